"""What the fault-injection tests share: the no-loss/no-duplicate report, the shards a kill cut short, and the
identity of a process known dead."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from app.base.ledger import attempt_errors, attempt_names
from app.base.storage import RunStore
from tests.support.runs import prompts_file, run_records


def report(storage: Path, run_id: str, expected: int) -> Counter:
    records = run_records(storage, run_id)
    ids = Counter(r["sample_id"] for r in records)
    duplicated = sum(n - 1 for n in ids.values())
    lost = expected - len(ids)
    print(f"[{run_id}] samples expected {expected} / written {len(records)} / duplicated {duplicated} / lost {lost}")
    assert (duplicated, lost) == (0, 0)
    return ids


def temporaries(run_dir: Path) -> list[str]:
    """Every `atomic_writer` temporary (`.name.tmp-*`) anywhere under a run's folder."""
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob(".*.tmp-*"))


def in_flight_shards(store: RunStore) -> set[str]:
    """Shards with a started attempt and no completion marker (the worker is inside them, or was killed in them).

    Started means an attempt record is in place: a shard's attempts folder appears while its first record is still
    being written (temporary, fsync, rename), and a kill in that window leaves a folder but no attempt."""
    done = store.done_shards()
    return {shard for shard in store.storage.listdir(store.rel("attempts"))
            if shard not in done and "." not in shard
            and any(n.endswith(".json") for n in attempt_names(store, shard))}


def in_flight_shard(store: RunStore, besides: set[str] = frozenset()) -> str | None:
    """A shard the worker is inside right now, other than `besides` (shards an earlier kill left unfinished)."""
    return min(in_flight_shards(store) - besides, default=None)


def assert_redone_elsewhere(store: RunStore, shards: set[str], pid: int) -> None:
    """Of `shards`, in flight when process `pid` (the one recording their attempts) lost them, each is finished by
    `pid` all the same (its last write landed as the signal arrived: a kill lands when the syscall under way
    returns, so a publish can complete just after the test listed the done markers) or redone by another process
    after `pid`'s attempt. At least one must be redone, or the kill tested nothing."""
    redone = set()
    for shard in sorted(shards):
        marker = store.done_marker(shard)
        assert marker is not None, f"{shard} never finished"
        records = {r.get("attempt"): r for r in attempt_errors(store, shard)}
        if records[marker["attempt"]].get("pid") == pid:
            continue
        assert any(r.get("pid") == pid for r in records.values()), (shard, pid, records)  # the attempt cut short
        redone.add(shard)
    assert redone, f"every shard in flight at the kill ({sorted(shards)}) was finished by the process killed"


def prompts_beyond_the_slots(cpu_worker, tmp_path: Path) -> Path:
    """Synthetic prompts for over twice as many shards (of 4, the e2e runs') as the worker has task slots (read
    from its log): a kill leaves unfinished every shard the worker had started, up to one per slot, and a run that
    all fits the slots can be done between two polls."""
    slots = int(re.search(r"task slots: (\d+)", cpu_worker.text()).group(1))
    return prompts_file(tmp_path, n_synthetic=4 * (2 * slots + 2), with_formats=False)


def dead_process() -> dict:
    """The identity of a process of this machine that has exited (its pid is free now)."""
    import subprocess

    from app.base.liveness import identity

    child = subprocess.Popen(["true"])
    child.wait()
    return {**identity(), "pid": child.pid, "pid_start": 1}
