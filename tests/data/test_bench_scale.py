"""bench/bench_scale.py at a tiny scale, so the harness cannot rot: it lays a run down through the project's
writers, times every command on it and prints one row for each. Timings are printed, never asserted."""

from __future__ import annotations

import os
import subprocess
import sys

from app.data.run_reader import RunReader
from app.data.verify import verify_run
from tests.support.paths import REPO


def test_harness_runs_every_command_and_reuses_its_run(tmp_path):
    keep = tmp_path / "scale"
    # 150 samples in 3 shards, the first captured (narrow states: 8 wide instead of 5120).
    cmd = [sys.executable, "bench/bench_scale.py", "--scale", "0.000164", "--states-shards", "1", "--hidden", "8",
           "--keep", str(keep), "--fractions", "0.5,1", "--sample", "4",
           "--skip", "sharegpt,parquet,specforge-eagle3,speculators"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    table = [line for line in first.stdout.splitlines() if line.startswith("| ")]
    names = {line.split(" | ")[0][2:] for line in table[1:]}
    from app.cli.data import export_cmd

    formats = next(p for p in export_cmd.params if p.name == "fmt").type.choices
    skipped = ("sharegpt", "parquet", "specforge-eagle3", "speculators")
    want = {"status", "verify --sample 4", "stats", "specforge-dflash (walk)"}
    want |= {f for f in formats if f not in skipped}
    assert want <= names, first.stdout
    assert "laid down 150 samples" in first.stdout

    # The run is what workers leave: every check holds but the capture still running on shards 1 and 2.
    report = verify_run(RunReader(str(keep / "f100"), "job"))
    assert {(p.kind, p.shard) for p in report.problems} == {("capture_missing", "shard-000001"),
                                                            ("capture_missing", "shard-000002")}
    assert report.accounting["identity_holds"] and report.accounting["written_ok"] == 150
    assert [len(RunReader(str(keep / f), "job").done_shards()) for f in ("f010", "f050", "f100")] == [1, 2, 3]

    again = subprocess.run([*cmd[:-2], "--skip", "export,verify,stats"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "reusing the run laid down" in again.stdout
