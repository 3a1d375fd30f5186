"""Sharing the read side of a run among processes on one host (`--processes N`) and among hosts (`--part I/N`).

Shards are the unit (independent files with their own markers): a part takes every N-th shard of a fixed,
sorted list, and results come back in shard order, so sums and lists are bit for bit one process's. Processes,
not threads (the work is CPU in Python), started with `spawn` (fork can deadlock after torch or threads). Why:
docs/formats.md#how-the-read-side-fans-out.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from app.base.errors import ConfigError
from app.data.run_reader import RunReader


@dataclass(frozen=True)
class Part:
    """Part `index` (1-based) of `count` disjoint parts of a run's shards; `Part(1, 1)` is the whole run."""

    index: int = 1
    count: int = 1

    @classmethod
    def parse(cls, text: str | None) -> Part:
        """`I/N` with 1 <= I <= N; None or empty: the whole run."""
        if not text:
            return cls()
        try:
            i, n = (int(x) for x in text.split("/"))
        except ValueError:
            raise ConfigError(f"--part {text!r}: expected I/N, e.g. 2/4") from None
        if not 1 <= i <= n:
            raise ConfigError(f"--part {text!r}: I must be between 1 and N")
        return cls(i, n)

    @property
    def whole(self) -> bool:
        return self.count == 1

    def owns(self, position: int) -> bool:
        """Whether the shard at `position` (0-based, in the sorted list every part reads) is this part's."""
        return position % self.count == self.index - 1

    def pick(self, items: list) -> list:
        return [x for k, x in enumerate(items) if self.owns(k)]

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


WHOLE = Part()  # the whole run: one part

_READER: RunReader | None = None  # this worker process's reader of the run (set by `open_reader`)


def open_reader(storage: str, run_id: str) -> None:
    """A pool initializer: open the run's reader once in this worker process (never a parent's handles)."""
    global _READER
    _READER = RunReader(storage, run_id)


def worker_reader() -> RunReader:
    """The reader `open_reader` opened in this process."""
    if _READER is None:
        raise RuntimeError("worker_reader() before open_reader() in this process")
    return _READER


def process_pool(processes: int, initializer: Callable | None = None, initargs: tuple = ()) -> ProcessPoolExecutor:
    """`processes` spawned workers; `initializer(*initargs)` runs once in each (module-level, picklable)."""
    return ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"), initializer=initializer,
                               initargs=initargs)


def ordered_map(fn: Callable, items: Iterable, processes: int, initializer: Callable | None = None,
                initargs: tuple = ()) -> Iterator:
    """`fn(item)` for every item, yielded in item order as they finish; in `processes` spawned workers when more
    than one, else here after one `initializer(*initargs)` call. `fn`, `initializer` and the items must be
    picklable (module-level functions)."""
    items = list(items)
    if processes <= 1 or len(items) <= 1:
        if initializer is not None:
            initializer(*initargs)
        for item in items:
            yield fn(item)
        return
    with process_pool(min(processes, len(items)), initializer, initargs) as pool:
        yield from pool.map(fn, items)
