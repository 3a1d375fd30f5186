"""An idle worker's periodic check for shards held by dead processes (app/dead_holders.py).

Why idle workers: a worker with nothing to do is the one that would take a re-sent shard, and the check costs
the broker one `HKEYS` and storage a few attempt reads per held shard, nothing while the fleet is busy. Every
`CHECK_LEASES` lease lengths (with up to a heartbeat of jitter, so a fleet started at once does not check in
step) the worker looks when it holds no shard; the claim in app/dead_holders.py keeps two idle workers from
re-sending one shard twice. A dead host's shards are thus back in the queue about one lease after their last
heartbeat's lease ran out: with the defaults (30 s heartbeats, 120 s leases) within about 4-5 minutes of the
death, instead of the broker's 4 h visibility timeout.
"""

from __future__ import annotations

import logging
import random
import threading

from app.dead_holders import DeadHolderCheck
from app.liveness import heartbeat_seconds, lease_seconds

log = logging.getLogger("regen.dead_holders")

CHECK_LEASES = 0.5  # how often an idle worker looks, in lease lengths


def start(app, storage: str | None, idle, stale_after: float) -> threading.Thread:
    """Check in a daemon thread for the process's life; `idle()` says whether this worker holds no shard."""
    check = DeadHolderCheck(app.conf.broker_url, stale_after, app=app,
                            storage_for=(lambda _url: storage) if storage else None)

    def loop() -> None:
        stop = threading.Event()
        while not stop.wait(CHECK_LEASES * lease_seconds() + random.uniform(0, heartbeat_seconds())):
            if idle():
                check.run()

    thread = threading.Thread(target=loop, name="regen-dead-holders", daemon=True)
    thread.start()
    return thread
