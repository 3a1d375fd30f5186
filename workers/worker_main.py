"""Entry point of one worker process (one per GPU, or one on the CPU).

Started by `regen worker` with CUDA_VISIBLE_DEVICES and REGEN_WORKER_CONFIG already set, so nothing touches
CUDA before the device is pinned. The engine is built and self-tested *before* the Celery consumer starts,
so a broken engine never takes a shard (exit 70: the supervisor restarts it with backoff).

Pool: Celery's thread pool, every slot feeding the one engine thread (workers/engine/in_process.py; on the CPU that engine
lives in a child process of this one, workers/engine/process.py); `regen worker` sizes
it (workers/devices.task_slots_for) so that while one shard is written to storage and acked, the others fill
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
    queues = os.environ.get("REGEN_QUEUES", "regen")
    logging.basicConfig(level=os.environ.get("REGEN_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from workers.context import WorkerContext

    try:
        config = WorkerContext.get().config
    except BaseException:  # an engine that cannot start must not consume shards
        logging.getLogger("regen.worker").exception("worker start-up failed")
        sys.stderr.flush()
        os._exit(70)
    from workers.celery_worker import celery

    celery.worker_main([
        "worker",
        "--pool=threads",
        f"--concurrency={config.task_slots}",
        f"--hostname={config.hostname}",
        f"--queues={queues}",
        f"--loglevel={os.environ.get('REGEN_LOG_LEVEL', 'INFO')}",
        "--without-mingle",
        "--task-events",
    ])


if __name__ == "__main__":
    main()
