"""zstd-compressed JSON Lines: how shard records are stored (`*.records.jsonl.zst`).

One zstd frame with a content checksum, one orjson object per line; readable with `zstdcat | jq`.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator

import orjson
import zstandard

from app.base.manifest import COMPRESSION_LEVEL

_OPTS = orjson.OPT_SERIALIZE_NUMPY


def dumps_jsonl_zst(rows: Iterable[dict], level: int = COMPRESSION_LEVEL) -> bytes:
    raw = b"".join(orjson.dumps(r, option=_OPTS) + b"\n" for r in rows)
    return zstandard.ZstdCompressor(level=level, write_checksum=True).compress(raw)


def loads_jsonl_zst(data: bytes) -> list[dict]:
    raw = zstandard.ZstdDecompressor().decompress(data) if data else b""
    return [orjson.loads(line) for line in raw.splitlines() if line]


def iter_jsonl_zst(fh: io.BufferedIOBase) -> Iterator[dict]:
    """Stream rows from an open binary file without holding the whole file in memory."""
    reader = zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True)
    buffered = io.BufferedReader(reader, buffer_size=1 << 20)
    for line in buffered:
        if line.strip():
            yield orjson.loads(line)
