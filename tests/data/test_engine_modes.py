"""`regen stats` and `regen verify` count samples and capture-check results per engine mode, from the shards'
markers, and verify fails a shard whose capture check found a sample differing from its re-capture.

The run is the synthetic one (tests/support/synthetic_run.py, real storage and markers); its markers are given
the modes and checks two hosts' workers write (an sm_120 host and an sm_100 host), as a worker writes them
(workers/shard/generate.py, capture_stage.py)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from app.cli import main
from tests.support.synthetic_run import Spec, build_run

SM120 = "sm_120 vLLM 0.33.0 V2 async chunked:8192 cudagraph:FULL_AND_PIECEWISE tp1"
SM100 = "sm_100 vLLM 0.33.0 V2 async chunked:8192 cudagraph:FULL_AND_PIECEWISE tp1"
FAILURE = {"sample_id": "s-1", "ok": False, "check": "recapture", "layer": 2, "token": 17, "error": 0.41,
           "bound": 0.0625, "problem": "layer 2: 30 of 40 rows nearer a neighbouring token's reference: shifted"}


def two_hosts(root: Path, staged: bool = False):
    built = build_run(root, Spec(shards=3, shard_size=4, capture="staged" if staged else "inline"))
    store = built.store
    for shard, mode, check in (("shard-000000", SM100, {"checked": 4, "failed": 0}),
                               ("shard-000001", SM120, {"checked": 4, "failed": 1, "first_failure": FAILURE}),
                               ("shard-000002", SM120, {"checked": 0, "failed": 0})):
        path = store.storage.path(store.captured_path(shard) if staged else store.done_path(shard))
        marker = json.loads(Path(path).read_text())
        marker["engine_mode"], marker["capture_check"] = mode, check
        Path(path).write_text(json.dumps(marker))
    return built


def test_stats_counts_samples_and_checks_per_engine_mode(tmp_path):
    two_hosts(tmp_path / "s")
    result = CliRunner().invoke(main, ["stats", "synth", "--storage", str(tmp_path / "s"), "--json"])
    assert result.exit_code == 0, result.output
    modes = json.loads(result.output)["engine_modes"]
    assert modes == {SM100: {"shards": 1, "samples": 4, "checked": 4, "failed": 0},
                     SM120: {"shards": 2, "samples": 8, "checked": 4, "failed": 1}}
    shown = CliRunner().invoke(main, ["stats", "synth", "--storage", str(tmp_path / "s")], terminal_width=250)
    assert "per engine mode" in shown.output and "sm_120 vLLM 0.33.0 V2 async" in shown.output


def test_verify_fails_a_shard_whose_capture_check_failed_naming_the_engine_mode(tmp_path):
    two_hosts(tmp_path / "s")
    result = CliRunner().invoke(main, ["verify", "synth", "--storage", str(tmp_path / "s"), "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    checks = [p for p in report["problems"] if p["kind"] == "capture_check"]
    assert [(p["shard"], p["sample"]) for p in checks] == [("shard-000001", "s-1")]
    assert f"1 of 4 re-captured samples differ from their stored states on engine {SM120}" in checks[0]["detail"]
    assert "shifted" in checks[0]["detail"]
    assert report["engine_modes"][SM120]["failed"] == 1 and report["engine_modes"][SM100]["samples"] == 4


def test_a_staged_runs_states_count_under_the_engine_that_captured_them(tmp_path):
    two_hosts(tmp_path / "s", staged=True)
    result = CliRunner().invoke(main, ["stats", "synth", "--storage", str(tmp_path / "s"), "--json"])
    modes = json.loads(result.output)["engine_modes"]
    assert set(modes) == {SM100, SM120} and modes[SM120]["failed"] == 1  # the capture markers', not "synthetic"
    verify = CliRunner().invoke(main, ["verify", "synth", "--storage", str(tmp_path / "s"), "--json"])
    assert [p["shard"] for p in json.loads(verify.output)["problems"] if p["kind"] == "capture_check"] == [
        "shard-000001"]
