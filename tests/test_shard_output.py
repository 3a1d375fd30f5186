"""Publishing a shard under at-least-once delivery: exactly one attempt's outputs survive, marker last."""

from __future__ import annotations

import threading

import numpy as np

from app.hidden_file import HiddenFileReader, encode_sample, float32_to_bf16
from app.jsonl_zst import loads_jsonl_zst
from app.storage import RunStore, Storage
from workers.shard_output import attempt_errors, dead_letter, new_attempt_id, publish_shard, record_attempt


def _outputs(tag: str):
    rng = np.random.default_rng(abs(hash(tag)) % 2**32)
    records = [{"sample_id": f"s{i}", "tag": tag, "input_ids": list(range(10 + i))} for i in range(3)]
    hidden = [encode_sample(f"s{i}", np.arange(9 + i), float32_to_bf16(rng.normal(size=(9 + i, 2, 16))), [1, 2])
              for i in range(3)]
    return records, hidden


def test_two_attempts_racing_on_one_shard_leave_one_output(tmp_path):
    store = RunStore(Storage(str(tmp_path)), "race")
    barrier = threading.Barrier(8)
    results = {}

    def attempt(k: int):
        records, hidden = _outputs(f"attempt{k}")
        aid = new_attempt_id()
        barrier.wait()
        results[aid] = publish_shard(store, "shard-000000", aid, records, hidden, {"samples": 3})

    threads = [threading.Thread(target=attempt, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [a for a, won in results.items() if won]
    assert len(winners) == 1
    marker = store.done_marker("shard-000000")
    assert marker["attempt"] == winners[0]
    # Only the winner's files remain, and they are whole and consistent with each other.
    files = store.storage.listdir(store.rel("shards", "shard-000000"))
    assert sorted(files) == sorted([f"{winners[0]}.records.jsonl.zst", f"{winners[0]}.hidden.rgh"])
    records = loads_jsonl_zst(store.storage.read_bytes(marker["files"]["records"]["path"]))
    with store.storage.open(marker["files"]["hidden"]["path"]) as fh:
        reader = HiddenFileReader(fh)
        assert [e["sample_id"] for e in reader.entries] == [r["sample_id"] for r in records]
        assert len({r["tag"] for r in records}) == 1


def test_the_marker_is_written_after_the_files(tmp_path, monkeypatch):
    store = RunStore(Storage(str(tmp_path)), "order")
    seen = []
    original = store.storage.create_exclusive

    def spy(rel, data):
        seen.append(sorted(store.storage.listdir(store.rel("shards", "shard-000001"))))
        return original(rel, data)

    monkeypatch.setattr(store.storage, "create_exclusive", spy)
    records, hidden = _outputs("one")
    publish_shard(store, "shard-000001", "a1", records, hidden, {})
    assert seen == [["a1.hidden.rgh", "a1.records.jsonl.zst"]]
    assert store.is_done("shard-000001")


def test_no_partial_file_is_ever_visible_when_a_write_fails(tmp_path):
    store = RunStore(Storage(str(tmp_path)), "partial")
    try:
        with store.storage.atomic_writer(store.records_path("shard-000002", "a2")) as fh:
            fh.write(b"half a shard")
            raise OSError("disk full")
    except OSError:
        pass
    assert store.storage.listdir(store.rel("shards", "shard-000002")) == []
    assert not store.is_done("shard-000002")


def test_attempts_are_counted_and_a_dead_letter_keeps_their_errors(tmp_path):
    store = RunStore(Storage(str(tmp_path)), "dead")
    for k in range(3):
        n = record_attempt(store, "shard-000003", f"a{k}", "gpu0@host")
        assert n == k + 1
    from workers.shard_output import record_attempt_error

    record_attempt_error(store, "shard-000003", "a1", "EngineDead: CUDA error")
    dead_letter(store, "shard-000003", "3 attempts without success")
    body = store.storage.read_json(store.dead_path("shard-000003"))
    assert body["reason"] == "3 attempts without success"
    assert [a.get("error") for a in attempt_errors(store, "shard-000003")].count("EngineDead: CUDA error") == 1
    assert store.dead_shards() == {"shard-000003"}
