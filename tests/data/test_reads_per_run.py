"""What the read side does once per run stays once per run: a step per shard that lists a folder is 14K
round trips on the job's 14,282 shards (docs/performance.md, the scale harness)."""

from __future__ import annotations

from app.base import ledger
from app.base.storage import Storage
from app.data.run_reader import RunReader
from app.data.verify import verify_run
from tests.support.synthetic_run import Spec, build_run


def test_verify_lists_dead_captures_once_however_many_shards_lack_a_capture(tmp_path, monkeypatch):
    built = build_run(tmp_path / "s", Spec(shards=8, shard_size=3, capture="staged"))
    store = built.store
    lacking = [f"shard-00000{s}" for s in (1, 2, 4, 5, 7)]  # capture not finished on five shards
    for shard in lacking:
        store.storage.delete(store.captured_path(shard))
    ledger.dead_letter(store, ledger.stage_key("shard-000002", ledger.CAPTURE), "engine failed 3 times")

    listed: list[str] = []
    real = Storage.listdir
    monkeypatch.setattr(Storage, "listdir", lambda self, rel: listed.append(rel) or real(self, rel))
    report = verify_run(RunReader(built.storage, "synth"))

    found = {(p.shard, p.kind, p.severity) for p in report.problems}
    assert found == {(s, "capture_dead", "warning") if s == "shard-000002" else (s, "capture_missing", "error")
                     for s in lacking}
    # Run-level questions only (the generate stage's letters, the capture stage's), never one per shard.
    assert listed.count("synth/dead") <= 3 < len(lacking)
