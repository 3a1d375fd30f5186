"""Exact-duplicate removal and fixed-size, deterministic shards.

Why: the same prompt often appears in several datasets (or twice in one); generating it twice wastes GPU hours
and biases the drafter. A sample id is a 64-bit hash of the normalised prompt (app.base.ids), so the record of seen
ids holds ~10 bytes per unique sample (see `Deduper`), not the samples themselves.

Shard k is the k-th group of `shard_size` unique samples in input order and is named `app.base.ids.shard_id(k)`,
so the same inputs and settings always give the same shards: a re-run or a `--resume` can tell which shards
are done from their completion markers alone.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from app.base.ids import shard_id


class Deduper:
    """Remembers sample ids seen so far (across all files of a run) as 64-bit ints; counts the repeats.

    Memory is ~10 bytes per unique sample instead of a Python set's ~100: the newest `window` ids live in a set,
    and every `window` ids they are merged into a sorted `array('Q')` (8 bytes each), searched with bisect.
    A one-hash bitmap over the archive (16 bits per id, rebuilt at each merge) answers "certainly new" for ~94%
    of new ids without a search, so the hot path stays a set lookup and a bit test. Answers are exact: the
    bitmap only skips searches, never decides a duplicate.
    """

    WINDOW = 1 << 16

    def __init__(self, window: int = WINDOW):
        self._window = window
        self._recent: set[int] = set()
        self._archive = array("Q")  # sorted
        self._bits = bytearray(1)  # all zero: nothing archived yet
        self._mask = 7
        self.duplicates = 0

    def first_time(self, sid: str) -> bool:
        key = int(sid, 16)
        if key in self._recent or self._archived(key):
            self.duplicates += 1
            return False
        self._recent.add(key)
        if len(self._recent) >= self._window:
            self._merge()
        return True

    def _archived(self, key: int) -> bool:
        bit = key & self._mask
        if not (self._bits[bit >> 3] >> (bit & 7)) & 1:
            return False
        archive = self._archive
        i = bisect_left(archive, key)
        return i < len(archive) and archive[i] == key

    def _merge(self) -> None:
        recent = np.fromiter(self._recent, dtype=np.uint64, count=len(self._recent))
        merged = np.concatenate([np.frombuffer(self._archive, dtype=np.uint64), recent])
        merged.sort()
        nbits = 1 << max(16, (len(merged) * 16 - 1).bit_length())
        low = merged & np.uint64(nbits - 1)
        bitmap = np.zeros(nbits >> 3, dtype=np.uint8)
        np.bitwise_or.at(bitmap, (low >> np.uint64(3)).astype(np.intp), np.left_shift(1, low & np.uint64(7)).astype(np.uint8))
        archive = array("Q")
        archive.frombytes(merged.tobytes())
        self._archive, self._bits, self._mask = archive, bytearray(bitmap.tobytes()), nbits - 1
        self._recent = set()

    def __len__(self) -> int:
        return len(self._recent) + len(self._archive)


@dataclass
class Shard:
    index: int
    id: str
    samples: list[dict]
    approx_bytes: int  # size of the input lines the samples came from: a cheap proxy for the message size


def shard_samples(samples: Iterable[tuple[dict, int]], shard_size: int, first: int = 0) -> Iterator[Shard]:
    """Group `(sample, approx_bytes)` pairs, already deduplicated, into shards of `shard_size` (last may be short),
    numbered from `first`."""
    if shard_size < 1:
        raise ValueError("shard_size must be >= 1")
    batch: list[dict] = []
    size = 0
    index = first
    for sample, nbytes in samples:
        batch.append(sample)
        size += nbytes
        if len(batch) == shard_size:
            yield Shard(index, shard_id(index), batch, size)
            index += 1
            batch, size = [], 0
    if batch:
        yield Shard(index, shard_id(index), batch, size)
