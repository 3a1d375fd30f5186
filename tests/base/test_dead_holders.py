"""app/base/dead_holders.py with the real Redis and kombu: a process fetches shard messages and is SIGKILLed (its
messages stay in kombu's unacked hash, as a dead host's do); the check moves back exactly the one whose every
attempt is dead, once however many checkers run. The worker-level test is tests/workers/test_dead_host.py."""

from __future__ import annotations

import datetime as dt
import time

from app.base.dead_holders import UNSTARTED_LEASES, DeadHolderCheck, decode_held
from app.base.ledger import record_attempt
from app.base.storage import RunStore, Storage
from tests.support.held_messages import fetch_and_die, send_shards
from tests.support.polling import wait_for
from tests.support.redis_db import OPS_BROKER

QUEUE = "q-dead-holders"


def _send(shards: list[str], storage: str) -> None:
    send_shards(OPS_BROKER, QUEUE, "r1", storage, shards)


def _fetch_and_die(n: int) -> None:
    fetch_and_die(OPS_BROKER, QUEUE, n)


def _ago(seconds: float) -> str:
    return (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=seconds)).isoformat()


def test_only_the_shard_whose_attempts_all_died_is_moved_back_and_only_once(tmp_path, redis7, monkeypatch):
    store = RunStore(Storage(str(tmp_path)), "r1")
    _send(["shard-000000", "shard-000001", "shard-000002"], str(tmp_path))
    _fetch_and_die(3)
    assert redis7.hlen("unacked") == 3 and redis7.llen(QUEUE) == 0
    # shard 0: hostA's attempt, its lease long run out; shard 1: hostB's, renewed now; shard 2: fetched, no attempt
    record_attempt(store, "shard-000000", "a" * 12, "gpu0@hostA", host="hostA", started=_ago(3600),
                   heartbeat=_ago(3600))
    record_attempt(store, "shard-000001", "b" * 12, "gpu0@hostB", host="hostB")

    checkers = [DeadHolderCheck(OPS_BROKER, stale_after=14400) for _ in range(3)]  # three idle workers
    resent = [r for c in checkers for r in c.run()]
    assert [(r["shard"], r["host"], r["worker"]) for r in resent] == [("shard-000000", "hostA", "gpu0@hostA")]
    assert redis7.llen(QUEUE) == 1 and redis7.hlen("unacked") == 2
    # the message back in the queue is shard 0's own, whole (its samples travel with it)
    raw = redis7.lrange(QUEUE, 0, -1)[0]
    import orjson

    held = decode_held("t", orjson.dumps([orjson.loads(raw), "", QUEUE]))
    assert held is not None and (held.key, held.run_id, held.storage) == ("shard-000000", "r1", str(tmp_path))
    assert all(not c.run() for c in checkers)  # nothing more: one re-send per death

    # shard 2 was fetched and never started: it counts once held for UNSTARTED_LEASES leases (here 2 x 2 s)
    monkeypatch.setenv("REGEN_HEARTBEAT_S", "0.5")
    assert all(not c.run() for c in checkers)
    time.sleep(UNSTARTED_LEASES * 2.0 + 0.5)
    assert [(r["shard"], r["host"]) for c in checkers for r in c.run()] == [("shard-000002", None)]
    assert redis7.llen(QUEUE) == 2 and redis7.hlen("unacked") == 1  # shard 1's live holder keeps its message
    redis7.delete(QUEUE)

    # the re-sent copy dies too (a new attempt, dead): it is moved back again, once
    _send(["shard-000000"], str(tmp_path))  # (the queue was emptied above: shard 0 again, fetched and dropped)
    _fetch_and_die(1)
    wait_for(lambda: redis7.hlen("unacked") == 2 or None, 10, "the re-sent copy to be held")
    record_attempt(store, "shard-000000", "c" * 12, "gpu1@hostC", host="hostC", started=_ago(600),
                   heartbeat=_ago(600))
    assert [r["shard"] for c in checkers for r in c.run()] == ["shard-000000"]
    assert redis7.llen(QUEUE) == 1


def test_a_finished_shard_is_left_to_the_broker(tmp_path, redis7):
    store = RunStore(Storage(str(tmp_path)), "r1")
    _send(["shard-000000"], str(tmp_path))
    _fetch_and_die(1)
    record_attempt(store, "shard-000000", "a" * 12, "gpu0@hostA", host="hostA", started=_ago(3600),
                   heartbeat=_ago(3600))
    store.storage.write_json(store.done_path("shard-000000"), {"attempt": "d" * 12})
    # hostA took a redelivered copy just before its twin published, then lost power mid-write: its half file
    folder = tmp_path / "r1" / "shards" / "shard-000000"
    folder.mkdir(parents=True)
    left = folder / f".{'a' * 12}.hidden.rgh.tmp-0123456789ab"
    left.write_bytes(b"half a sample of a dead duplicate")
    check = DeadHolderCheck(OPS_BROKER, stale_after=14400)
    assert check.run() == []
    assert redis7.hlen("unacked") == 1  # its later restore finds the marker and is skipped
    assert not left.exists()  # ...and what its dead holder left on the finished shard is gone now
    left.write_bytes(b"")
    assert check.run() == [] and left.exists()  # once per held copy: the next checks list nothing


def test_a_shard_whose_newest_attempt_failed_is_left_to_celerys_retry():
    """A killed attempt, then one that recorded an error: Celery's retry (a new message, perhaps held with its
    countdown by a live worker) brings it back, so nothing is re-sent beside it."""
    from app.base.clock import shared_now
    from app.base.dead_holders import died_holding

    killed = {"attempt": "a" * 12, "host": "hostA", "started": _ago(900), "heartbeat": _ago(900), "lease_s": 120}
    failed = {"attempt": "b" * 12, "host": "hostB", "started": _ago(300), "heartbeat": _ago(300), "lease_s": 120,
              "error": "OSError: stale NFS handle"}
    now = shared_now()
    assert died_holding([killed, failed], now, 14400) is None
    assert died_holding([failed, killed], now, 14400) is None  # by start time, not by listing order
    assert died_holding([killed], now, 14400) is killed
    assert died_holding([killed, {**failed, "heartbeat": _ago(0), "error": None}], now, 14400) is None  # alive


def test_a_broker_without_an_unacked_hash_is_not_asked(caplog):
    """The embedded filesystem broker of a one-machine `regen run`: no check, and no warning every 15 s."""
    assert DeadHolderCheck("filesystem:///tmp/nowhere", stale_after=14400).run() == []
    assert "failed" not in caplog.text


def test_one_check_a_period_for_the_fleet_and_its_holder_keeps_the_turn(redis7):
    """The dead-holder watch's turn (workers/process/dead_holder_watch.py): one taker a period in the whole fleet;
    the worker that holds it keeps it (its cache of decoded messages stays warm), another takes it once it lapses."""
    from app.base.dead_holders import TURN_KEY, take_turn

    assert take_turn(OPS_BROKER, 0.6, holder="gpu0@hostA")
    assert not take_turn(OPS_BROKER, 0.6, holder="gpu1@hostB")  # hostA's period runs
    assert take_turn(OPS_BROKER, 0.6, holder="gpu0@hostA")  # renewed by its holder
    assert 0 < redis7.pttl(TURN_KEY) <= 600
    time.sleep(0.8)  # hostA stopped asking (no free slot, or dead): the turn lapses
    assert take_turn(OPS_BROKER, 0.6, holder="gpu1@hostB")
    assert not take_turn(OPS_BROKER, 0.6, holder="gpu0@hostA")
    assert take_turn("filesystem:///tmp/x", 0.6, holder="anyone")  # no Redis to share a turn on: every check runs
