"""Shard messages held by a dead process, as a dead host leaves them: sent with the app's own Celery
configuration, fetched by a real kombu consumer in a subprocess that is then SIGKILLed (no ack, no restore), so
they stay in kombu's unacked hash until the visibility timeout. For app/base/dead_holders.py's tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.support.paths import REPO

HOLD = """
import sys, time
from kombu import Connection
with Connection(sys.argv[1]) as conn:
    q = conn.SimpleQueue(sys.argv[2])
    for _ in range(int(sys.argv[3])):
        q.get(timeout=10)  # fetched, never acked
    print("held", flush=True)
    time.sleep(600)
"""


def send_shards(broker: str, queue: str, run_id: str, storage: str, shards: list[str]) -> None:
    """One generate-task message per shard, as the producer's (the samples travel with it)."""
    from app.base.celery_app import GENERATE_TASK, create_app
    from app.base.config import BrokerConfig

    app = create_app(BrokerConfig(url=broker))
    for shard in shards:
        app.send_task(GENERATE_TASK, kwargs={"run_id": run_id, "storage": storage, "shard_id": shard,
                                             "samples": [{"id": "x", "messages": []}]}, queue=queue)
    app.close()


def fetch_and_die(broker: str, queue: str, n: int) -> None:
    """A process fetches `n` messages of `queue` and is SIGKILLed holding them."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, broker, queue, str(n)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout.readline().strip() == "held"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
