"""Entry point of one worker process (one per GPU, or one on the CPU).

Started by `regen worker` with CUDA_VISIBLE_DEVICES and REGEN_WORKER_CONFIG already set (app.process_env),
so nothing touches CUDA before the device is pinned. It reads its settings once (app.settings); the engine is
built and self-tested *before* the Celery app is built with them (workers.celery_worker.build_worker_app) and its
consumer starts, so a broken engine never takes a shard (exit 70: the supervisor restarts it with backoff).

Pool: Celery's thread pool, every slot feeding the one engine thread (workers.engine.in_process; on the CPU that engine
lives in a child process of this one, workers.engine.process); `regen worker` sizes
it (workers.process.devices.task_slots_for) so that while one shard is written to storage and acked, the others fill
the engine's batch with a shard queued behind them, and the engine does not idle or run short between shards;
each shard is still acked only after its completion marker exists. (Prefork cannot work:
its children are daemonic and cannot start vLLM's processes, docs/measured-facts.md.) The thread pool also keeps the
consumer answering heartbeats and `inspect` while a shard runs, unlike the solo pool.
"""

from __future__ import annotations

import logging
import os
import sys


def main() -> None:
    from app.settings import Settings, install

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        settings = install(Settings.from_env())  # this process's settings, read once (app.settings)
        logging.getLogger().setLevel(settings.log_level)
        from workers.process.context import WorkerContext

        config = WorkerContext.get().config
    except BaseException as exc:  # an engine that cannot start (or a malformed setting) must not consume shards
        from workers.engine.self_test import SelfTestFailed

        log = logging.getLogger("regen.worker")
        if isinstance(exc, SelfTestFailed):  # one line: the check that failed and the engine mode
            log.error("worker start-up failed: %s", exc)
        else:
            log.exception("worker start-up failed")
        sys.stderr.flush()
        os._exit(70)
    from workers.celery_worker import build_worker_app

    build_worker_app(settings).worker_main([
        "worker",
        "--pool=threads",
        f"--concurrency={config.task_slots}",
        f"--hostname={config.hostname}",
        f"--queues={settings.queues}",
        f"--loglevel={settings.log_level}",
        "--without-mingle",
        "--task-events",
    ])


if __name__ == "__main__":
    main()
