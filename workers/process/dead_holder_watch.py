"""A worker's periodic check for shards held by dead processes (app.dead_holders), while it has a free task slot.

Why a free slot: a worker that could take a shard is the one that would take a re-sent one. While the queue
holds shards every slot of every worker is full (each fetches as many messages as it has slots), so the check
costs nothing in a busy fleet. When the queue runs dry (the run's tail) slots free up one by one; a worker
waiting until it held no shard at all, as before, let a dead host's shards wait for the longest shard of the
workers still running: measured with bench/bench_fleet_scale.py (stand-in GPUs, the job's thinking-mode lengths),
~600 s of real time after a host's death at the tail, against the few minutes of a lease.

Why one check per period for the whole fleet: a check reads the broker's unacked hash and, for every shard held,
its markers and attempts on storage, so a check costs O(shards held) storage operations; held shards are
O(workers), and every worker with a free slot checking on its own made the tail cost O(workers^2) storage
operations a period (at 1,000 GPUs: 10,000 shards held, a few operations each, times every worker with a free
slot, once a minute: docs/performance.md has the measured figures). So a worker first takes the period's turn in Redis
(`SET NX` with the period as expiry, app.dead_holders.take_turn), and keeps it while it asks again in time; one
check per period per broker re-sends all that dead processes hold. The claim per re-send (app.dead_holders) still keeps
two checks from re-sending one shard twice.

Every `CHECK_LEASES` lease lengths (with up to a heartbeat of jitter) a worker with a free slot asks for the turn;
a dead host's shards are thus back in the queue about one lease after their last heartbeat's lease ran out: with
the defaults (30 s heartbeats, 120 s leases) within about 4-5 minutes of the death, instead of the broker's 4 h
visibility timeout.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading

from app.dead_holders import DeadHolderCheck, take_turn
from app.liveness import heartbeat_seconds, lease_seconds

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
