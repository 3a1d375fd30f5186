"""The Celery app as a worker process sees it: tasks registered, the engine closed at shutdown.

`python -m workers.worker_main` (started by `regen worker`) builds the engine, then runs a worker on this
app. Started any other way (`celery -A workers.celery_worker worker --pool solo`), the engine is built in
`worker_process_init` instead.
"""

from __future__ import annotations

import logging
import os
import sys

from celery.signals import worker_process_init, worker_process_shutdown, worker_ready, worker_shutdown

from app.celery_app import create_app
from workers.message_guard import install as guard_messages
from workers.tasks import register

log = logging.getLogger("regen.worker")

celery = create_app()
guard_messages(celery)  # a message that cannot be decoded is set aside, not fatal (workers/message_guard.py)
register(celery)
if os.environ.get("REGEN_BENCH_TASKS") == "1":  # the fleet bench's in-worker baseline (workers/bench_task.py)
    from workers.bench_task import register_bench

    register_bench(celery)


@worker_process_init.connect
def _build_engine(**_):
    from workers.context import WorkerContext

    try:
        WorkerContext.get()
    except BaseException as exc:  # an engine that cannot start must not consume shards
        log.exception("worker start-up failed: %s", exc)
        sys.stderr.flush()
        os._exit(70)


@worker_ready.connect
def _freeze_heap(**_):
    """Once the consumer runs, this process's start-up heap is frozen out of full collections (workers/heap.py)."""
    from workers.heap import freeze_startup_heap

    log.info("worker process: %d start-up objects frozen out of garbage collection", freeze_startup_heap())


@worker_ready.connect
def _start_watchers(**_):
    """The engine watchdog (workers/engine/watch.py), and the sweep of this host's dead attempts' temporaries
    (workers/inflight.py; in a thread: storage may be slow to answer)."""
    import threading

    from workers.engine.watch import watch_engine
    from workers.inflight import sweep_dead_attempts
    from workers.tasks import _visibility_timeout

    watch_engine()
    threading.Thread(target=sweep_dead_attempts, args=(_visibility_timeout(celery),), name="regen-sweep",
                     daemon=True).start()


@worker_shutdown.connect
@worker_process_shutdown.connect
def _close_engine(**_):
    from workers.context import WorkerContext

    if WorkerContext.current is not None:
        WorkerContext.current.close()
