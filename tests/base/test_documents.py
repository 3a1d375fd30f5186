"""The run's typed documents (app/base/documents.py): the same bytes as the dicts they replaced, older and newer runs
read, and a malformed document refused in one line naming its path."""

from __future__ import annotations

import orjson
import pytest

from app.base import ledger
from app.base.documents import CaptureMarker, DeadLetter, DoneMarker, MalformedDocument, Pause
from app.base.storage import RunStore, Storage


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
    assert isinstance(pause, Pause)


def test_older_and_newer_letters_read_and_unknown_keys_survive_a_rewrite():
    old = DeadLetter.parse(b'{"shard_id": "shard-000002", "reason": "x"}', "r/dead/shard-000002.json")
    assert old.dead_lettered is None and old.attempts == [] and old.key == "shard-000002"
    newer = {"shard_id": "k", "reason": "y", "attempts": [], "dead_lettered": "2026-01-01T00:00:00+00:00",
             "host": "h1"}
    letter = DeadLetter.from_dict(newer, "r/dead/k.json")
    assert letter["host"] == "h1" and letter.to_json() == orjson.dumps(newer)


def test_markers_read_older_runs_with_the_defaults_they_imply_and_refuse_what_names_no_file():
    older = {"shard_id": "shard-000001", "attempt": "a1", "samples": 4, "ok": 4,
             "files": {"records": {"path": "r/shards/shard-000001/a1.records.jsonl.zst", "bytes": 10}}}
    marker = DoneMarker.from_dict(older, "r/done/shard-000001.json")
    assert (marker.records, marker.stubs, marker.rejected, marker.hidden_file) == (4, 0, {}, None)
    assert marker == older and marker.to_json() == orjson.dumps(older)
    with pytest.raises(MalformedDocument, match=r"^r/done/shard-000001.json: files names no records file$"):
        DoneMarker.from_dict({**older, "files": {}}, "r/done/shard-000001.json")
    with pytest.raises(MalformedDocument, match=r"^r/done/shard-000001.json: 'ok' is str, not int$"):
        DoneMarker.from_dict({**older, "ok": "4"}, "r/done/shard-000001.json")
    with pytest.raises(MalformedDocument, match=r"^r/captured/s.json: files.hidden names no path$"):
        CaptureMarker.from_dict({"shard_id": "s", "attempt": "a", "hidden": {"bytes": 3}}, "r/captured/s.json")


def test_the_markers_writers_build_them_key_for_key_as_before(tmp_path):
    from tests.support.status_run import publish_synthetic

    store = _store(tmp_path)
    summary = publish_synthetic(store, "shard-000004", "gpu0@host", 2, 1, 5, 7, 1.5)
    raw = store.storage.read_bytes(store.done_path("shard-000004"))
    body = orjson.loads(raw)
    before = {"shard_id": "shard-000004", "attempt": "a0", "files": body["files"], **summary,
              "finished": body["finished"]}
    assert list(body) == list(before) and body == before
    assert set(body["files"]) == {"records", "hidden"} and all("sha256" in f for f in body["files"].values())
    marker = store.done_marker("shard-000004")
    assert isinstance(marker, DoneMarker) and marker.hidden_file == body["files"]["hidden"]


@pytest.mark.parametrize("raw, why", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "a JSON object expected, found list"),
    (b'{"reason": "x", "attempts": []}', "no 'shard_id'"),
    (b'{"shard_id": "k", "attempts": []}', "no 'reason'"),
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


def test_no_module_but_the_types_builds_a_run_document():
    """A dict literal with a marker's or a letter's keys (`shard_id` beside `attempt` or `reason`), an attempt
    record's (`attempt` beside `worker`), the producer's summary's (`run_id` beside `complete`) or the manifest's
    (`run_id` beside `settings`), anywhere in the code but app/base/documents.py is a second
    definition of the document."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = []
    for package in ("app", "producer", "workers"):
        for path in sorted((root / package).rglob("*.py")):
            if path.name == "documents.py" and path.parent.name == "base":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Dict):
                    keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                    if ("shard_id" in keys and keys & {"attempt", "reason"}) or {"run_id", "complete"} <= keys \
                            or {"attempt", "worker"} <= keys or {"run_id", "settings"} <= keys:
                        found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, found


def test_an_attempt_record_is_written_as_before_and_read_typed(tmp_path):
    from app.base.documents import AttemptRecord

    store = _store(tmp_path)
    ledger.record_attempt(store, "shard-000005", "a1", "gpu0@host", stage="generate")
    body = orjson.loads(store.storage.read_bytes(store.attempt_path("shard-000005", "a1")))
    assert list(body)[:2] == ["attempt", "worker"] and body["heartbeat"] == body["started"]
    assert list(body)[-3:] == ["lease_s", "stage", "heartbeat"] and body["stage"] == "generate"
    ledger.record_attempt_error(store, "shard-000005", "a1", "boom")
    (record,) = ledger.attempt_errors(store, "shard-000005")
    assert isinstance(record, AttemptRecord) and (record.error, record.error_kind) == ("boom", "error")
    store.storage.write_bytes(store.attempt_path("shard-000005", "a2"), b'{"attempt": "a2", "pid": "7"}')
    with pytest.raises(MalformedDocument, match=r"attempts/shard-000005/a2.json: 'pid' is str, not int$"):
        ledger.attempt_errors(store, "shard-000005")


def test_the_counts_have_one_home_and_an_older_runs_manifest_copy_still_reads():
    from app.base.documents import Manifest, ProduceSummary, run_counts

    new = Manifest.new("regen-run/1", "r", "2026-12-05T00:00:00+00:00", {"model": "m"}, {})
    assert "counts" not in new  # write-once: the producer's summary holds the counts
    summary = ProduceSummary.new("r", True, "t0", "t1", "regen", {}, {"shards": 3, "samples": 10})
    assert run_counts(summary, new) == {"shards": 3, "samples": 10}
    older = Manifest.parse(orjson.dumps({"run_id": "r", "settings": {}, "counts": {"shards": 2}}), "r/run.json")
    assert run_counts(None, older) == {"shards": 2}  # written before: the manifest's copy
    assert run_counts(ProduceSummary.new("r", False, "t0", None, "regen", {}, None), older) == {"shards": 2}
    # both present (an older run): the producer's summary wins, as every reader took it
    assert run_counts(summary, older) == {"shards": 3, "samples": 10}
