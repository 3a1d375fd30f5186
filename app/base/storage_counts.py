"""Counts of the storage operations one process makes through `app.base.storage.Storage`, by kind and by what they
touch.

Why: what the fleet costs the shared storage per shard decides whether NFS's metadata server or an object
store's request rate breaks first as the fleet grows; bench/bench_fleet_scale.py reads these counts. Off
unless `REGEN_STORAGE_COUNTS=DIR` is set; then each operation is one O_APPEND line in `DIR/{pid}.log`, so a
killed process loses at most the operation in progress. Kinds and areas:
docs/performance.md#counting-storage-operations.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter

from app.base.config import current

_lock = threading.Lock()
_log: tuple[int, int] | None = None  # (pid, fd): reopened in a forked child


def area(rel: str) -> str:
    """What a storage path (relative to the root) touches: the run's folder or file, records and hidden apart."""
    parts = [p for p in rel.split("/") if p]
    if len(parts) < 2:
        return parts[0] if parts else "root"
    if parts[1] == "shards" and len(parts) > 3:
        return "records" if parts[-1].endswith(".records.jsonl.zst") else "hidden"
    return parts[1]


def count(kind: str, rel: str, nbytes: int = 0) -> None:
    """Count one operation (and its bytes); nothing unless counting is on."""
    folder = current().storage_counts
    if folder is None:
        return
    line = f"{kind} {area(rel)} {int(nbytes)} {_who()}\n".encode()
    with contextlib.suppress(OSError):  # counting must never fail the process it counts
        os.write(_fd(folder), line)


def _who() -> str:
    """The counting thread's part of the process: the project's named threads (`regen-lease`: heartbeats,
    `regen-dead-holders`, `regen-sweep`) by name, everything else (Celery's task slots, a command's main) as
    `task`."""
    name = threading.current_thread().name
    return name.removeprefix("regen-") if name.startswith("regen-") and " " not in name else "task"


def _fd(folder: str) -> int:
    global _log
    pid = os.getpid()
    if _log is None or _log[0] != pid:
        with _lock:
            if _log is None or _log[0] != pid:
                os.makedirs(folder, exist_ok=True)
                _log = (pid, os.open(os.path.join(folder, f"{pid}.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                                     0o644))
    return _log[1]


def tally(lines) -> Counter:
    """Counts from `kind area bytes who` lines: `kind`, `kind:area`, `by:who` (operations per thread kind),
    `bytes_written`/`bytes_read` (and per area)."""
    total: Counter = Counter()
    for line in lines:
        parts = line.split()
        if len(parts) != 4:
            continue  # a line cut short by a kill
        kind, where, nbytes = parts[0].decode(), parts[1].decode(), int(parts[2])
        total[kind] += 1
        total[f"{kind}:{where}"] += 1
        total[f"by:{parts[3].decode()}"] += 1
        if nbytes:
            key = "bytes_read" if kind in ("read", "open") else "bytes_written"
            total[key] += nbytes
            total[f"{key}:{where}"] += nbytes
    return total


def read_all(folder: str) -> Counter:
    """The sum of every process's counts under `folder`."""
    total: Counter = Counter()
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return total
    for name in names:
        if name.endswith(".log"):
            try:
                with open(os.path.join(folder, name), "rb") as fh:
                    total.update(tally(fh.read().splitlines()))
            except OSError:
                continue
    return total
