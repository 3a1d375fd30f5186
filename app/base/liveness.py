"""Is the process that started an attempt still alive? The answer decides what a shard's attempts count and
which temporaries may be removed.

On the same machine: its pid with the start time it had (pid + start time cannot be reused). From another
machine: its lease (`heartbeat`, renewed every `heartbeat_seconds()`) has not run out, measured on the fleet's
one clock (app.base.clock); a worker warns at start when its clock is off by more than a lease.
Details: docs/faults.md#is-an-attempts-process-alive.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import socket

from app.base.clock import clock
from app.base.config import current

LEASE_HEARTBEATS = 4


def heartbeat_seconds() -> float:
    """How often a worker renews its attempts' leases (`REGEN_HEARTBEAT_S`, default 30 s; app.base.config)."""
    return current().heartbeat_s


def lease_seconds() -> float:
    return LEASE_HEARTBEATS * heartbeat_seconds()


def clock_skew_warning() -> str | None:
    """One line for a worker's start when this host's clock is off the fleet's shared one by more than a lease;
    None when it is not (or there is no shared clock to compare with)."""
    shared = clock()
    offset = shared.offset()
    if not shared.shared or abs(offset) <= lease_seconds():
        return None
    return (f"this host's clock is {abs(offset):.0f} s {'behind' if offset > 0 else 'ahead of'} the broker's "
            f"(more than a {lease_seconds():.0f} s lease): leases use the broker's clock, but fix this host's "
            f"time (NTP) so its logs and files agree")


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _machine() -> dict:
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {"host": socket.gethostname(), "boot": boot, "pidns": pidns}


def pid_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None when it does not run."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    if fields and fields[0] == "Z":  # a zombie has exited
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def identity() -> dict:
    """This process, as attempt records name it."""
    pid = os.getpid()
    return {**_machine(), "pid": pid, "pid_start": pid_start(pid)}


def process_key(record: dict) -> tuple:
    """One key per process that ever ran an attempt (a machine's death counts once per shard, not per copy)."""
    return (record.get("host"), record.get("boot"), record.get("pidns"), record.get("pid"), record.get("pid_start"))


def on_this_machine(record: dict) -> bool:
    me = _machine()
    return all(me[k] is not None and record.get(k) == me[k] for k in ("host", "boot", "pidns"))


def process_alive(pid: int | None, start: int | None) -> bool:
    return pid is not None and start is not None and pid_start(int(pid)) == int(start)


def _time(value) -> float | None:
    try:
        return dt.datetime.fromisoformat(value).timestamp()
    except (TypeError, ValueError):
        return None


def attempt_state(record: dict, now: float, stale_after: float | None) -> str:
    """`ended` (it recorded an error or its end), `alive` or `dead`; see the module docstring."""
    if record.get("error") or record.get("ended"):
        return "ended"
    if on_this_machine(record) and record.get("pid_start") is not None:
        return "alive" if process_alive(record.get("pid"), record.get("pid_start")) else "dead"
    last = _time(record.get("heartbeat")) or _time(record.get("started"))
    lease = record.get("lease_s") or stale_after
    if last is None:
        return "dead"
    if lease is None:
        return "alive"
    return "alive" if now - last < float(lease) else "dead"
