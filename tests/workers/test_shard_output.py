"""Publishing a shard under at-least-once delivery: exactly one attempt's outputs survive, marker last."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time

import numpy as np
import pytest

from app.base.hidden_file import HiddenFileReader, encode_sample, float32_to_bf16
from app.base.jsonl_zst import loads_jsonl_zst
from app.base.ledger import attempt_errors, dead_letter, new_attempt_id, record_attempt
from app.base.storage import RunStore, Storage
from tests.support.faults import dead_process
from workers.shard.shard_output import hidden_file_stream, publish_shard


def _outputs(tag: str):
    rng = np.random.default_rng(abs(hash(tag)) % 2**32)
    records = [{"sample_id": f"s{i}", "worker": tag, "input_ids": list(range(10 + i))} for i in range(3)]
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
        assert len({r["worker"] for r in records}) == 1


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
        assert n.records == k + 1
    from app.base.ledger import record_attempt_error

    record_attempt_error(store, "shard-000003", "a1", "EngineDead: CUDA error")
    dead_letter(store, "shard-000003", "3 attempts without success")
    body = store.storage.read_json(store.dead_path("shard-000003"))
    assert body["reason"] == "3 attempts without success"
    assert [a.get("error") for a in attempt_errors(store, "shard-000003")].count("EngineDead: CUDA error") == 1
    assert store.dead_shards() == {"shard-000003"}


def _attempt_of(store, shard: str, attempt: str, **fields) -> None:
    store.storage.write_json(f"{store.attempts_dir(shard)}/{attempt}.json",
                             {"attempt": attempt, "worker": "w@h", "started": "2026-01-01T00:00:00+00:00", **fields})


def test_one_process_that_died_holding_six_copies_of_a_shard_counts_once(tmp_path):
    # The fault run's reproduction: produce + five reconciles, one worker started all six copies, one SIGKILL.
    store = RunStore(Storage(str(tmp_path)), "copies")
    dead = dead_process()
    for k in range(6):
        _attempt_of(store, "shard-000000", f"copy{k}", **dead)
    counted = record_attempt(store, "shard-000000", "after", "gpu0@host", stale_after=20)
    assert (counted.failures, counted.crashes, counted.records) == (0, 1, 7)


def test_errors_of_the_shards_own_count_each_and_an_engine_killed_under_it_counts_as_a_crash(tmp_path):
    from app.base.ledger import record_attempt_error

    store = RunStore(Storage(str(tmp_path)), "kinds")
    for k in range(2):
        record_attempt(store, "shard-000001", f"e{k}", "gpu0@host")
        record_attempt_error(store, "shard-000001", f"e{k}", "EngineDead: vLLM engine failed: index out of bounds")
    record_attempt(store, "shard-000001", "k", "gpu0@host")
    record_attempt_error(store, "shard-000001", "k", "engine process exited (killed by SIGKILL)", kind="crash")
    record_attempt(store, "shard-000001", "running", "gpu0@host")  # this very process: alive, counts as nothing
    counted = record_attempt(store, "shard-000001", "next", "gpu0@host", stale_after=20)
    assert (counted.failures, counted.crashes) == (2, 1)


def test_another_machines_attempt_counts_once_its_lease_runs_out(tmp_path):
    import datetime as dt

    store = RunStore(Storage(str(tmp_path)), "lease")
    now = dt.datetime.now(dt.UTC)
    other = {"host": "elsewhere", "boot": "b", "pidns": "p", "pid": 7, "pid_start": 9, "lease_s": 120}
    _attempt_of(store, "shard-000002", "fresh", **other, heartbeat=(now - dt.timedelta(seconds=30)).isoformat())
    _attempt_of(store, "shard-000002", "expired", **{**other, "pid": 8},
                heartbeat=(now - dt.timedelta(seconds=600)).isoformat())
    # Written before leases existed: judged by its start time against the visibility timeout, as before.
    _attempt_of(store, "shard-000002", "legacy", started=(now - dt.timedelta(seconds=10)).isoformat())
    counted = record_attempt(store, "shard-000002", "mine", "gpu0@host", stale_after=20)
    assert (counted.failures, counted.crashes) == (0, 1)


def test_a_dead_attempts_temporaries_go_when_the_shard_is_published_and_a_live_ones_stay(tmp_path):
    from app.base.ledger import new_attempt_id

    store = RunStore(Storage(str(tmp_path)), "sweep")
    dead_id, live_id = new_attempt_id(), new_attempt_id()
    _attempt_of(store, "shard-000007", dead_id, **dead_process())
    record_attempt(store, "shard-000007", live_id, "gpu0@host")  # this process: alive
    folder = tmp_path / "sweep" / "shards" / "shard-000007"
    folder.mkdir(parents=True)
    (folder / f".{dead_id}.hidden.rgh.tmp-0123456789ab").write_bytes(b"half a sample, seconds old")
    (folder / f".{live_id}.hidden.rgh.tmp-ba9876543210").write_bytes(b"a duplicate still writing")
    attempts = tmp_path / "sweep" / "attempts" / "shard-000007"
    (attempts / f".{dead_id}.json.tmp-00000000000a").write_bytes(b"{")
    records, hidden = _outputs("swept")
    assert publish_shard(store, "shard-000007", "a7", records, hidden, {}, stale_after=3600)
    assert sorted(p.name for p in folder.iterdir()) == [f".{live_id}.hidden.rgh.tmp-ba9876543210", "a7.hidden.rgh",
                                                        "a7.records.jsonl.zst"]
    assert not [p for p in attempts.iterdir() if p.name.startswith(".")]


def _stream(store, shard: str, attempt: str, samples, threads: int = 4):
    """Append `samples` from several threads at once, as the encoder pool does; return each one's position."""
    from concurrent.futures import ThreadPoolExecutor

    with hidden_file_stream(store, shard, attempt) as stream, ThreadPoolExecutor(threads) as pool:
        positions = list(pool.map(stream.append, samples))
    return positions, stream.written


def test_a_streamed_hidden_file_holds_every_sample_where_append_said(tmp_path):
    store = RunStore(Storage(str(tmp_path)), "stream")
    records, hidden = _outputs("streamed")
    hidden = [dataclasses.replace(hidden[k % 3], sample_id=f"s{k}") for k in range(12)]  # 12 appends racing
    positions, written = _stream(store, "shard-000003", "a3", hidden)
    assert sorted(positions) == list(range(len(hidden)))
    with store.storage.open(written.path) as fh:
        reader = HiddenFileReader(fh)
        for k, pos in enumerate(positions):
            assert reader.by_id[f"s{k}"] == pos  # the record's hidden.index is the file's own position
            token_ids, _ = reader.read(pos)
            assert len(token_ids) == hidden[k].n_tokens
    records = [{"sample_id": f"s{k}", "hidden": {"index": pos}} for k, pos in enumerate(positions)]
    assert publish_shard(store, "shard-000003", "a3", records, written, {"samples": len(records)})
    marker = store.done_marker("shard-000003")
    assert marker["files"]["hidden"]["path"] == written.path
    assert marker["files"]["hidden"]["sha256"] == hashlib.sha256(store.storage.read_bytes(written.path)).hexdigest()


def test_a_failed_shard_leaves_no_streamed_file_and_late_appends_fail(tmp_path):
    store = RunStore(Storage(str(tmp_path)), "stream-fail")
    _, hidden = _outputs("failed")
    with pytest.raises(OSError, match="engine gone"), hidden_file_stream(store, "shard-000004", "a4") as stream:
        stream.append(hidden[0])
        raise OSError("engine gone")
    assert store.storage.listdir(store.rel("shards", "shard-000004")) == []
    with pytest.raises(RuntimeError, match="closed"):  # an encoder finishing after its shard failed
        stream.append(hidden[1])


def test_a_streamed_file_of_the_losing_attempt_is_deleted(tmp_path):
    store = RunStore(Storage(str(tmp_path)), "stream-race")
    records, hidden = _outputs("first")
    assert publish_shard(store, "shard-000005", "a5", records, hidden, {})
    _, written = _stream(store, "shard-000005", "b5", hidden)
    assert not publish_shard(store, "shard-000005", "b5", records, written, {})
    assert sorted(store.storage.listdir(store.rel("shards", "shard-000005"))) == ["a5.hidden.rgh",
                                                                                  "a5.records.jsonl.zst"]


def test_publishing_removes_what_killed_attempts_left_half_written(tmp_path):
    """A worker SIGKILLed while streaming leaves `.a.hidden.rgh.tmp-*` (GBs at a real model's size); the attempt
    that completes the shard removes it, and only temporary files."""
    store = RunStore(Storage(str(tmp_path)), "leftovers")
    folder = tmp_path / "leftovers" / "shards" / "shard-000006"
    folder.mkdir(parents=True)
    (folder / ".dead1.hidden.rgh.tmp-0123456789ab").write_bytes(b"half a sample")
    (folder / ".dead2.records.jsonl.zst.tmp-ba9876543210").write_bytes(b"")
    (folder / ".live.hidden.rgh.tmp-00000000000a").write_bytes(b"a duplicate still writing")
    (folder / "notes.txt").write_text("not ours")
    old = time.time() - 3600
    for name in (".dead1.hidden.rgh.tmp-0123456789ab", ".dead2.records.jsonl.zst.tmp-ba9876543210", "notes.txt"):
        os.utime(folder / name, (old, old))
    records, hidden = _outputs("after-a-kill")
    assert publish_shard(store, "shard-000006", "a6", records, hidden, {}, stale_after=600)
    assert sorted(p.name for p in folder.iterdir()) == [".live.hidden.rgh.tmp-00000000000a", "a6.hidden.rgh",
                                                        "a6.records.jsonl.zst", "notes.txt"]
