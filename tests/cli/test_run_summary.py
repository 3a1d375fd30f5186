"""`regen run`'s closing summary counts shards, not stage keys."""

from __future__ import annotations

from rich.console import Console

from app.base.ledger import CAPTURE, GENERATE, dead_letter, stage_key
from app.base.storage import RunStore, Storage
from app.cli.run import print_run_totals


def test_a_staged_shard_dead_in_both_stages_counts_once(tmp_path):
    store = RunStore(Storage(str(tmp_path)), "summary")
    for shard, stage in (("shard-000001", GENERATE), ("shard-000001", CAPTURE), ("shard-000002", CAPTURE)):
        dead_letter(store, stage_key(shard, stage), "test")
    console = Console(record=True, width=120)
    print_run_totals(store, console, seconds=1.0)
    rows = [line for line in console.export_text().splitlines() if "dead-lettered shards" in line]
    assert len(rows) == 1 and rows[0].split()[-2] == "2", rows
