"""The shard hidden-state file (`*.hidden.rgh`): bf16 states, byte-shuffled, zstd, with a per-sample index.

Why this layout: a bf16 value's high byte is redundant and its low byte noise, so only the high bytes are
compressed (with match tables tuned for them), and a trainer reads sample i with two seeks without
decompressing the shard. Every part carries a CRC32; the stored `token_ids` are a sample's `input_ids[:-1]`.
Lossy samples (app.base.states_codec) make the file `regen.hidden/2`; a bf16-only file stays `regen.hidden/1`.
Byte layout, index entries and the measured ratios: docs/capture.md#the-hidden-state-file-in-detail.
"""

from __future__ import annotations

import functools
import struct
import threading
import zlib
from dataclasses import dataclass

import numpy as np
import orjson
import zstandard

from app.base import states_codec
from app.base.byte_planes import join_bytes, join_layers, split_bytes  # noqa: F401 (join_bytes: importers of this module use it)
from app.base.errors import PermanentError
from app.base.manifest import COMPRESSION_LEVEL

MAGIC = b"RGHS\x00\x01\x00\x00"
FOOTER_MAGIC = b"RGHSIDX1"
FOOTER = struct.Struct("<QQ8s")
FORMAT = "regen.hidden/1"
FORMAT_LOSSY = "regen.hidden/2"  # an index with lossy entries (see the module docstring)


class CorruptHiddenFile(PermanentError, ValueError):
    """The file's structure, a checksum or a length does not hold (it will not on a second read either). A
    ValueError too, as callers have caught it."""


@functools.cache
def _state_params(level: int) -> zstandard.ZstdCompressionParameters:
    """zstd parameters for the high bytes: the level's strategy with tiny match tables and 7-byte matches.

    The high bytes are close to independent draws from a skewed alphabet: nearly all the gain is entropy coding,
    and match finding mostly finds short false matches that cost more bits than they save. A 64-entry hash
    table (fits in L1), one search attempt and a 7-byte minimum match make level 1 ~2.4x faster and its output
    ~2% smaller on a Qwen3-1.7B-wide model's states (hidden 2048, 5 layers; high bytes 2.68x -> 2.87x, whole
    file 1.457x -> 1.483x), and level 3 ~3x faster (2.33x -> 2.86x): `bench/bench_hidden_codec.py`. The
    frames are ordinary zstd: any decoder reads them, and files written before this read as they did.
    """
    return zstandard.ZstdCompressionParameters.from_level(level, hash_log=6, chain_log=6, search_log=1, min_match=7)


@dataclass
class EncodedSample:
    """One sample compressed and ready to append; built off the engine's thread."""

    sample_id: str
    n_tokens: int
    layers: list[int]
    hidden: int
    parts: tuple[bytes, bytes, bytes]
    lo_codec: str
    # Each part's crc32, computed where the sample is encoded: the writer appends under its file's lock, and a
    # real model's sample (~140 MB of parts) took ~70 ms of crc32 there, serialising every encoder thread.
    crc32: tuple[int, int, int]
    codec: str = "bf16"
    max_rel_error: list[float] | None = None  # lossy codecs: the measured error per layer (app.base.states_codec)
    rms_rel_error: list[float] | None = None

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.parts)


def encode_sample(
    sample_id: str,
    token_ids: np.ndarray,
    states_u16: np.ndarray,
    layers: list[int],
    level: int = COMPRESSION_LEVEL,
    compress_low: bool = False,
    stored: str = "bf16",
) -> EncodedSample:
    """Compress one sample's states `[n_tokens, n_layers, hidden]` (bf16 bit patterns as uint16).

    `stored` is the run's states dtype: `bf16` (lossless) or a lossy codec of app.base.states_codec. A lossy
    run still stores a sample losslessly when it holds NaN/Inf (the quality gate flagged it: whoever looks
    into it sees what the engine produced) or when its measured error is above the codec's bound, so no
    sample ever breaks the bound its run's manifest promises.
    """
    if states_u16.dtype != np.uint16 or states_u16.ndim != 3:
        raise ValueError(f"states must be uint16 [tokens, layers, hidden], got {states_u16.dtype} {states_u16.shape}")
    n_tokens, n_layers, hidden = states_u16.shape
    if n_layers != len(layers) or len(token_ids) != n_tokens:
        raise ValueError(f"shape {states_u16.shape} does not match {len(token_ids)} tokens and layers {layers}")
    cctx = _compressor(level)
    if stored != "bf16":
        lossy = _encode_lossy(sample_id, token_ids, states_u16, layers, cctx, stored)
        if lossy is not None:
            return lossy
    high, low = split_bytes(states_u16)
    tok = cctx.compress(np.asarray(token_ids, dtype="<i4").tobytes())
    hi = cctx.compress(high.tobytes())
    lo = cctx.compress(low.tobytes()) if compress_low else low.tobytes()
    parts = (tok, hi, lo)
    return EncodedSample(sample_id, n_tokens, list(layers), hidden, parts, "zstd" if compress_low else "raw",
                         tuple(zlib.crc32(p) for p in parts))


def _encode_lossy(sample_id, token_ids, states_u16, layers, cctx, codec: str) -> EncodedSample | None:
    """The sample in `codec`, or None where it must be stored losslessly (non-finite, or above the bound)."""
    n_tokens, _, hidden = states_u16.shape
    try:
        q = states_codec.quantise(codec, states_u16)
    except states_codec.NonFiniteStates:
        return None
    if q.max_rel_error and max(q.max_rel_error) > states_codec.bound(codec, hidden):
        return None
    tok = cctx.compress(np.asarray(token_ids, dtype="<i4").tobytes())
    parts = (tok, *(cctx.compress(np.ascontiguousarray(a).tobytes()) for a in q.arrays))
    return EncodedSample(sample_id, n_tokens, list(layers), hidden, parts, "zstd", tuple(zlib.crc32(p) for p in parts),
                         codec, q.max_rel_error, q.rms_rel_error)


_compressors = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for `level`: a ZstdCompressor is not thread-safe, and building one per sample (its
    context and tables) cost ~20 us, a tenth of encoding a small sample."""
    cache = _compressors.__dict__.setdefault("by_level", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(compression_params=_state_params(level))
    return cache[level]


class HiddenFileWriter:
    """Append encoded samples to a binary file object; `close()` writes the index and footer."""

    def __init__(self, fh):
        self.fh = fh
        self.offset = 0
        self.entries: list[dict] = []
        self._write(MAGIC)

    def _write(self, data: bytes) -> None:
        self.fh.write(data)
        self.offset += len(data)

    def append(self, sample: EncodedSample) -> None:
        entry = {
            "sample_id": sample.sample_id,
            "n_tokens": sample.n_tokens,
            "layers": sample.layers,
            "hidden": sample.hidden,
            "offset": self.offset,
            "sizes": [len(p) for p in sample.parts],
            "lo_codec": sample.lo_codec,
            "crc32": list(sample.crc32),
        }
        if sample.codec != "bf16":
            entry.pop("lo_codec")
            entry.update(codec=sample.codec, max_rel_error=sample.max_rel_error, rms_rel_error=sample.rms_rel_error)
        for part in sample.parts:
            self._write(part)
        self.entries.append(entry)

    def close(self) -> int:
        # The index carries zstd's content checksum: its entries hold the per-part CRCs, so it needs its own.
        index = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(
            orjson.dumps({"format": FORMAT_LOSSY if any("codec" in e for e in self.entries) else FORMAT,
                          "samples": self.entries})
        )
        index_offset = self.offset
        self._write(index)
        self._write(FOOTER.pack(index_offset, len(index), FOOTER_MAGIC))
        return self.offset


class HiddenFileReader:
    """Random access to one shard's hidden states; works on any seekable binary file (local, fsspec, S3)."""

    def __init__(self, fh):
        self.fh = fh
        fh.seek(0, 2)
        size = fh.tell()
        if size < len(MAGIC) + FOOTER.size:
            raise CorruptHiddenFile(f"file too short ({size} bytes)")
        fh.seek(0)
        if fh.read(len(MAGIC)) != MAGIC:
            raise CorruptHiddenFile("bad magic")
        fh.seek(size - FOOTER.size)
        index_offset, index_len, magic = FOOTER.unpack(fh.read(FOOTER.size))
        if magic != FOOTER_MAGIC or index_offset + index_len + FOOTER.size != size:
            raise CorruptHiddenFile("bad footer")
        fh.seek(index_offset)
        try:
            # Streaming decompression: a corrupted frame header cannot make us allocate its claimed size.
            dobj = zstandard.ZstdDecompressor().decompressobj()
            raw_index = dobj.decompress(fh.read(index_len))
            if not dobj.eof:
                raise CorruptHiddenFile("truncated index")
            index = orjson.loads(raw_index)
            if index.get("format") not in (FORMAT, FORMAT_LOSSY):
                raise CorruptHiddenFile(f"unknown format {index.get('format')!r}")
            self.entries: list[dict] = index["samples"]
            for e in self.entries:
                codec = e.get("codec", "bf16")
                if codec != "bf16" and (index["format"] == FORMAT or codec not in states_codec.LOSSY_CODECS):
                    raise CorruptHiddenFile(f"sample {e.get('sample_id')}: states codec {codec!r} in a "
                                            f"{index['format']} file")
            self.by_id = {e["sample_id"]: i for i, e in enumerate(self.entries)}
        except (zstandard.ZstdError, orjson.JSONDecodeError, AttributeError, KeyError, TypeError) as exc:
            raise CorruptHiddenFile(f"unreadable index: {exc}") from exc

    def __len__(self) -> int:
        return len(self.entries)

    def read(self, i: int, slots=None) -> tuple[np.ndarray, np.ndarray]:
        """Sample i as (token_ids int32 [T], states uint16 bf16 bit patterns [T, L, H]); checksums verified.

        bf16 whatever the sample is stored as: a lossy entry is decoded (app.base.states_codec). `slots` (positions
        in the entry's `layers`) returns those layers only, in that order, [T, len(slots), H] C-ordered: an
        export that writes some layers gets them without joining the others or copying them again.
        """
        e = self.entries[i]
        codec = e.get("codec", "bf16")
        shape = (e["n_tokens"], len(e["layers"]), e["hidden"])
        if codec != "bf16":
            tokens, arrays = self._read_lossy(e)
            states = states_codec.dequantise(codec, arrays, shape)
            return tokens, states if slots is None else np.take(states, list(slots), axis=1)
        parts = self._parts(e)
        dctx = zstandard.ZstdDecompressor()
        n = e["n_tokens"] * len(e["layers"]) * e["hidden"]
        tokens = np.frombuffer(dctx.decompress(parts[0]), dtype="<i4")
        high = _decompress_array(dctx, parts[1], n, e)
        low = _decompress_array(dctx, parts[2], n, e) if e["lo_codec"] == "zstd" else np.frombuffer(parts[2], np.uint8)
        if high.size != n or low.size != n or tokens.size != e["n_tokens"]:
            raise CorruptHiddenFile(f"sample {e['sample_id']}: decoded sizes do not match the index")
        return tokens, join_layers(high, low, shape, range(shape[1]) if slots is None else slots)

    def _parts(self, e: dict) -> list:
        """The entry's stored parts (bytes-like), their lengths and CRCs checked.

        Read in one `readinto` a fresh numpy array where the file has it: numpy asks the kernel for huge pages
        on large arrays, so the read is not mostly page faults as into a fresh `bytes` (0.13 s against 0.45 s
        for a width-5120 shard's 6 samples, 710 MB, from the page cache; bench/bench_export_speed.py's run).
        """
        self.fh.seek(e["offset"])
        readinto = getattr(self.fh, "readinto", None)
        if readinto is None:  # a file seen through a wrapper with read() only (verify's one-pass hash)
            parts = [self.fh.read(n) for n in e["sizes"]]
        else:
            view = memoryview(np.empty(sum(e["sizes"]), dtype=np.uint8))
            got = 0
            while got < len(view) and (k := readinto(view[got:])):
                got += k
            parts, at = [], 0
            for n in e["sizes"]:
                parts.append(view[at:min(at + n, got)])
                at += n
        for k, (part, crc) in enumerate(zip(parts, e["crc32"], strict=True)):
            if len(part) != e["sizes"][k] or zlib.crc32(part) != crc:
                raise CorruptHiddenFile(f"sample {e['sample_id']}: checksum mismatch in part {k}")
        return parts

    def _read_lossy(self, e: dict) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        parts = self._parts(e)
        dctx = zstandard.ZstdDecompressor()
        rows, n = e["n_tokens"] * len(e["layers"]), e["n_tokens"] * len(e["layers"]) * e["hidden"]
        fp8 = e["codec"] == "fp8-e4m3"
        first_size = rows * 4 if fp8 else n  # fp8: float32 scales; bf16-m*: high bytes
        try:
            tokens = np.frombuffer(dctx.decompress(parts[0]), dtype="<i4")
            first = dctx.decompress(parts[1], max_output_size=first_size)
            second = dctx.decompress(parts[2], max_output_size=n)
        except zstandard.ZstdError as exc:
            raise CorruptHiddenFile(f"sample {e['sample_id']}: {exc}") from exc
        if tokens.size != e["n_tokens"] or len(first) != first_size or len(second) != n:
            raise CorruptHiddenFile(f"sample {e['sample_id']}: decoded sizes do not match the index")
        shape = (e["n_tokens"], len(e["layers"]), e["hidden"])
        if fp8:
            return tokens, (np.frombuffer(first, dtype="<f4").reshape(shape[:2]),
                            np.frombuffer(second, dtype=np.uint8).reshape(shape))
        return tokens, (np.frombuffer(first, dtype=np.uint8).reshape(shape),
                        np.frombuffer(second, dtype=np.uint8).reshape(shape))

    def read_stored(self, i: int) -> tuple[str, np.ndarray, object]:
        """Sample i as stored: (codec, token_ids, arrays); checksums verified, nothing decoded.

        For an export to a trainer that reads the stored form itself. `fp8-e4m3`: (scales float32 [T, L],
        e4m3fn bytes uint8 [T, L, H]; value = e4m3 * scale, e.g. `torch.from_numpy(b).view(torch.float8_e4m3fn)`);
        `bf16-m*`: (high bytes, low bytes); `bf16`: the states as `read` returns them.
        """
        e = self.entries[i]
        codec = e.get("codec", "bf16")
        if codec == "bf16":
            tokens, states = self.read(i)
            return codec, tokens, states
        tokens, arrays = self._read_lossy(e)
        return codec, tokens, arrays

    def read_torch(self, i: int):
        """Sample i as torch tensors: (token_ids int64 [T], hidden_states bfloat16 [T, L, H])."""
        import torch

        tokens, states = self.read(i)
        return torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(states.view(np.int16).copy()).view(
            torch.bfloat16
        )


def _decompress_array(dctx: zstandard.ZstdDecompressor, frame, n: int, e: dict) -> np.ndarray:
    """One zstd frame that must decode to exactly `n` bytes, into a fresh numpy array (uint8).

    Why not `dctx.decompress`: its `bytes` result is fresh memory the kernel maps page by page as zstd writes
    it; a numpy array of this size gets huge pages, which halved the decompression of a width-5120 sample's
    high bytes (0.46 s -> 0.27 s for 6 samples, 507 MB; bench/bench_export_speed.py's run). A frame that
    decodes to more or fewer bytes is refused without decoding past `n`, as `max_output_size` did.
    """
    out = np.empty(n, dtype=np.uint8)
    view, got = memoryview(out), 0
    with dctx.stream_reader(frame) as reader:
        while got < n and (k := reader.readinto(view[got:])):
            got += k
        if got != n or reader.read(1):
            raise CorruptHiddenFile(f"sample {e['sample_id']}: decoded sizes do not match the index")
    return out


def bf16_to_float32(states_u16: np.ndarray) -> np.ndarray:
    """bf16 bit patterns -> float32 values, without torch (bf16 is the top half of a float32)."""
    return (states_u16.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns with round-to-nearest-even (what torch's .to(bfloat16) does)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    rounded = ((bits + rounding) >> 16).astype(np.uint16)
    # NaN must stay NaN: rounding its payload would carry into the exponent/sign (0x7FFFFFFF -> -0.0,
    # 0x7F800001 -> inf), hiding exactly the non-finite states a sample check looks for. Keep it, made quiet.
    return np.where(np.isnan(values), ((bits >> 16) | 0x0040).astype(np.uint16), rounded)
