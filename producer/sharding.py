"""Exact-duplicate removal and fixed-size, deterministic shards.

Why: the same prompt often appears in several datasets (or twice in one); generating it twice wastes GPU hours
and biases the drafter. A sample id is a 64-bit hash of the normalised prompt (app/ids.py), so the set of seen
ids holds one Python int per unique sample (~70 bytes), not the samples themselves.

Shard k is the k-th group of `shard_size` unique samples in input order and is named `app.ids.shard_id(k)`,
so the same inputs and settings always give the same shards: a re-run or a `--resume` can tell which shards
are done from their completion markers alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from app.ids import shard_id


class Deduper:
    """Remembers sample ids seen so far (across all files of a run) as 64-bit ints; counts the repeats."""

    def __init__(self):
        self._seen: set[int] = set()
        self.duplicates = 0

    def first_time(self, sid: str) -> bool:
        key = int(sid, 16)
        seen = self._seen
        if key in seen:
            self.duplicates += 1
            return False
        seen.add(key)
        return True

    def __len__(self) -> int:
        return len(self._seen)


@dataclass
class Shard:
    index: int
    id: str
    samples: list[dict]
    approx_bytes: int  # size of the input lines the samples came from: a cheap proxy for the message size


def shard_samples(samples: Iterable[tuple[dict, int]], shard_size: int) -> Iterator[Shard]:
    """Group `(sample, approx_bytes)` pairs, already deduplicated, into shards of `shard_size` (last may be short)."""
    if shard_size < 1:
        raise ValueError("shard_size must be >= 1")
    batch: list[dict] = []
    size = 0
    index = 0
    for sample, nbytes in samples:
        batch.append(sample)
        size += nbytes
        if len(batch) == shard_size:
            yield Shard(index, shard_id(index), batch, size)
            index += 1
            batch, size = [], 0
    if batch:
        yield Shard(index, shard_id(index), batch, size)
