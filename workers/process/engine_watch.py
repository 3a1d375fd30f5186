"""Notice an engine that died while the worker is idle, within a second or so, and leave for a restart.

Why: a task sees a dead engine only when it hands the engine work. An idle worker whose engine died went on
taking shards from the queue, each of which then failed at once (17 s after the death in one fault run, when the
next shard came). The watchdog polls the worker's `Engine.dead` (workers.engine.interface) every POLL_SECONDS.
The CPU worker's `EngineProcess` (workers.engine.process) sets it the moment its child process's pipe closes; an
`InProcessEngine` (GPUs) sets it when its own loop fails. On a death it asks Celery for a warm shutdown (SIGTERM to this process): the consumer
stops, the prefetched messages go back to the queue (kombu restores a channel's unacked messages when it closes),
a shard still running meets the dead engine and exits the process itself (workers.shard.delivery), and the supervisor
starts a fresh worker.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from workers.process.context import WorkerContext

log = logging.getLogger("regen.worker")
POLL_SECONDS = 0.5


def _watch(stop: threading.Event) -> None:
    while not stop.wait(POLL_SECONDS):
        ctx = WorkerContext.current
        if ctx is None or ctx.closed:
            continue
        dead = ctx.engine.dead
        if dead:
            log.error("engine died (%s); this worker stops taking shards and exits for a restart", dead)
            os.kill(os.getpid(), signal.SIGTERM)
            return


def watch_engine() -> threading.Event:
    """Start the watchdog thread; set the returned event to stop it."""
    stop = threading.Event()
    threading.Thread(target=_watch, args=(stop,), name="regen-engine-watch", daemon=True).start()
    return stop
