"""The shard ledger's own rules (app/base/ledger.py): attempt records amended one writer at a time, and the marker
folders swept at a worker's start, not at every publish."""

from __future__ import annotations

import json
import os
import threading
import time

from app.base import ledger
from app.base.storage import RunStore, Storage
from tests.support.faults import dead_process
from workers.process.inflight import sweep_dead_attempts
from workers.shard.shard_output import publish_shard


def test_a_lease_renewal_racing_the_attempts_error_never_erases_it(tmp_path):
    store = RunStore(Storage(str(tmp_path)), "race")
    attempt = ledger.new_attempt_id()
    ledger.record_attempt(store, "shard-000000", attempt, "w@h")
    stop = threading.Event()
    renewals = [0] * 4  # per thread: the error is written only while every thread is renewing, before and after

    def renew(i: int):
        while not stop.is_set():
            ledger.renew_lease(store, "shard-000000", attempt)
            renewals[i] += 1

    def all_renewed(at_least: list[int]) -> bool:
        deadline = time.monotonic() + 30
        while min(n - m for n, m in zip(renewals, at_least, strict=True)) < 3:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    threads = [threading.Thread(target=renew, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        assert all_renewed([0] * 4), renewals
        before = list(renewals)
        ledger.record_attempt_error(store, "shard-000000", attempt, "OSError: disk full")
        assert all_renewed(before), renewals  # every thread renewed again after the error: the race was run
    finally:
        stop.set()
        for t in threads:
            t.join()
    (record,) = ledger.attempt_errors(store, "shard-000000")
    assert record["error"] == "OSError: disk full"
    heartbeat = record["heartbeat"]
    ledger.renew_lease(store, "shard-000000", attempt)  # an attempt that failed keeps its last renewal
    assert ledger.attempt_errors(store, "shard-000000")[0]["heartbeat"] == heartbeat


def _marker_temporary(store: RunStore, folder: str, shard: str, age: float) -> str:
    path = os.path.join(store.storage.root, store.rel(folder), f".{shard}.json.tmp-0123456789ab")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(b"{")
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_a_publish_leaves_the_marker_folders_and_the_start_sweep_removes_what_is_old_enough(tmp_path):
    store = RunStore(Storage(str(tmp_path)), "markers")
    old = _marker_temporary(store, "done", "shard-000001", age=3600)  # a killed publish's marker, long ago
    young = _marker_temporary(store, "dead", "shard-000001", age=1)  # perhaps a live duplicate's, this instant
    assert publish_shard(store, "shard-000001", "a1", [{"sample_id": "s0"}], None, {}, stale_after=600)
    assert os.path.exists(old)  # publishing lists the shard's own folders only
    assert ledger.sweep_marker_temporaries(store, {"shard-000001"}) == (1, 1)
    assert not os.path.exists(old) and os.path.exists(young)


def test_a_starting_worker_sweeps_each_runs_marker_folders_for_its_dead_attempts(tmp_path, monkeypatch):
    monkeypatch.setenv("REGEN_STATE_DIR", str(tmp_path / "state"))
    store = RunStore(Storage(str(tmp_path / "storage")), "run")
    dead, journal = dead_process(), tmp_path / "state" / "attempts"
    journal.mkdir(parents=True)
    temporaries = []
    for k in range(3):
        shard, attempt = f"shard-00000{k}", ledger.new_attempt_id()
        temporaries.append(_marker_temporary(store, "done", shard, age=3600))
        (journal / f"{dead['pid']}-{attempt}.json").write_text(json.dumps(
            {"storage": store.storage.url, "run_id": "run", "key": shard, "attempt": attempt, **dead}))
    other = _marker_temporary(store, "done", "shard-000009", age=3600)  # no dead attempt of this host: not ours
    assert sweep_dead_attempts(stale_after=3600) == 3
    assert not any(os.path.exists(p) for p in temporaries) and os.path.exists(other)
    assert list(journal.iterdir()) == []
