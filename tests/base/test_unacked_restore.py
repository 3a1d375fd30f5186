"""kombu's unacked sweep on regen's configuration, as docs/configuration.md (`REGEN_UNACKED_RESTORE_INTERVAL`)
states it: the transport's timer calls the sweep every interval, only every 10th call scans, and a scan restores
every message older than the visibility timeout (no cap of 10), each to the end of its queue that workers pop
next. A kombu upgrade that changes any of it fails here, not in a fleet."""

from __future__ import annotations

from app.base.celery_app import create_app
from app.base.config import BrokerConfig
from tests.support.redis_db import OPS_BROKER

QUEUE = "regen-restore-test"
HELD = 15  # more than the 10 a scan was once said to restore


def test_every_tenth_call_of_the_sweep_restores_every_expired_message(redis7):
    app = create_app(BrokerConfig(url=OPS_BROKER, visibility_timeout=0))  # every unacked message is expired
    for i in range(HELD):
        app.send_task("regen_test.none", kwargs={"i": i}, queue=QUEUE)
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        assert channel.unacked_restore_limit is None and channel.unacked_restore_throttle == 10

        def take_all():
            """What a host that then dies does: fetched, unacked, never acked."""
            taken = [channel.basic_get(QUEUE, no_ack=False) for _ in range(HELD)]
            assert all(taken) and redis7.llen(QUEUE) == 0 and redis7.hlen("unacked") == HELD

        take_all()
        channel.basic_consume(QUEUE, False, lambda message: None, "regen-restore-test")  # a consuming worker
        restored = []
        for _ in range(21):
            channel.connection.cycle.maybe_restore_messages()  # what the worker's timer calls every interval
            restored.append(redis7.llen(QUEUE))
            if restored[-1]:
                newest = channel.basic_get(QUEUE, no_ack=False)  # the end workers pop: a restored message
                assert newest.delivery_info["redelivered"] is True
                channel.basic_reject(newest.delivery_tag, requeue=True)
                take_all()
    app.close()
    assert restored == [HELD if call % 10 == 1 else 0 for call in range(1, 22)]
