"""Keeping a CPU worker's side work off the cores while its engine wants them.

Rule: on the CPU every thread of the worker process runs under SCHED_BATCH at nice 19 (GPU hosts keep the
normal policy; `REGEN_SIDE_THREADS=idle|batch|normal` chooses), because the engine's OpenMP team waits at each
barrier for a thread a side thread preempted; the engine's own process keeps the normal policy throughout, since
its threads share the engine thread's GIL. Each thread is switched after the engine's exists, since a new thread
inherits its creator's policy. Why, measured: docs/performance.md (2026-11-30, 2026-12-06); which thread
switches when: docs/workers.md#thread-priorities-in-detail.
"""

from __future__ import annotations

import logging
import os
import threading

from app.base.config import current
from app.base.errors import ConfigError

log = logging.getLogger("regen.worker")

ENV = "REGEN_SIDE_THREADS"


IDLE, BATCH = "idle", "batch"
BATCH_NICE = 19  # SCHED_BATCH's share: weight 15 against an OpenMP thread's 1024, ~1.4% of a core it shares
POLICY_NAMES = {IDLE: "SCHED_IDLE", BATCH: f"SCHED_BATCH at nice {BATCH_NICE}"}


def side_threads_policy(device: str) -> str | None:
    """How this worker's side threads yield to the engine: IDLE, BATCH, or None (the normal policy).

    By default SCHED_BATCH at nice 19 on the CPU only; `REGEN_SIDE_THREADS=idle|batch|normal` chooses (read
    with the process's config, app.base.config)."""
    choice = current().side_threads
    if choice in (IDLE, BATCH):
        return choice
    if choice == "normal":
        return None
    if choice:
        raise ConfigError(f"{ENV}={choice!r}: expected 'idle', 'batch' or 'normal'")
    return BATCH if device == "cpu" else None


def lower_priority(thread_id: int = 0, policy: str = IDLE) -> bool:
    """Put one thread (a native id; 0: the calling thread) under `policy`. False where unsupported."""
    tid = thread_id or threading.get_native_id()
    try:
        if policy == BATCH:
            os.sched_setscheduler(thread_id, os.SCHED_BATCH, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, BATCH_NICE)  # Linux: per thread
        else:
            os.sched_setscheduler(thread_id, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError) as exc:  # a container, kernel or OS that refuses it: only slower
        log.warning("could not move thread %s to %s: %s", tid, POLICY_NAMES.get(policy, policy), exc)
        return False
    return True


def name_thread(name: str) -> None:
    """Give the calling thread an OS-level name (15 bytes), so `top -H`, `ps -L` and tests can tell threads apart."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as fh:
            fh.write(name[:15])
    except OSError:  # not Linux, or /proc not mounted: only the name is lost
        pass
