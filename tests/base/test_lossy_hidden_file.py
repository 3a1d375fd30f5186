"""Lossy samples in the `.rgh` file (app/base/hidden_file.py): versioned, self-checking, read back as bf16.

Files of bf16 samples must stay exactly what they were (a file written before lossy storage existed reads, and a
bf16 file written now is byte-identical to it); a file with lossy samples must say so in a way an older reader
refuses, record each sample's error, and fail loudly when damaged.
"""

from __future__ import annotations

import io
import struct

import numpy as np
import orjson
import pytest
import torch
import zstandard

from app.base import states_codec
from app.base.hidden_file import (
    FOOTER,
    FOOTER_MAGIC,
    CorruptHiddenFile,
    HiddenFileReader,
    HiddenFileWriter,
    bf16_to_float32,
    encode_sample,
    float32_to_bf16,
)
from tests.support.activations import realistic_activations
from tests.support.paths import FIXTURES_DIR

V1_FIXTURE = FIXTURES_DIR / "v1-bf16.hidden.rgh"
LAYERS = [1, 3]


def _v1_samples():
    """The samples in V1_FIXTURE, regenerated the way it was written (by the code before lossy storage)."""
    rng = np.random.default_rng(25)
    out = []
    for i, n in enumerate((3, 17)):
        x = rng.standard_normal((n, 2, 32)).astype(np.float32) * 3
        out.append((f"old-{i}", np.arange(n, dtype=np.int32) + 100 * i, float32_to_bf16(x)))
    return out


def _file(samples, stored="bf16", level=1) -> bytes:
    buf = io.BytesIO()
    writer = HiddenFileWriter(buf)
    for sid, tokens, states in samples:
        writer.append(encode_sample(sid, tokens, states, LAYERS, level, stored=stored))
    writer.close()
    return buf.getvalue()


def _index(data: bytes) -> dict:
    offset, length, _ = FOOTER.unpack(data[-FOOTER.size:])
    return orjson.loads(zstandard.ZstdDecompressor().decompress(data[offset:offset + length]))


def _with_index(data: bytes, change) -> bytes:
    """The file with its index replaced by `change(index)` (a well-formed index: only the content is wrong)."""
    offset, _, _ = FOOTER.unpack(data[-FOOTER.size:])
    index = _index(data)
    change(index)
    raw = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(orjson.dumps(index))
    return data[:offset] + raw + struct.pack("<QQ8s", offset, len(raw), FOOTER_MAGIC)


def _lossy_samples(n_samples=3, hidden=64):
    rng = np.random.default_rng(4)
    return [(f"s{i}", rng.integers(0, 150_000, size=n).astype(np.int32),
             float32_to_bf16(realistic_activations(rng, n, len(LAYERS), hidden)))
            for i, n in enumerate((1, 40, 9)[:n_samples])]


def test_a_file_written_before_lossy_storage_still_reads():
    reader = HiddenFileReader(io.BytesIO(V1_FIXTURE.read_bytes()))
    assert len(reader) == 2
    for i, (sid, tokens, states) in enumerate(_v1_samples()):
        got_tokens, got_states = reader.read(i)
        assert reader.entries[i]["sample_id"] == sid
        assert np.array_equal(got_tokens, tokens) and np.array_equal(got_states, states)


def test_a_bf16_file_written_now_is_byte_identical_to_one_written_before():
    assert _file(_v1_samples()) == V1_FIXTURE.read_bytes()


@pytest.mark.parametrize("codec", states_codec.LOSSY_CODECS)
def test_lossy_samples_read_back_as_bf16_within_the_bound_they_record(codec):
    samples = _lossy_samples()
    data = _file(samples, stored=codec)
    index = _index(data)
    assert index["format"] == "regen.hidden/2"  # a reader of regen.hidden/1 only refuses the file
    reader = HiddenFileReader(io.BytesIO(data))
    for i, (sid, tokens, states) in enumerate(samples):
        entry = reader.entries[i]
        assert entry["sample_id"] == sid and entry["codec"] == codec and len(entry["max_rel_error"]) == len(LAYERS) == len(entry["rms_rel_error"])
        got_tokens, got = reader.read(i)
        assert np.array_equal(got_tokens, tokens) and got.dtype == np.uint16 and got.shape == states.shape
        x, y = bf16_to_float32(states).astype(np.float64), bf16_to_float32(got).astype(np.float64)
        rel = np.linalg.norm(y - x, axis=-1) / np.linalg.norm(x, axis=-1)
        assert np.allclose(entry["max_rel_error"], rel.max(axis=0), rtol=1e-5)
        assert max(entry["max_rel_error"]) <= states_codec.bound(codec, 64)
        _, torch_states = reader.read_torch(i)
        assert torch_states.dtype == torch.bfloat16
        assert np.array_equal(torch_states.view(torch.int16).numpy().view(np.uint16), got)
    assert len(data) < 0.6 * sum(s.nbytes for _, _, s in samples)


def test_read_stored_gives_the_fp8_values_and_scales_a_trainer_can_use_directly():
    samples = _lossy_samples()
    reader = HiddenFileReader(io.BytesIO(_file(samples, stored="fp8-e4m3")))
    codec, tokens, (scales, codes) = reader.read_stored(1)
    assert codec == "fp8-e4m3" and np.array_equal(tokens, samples[1][1])
    fp8 = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn)
    values = (fp8.float() * torch.from_numpy(scales.copy())[..., None]).to(torch.bfloat16)
    assert np.array_equal(values.view(torch.int16).numpy().view(np.uint16), reader.read(1)[1])
    bf16_reader = HiddenFileReader(io.BytesIO(_file(samples)))
    codec, _, states = bf16_reader.read_stored(1)
    assert codec == "bf16" and np.array_equal(states, samples[1][2])


def test_a_sample_with_nan_or_inf_is_stored_exactly_as_captured_in_a_lossy_file():
    samples = _lossy_samples()
    broken = samples[1][2].copy()
    broken[3, 0, 5] = 0x7FC0  # NaN
    broken[4, 1, 2] = 0xFF80  # -Inf
    samples[1] = (samples[1][0], samples[1][1], broken)
    reader = HiddenFileReader(io.BytesIO(_file(samples, stored="fp8-e4m3")))
    assert [e.get("codec", "bf16") for e in reader.entries] == ["fp8-e4m3", "bf16", "fp8-e4m3"]
    assert np.array_equal(reader.read(1)[1], broken)


def test_a_sample_measured_above_the_bound_is_stored_losslessly(monkeypatch):
    monkeypatch.setattr(states_codec, "bound", lambda codec, hidden: 1e-6)
    samples = _lossy_samples(n_samples=2)
    reader = HiddenFileReader(io.BytesIO(_file(samples, stored="fp8-e4m3")))
    assert all("codec" not in e for e in reader.entries)
    assert _index(_file(samples, stored="fp8-e4m3"))["format"] == "regen.hidden/1"
    assert np.array_equal(reader.read(1)[1], samples[1][2])


def test_damage_to_a_lossy_sample_is_found():
    data = bytearray(_file(_lossy_samples(), stored="fp8-e4m3"))
    reader = HiddenFileReader(io.BytesIO(bytes(data)))
    entry = reader.entries[1]
    for part in (1, 2):  # the scales, then the FP8 bytes
        damaged = bytearray(data)
        damaged[entry["offset"] + sum(entry["sizes"][:part]) + 3] ^= 0x10
        with pytest.raises(CorruptHiddenFile, match="checksum mismatch"):
            HiddenFileReader(io.BytesIO(bytes(damaged))).read(1)


def test_an_index_that_misstates_the_codec_is_refused():
    data = _file(_lossy_samples(), stored="fp8-e4m3")

    def as_v1(index):
        index["format"] = "regen.hidden/1"

    def unknown_codec(index):
        index["samples"][0]["codec"] = "fp4"

    for change in (as_v1, unknown_codec):
        with pytest.raises(CorruptHiddenFile, match="states codec"):
            HiddenFileReader(io.BytesIO(_with_index(data, change)))

    def fp8_read_as_mantissa(index):
        index["samples"][1]["codec"] = "bf16-m4"  # same parts, other meaning: their sizes no longer hold

    with pytest.raises(CorruptHiddenFile, match="sizes"):
        HiddenFileReader(io.BytesIO(_with_index(data, fp8_read_as_mantissa))).read(1)
