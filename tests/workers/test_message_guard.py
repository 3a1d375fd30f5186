"""The worker's guard against messages it cannot use (workers/process/message_guard.py, app/base/dead_messages.py).

The end-to-end proof (garbage on the real worker's queue, same pids after) is in tests/workers/test_faults.py; these
check the rules on their own, against real Redis (the operations suites' db 7)."""

from __future__ import annotations

import base64
import json

from app.base import dead_messages
from tests.support.redis_db import OPS_BROKER
from workers.process.message_guard import Undecodable, envelope_problem


def _envelope(body: str, encoding: str | None = "base64") -> dict:
    return {"body": body, "content-type": "application/json", "content-encoding": "utf-8",
            "headers": {"task": "regen.generate_shard", "id": "x"},
            "properties": {"delivery_tag": "t1", "body_encoding": encoding, "delivery_info": {"routing_key": "q"}}}


def test_an_envelope_kombu_can_build_passes():
    assert envelope_problem(_envelope(base64.b64encode(json.dumps([[], {}, {}]).encode()).decode())) is None
    assert envelope_problem(_envelope('[[], {}, {}]', encoding=None)) is None


def test_envelopes_kombu_would_raise_on_are_named():
    assert "not a JSON envelope" in envelope_problem(Undecodable("\x00garbage", ValueError("Expecting value")))
    assert envelope_problem([1, 2]) == "envelope is a JSON list, not an object"
    assert envelope_problem({"body": "x"}) == "envelope has no properties.delivery_tag"
    assert "not valid base64" in envelope_problem(_envelope("!!! not base64 !!!"))
    assert "unknown body_encoding" in envelope_problem(_envelope("x", encoding="rot13"))


def test_a_set_aside_message_is_kept_with_its_queue_reason_and_hexdump(redis7):
    dead_messages.record(OPS_BROKER, "regen", "not a JSON envelope", b"\x00\x01" + b"z" * 100)
    assert dead_messages.count(OPS_BROKER) == 1
    entry = dead_messages.recent(OPS_BROKER, 1)[0]
    assert entry["queue"] == "regen" and entry["reason"] == "not a JSON envelope" and entry["size"] == 102
    assert entry["hexdump"].startswith("00 01 7a") and entry["hexdump"].endswith("(102 bytes)")


def test_recording_never_raises_when_the_broker_is_gone():
    dead_messages.record("redis://127.0.0.1:1/0", "regen", "boom", b"x")  # nothing listens on port 1
    assert dead_messages.count("redis://127.0.0.1:1/0") is None
