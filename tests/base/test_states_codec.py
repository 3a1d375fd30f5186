"""The lossy states codecs (app/base/states_codec.py): bit-exact against torch's FP8, and within their bounds.

A lossy run's promise is a number in its manifest that a trainer relies on months later; these tests hold the
codecs to it on the inputs that break lossy codecs: outlier channels, an attention-sink token 100x the others,
all-negative rows, zero rows, the extremes of the e4m3 grid, and the tiny model's real captured states.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.base.hidden_file import bf16_to_float32, float32_to_bf16
from app.base.states_codec import (
    _E4M3_VALUES,
    LOSSY_CODECS,
    NonFiniteStates,
    bound,
    dequantise,
    fp8_codes,
    fp8_round,
    promised_bound,
    quantise,
    resolve,
    round_mantissa,
)
from tests.support.activations import SINK_FACTOR, realistic_activations


def _row_errors(original_u16: np.ndarray, decoded_u16: np.ndarray) -> np.ndarray:
    """||decoded - original|| / ||original|| per (token, layer), in float64, by definition."""
    x, y = bf16_to_float32(original_u16).astype(np.float64), bf16_to_float32(decoded_u16).astype(np.float64)
    norm = np.linalg.norm(x, axis=-1)
    err = np.linalg.norm(y - x, axis=-1)
    return np.where(norm > 0, err / np.where(norm > 0, norm, 1), np.where(err > 0, np.inf, 0.0))


def _round_trip(codec: str, states: np.ndarray):
    q = quantise(codec, states)
    return q, dequantise(codec, q.arrays, states.shape)


def test_the_e4m3_table_is_torchs_float8_e4m3fn():
    torch_values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(np.isnan(torch_values), np.isnan(_E4M3_VALUES))
    finite = ~np.isnan(torch_values)
    assert np.array_equal(torch_values[finite].view(np.uint32), _E4M3_VALUES[finite].view(np.uint32))  # -0 too


def test_fp8_rounding_is_torchs_bit_for_bit_across_the_range():
    rng = np.random.default_rng(0)
    grid = _E4M3_VALUES[~np.isnan(_E4M3_VALUES)]
    grid = np.sort(grid[np.abs(grid) <= 448])
    midpoints = (grid[1:] + grid[:-1]) / 2  # ties: nearest-even decides
    values = np.concatenate([
        rng.uniform(-448, 448, 200_000), rng.standard_normal(200_000) * 0.01, rng.standard_normal(50_000) * 1e-4,
        grid, midpoints, np.nextafter(midpoints, np.inf), np.nextafter(midpoints, -np.inf), [0.0, -0.0, 448, -448],
    ]).astype(np.float32)
    expected = torch.from_numpy(values).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(fp8_round(values), expected)
    assert np.array_equal(fp8_codes(values), expected)  # the table the encoder looks codes up in


def test_fp8_sample_round_trip_is_torchs_own_conversion_with_the_stored_scales():
    states = float32_to_bf16(realistic_activations(np.random.default_rng(1), 40, 3, 256))
    q, decoded = _round_trip("fp8-e4m3", states)
    scales, codes = q.arrays
    x = torch.from_numpy(bf16_to_float32(states))
    t_codes = (x / torch.from_numpy(scales)[..., None]).to(torch.float8_e4m3fn)
    assert np.array_equal(t_codes.view(torch.uint8).numpy(), codes)
    t_decoded = (t_codes.float() * torch.from_numpy(scales)[..., None]).to(torch.bfloat16)
    assert np.array_equal(t_decoded.view(torch.int16).numpy().view(np.uint16), decoded)
    # The exact absmax scale brings every row's largest magnitude back exactly.
    assert np.array_equal(np.abs(bf16_to_float32(decoded)).max(axis=2), np.abs(bf16_to_float32(states)).max(axis=2))


def test_mantissa_rounding_is_round_to_nearest_even_on_every_bf16_value():
    bits = np.arange(0x10000, dtype=np.uint32).astype(np.uint16)
    finite = (bits & 0x7F80) != 0x7F80
    normal = finite & ((bits & 0x7F80) != 0)
    bits = bits[finite]
    x = bf16_to_float32(bits).astype(np.float64)
    for keep in (3, 4):
        got = bf16_to_float32(round_mantissa(bits, keep)).astype(np.float64)
        is_normal = normal[finite]
        exponent = np.floor(np.log2(np.abs(np.where(is_normal, x, 1))))
        ulp = 2.0 ** (exponent - keep)
        expected = np.rint(x / ulp) * ulp  # numpy's rint is round-half-even
        largest = (2 - 2.0**-keep) * 2.0**127
        expected = np.where(np.abs(expected) > largest, np.sign(x) * largest, expected)  # never Inf
        assert np.array_equal(got[is_normal], expected[is_normal]), keep
        assert np.isfinite(got).all()
        assert np.array_equal(np.signbit(got), np.signbit(x))


@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_outliers_sinks_and_negative_rows_stay_within_the_bound(codec):
    rng = np.random.default_rng(2)
    x = realistic_activations(rng, 300, 4, 512, negative_rows=6)
    x[5, 1] = 0.0  # one all-zero row
    x[7, 2] = -np.abs(x[7, 2]) * 1e-3 - 1e-6  # a small all-negative row
    states = float32_to_bf16(x)
    q, decoded = _round_trip(codec, states)
    rel = _row_errors(states, decoded)
    assert rel.max() <= bound(codec, 512)
    assert np.allclose(q.max_rel_error, rel.max(axis=0), rtol=1e-5, atol=1e-9)
    assert np.allclose(q.rms_rel_error, np.sqrt(np.square(rel).mean(axis=0)), rtol=1e-5, atol=1e-9)
    assert rel.mean() > 0.001  # lossy: the bound is not met by storing the input unchanged
    assert not bf16_to_float32(decoded[5, 1]).any() and rel[5, 1] == 0.0
    negative = bf16_to_float32(states) < 0
    assert np.array_equal(np.signbit(bf16_to_float32(decoded))[negative], negative[negative])


def test_a_sink_token_100x_the_others_does_not_change_the_other_tokens_error():
    """Per-token-per-layer scales: the first token's size decides nothing about the rest."""
    rng = np.random.default_rng(3)
    plain = realistic_activations(rng, 64, 2, 256, sink=False)
    sunk = plain.copy()
    sunk[0] *= SINK_FACTOR
    for codec in LOSSY_CODECS:
        errors_plain = _row_errors(float32_to_bf16(plain), _round_trip(codec, float32_to_bf16(plain))[1])
        errors_sunk = _row_errors(float32_to_bf16(sunk), _round_trip(codec, float32_to_bf16(sunk))[1])
        assert np.array_equal(errors_plain[1:], errors_sunk[1:]), codec
        assert errors_sunk[0].max() <= bound(codec, 256)


def test_worst_case_rows_for_fp8_stay_within_the_bound():
    """Rows built to maximise FP8's error: every value just past a rounding midpoint, at every binade, with the
    row's largest value exact (448 after scaling), plus rows that are mostly subnormal after scaling."""
    grid = np.sort(_E4M3_VALUES[(~np.isnan(_E4M3_VALUES)) & (_E4M3_VALUES > 0)])
    mids = np.nextafter(((grid[1:] + grid[:-1]) / 2).astype(np.float32), np.float32(np.inf))
    hidden = 1024
    rows = []
    for binade_start in range(0, len(mids) - 8, 8):
        row = np.resize(mids[binade_start:binade_start + 8], hidden).astype(np.float32)
        row[0] = 448.0
        rows.append(row)
    sub = np.full(hidden, 2.0**-10 * 1.01, np.float32)
    sub[0] = 448.0
    rows.append(sub)
    states = float32_to_bf16(np.stack(rows)[:, None, :] * np.float32(0.37))
    q, decoded = _round_trip("fp8-e4m3", states)
    rel = _row_errors(states, decoded)
    assert rel.max() <= bound("fp8-e4m3", hidden)
    assert rel.max() > 0.04  # these rows do reach near the bound: the test is not vacuous


def test_the_bound_is_the_documented_figure():
    assert round(bound("fp8-e4m3", 5120), 4) == 0.0671
    assert bound("bf16-m3", 5120) == 2.0**-4 and bound("bf16-m4", 5120) == 2.0**-5
    assert promised_bound("fp8-e4m3", 5120) >= bound("fp8-e4m3", 5120) and promised_bound("bf16", 5120) == 0.0
    assert resolve("lossy") == "fp8-e4m3" and resolve("bf16") == "bf16"
    with pytest.raises(ValueError, match="unknown states dtype"):
        resolve("fp4")


@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_non_finite_states_are_refused(codec):
    states = float32_to_bf16(np.ones((3, 2, 8), np.float32))
    for bad in (np.nan, np.inf, -np.inf):
        broken = states.copy()
        broken[1, 1, 3] = float32_to_bf16(np.array([bad], np.float32))[0]
        with pytest.raises(NonFiniteStates):
            quantise(codec, broken)


@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_empty_and_all_zero_samples(codec):
    empty = np.zeros((0, 2, 8), np.uint16)
    q, decoded = _round_trip(codec, empty)
    assert decoded.shape == (0, 2, 8) and q.max_rel_error == [0.0, 0.0]
    zeros = np.zeros((4, 2, 8), np.uint16)
    q, decoded = _round_trip(codec, zeros)
    assert np.array_equal(decoded, zeros) and q.max_rel_error == [0.0, 0.0]


def test_real_captured_states_of_the_tiny_model_stay_within_the_bound(tiny_qwen3):
    """States captured from the tiny dense model (transformers, the fleet's reference capture), as they are and
    with the first token made an attention sink (100x) and a row made all-negative. (The tiny hybrid model, when
    the project has one, belongs here too.)"""
    from transformers import AutoTokenizer

    from app.data.reference import ReferenceCapture

    tok = AutoTokenizer.from_pretrained(str(tiny_qwen3))
    ref = ReferenceCapture(str(tiny_qwen3), [1, 2, 4])
    ids = tok.apply_chat_template([{"role": "user", "content": "Natalia sold clips to 48 of her friends. " * 6}],
                                  add_generation_prompt=True, tokenize=False)
    states = ref.capture(tok.encode(ids, add_special_tokens=False))
    x = bf16_to_float32(states).copy()
    x[0] *= SINK_FACTOR
    x[3, 1] = -np.abs(x[3, 1])
    for sample in (states, float32_to_bf16(x)):
        for codec in LOSSY_CODECS:
            q, decoded = _round_trip(codec, sample)
            rel = _row_errors(sample, decoded)
            assert rel.max() <= bound(codec, sample.shape[2]), codec
            assert np.allclose(q.max_rel_error, rel.max(axis=0), rtol=1e-5, atol=1e-9)
