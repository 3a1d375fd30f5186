"""One item read ahead: an iterator advanced in a background thread while the caller uses the item before.

Why: a hidden-state export spends about half of a sample's time decoding it (file reads, CRCs, zstd, joining
the byte planes) and the other half writing it (torch.save's zip records, the write, fsync). Both halves run
in code that releases the GIL (zstd, zlib, numpy's large-array loops, file writes, fsync), so decoding sample
i+1 while sample i is written overlaps them on a second core, or with the disk's flush on one.

Exactly one item ahead, so memory grows by one item (a 8,192-token sample's states at 5120 x 6 layers are
~500 MB). The iterator is only ever advanced by one thread at a time (the next step is submitted after the
last one's result is taken), so a generator with side effects (counters) sees them in order, as without the
thread. An error in the iterator is raised where the caller takes that item; when the caller stops early (an
error while writing) the step in flight is waited for, so no thread outlives the loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
_END = object()


def read_ahead(items: Iterable[T]) -> Iterator[T]:
    """`items`, in order, each fetched in a background thread while the caller works on the one before."""
    it = iter(items)

    def step():
        return next(it, _END)

    with ThreadPoolExecutor(1, thread_name_prefix="read-ahead") as pool:
        pending = pool.submit(step)
        while True:
            item = pending.result()
            if item is _END:
                return
            pending = pool.submit(step)
            yield item
