"""`regen run` re-sends the shards the broker lost (a worker killed between kombu's pop of a message and its
unacked record), once two checks in a row found them lost, and never while Redis holds a message; and it moves
back at once the messages a killed local worker held (app/base/dead_holders.py)."""

from __future__ import annotations

from app.base import ledger
from app.base.storage import RunStore, Storage
from app.ops.run_watch import LostShardWatch
from tests.support.redis_db import OPS_BROKER
from tests.support.status_run import STATUS_QUEUE, build_status_run


def _watch(tmp_path) -> tuple[LostShardWatch, list[str]]:
    build_status_run(str(tmp_path))
    store = RunStore(Storage(str(tmp_path)), "r1")
    ledger.clear_pause(store)
    sent: list[str] = []
    return LostShardWatch(store, OPS_BROKER, lambda: sent.append("reconcile")), sent


def _poll(watch: LostShardWatch) -> int:
    watch.next_check = 0.0  # due now
    return watch.poll()


def test_lost_shards_are_re_sent_once_two_checks_in_a_row_found_them(tmp_path, redis7):
    watch, sent = _watch(tmp_path)
    assert watch.poll() == 0 and sent == []  # not due yet
    assert _poll(watch) == 0 and sent == []  # first sighting: a message may be between pop and unacked
    assert _poll(watch) == 3 and sent == ["reconcile"]  # 2 never attempted + 1 failed whose retry is not coming
    assert _poll(watch) == 0 and sent == ["reconcile"]  # after a re-send, it starts counting again


def test_nothing_is_re_sent_while_redis_holds_a_message(tmp_path, redis7):
    watch, sent = _watch(tmp_path)
    assert _poll(watch) == 0
    redis7.lpush(STATUS_QUEUE, b"m1")  # it may be one of theirs
    assert _poll(watch) == 0 and _poll(watch) == 0
    redis7.delete(STATUS_QUEUE)
    assert _poll(watch) == 0 and sent == []  # the sighting before the message does not count


def test_a_killed_local_workers_held_shard_is_moved_back_at_the_next_check(tmp_path, redis7):
    from tests.support.faults import dead_process
    from tests.support.held_messages import fetch_and_die, send_shards

    watch, _ = _watch(tmp_path)
    send_shards(OPS_BROKER, STATUS_QUEUE, "r1", str(tmp_path), ["shard-000006"])
    fetch_and_die(OPS_BROKER, STATUS_QUEUE, 1)
    # its attempt names a process of this machine that is gone: dead at once, no lease to wait for
    ledger.record_attempt(watch.store, "shard-000006", "a" * 12, "cpu@here", **dead_process())
    assert redis7.llen(STATUS_QUEUE) == 0 and redis7.hlen("unacked") == 1
    _poll(watch)
    assert [r["shard"] for r in watch.resent_dead] == ["shard-000006"]
    assert redis7.llen(STATUS_QUEUE) == 1 and redis7.hlen("unacked") == 0  # back at the head of its queue
    assert watch.poll() == 0 and watch.resent_dead == []  # not due: nothing said twice
