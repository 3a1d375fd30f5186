"""Entry point of one worker process (one per GPU, or one on the CPU): a solo-pool Celery worker.

Started by `regen worker` with CUDA_VISIBLE_DEVICES and REGEN_WORKER_CONFIG already set, so nothing touches
CUDA before the device is pinned.
"""

from __future__ import annotations

import json
import logging
import os
import sys


def main() -> None:
    config = json.loads(os.environ["REGEN_WORKER_CONFIG"])
    queues = os.environ.get("REGEN_QUEUES", "regen")
    logging.basicConfig(level=os.environ.get("REGEN_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from workers.celery_worker import celery

    celery.worker_main([
        "worker",
        "--pool=solo",
        "--concurrency=1",
        f"--hostname={config['hostname']}",
        f"--queues={queues}",
        f"--loglevel={os.environ.get('REGEN_LOG_LEVEL', 'INFO')}",
        "--without-mingle",
        "--task-events",
    ])


if __name__ == "__main__":
    main()
