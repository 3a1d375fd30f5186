"""One process, one delivery of a shard at a time; its journal lets a later worker on the host tidy up after it."""

from __future__ import annotations

import json
from pathlib import Path

from app.base.ledger import new_attempt_id, record_attempt
from app.base.storage import RunStore, Storage
from tests.support.faults import dead_process
from workers.process.inflight import InFlight, sweep_dead_attempts


def test_a_second_delivery_of_a_shard_finds_the_first_one_holding_it():
    claims = InFlight()
    first, _ = claims.claim(("root", "run", "shard-000000"), "tag-a")
    second, holder = claims.claim(("root", "run", "shard-000000"), "tag-b")
    assert second is None and holder is first and holder.tag == "tag-a"
    other, _ = claims.claim(("root", "run", "shard-000001"), "tag-c")  # another shard is free
    assert other is not None
    claims.release(first)
    again, _ = claims.claim(("root", "run", "shard-000000"), "tag-b")
    assert again is not None


def test_an_attempt_is_journaled_while_it_runs_and_the_journal_entry_goes_with_it(tmp_path, monkeypatch):
    monkeypatch.setenv("REGEN_STATE_DIR", str(tmp_path / "state"))
    store = RunStore(Storage(str(tmp_path / "storage")), "run")
    claims = InFlight()
    claim, _ = claims.claim((store.storage.url, "run", "shard-000000"), "t")
    attempt = new_attempt_id()
    record_attempt(store, "shard-000000", attempt, "w@h")
    claims.started(claim, store, attempt)
    entry = json.loads(Path(claim.journal).read_text())
    assert (entry["run_id"], entry["key"], entry["attempt"]) == ("run", "shard-000000", attempt)
    claims.release(claim)
    assert not list((tmp_path / "state" / "attempts").iterdir())


def test_a_starting_worker_removes_what_its_hosts_dead_attempts_left(tmp_path, monkeypatch):
    monkeypatch.setenv("REGEN_STATE_DIR", str(tmp_path / "state"))
    store = RunStore(Storage(str(tmp_path / "storage")), "run")
    attempt, dead = new_attempt_id(), dead_process()
    store.storage.write_json(f"{store.attempts_dir('shard-000003')}/{attempt}.json",
                             {"attempt": attempt, "worker": "w@h", "started": "2026-01-01T00:00:00+00:00", **dead})
    folder = tmp_path / "storage" / "run" / "shards" / "shard-000003"
    folder.mkdir(parents=True)
    (folder / f".{attempt}.hidden.rgh.tmp-0123456789ab").write_bytes(b"GBs on a real model")
    journal = tmp_path / "state" / "attempts"
    journal.mkdir(parents=True)
    (journal / f"{dead['pid']}-{attempt}.json").write_text(json.dumps(
        {"storage": store.storage.url, "run_id": "run", "key": "shard-000003", "attempt": attempt, **dead}))
    assert sweep_dead_attempts(stale_after=3600) == 1
    assert list(folder.iterdir()) == [] and list(journal.iterdir()) == []


def test_a_journal_entry_of_another_machine_is_never_swept(tmp_path, monkeypatch):
    """A journal folder shared by mistake (NFS): another host's entry names a pid that is free on this machine,
    which alone would have made this host sweep that host's live shard and drop its entry."""
    import os
    import time

    monkeypatch.setenv("REGEN_STATE_DIR", str(tmp_path / "state"))
    store = RunStore(Storage(str(tmp_path / "storage")), "run")
    attempt, other = new_attempt_id(), {**dead_process(), "host": "hostB", "boot": "boot-of-hostB"}
    record_attempt(store, "shard-000004", attempt, "w@hostB", **other)
    done = tmp_path / "storage" / "run" / "done"
    done.mkdir(parents=True)
    marker_tmp = done / ".shard-000004.json.tmp-0123456789ab"  # hostB creating its marker, as old as a slow NFS
    marker_tmp.write_bytes(b"{}")
    os.utime(marker_tmp, (time.time() - 600, time.time() - 600))
    journal = tmp_path / "state" / "attempts"
    journal.mkdir(parents=True)
    entry = journal / f"{other['pid']}-{attempt}.json"
    entry.write_text(json.dumps({"storage": store.storage.url, "run_id": "run", "key": "shard-000004",
                                 "attempt": attempt, **other}))
    assert sweep_dead_attempts(stale_after=3600) == 0
    assert entry.exists() and marker_tmp.exists()


def test_a_journal_entry_names_its_process_as_attempt_records_do(tmp_path, monkeypatch):
    from app.base.liveness import identity

    monkeypatch.setenv("REGEN_STATE_DIR", str(tmp_path / "state"))
    store = RunStore(Storage(str(tmp_path / "storage")), "run")
    claims = InFlight()
    claim, _ = claims.claim((store.storage.url, "run", "shard-000000"), "t")
    claims.started(claim, store, new_attempt_id())
    entry = json.loads(Path(claim.journal).read_text())
    assert {k: entry[k] for k in ("host", "boot", "pidns", "pid", "pid_start")} == identity()
    claims.release(claim)
