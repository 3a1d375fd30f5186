"""The run's typed documents (app/documents.py): the same bytes as the dicts they replaced, older and newer runs
read, and a malformed document refused in one line naming its path."""

from __future__ import annotations

import orjson
import pytest

from app import ledger
from app.documents import DeadLetter, MalformedDocument, Pause
from app.storage import RunStore, Storage


def _store(tmp_path) -> RunStore:
    return RunStore(Storage(str(tmp_path)), "docs")


def test_a_dead_letter_and_a_pause_are_written_as_the_dicts_before_them(tmp_path, monkeypatch):
    store = _store(tmp_path)
    ledger.record_attempt(store, "shard-000001", "a1", "gpu0@host")
    ledger.record_attempt_error(store, "shard-000001", "a1", "boom")
    ledger.dead_letter(store, "shard-000001", "failed 3 times")
    raw = store.storage.read_bytes(store.dead_path("shard-000001"))
    body = orjson.loads(raw)
    # the dict the writer built before the type, key for key and in order
    before = {"shard_id": "shard-000001", "reason": "failed 3 times", "attempts": body["attempts"],
              "dead_lettered": body["dead_lettered"]}
    assert list(body) == list(before) and body == before
    letter = ledger.read_dead_letter(store, "shard-000001")
    assert letter.reason == "failed 3 times" and letter.attempts[0]["error"] == "boom" and letter == before

    ledger.pause_run(store, "stub rate 90%", rate=0.9, window=10, by="gpu0@host")
    assert orjson.loads(store.storage.read_bytes(store.pause_path)) == {"reason": "stub rate 90%", "rate": 0.9,
                                                                         "window": 10, "by": "gpu0@host"}
    pause = ledger.pause_state(store)
    assert pause.reason == "stub rate 90%" and pause.details == {"rate": 0.9, "window": 10, "by": "gpu0@host"}


def test_older_and_newer_letters_read_and_unknown_keys_survive_a_rewrite():
    old = DeadLetter.parse(b'{"shard_id": "shard-000002", "reason": "x", "attempts": []}', "r/dead/shard-000002.json")
    assert old.dead_lettered is None and old.to_dict() == {"shard_id": "shard-000002", "reason": "x", "attempts": []}
    newer = {"shard_id": "k", "reason": "y", "attempts": [], "dead_lettered": "2026-01-01T00:00:00+00:00",
             "host": "h1"}
    letter = DeadLetter.from_dict(newer, "r/dead/k.json")
    assert letter.extra == {"host": "h1"} and letter.to_json() == orjson.dumps(newer)


@pytest.mark.parametrize("raw, why", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "a JSON object expected, found list"),
    (b'{"reason": "x", "attempts": []}', "no 'shard_id'"),
    (b'{"shard_id": "k", "reason": "x", "attempts": {}}', "'attempts' is dict, not list"),
])
def test_a_malformed_letter_is_refused_in_one_line_naming_its_path(raw, why):
    with pytest.raises(MalformedDocument) as err:
        DeadLetter.parse(raw, "run1/dead/shard-000003.json")
    assert str(err.value).startswith("run1/dead/shard-000003.json: ") and why in str(err.value)
    assert "\n" not in str(err.value)


def test_a_malformed_pause_names_its_path(tmp_path):
    store = _store(tmp_path)
    store.storage.write_bytes(store.pause_path, b'"paused"')
    with pytest.raises(MalformedDocument, match="docs/PAUSED.json: a JSON object expected"):
        ledger.pause_state(store)
    assert Pause.parse(b'{"reason": "r"}', "p") == {"reason": "r"}
