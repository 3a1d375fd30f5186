"""Entry point of one worker process (one per GPU, or one on the CPU).

Started by `regen worker` with its device pinned; it reads its settings once, then builds and self-tests the
engine before the Celery app and its consumer start, so a broken engine never takes a shard (exit 70,
restarted with backoff). The pool is Celery's thread pool, sized so the engine's batch stays full between
shards. Why: docs/workers.md#the-worker-processs-start-and-pool.
"""

from __future__ import annotations

import logging
import os
import sys


def main() -> None:
    from app.base.config import Config, install

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        settings = install(Config.from_env())  # this process's config, read once (app.base.config)
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
