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
task's start and prompt rendering, the engine host reading it from the pipe) also runs only when the engine
runs dry, so in steady state the engine took one shard at a time and stood idle 35-80 ms before each (the
engine's own spans, 512-prompt passes); more task slots only batched the first shards of a run. So the CPU
default is SCHED_BATCH at nice 19: SCHED_BATCH never preempts a running thread on wake-up (what made the normal
policy stall the team), and nice 19's weight (15 against an OpenMP thread's 1024) gives these threads a thin but
steady share of a core they share, enough for the fleet's side work to keep up (~30 ms of CPU per 64-sample
shard of the tiny model, per ~0.9 s of engine time), so with spare task slots (workers/devices.py) the next
shards are rendered and queued in the engine before the current one ends. Measured in the same rounds as
SCHED_IDLE workers (bench/bench_fleet.py, 512 prompts, 2 direct processes): engine gaps at most 45 ms and
mostly none, against 35-80 ms before most shards; fleet/direct 0.944 against 0.957 and 0.940 for two SCHED_IDLE
workers (6 rounds; 0.916 against 0.940 in 5 more), a difference smaller than one process's own lasting speed
difference here. Larger shares stall the team more than the gaps cost: nice 10 0.872 and nice 15 0.901 of
direct, against 0.963 and 0.928 for SCHED_IDLE in the same rounds. Where the side work outgrows the share (a
real model's states on a CPU host), shards queue up until the engine runs dry and the side threads get the
cores, which is SCHED_IDLE's behaviour: nothing starves. `REGEN_SIDE_THREADS=idle` keeps SCHED_IDLE.

Linux sets a scheduling policy (and, for SCHED_OTHER and SCHED_BATCH, a nice value) per thread, and a new thread
inherits its creator's. So the main thread switches itself only after the engine thread (and, through it, the
OpenMP team) exists, and every thread Celery starts later inherits the side policy; the delivery thread is
switched by its id, and encoder threads switch themselves as they start. With the CPU engine in a process of its
own (workers/engine/process.py) the same holds on both sides: that process switches its main and delivery threads
once its engine thread exists, and the worker process switches after starting it, so every thread of the worker
runs under the side policy and the engine's process is spawned at normal priority. GPU hosts keep the normal
policy: there the side work competes with no GPU kernel, and engine-core processes polling their GPUs could
starve it under a low one. `REGEN_SIDE_THREADS=normal` turns it off on the CPU, `=idle` or `=batch` sets it
anywhere.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("regen.worker")

ENV = "REGEN_SIDE_THREADS"


IDLE, BATCH = "idle", "batch"
BATCH_NICE = 19  # SCHED_BATCH's share: weight 15 against an OpenMP thread's 1024, ~1.4% of a core it shares
POLICY_NAMES = {IDLE: "SCHED_IDLE", BATCH: f"SCHED_BATCH at nice {BATCH_NICE}"}


def side_threads_policy(device: str) -> str | None:
    """How this worker's side threads yield to the engine: IDLE, BATCH, or None (the normal policy).

    By default SCHED_BATCH at nice 19 on the CPU only; `REGEN_SIDE_THREADS=idle|batch|normal` chooses."""
    choice = os.environ.get(ENV, "").strip().lower()
    if choice in (IDLE, BATCH):
        return choice
    if choice == "normal":
        return None
    if choice:
        from app.errors import ConfigError

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
