"""Keeping a CPU worker's side work off the cores while its engine wants them.

On a CPU host the in-process engine's OpenMP team has a thread on every core. The worker's other threads (task
slots rendering prompts and writing shards, the delivery thread checking samples, the encoders, Celery's
consumer) need a few percent of one core, but every burst of theirs lands on a core where an OpenMP thread is
pinned, and the whole team waits at its next barrier until the burst ends: on 2 cores that side work cost the
engine several times its own CPU time. Under Linux's SCHED_IDLE those threads run only when a core has nothing
else to run, which the engine leaves often (its Python phases, when the OpenMP threads sleep), so they still
finish their work and the engine is not stalled by it. Measured here in alternating passes of the worker's
Engine beside a thread doing 8 ms of Python every 130 ms: at normal priority that thread cost the engine a
median 6%, under SCHED_IDLE nothing measurable (ahead in 8 rounds of 8). The whole worker, against
`LLM.generate` in 6 alternating rounds (bench/bench_fleet.py with a second worker): median 0.960 of direct with
SCHED_IDLE, 0.914 without (ahead in 5 of 6). If the engine keeps every core busy, these threads wait; the shards
they would hand it are then its only work, so it drains, idles briefly and they run: nothing starves for long.
How often the OpenMP threads leave a core depends on libgomp's spin: on a 2-core EPYC its default spin outlasted
the engine's Python phases, so during a pass its two threads never slept (15-60 voluntary switches each in a
13 s pass) and the side threads ran in the scheduler's small share for SCHED_IDLE and after the pass. A shorter
spin frees the core in those phases but makes every parallel region wake a sleeping thread: GOMP_SPINCOUNT=10000
gave the fleet 0.887 of direct and OMP_WAIT_POLICY=PASSIVE 0.859, against 0.948 with the default (medians of 8
alternating rounds), so the engine keeps libgomp's default.

The price of SCHED_IDLE on such a box: side work that gates the next shard (its slot's write and ack, the next
task's start and prompt rendering) also runs only when the engine runs dry, so in steady state the engine takes
one shard at a time and idles 35-80 ms before each (measured with the engine's own spans, 512-prompt passes,
3 task slots); more slots only batch the first shards of a run. Giving those threads a small guaranteed share
instead (SCHED_BATCH, which never preempts on wake-up, at a high nice value) removed the gaps but stalled the
OpenMP team more than the gaps cost: median of 5 rounds against direct, nice 10 0.872 and nice 15 0.901 against
0.963 and 0.928 for SCHED_IDLE in the same rounds; nice 19 0.967 against 0.943 (4 rounds), with gaps left.

Linux sets a scheduling policy per thread, and a new thread inherits its creator's. So the main thread switches
itself only after the engine thread (and, through it, the OpenMP team) exists, and every thread Celery starts
later inherits SCHED_IDLE; the delivery thread is switched by its id, and encoder threads switch themselves as
they start. With the CPU engine in a process of its own (workers/engine_host.py) the same holds on both sides:
that process switches its main and delivery threads once its engine thread exists, and the worker process
switches after starting it, so every thread of the worker is idle and the engine's process is spawned at normal
priority. GPU hosts keep the normal policy: there the side work competes with no GPU kernel, and engine-core
processes polling their GPUs could starve it under SCHED_IDLE. `REGEN_SIDE_THREADS=normal` turns it off on the
CPU, `=idle` forces it anywhere.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("regen.worker")

ENV = "REGEN_SIDE_THREADS"


def side_threads_idle(device: str) -> bool:
    """Whether this worker's side threads should run under SCHED_IDLE: by default on the CPU only."""
    choice = os.environ.get(ENV, "").strip().lower()
    if choice in ("idle", "normal"):
        return choice == "idle"
    if choice:
        from app.errors import ConfigError

        raise ConfigError(f"{ENV}={choice!r}: expected 'idle' or 'normal'")
    return device == "cpu"


def make_idle(thread_id: int = 0) -> bool:
    """Put one thread (a native id; 0: the calling thread) under SCHED_IDLE. False where unsupported."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        os.sched_setscheduler(thread_id, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:  # a container or kernel that refuses it: the worker still works, only slower
        log.warning("could not move thread %s to SCHED_IDLE: %s", thread_id or threading.get_native_id(), exc)
        return False
    return True


def name_thread(name: str) -> None:
    """Give the calling thread an OS-level name (15 bytes), so `top -H`, `ps -L` and tests can tell threads apart."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as fh:
            fh.write(name[:15])
    except OSError:  # not Linux, or /proc not mounted: only the name is lost
        pass
