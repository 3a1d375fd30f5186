"""A worker's periodic check for shards held by dead processes (app.base.dead_holders), while it has a free task slot.

Why a free slot: a worker that could take a shard is the one that would take a re-sent one, and in a busy
fleet no slot is free, so the check costs nothing there. Why one check per period for the whole fleet: a check
costs O(shards held) storage operations, so every free worker checking alone would cost O(workers^2); a worker
first takes the period's turn in Redis (app.base.dead_holders.take_turn). A dead host's shards are back within
minutes. Timing and the measured figures: docs/faults.md#when-a-worker-checks-for-dead-holders.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading

from app.base.dead_holders import DeadHolderCheck, take_turn
from app.base.liveness import heartbeat_seconds, lease_seconds

log = logging.getLogger("regen.dead_holders")

CHECK_LEASES = 0.5  # how often a worker with a free slot looks, in lease lengths


def start(app, storage: str | None, can_take, stale_after: float) -> threading.Thread:
    """Check in a daemon thread for the process's life; `can_take()` says whether this worker has a free task
    slot."""
    check = DeadHolderCheck(app.conf.broker_url, stale_after, app=app,
                            storage_for=(lambda _url: storage) if storage else None)
    me = f"{socket.gethostname()}:{os.getpid()}"

    def loop() -> None:
        stop = threading.Event()
        while not stop.wait(CHECK_LEASES * lease_seconds() + random.uniform(0, heartbeat_seconds())):
            # the turn outlasts the period by a heartbeat (the loop's jitter), so its holder renews it in time
            if can_take() and take_turn(app.conf.broker_url, CHECK_LEASES * lease_seconds() + heartbeat_seconds(),
                                        me):
                check.run()

    thread = threading.Thread(target=loop, name="regen-dead-holders", daemon=True)
    thread.start()
    return thread
