"""Fanned-out export, verify and stats (`--processes N`, `--part I/N`) give exactly what one process gives.

Exports are compared file by file, every byte of every file in the output folder (the plan, counts, markers,
samples, token_freq.pt, speculators' dataset): one process vs two worker processes vs two parts run at once
as two `regen export` processes into one folder, and after an exporter's whole process group (its worker
processes included, as when a host dies) is SIGKILLed in the middle of a shard and rerun.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from app.base.storage import Storage
from app.cli import main
from app.data import export_plan
from tests.support.faults import temporaries
from tests.support.synthetic_run import Spec, build_run
from tests.support.verify_runs import run_verify

ROOT = Path(__file__).resolve().parents[2]
FILTER = ("--min-response-tokens", "30")  # leaves out about half the samples, so shards export unequal counts


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """Six shards of 24 (two records rejected by the worker, 10% stubs, two samples with all-zero states)."""
    root = tmp_path_factory.mktemp("fanout") / "s"
    build_run(root, Spec(shards=6, shard_size=24, worker_rejects={3, 50}, stub_fraction=0.1, zero_samples={7, 90}))
    return root


def files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones included) by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def export_in_process(run: Path, out: Path, fmt: str, *extra: str) -> str:
    result = CliRunner().invoke(main, ["export", "synth", "--storage", str(run), "--format", fmt, "--out", str(out),
                                       *FILTER, *extra], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def exporter(run: Path, out: Path, fmt: str, *extra: str) -> subprocess.Popen:
    """`regen export` as its own process (in its own process group, so a kill can take its workers too)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.Popen([sys.executable, "-m", "app.cli", "export", "synth", "--storage", str(run), "--format",
                             fmt, "--out", str(out), *FILTER, *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finished(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def exported_now(output: str) -> int:
    line = next(x for x in output.splitlines() if "shards exported now" in x)
    return int(line.split("│")[2].split("/")[0])


@pytest.fixture(scope="module")
def reference(run, tmp_path_factory):
    """One-process exports, by format."""
    made = {}
    for fmt in ("specforge-dflash", "speculators"):
        out = tmp_path_factory.mktemp("ref") / fmt
        export_in_process(run, out, fmt)
        made[fmt] = files(out)
    return made


FORMATS = ["specforge-dflash", "speculators"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_processes_and_two_parts_at_once_write_the_same_bytes(run, reference, tmp_path, fmt):
    want = reference[fmt]
    assert sum(k.startswith(("rows_", "hidden_states/")) for k in want) > 40  # samples from every shard
    assert len({json.loads(v)["exported"] for k, v in want.items() if k.startswith("done/")}) > 1  # unequal shards

    export_in_process(run, tmp_path / "procs", fmt, "--processes", "2")
    assert files(tmp_path / "procs") == want

    parts = [exporter(run, tmp_path / "parts", fmt, "--part", f"{i}/2") for i in (1, 2)]
    outputs = [finished(p) for p in parts]
    assert files(tmp_path / "parts") == want
    assert sum(exported_now(o) for o in outputs) == 6  # each shard written by one part only
    assert sum("written now" in o for o in outputs) == 1  # the last part to finish assembled


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_part_killed_mid_shard_and_rerun_writes_the_same_bytes(run, reference, tmp_path, fmt):
    out = tmp_path / "out"
    victim = exporter(run, out, fmt, "--part", "1/2", "--processes", "2")
    shard = _wait_mid_shard(out, fmt, victim)
    os.killpg(victim.pid, signal.SIGKILL)  # the host dies: the exporter and its worker processes
    victim.wait()
    assert not (out / "done" / f"{shard}.json").exists(), "the kill landed after the shard was finished"
    assert (out / "claims" / f"{shard}.json").exists()  # the dead exporter's claim is still there
    other = finished(exporter(run, out, fmt, "--part", "2/2"))
    assert "not yet: other parts" in other  # part 1's shards are missing: nothing assembled
    assert not (out / "token_freq.pt").exists()
    rerun = finished(exporter(run, out, fmt, "--part", "1/2"))
    assert "written now" in rerun
    assert temporaries(out) == []
    assert files(out) == reference[fmt]


def test_an_exporter_killed_mid_shard_and_rerun_alone_writes_the_same_bytes(run, reference, tmp_path):
    out = tmp_path / "out"
    victim = exporter(run, out, "speculators")
    shard = _wait_mid_shard(out, "speculators", victim)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert not (out / "done" / f"{shard}.json").exists(), "the kill landed after the shard was finished"
    export_in_process(run, out, "speculators")
    assert files(out) == reference["speculators"]


@pytest.mark.parametrize("fmt", ["specforge-jsonl", "parquet", "specforge-online", "speculators-online"])
def test_text_and_token_only_exports_fan_out_to_the_same_bytes(run, tmp_path, fmt):
    export_in_process(run, tmp_path / "one", fmt)
    export_in_process(run, tmp_path / "procs", fmt, "--processes", "2")
    for i in (2, 1):
        export_in_process(run, tmp_path / "parts", fmt, "--part", f"{i}/2")
    want = files(tmp_path / "one")
    per_shard = "done/" if fmt.endswith("-online") else "data/"
    assert sum(k.startswith(per_shard) for k in want) == 6  # every shard written
    assert files(tmp_path / "procs") == want and files(tmp_path / "parts") == want


def test_a_run_exported_while_generating_is_numbered_the_same_fanned_out(tmp_path):
    """Shards that finish after an export are the next export's batch, numbered after every earlier sample."""
    built = build_run(tmp_path / "s", Spec(shards=5, shard_size=6))
    late = {s: (tmp_path / "s" / built.store.done_path(s)) for s in ("shard-000001", "shard-000004")}
    saved = {s: p.read_bytes() for s, p in late.items()}
    for p in late.values():  # the run in progress: shards 1 and 4 not done yet
        p.unlink()
    export_in_process(tmp_path / "s", tmp_path / "one", "speculators")
    export_in_process(tmp_path / "s", tmp_path / "fanned", "speculators", "--processes", "2")
    for s, p in late.items():
        p.write_bytes(saved[s])
    export_in_process(tmp_path / "s", tmp_path / "one", "speculators")
    for i in (1, 2):
        export_in_process(tmp_path / "s", tmp_path / "fanned", "speculators", "--part", f"{i}/2")
    want = files(tmp_path / "one")
    assert [json.loads(want[f"batches/00000{k}.json"])["shards"] for k in (0, 1)] == [
        ["shard-000000", "shard-000002", "shard-000003"], ["shard-000001", "shard-000004"]]
    assert files(tmp_path / "fanned") == want


def test_two_whole_exporters_racing_write_each_shard_once(run, reference, tmp_path):
    racers = [exporter(run, tmp_path / "out", "specforge-dflash") for _ in range(2)]
    outputs = [finished(p) for p in racers]
    assert sum(exported_now(o) for o in outputs) == 6, outputs
    assert files(tmp_path / "out") == reference["specforge-dflash"]


def _wait_mid_shard(out: Path, fmt: str, proc: subprocess.Popen, timeout: float = 240) -> str:
    """A shard that is claimed, has its first sample written and no done marker yet."""
    storage = Storage(str(out))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        batch = next(iter(export_plan.batches(storage)), None)
        claimed = sorted(p.stem for p in (out / "claims").glob("shard-*.json"))
        if batch and claimed:
            firsts = export_plan.first_indices(storage, batch)
            for shard in claimed:
                first = firsts.get(shard)
                if first is None or (out / "done" / f"{shard}.json").exists():
                    continue
                name = (f"hidden_states/hs_{first + 1}.safetensors" if fmt == "speculators"
                        else f"rows_0-2000/data_{first + 1}.ckpt")
                if (out / name).exists():
                    return shard
        time.sleep(0.002)
    raise AssertionError("no shard was seen in the middle of being exported")


def test_verify_with_processes_and_parts_finds_what_one_process_finds(run):
    code, whole = run_verify(run)
    assert code == 1 and {p["kind"] for p in whole["problems"]} >= {"states_zero"}  # the zero-state samples
    code2, procs = run_verify(run, "synth", "--processes", "2")
    assert (code2, procs) == (code, whole)
    parts = [run_verify(run, "synth", "--part", f"{i}/3") for i in (1, 2, 3)]
    assert max(c for c, _ in parts) == code
    for _, rep in parts:
        assert rep["accounting"] == whole["accounting"]  # other parts' shards counted from their markers
    shard_problems = sorted((json.dumps(p, sort_keys=True) for _, rep in parts for p in rep["problems"]
                             if p["shard"]))
    assert shard_problems == sorted(json.dumps(p, sort_keys=True) for p in whole["problems"] if p["shard"])
    assert sum(sum(rep["shards"].values()) for _, rep in parts) == sum(whole["shards"].values())


def _stats(run: Path, *extra: str) -> dict:
    result = CliRunner().invoke(main, ["stats", "synth", "--storage", str(run), "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_stats_with_processes_is_the_same_and_parts_add_up(run):
    whole = _stats(run)
    assert _stats(run, "--processes", "2") == whole
    parts = [_stats(run, "--part", f"{i}/2") for i in (1, 2)]
    assert sum(p["ok"] for p in parts) == whole["ok"] and sum(p["stubs"] for p in parts) == whole["stubs"] > 0
    for key in ("flags", "finish_reasons", "rejected"):
        assert sum((Counter(p[key]) for p in parts), Counter()) == Counter(whole[key])
    assert sum(p["shards_done"] for p in parts) == whole["shards_done"] == 6


def test_a_claim_is_taken_over_only_when_its_process_is_gone(tmp_path):
    from app.data.export_claims import take
    from tests.support.faults import dead_process

    out = Storage(str(tmp_path))
    held = take(out, "shard-000000")
    assert held is not None and take(out, "shard-000000") is None  # this very process holds it: alive
    with held.held():
        pass
    assert not (tmp_path / "claims" / "shard-000000.json").exists()  # released at the end
    now = time.time()
    elsewhere = {"host": "gpu-7", "boot": "b", "pidns": "p", "pid": 8, "pid_start": 1, "lease_s": 120}
    for key, body, free in [
        ("dead-here", {**dead_process(), "heartbeat": _iso(now), "lease_s": 120}, True),  # pid gone: at once
        ("fresh-elsewhere", {**elsewhere, "heartbeat": _iso(now - 30)}, False),  # another host, within its lease
        ("stale-elsewhere", {**elsewhere, "heartbeat": _iso(now - 600)}, True),  # another host, lease ran out
    ]:
        out.write_json(f"claims/{key}.json", body)
        assert (take(out, key) is not None) is free, key


def _iso(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat()
