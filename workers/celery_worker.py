"""The Celery app as a worker process sees it: `build_worker_app(settings)` registers the tasks, guards the
transport (workers.process.message_guard) and connects the worker's signals (engine built, heap frozen, watchers
started, engine closed at shutdown).

Importing this module does none of that: an app and its signal handlers exist only once an entry point asks.
`python -m workers.worker_main` (started by `regen worker`) builds the engine, then calls `build_worker_app`.
Celery's own command line (`celery -A workers.celery_worker worker --pool solo`) asks this module for its
`celery` attribute, which is built on that first access from the environment's settings; the engine is then
built in `worker_process_init`.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading

from celery import Celery
from celery.signals import worker_process_init, worker_process_shutdown, worker_ready, worker_shutdown

from app.base.celery_app import create_app
from app.base.config import Config, install
from app.base.liveness import clock_skew_warning
from workers.doubles.bench_task import register_bench
from workers.process import dead_holder_watch
from workers.process.context import WorkerContext
from workers.process.engine_watch import watch_engine
from workers.process.heap import freeze_startup_heap
from workers.process.inflight import sweep_dead_attempts
from workers.process.message_guard import install as guard_messages
from workers.shard.delivery import shards_held, visibility_timeout
from workers.shard.tasks import register

log = logging.getLogger("regen.worker")


def build_worker_app(settings: Config) -> Celery:
    """The worker's Celery app on `settings.broker`: tasks registered (the fleet bench's too with
    `REGEN_BENCH_TASKS=1`), undecodable messages set aside instead of fatal, the worker's signals connected."""
    celery = create_app(settings.broker)
    guard_messages(celery)
    register(celery)
    if settings.bench_tasks:  # the fleet bench's in-worker baseline (workers.doubles.bench_task)
        register_bench(celery)
    connect_worker_signals(celery)
    return celery


def connect_worker_signals(celery: Celery) -> None:
    """Connect the handlers below, once per process (Celery's signals are process-wide; `dispatch_uid` keeps a
    second call from connecting them twice)."""
    worker_process_init.connect(_build_engine, weak=False, dispatch_uid="regen.build_engine")
    worker_ready.connect(_freeze_heap, weak=False, dispatch_uid="regen.freeze_heap")
    worker_ready.connect(functools.partial(_start_watchers, celery), weak=False, dispatch_uid="regen.watchers")
    worker_shutdown.connect(_close_engine, weak=False, dispatch_uid="regen.close_engine")
    worker_process_shutdown.connect(_close_engine, weak=False, dispatch_uid="regen.close_engine.process")


def __getattr__(name: str) -> Celery:
    """`celery`: the app Celery's command line finds here (`celery -A workers.celery_worker`), built on first
    access with this process's settings read from the environment."""
    if name != "celery":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    app = globals()["celery"] = build_worker_app(install(Config.from_env()))
    return app


def _build_engine(**_):
    try:
        WorkerContext.get()
    except BaseException as exc:  # an engine that cannot start must not consume shards
        log.exception("worker start-up failed: %s", exc)
        sys.stderr.flush()
        os._exit(70)


def _freeze_heap(**_):
    """Once the consumer runs, this process's start-up heap is frozen out of full collections (workers.process.heap)."""
    log.info("worker process: %d start-up objects frozen out of garbage collection", freeze_startup_heap())


def _start_watchers(celery: Celery, **_):
    """The engine watchdog (workers.process.engine_watch), the sweep of this host's dead attempts' temporaries
    (workers.process.inflight; in a thread: storage may be slow to answer), the re-send of shards held by
    dead processes while this worker has a free task slot (workers.process.dead_holder_watch), and a warning
    when this host's clock is off the fleet's shared one by more than a lease (app.base.liveness)."""
    skew = clock_skew_warning()
    if skew:
        log.warning("%s", skew)
    watch_engine()
    threading.Thread(target=sweep_dead_attempts, args=(visibility_timeout(celery),), name="regen-sweep",
                     daemon=True).start()
    ctx = WorkerContext.current
    slots = ctx.config.task_slots if ctx is not None else 1
    dead_holder_watch.start(celery, ctx.config.storage if ctx is not None else None,
                            lambda: shards_held() < slots, visibility_timeout(celery))


def _close_engine(**_):
    if WorkerContext.current is not None:
        WorkerContext.current.close()
