"""app/states_compare on states shaped like a residual stream: right captures pass at bf16 noise, with and without
a massive channel; shifted, swapped, zeroed, foreign and non-finite rows fail, each by the test meant for it."""

from __future__ import annotations

import numpy as np
import pytest

from app.base.hidden_file import bf16_to_float32, float32_to_bf16
from app.base.states_compare import REL_BOUND, UNIT_ROUNDOFF_BF16, Comparison, compare, row_problems
from tests.support.activations import realistic_activations

LAYERS = [1, 16, 31, 46, 61]


def residual_stream(rng, n_tokens=300, n_layers=5, hidden=256, massive=0.0) -> np.ndarray:
    """float32 [T, L, H]: each layer adds an update to the one before (so neighbouring layers are close, as in a
    real residual stream); `massive` puts a channel of that size, the same sign, in every token and layer."""
    x = rng.standard_normal((n_tokens, 1, hidden)).astype(np.float32)
    layers = [x]
    for _ in range(n_layers - 1):
        layers.append(layers[-1] + 0.5 * rng.standard_normal((n_tokens, 1, hidden)).astype(np.float32))
    states = np.concatenate(layers, axis=1)
    if massive:
        states[:, :, 7] = massive + rng.standard_normal((n_tokens, n_layers)).astype(np.float32)
    return states


def gpu_like(rng, states: np.ndarray, steps: float = 4.0) -> np.ndarray:
    """bf16 bits of `states` moved by up to `steps` bf16 roundings per value, independently (a pessimistic model
    of another device's kernels: every value off by a few units in its last place)."""
    noise = rng.uniform(-1, 1, states.shape).astype(np.float32) * (steps * UNIT_ROUNDOFF_BF16)
    return float32_to_bf16(states * (1 + noise))


def bits(states: np.ndarray) -> np.ndarray:
    return float32_to_bf16(states)


@pytest.mark.parametrize("massive", [0.0, 400.0])
@pytest.mark.parametrize("hidden", [128, 1024])
def test_right_states_pass_at_several_bf16_steps_of_noise(massive, hidden):
    rng = np.random.default_rng(hidden + int(massive))
    ref = residual_stream(rng, hidden=hidden, massive=massive)
    result = compare(bits(ref), gpu_like(rng, ref), LAYERS)
    assert result.ok, result.line()
    assert result.error < REL_BOUND / 2  # 4 roundings per value and one more to store: <= 5u = 0.02 of a row
    assert result.line().startswith("ok: worst error")
    assert [f.layer for f in result.per_layer] == LAYERS


def test_right_states_pass_on_realistic_activations_with_a_sink_token():
    rng = np.random.default_rng(3)
    ref = realistic_activations(rng, 500, 5, 512)  # heavy tails, outlier channels, a 100x first token
    assert compare(bits(ref), gpu_like(rng, ref), LAYERS).ok


def test_an_identical_capture_has_error_zero():
    ref = bits(residual_stream(np.random.default_rng(4), massive=400.0))
    result = compare(ref, ref.copy(), LAYERS)
    assert result.ok and result.error == 0.0


def test_the_bound_is_the_measured_gpu_noise_with_room():
    """bench/calibrate_gpu_noise.py on an H200 (64 layers x 5120): the worst GPU-vs-CPU row error was 0.0815, each
    device against float32 0.0865; the bound keeps 1.45x room over both and stays a whole number of roundings."""
    assert UNIT_ROUNDOFF_BF16 == 2 ** -8
    assert REL_BOUND == 32 * UNIT_ROUNDOFF_BF16 == 2 ** -3
    assert REL_BOUND >= 1.4 * 0.0865


def shifted(states: np.ndarray, by: int) -> np.ndarray:
    out = np.roll(states, -by, axis=0)
    return out


@pytest.mark.parametrize("by", [1, -1])
def test_states_shifted_by_one_token_fail_although_a_massive_channel_hides_them_from_the_error(by):
    rng = np.random.default_rng(5)
    ref = residual_stream(rng, hidden=128, massive=400.0)
    cand = bits(shifted(ref, by))
    result = compare(bits(ref), cand, LAYERS)
    assert not result.ok
    # the relative error alone cannot see it: the channel at 400 dominates every row's norm
    bulk = [f for f in result.per_layer]
    assert all(f.shifted_rows > 0.9 * ref.shape[0] for f in bulk), result.as_dict()
    assert "shifted" in result.problem or "nearer a neighbouring token" in result.problem


def test_a_shift_of_only_the_last_rows_fails():
    rng = np.random.default_rng(6)
    ref = residual_stream(rng, massive=400.0)
    cand = ref.copy()
    cand[-20:-1] = ref[-19:]
    result = compare(bits(ref), bits(cand), LAYERS)
    assert not result.ok and result.per_layer[0].shifted_rows >= 19


def test_the_error_alone_would_pass_a_shift_with_a_massive_channel():
    """Why the shift test exists: without it a shifted capture is within the bound."""
    rng = np.random.default_rng(7)
    ref = residual_stream(rng, hidden=128, massive=400.0)
    result = compare(bits(ref), bits(shifted(ref, 1)), LAYERS)
    assert result.per_layer[0].worst_error < REL_BOUND
    assert "states shifted" in result.problem


def test_two_swapped_layers_fail():
    rng = np.random.default_rng(8)
    ref = residual_stream(rng, massive=400.0)
    cand = ref[:, [0, 2, 1, 3, 4]]
    result = compare(bits(ref), bits(cand), LAYERS)
    assert not result.ok
    assert "the slot of layer 16 holds layer 31" in result.problem
    assert result.per_layer[1].holds_layer == 31 and result.per_layer[2].holds_layer == 16


def test_another_requests_rows_fail():
    rng = np.random.default_rng(9)
    ref = residual_stream(rng, massive=400.0)
    other = residual_stream(rng, massive=400.0)
    result = compare(bits(ref), bits(other), LAYERS)
    assert not result.ok
    assert all(f.far_rows > 0.9 * ref.shape[0] for f in result.per_layer)


def test_a_block_of_stale_rows_from_another_request_fails():
    rng = np.random.default_rng(10)
    ref = residual_stream(rng, massive=400.0)
    cand = ref.copy()
    cand[100:116] = residual_stream(rng, n_tokens=16, massive=400.0)
    result = compare(bits(ref), gpu_like(rng, cand), LAYERS)
    assert not result.ok
    assert result.per_layer[0].far_rows >= 14


@pytest.mark.parametrize("massive", [0.0, 400.0])
def test_zero_rows_inside_a_layer_fail_with_their_layer_and_token(massive):
    rng = np.random.default_rng(11)
    ref = residual_stream(rng, massive=massive)
    cand = bits(ref)
    cand[200:275, 3] = 0
    result = compare(bits(ref), cand, LAYERS)
    assert not result.ok
    assert result.layer == 46 and 200 <= result.token < 275
    assert result.error == pytest.approx(1.0)
    assert "layer 46 token" in result.problem and "75 of 300 rows over it" in result.problem


def test_a_non_finite_row_fails():
    rng = np.random.default_rng(12)
    ref = residual_stream(rng)
    cand = ref.copy()
    cand[5, 0, 3] = np.nan
    result = compare(bits(ref), bits(cand), LAYERS)
    assert not result.ok and result.layer == 1 and result.token == 5 and result.error == np.inf


def test_floats_and_bf16_bits_give_the_same_verdict():
    rng = np.random.default_rng(13)
    ref = residual_stream(rng, massive=400.0)
    cand = gpu_like(rng, ref)
    a = compare(bits(ref), cand, LAYERS)
    b = compare(bf16_to_float32(bits(ref)), bf16_to_float32(cand), LAYERS)
    assert a.ok == b.ok and a.error == pytest.approx(b.error)


def test_a_row_count_or_shape_mismatch_is_one_line():
    ref = bits(residual_stream(np.random.default_rng(14)))
    result = compare(ref, ref[:-1], LAYERS)
    assert not result.ok and result.problem == "299 rows stored for 300 tokens"


def test_repeated_tokens_with_identical_rows_are_not_shifts():
    """A token repeated may round to one row in early layers; then no neighbour distinguishes it from itself."""
    rng = np.random.default_rng(15)
    ref = residual_stream(rng)
    ref[50:60] = ref[50]  # ten identical rows
    assert compare(bits(ref), gpu_like(rng, ref), LAYERS).ok


def test_one_token_is_judged_by_the_error_only():
    ref = residual_stream(np.random.default_rng(16), n_tokens=1)
    assert compare(bits(ref), bits(ref), LAYERS).ok
    assert not compare(bits(ref), np.zeros_like(bits(ref)), LAYERS).ok


def test_the_comparison_prints_per_layer_worst_figures():
    rng = np.random.default_rng(17)
    ref = residual_stream(rng)
    result = compare(bits(ref), gpu_like(rng, ref), LAYERS)
    assert isinstance(result, Comparison)
    assert result.layers_line().startswith("layer 1 ") and result.layers_line().count("layer ") == 5
    assert result.as_dict()["per_layer"][4]["layer"] == 61


# row_problems: rows, not only layers


def test_row_problems_finds_one_zero_row_inside_a_layer():
    states = bits(residual_stream(np.random.default_rng(18)))
    assert row_problems(states) is None
    states[123, 2] = 0
    problem = row_problems(states)
    assert (problem.kind, problem.slot, problem.token, problem.rows) == ("states_zero", 2, 123, 1)
    assert problem.line(LAYERS) == "layer 31: 1 of 300 rows all-zero, first at token 123"


def test_row_problems_finds_negative_zero_and_a_whole_zero_layer():
    states = bits(residual_stream(np.random.default_rng(19)))
    states[:, 4] = 0x8000  # -0.0 everywhere
    problem = row_problems(states)
    assert problem.kind == "states_zero" and problem.rows == 300 and "(the whole layer)" in problem.line()


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_row_problems_finds_a_non_finite_value_before_zero_rows(value):
    states = residual_stream(np.random.default_rng(20))
    states[7, 1, 9] = value
    states[3, 0] = 0
    for form in (bits(states), states):
        problem = row_problems(form)
        assert (problem.kind, problem.slot, problem.token) == ("states_nonfinite", 1, 7)


def test_row_problems_on_an_empty_sample_is_none():
    assert row_problems(np.zeros((0, 5, 16), dtype=np.uint16)) is None


def small_channels_with_a_massive_one(rng, n_tokens=300, hidden=128, n_layers=5):
    """The tiny random model's shape of the problem: channels ~0.02 (HF's init), one at ~400 in every token that
    moves a little with the token, so one bf16 step there (2.0) is larger than two tokens' whole difference."""
    ref = residual_stream(rng, n_tokens, n_layers, hidden) * 0.02
    ref[:, :, 7] = 400 + rng.uniform(-3, 3, (n_tokens, n_layers)).astype(np.float32)
    return ref


def test_a_rounding_flip_in_the_massive_channel_is_not_a_shift():
    rng = np.random.default_rng(21)
    ref = small_channels_with_a_massive_one(rng)
    ref_bits = bits(ref)
    cand = ref_bits.copy()
    flip = rng.random((ref.shape[0], ref.shape[1])) < 0.3
    cand[:, :, 7] = np.where(flip, cand[:, :, 7] + 1, cand[:, :, 7])  # one bf16 step (2.0 at 400) up
    step = bf16_to_float32(cand[:, :, 7]) - bf16_to_float32(ref_bits[:, :, 7])
    assert np.abs(step).max() == 2.0
    neighbour = np.linalg.norm(bf16_to_float32(ref_bits[1:]) - bf16_to_float32(ref_bits[:-1]), axis=-1)
    assert np.median(neighbour) < 6  # the flip is a sizeable part of two tokens' whole distance
    result = compare(ref_bits, cand, LAYERS)
    assert result.ok, result.line()
    shifted = compare(ref_bits, bits(np.roll(ref, -1, axis=0)), LAYERS)
    assert not shifted.ok and "states shifted" in shifted.problem
    assert shifted.per_layer[0].worst_error < REL_BOUND  # invisible to the error alone


def test_a_zero_row_is_a_state_only_at_a_token_whose_embedding_is_zero():
    """A padding row of the embedding is zero, and on a hybrid its rows stay zero through the linear-attention
    layers: those rows are the token's states; a zero row anywhere else is a capture fault."""
    from app.base.states_compare import zero_rows_allowed

    rng = np.random.default_rng(12)
    states = bits(residual_stream(rng, n_tokens=6, hidden=64))
    ids = np.array([5, 9, 573, 7, 573, 8])
    states[2, :2] = 0  # the padding token's rows at the first two (linear-attention) layers
    states[4, :2] = 0
    allowed = zero_rows_allowed(ids, [573])
    assert allowed.tolist() == [False, False, True, False, True, False]
    assert row_problems(states, allowed) is None
    assert row_problems(states).kind == "states_zero"  # without the model's fact: flagged
    states[3, 1] = 0  # another token's zero row is still a fault
    problem = row_problems(states, allowed)
    assert problem.kind == "states_zero" and (problem.slot, problem.token, problem.rows) == (1, 3, 1)
    assert zero_rows_allowed(ids, []) is None and zero_rows_allowed(None, [573]) is None
