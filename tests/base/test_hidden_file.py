"""The shard hidden-state codec (app/base/hidden_file.py): exact round trips, corruption found, bf16 helpers.

The file is the fleet's product: a trainer reads it months later, so every bit must come back and any damage
must raise `CorruptHiddenFile` rather than return wrong states.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from app.base.hidden_file import (
    CorruptHiddenFile,
    HiddenFileReader,
    HiddenFileWriter,
    bf16_to_float32,
    encode_sample,
    float32_to_bf16,
    join_bytes,
    split_bytes,
)

LAYERS = [2, 5, 8]


def _activations(rng: np.random.Generator, n_tokens: int, hidden: int = 64) -> np.ndarray:
    """bf16 bit patterns shaped like hidden states: normal values with a few large outliers."""
    x = rng.standard_normal((n_tokens, len(LAYERS), hidden)).astype(np.float32)
    x[:, :, 3] *= 40.0  # activation outlier channel, as in real LLMs
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _write(path, samples, **kwargs) -> int:
    with open(path, "wb") as fh:
        writer = HiddenFileWriter(fh)
        for sid, tokens, states in samples:
            writer.append(encode_sample(sid, tokens, states, LAYERS, **kwargs))
        return writer.close()


def _samples(seed: int = 0, lengths=(1, 7, 300, 64, 2)):
    rng = np.random.default_rng(seed)
    return [
        (f"sample-{i}", rng.integers(0, 151_000, size=n).astype(np.int32), _activations(rng, n))
        for i, n in enumerate(lengths)
    ]


@pytest.mark.parametrize("compress_low", [False, True])
@pytest.mark.parametrize("level", [1, 3])
def test_round_trip_random_access(tmp_path, compress_low, level):
    samples = _samples()
    path = tmp_path / "shard.hidden.rgh"
    size = _write(path, samples, level=level, compress_low=compress_low)
    assert path.stat().st_size == size
    with open(path, "rb") as fh:
        reader = HiddenFileReader(fh)
        assert len(reader) == len(samples)
        assert {e["lo_codec"] for e in reader.entries} == {"zstd" if compress_low else "raw"}
        order = np.random.default_rng(1).permutation(len(samples)).tolist() * 2  # random order, repeated
        for i in order:
            tokens, states = reader.read(i)
            sid, want_tokens, want_states = samples[i]
            assert reader.by_id[sid] == i
            assert tokens.dtype == np.int32 and states.dtype == np.uint16
            np.testing.assert_array_equal(tokens, want_tokens)
            np.testing.assert_array_equal(states, want_states)
            assert reader.entries[i]["layers"] == LAYERS


def test_compression_helps_on_activations(tmp_path):
    samples = _samples(lengths=(512, 512))
    raw = sum(s.nbytes for _, _, s in samples)
    size = _write(tmp_path / "a.rgh", samples)
    assert size < raw / 1.2  # high bytes of activations compress; a regression to raw storage shows here


def test_empty_and_odd_shapes(tmp_path):
    rng = np.random.default_rng(3)
    samples = [("empty", np.zeros(0, np.int32), np.zeros((0, 3, 5), np.uint16)),
               ("odd", np.arange(3, dtype=np.int32), rng.integers(0, 2**16, size=(3, 3, 5), dtype=np.uint16))]
    _write(tmp_path / "e.rgh", samples)
    with open(tmp_path / "e.rgh", "rb") as fh:
        reader = HiddenFileReader(fh)
        for i, (_, tokens, states) in enumerate(samples):
            got_tokens, got_states = reader.read(i)
            np.testing.assert_array_equal(got_tokens, tokens)
            assert got_states.shape == states.shape
            np.testing.assert_array_equal(got_states, states)


def test_encode_rejects_bad_input():
    states = np.zeros((4, 3, 8), np.uint16)
    with pytest.raises(ValueError):
        encode_sample("x", np.arange(4), states.astype(np.float32), LAYERS)
    with pytest.raises(ValueError):
        encode_sample("x", np.arange(4), states[0], LAYERS)
    with pytest.raises(ValueError):
        encode_sample("x", np.arange(5), states, LAYERS)  # token count
    with pytest.raises(ValueError):
        encode_sample("x", np.arange(4), states, LAYERS[:2])  # layer count


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    states=arrays(
        np.uint16,
        st.tuples(st.integers(0, 20), st.just(len(LAYERS)), st.integers(1, 17)),
        elements=st.integers(0, 2**16 - 1),  # every bit pattern: NaNs, infs, subnormals, -0
    ),
    compress_low=st.booleans(),
    level=st.sampled_from([1, 3, 9]),
)
def test_round_trip_property(states, compress_low, level):
    tokens = np.arange(states.shape[0], dtype=np.int32) * 7919 % 151_936
    buf = io.BytesIO()
    writer = HiddenFileWriter(buf)
    writer.append(encode_sample("p", tokens, states, LAYERS, level=level, compress_low=compress_low))
    writer.close()
    got_tokens, got_states = HiddenFileReader(io.BytesIO(buf.getvalue())).read(0)
    np.testing.assert_array_equal(got_tokens, tokens)
    np.testing.assert_array_equal(got_states, states)
    high, low = split_bytes(states)
    np.testing.assert_array_equal(join_bytes(high, low).reshape(states.shape), states)


@pytest.mark.parametrize("shape", [(1, 3, 1), (3, 3, 21_845), (7, 3, 40_000)])
def test_split_bytes_across_blocks_matches_the_byte_view(shape):
    # Sizes below, at and beyond the 64K-value block, with a partial last block; and a non-contiguous input.
    states = np.random.default_rng(3).integers(0, 2**16, size=shape, dtype=np.uint16)
    as_bytes = states.reshape(-1).view(np.uint8)  # little-endian: low byte first
    high, low = split_bytes(states)
    np.testing.assert_array_equal(high, as_bytes[1::2])
    np.testing.assert_array_equal(low, as_bytes[0::2])
    strided = states[:, ::-1, :]
    high, low = split_bytes(strided)
    np.testing.assert_array_equal(join_bytes(high, low).reshape(strided.shape), strided)


def _small_file() -> tuple[bytes, list]:
    samples = _samples(seed=5, lengths=(4, 3, 6))
    samples = [(sid, tok, st_[:, :, :16].copy()) for sid, tok, st_ in samples]
    buf = io.BytesIO()
    writer = HiddenFileWriter(buf)
    for sid, tokens, states in samples:
        writer.append(encode_sample(sid, tokens, states, LAYERS))
    writer.close()
    return buf.getvalue(), samples


def _read_all(data: bytes):
    reader = HiddenFileReader(io.BytesIO(data))
    return reader.entries, [reader.read(i) for i in range(len(reader))]


def test_every_flipped_byte_is_detected_or_harmless():
    """Flip each byte of a small shard: the reader raises CorruptHiddenFile, or (where the flip lands on a zstd
    header bit that does not change the decoded bytes) returns exactly the original content. Never wrong data,
    never another exception."""
    data, _ = _small_file()
    want_entries, want = _read_all(data)
    detected = 0
    for pos in range(len(data)):
        for mask in (0x01, 0x80):
            damaged = bytearray(data)
            damaged[pos] ^= mask
            try:
                entries, got = _read_all(bytes(damaged))
            except CorruptHiddenFile:
                detected += 1
                continue
            assert entries == want_entries, f"byte {pos} ^ {mask:#x}: index changed silently"
            for (t0, s0), (t1, s1) in zip(want, got, strict=True):
                np.testing.assert_array_equal(t0, t1)
                np.testing.assert_array_equal(s0, s1)
    assert detected >= 0.99 * 2 * len(data)


def test_flip_in_one_sample_spares_the_others():
    data, samples = _small_file()
    reader = HiddenFileReader(io.BytesIO(data))
    entry = reader.entries[1]
    pos = entry["offset"] + entry["sizes"][0] + entry["sizes"][1] + 3  # inside sample 1's raw low bytes
    damaged = bytearray(data)
    damaged[pos] ^= 0x10
    reader = HiddenFileReader(io.BytesIO(bytes(damaged)))
    with pytest.raises(CorruptHiddenFile, match="sample-1"):
        reader.read(1)
    for i in (0, 2):
        np.testing.assert_array_equal(reader.read(i)[1], samples[i][2])


def test_truncated_file_is_detected(tmp_path):
    data, _ = _small_file()
    for n in range(len(data)):
        with pytest.raises(CorruptHiddenFile):
            _read_all(data[:n])
    # And through a real file cut short mid-write (no index, no footer).
    path = tmp_path / "cut.rgh"
    path.write_bytes(data[: len(data) // 2])
    with open(path, "rb") as fh, pytest.raises(CorruptHiddenFile):
        HiddenFileReader(fh)


def test_appended_garbage_is_detected():
    data, _ = _small_file()
    with pytest.raises(CorruptHiddenFile):
        HiddenFileReader(io.BytesIO(data + b"\0"))


def test_float32_to_bf16_matches_torch_rounding():
    rng = np.random.default_rng(11)
    with np.errstate(over="ignore"):  # some scaled values overflow float32 to inf, which is wanted
        scaled = (rng.standard_normal(100_000) * 10.0 ** rng.integers(-44, 39, size=100_000)).astype(np.float32)
    values = np.concatenate([
        scaled,
        rng.integers(0, 2**32, size=100_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
        # exact ties (low half 0x8000) on odd and even bf16 mantissas, max float, subnormals, zeros, infs
        np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7FFFFF, 0x00000001, 0x807FFFFF, 0x00008000,
                  0x0, 0x80000000, 0x7F800000, 0xFF800000,
                  # NaNs whose payload rounding would carry into exponent or sign (-> -0.0, 0, inf)
                  0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFF808000], dtype=np.uint32).view(np.float32),
    ])
    ours = float32_to_bf16(values)
    theirs = torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(values)
    assert nan.any()
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    # NaNs stay NaN (torch's exact NaN payload depends on its code path; the point is not to become 0 or inf).
    assert np.isnan(bf16_to_float32(ours[nan])).all()
    shaped = values[:200_000].reshape(2, -1, 1)  # shape kept, and a non-contiguous view works too
    np.testing.assert_array_equal(float32_to_bf16(shaped), ours[:200_000].reshape(2, -1, 1))
    np.testing.assert_array_equal(float32_to_bf16(shaped[:, ::3]), ours[:200_000].reshape(2, -1, 1)[:, ::3])


def test_bf16_to_float32_matches_torch():
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    ours = bf16_to_float32(every)
    theirs = torch.from_numpy(every.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))  # bit-exact, NaNs included
    finite = np.isfinite(ours)
    np.testing.assert_array_equal(float32_to_bf16(ours[finite]), every[finite])  # bf16 -> f32 -> bf16 exact


def test_read_torch(tmp_path):
    rng = np.random.default_rng(2)
    tensors = [torch.randn(n, len(LAYERS), 32, dtype=torch.float32).to(torch.bfloat16) * 3 for n in (5, 1, 33)]
    ids = [torch.from_numpy(rng.integers(0, 151_000, size=t.shape[0])) for t in tensors]
    samples = [
        (f"t{i}", i_.numpy().astype(np.int32), t.view(torch.int16).numpy().view(np.uint16))
        for i, (i_, t) in enumerate(zip(ids, tensors, strict=True))
    ]
    _write(tmp_path / "t.rgh", samples, compress_low=True)
    with open(tmp_path / "t.rgh", "rb") as fh:
        reader = HiddenFileReader(fh)
        for i in (2, 0, 1):
            tokens, states = reader.read_torch(i)
            assert tokens.dtype == torch.int64 and states.dtype == torch.bfloat16
            assert torch.equal(tokens, ids[i].to(torch.int64))
            assert torch.equal(states, tensors[i])
            states.add_(1)  # the tensor owns its memory: writable, and the next read is unaffected
        assert torch.equal(reader.read_torch(2)[1], tensors[2])
