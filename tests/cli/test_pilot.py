"""`regen pilot`: the sample of the input, each candidate's real run and its measurements, and the forecast.

The pilot's figures are recomputed here from what it measured (its JSON, and with --keep-runs the runs on
storage), never compared with figures written into the test: the CPU figures say nothing about a GPU, but the
arithmetic that turns measurements into a forecast is the same on both.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from app.base.hidden_file import HiddenFileReader
from app.base.jsonl_zst import loads_jsonl_zst
from app.base.storage import RunStore, Storage
from app.cli import main
from app.pilot.forecast import commands, forecast, samples_per_s
from app.pilot.sample import sample_inputs
from producer.estimate import human_bytes
from tests.support.engines import vllm_or_fail
from tests.support.redis_db import PILOT_BROKER, redis_or_fail
from tests.support.runs import prompts_file
from tests.support.workers import OPERATOR_ARG, worker_env

LAYERS = "vllm:1,2,4"
DEFAULT_CANDIDATES = ["inline", "inline-slots19", "inline-seqs32", "staged"]  # shard size 2 on the CPU preset


def _inputs(folder: Path, n: int = 10) -> Path:
    """n single-turn prompts, one exact duplicate and one malformed line (neither may be sampled)."""
    path = prompts_file(folder, n_synthetic=n, with_formats=False)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines, lines[0], "{not json"]) + "\n")
    return path


def test_the_sample_is_seeded_and_counts_what_produce_would_enqueue(tmp_path, tiny_model):
    inputs = _inputs(tmp_path)
    sample = sample_inputs([str(inputs)], 4, seed=1)
    dry = CliRunner().invoke(main, ["produce", str(inputs), "--model", str(tiny_model), "--layers", "vllm:1",
                                    "--dry-run", "--storage", str(tmp_path / "s")], catch_exceptions=False)
    counts = dict(re.findall(r"│ (rows read|samples|duplicates|rejected)\s*│\s*([\d,]+)", dry.output))
    assert (sample.read, sample.samples, sample.duplicates, sample.rejected) == tuple(
        int(counts[k].replace(",", "")) for k in ("rows read", "samples", "duplicates", "rejected"))
    assert len(sample.lines) == 4 and len(set(sample.lines)) == 4
    assert all(json.loads(line)["question"] for line in sample.lines)  # input lines, not the malformed one
    assert sample_inputs([str(inputs)], 4, seed=1).lines == sample.lines
    assert sample_inputs([str(inputs)], 4, seed=2).lines != sample.lines


def test_the_candidates_are_data_and_mtp_is_tried_only_where_the_checkpoint_has_a_head(tiny_model):
    from app.pilot.forecast import candidates, mtp_available

    def slots_for(seqs):
        return seqs // 8 + 2

    names = [c.name for c in candidates(slots=10, max_num_seqs=64, slots_for=slots_for, mtp=False)]
    assert names == ["inline", "inline-slots5", "inline-seqs32", "staged"]
    with_mtp = candidates(slots=10, max_num_seqs=64, slots_for=slots_for, mtp=True)
    mtp = with_mtp[-1]
    assert (mtp.name, mtp.capture, mtp.speculative, mtp.run_setting) == ("staged-mtp2", "staged", "mtp:2",
                                                                         "staged+mtp:2")
    # the speculative setting goes the way of every run setting: a `regen run` flag, recorded in the manifest
    assert mtp.run_args() == ["--capture", "staged", "--task-slots", "10", "--speculative", "mtp:2"]
    assert with_mtp[2].run_args() == ["--capture", "inline", "--task-slots", "6", "--vllm-arg", "max_num_seqs=32"]
    assert not mtp_available(str(tiny_model))  # no MTP weights in the tiny model's config
    with pytest.raises(Exception, match="no candidate nope"):
        candidates(slots=10, max_num_seqs=64, slots_for=slots_for, mtp=False, only=["staged", "nope"])


def _measured(host: str, setting: str, rate: float, devices: int = 1, slots: int = 8) -> dict:
    capture, _, spec = setting.partition("+")
    return {"candidate": {"name": setting, "capture": capture, "task_slots": slots, "max_num_seqs": None,
                          "speculative": spec or None},
            "measured": {"samples": 100, "window_s": 100 / rate, "generated_tokens": 5000, "context_tokens": 8000,
                         "devices": devices, "layers": 3, "hidden_size": 64, "generate_task_s": 1.0,
                         "capture_task_s": 0.0, "codec": {"samples": 10, "tokens": 800,
                                                          "bytes": {"bf16": 800 * 150, "fp8-e4m3": 800 * 90}}}}


def _pilot(host: str, entries: list[dict], devices: int = 1) -> dict:
    return {"version": 1, "name": host, "host": host, "device": {"kind": "cuda", "class": "sm_90", "count": devices,
                                                                   "names": ["H200"] * devices},
            "model": {"path": "/m", "fingerprint": "f"}, "inputs": {"files": ["/in.jsonl"], "samples": 10_000},
            "settings": {"layers": "dflash", "max_tokens": 64, "shard_size": 64}, "candidates": entries}


def test_the_fleet_takes_the_run_setting_fastest_on_all_hosts_together_and_each_hosts_best_worker_setting():
    a = _pilot("a", [_measured("a", "inline", 4.0), _measured("a", "staged", 3.0, slots=4),
                     _measured("a", "staged", 3.5, slots=12)])
    b = _pilot("b", [_measured("b", "inline", 1.0, devices=2), _measured("b", "staged", 3.0, devices=2)], devices=2)
    plan = forecast([a, b])
    assert plan["run_setting"] == "staged" and plan["fleet_samples_per_s"] == pytest.approx(6.5)  # > 4 + 1
    assert [h["task_slots"] for h in plan["hosts"]] == [12, 8]
    assert plan["wall_s"] == pytest.approx(10_000 / 6.5)
    assert plan["device_hours"] == pytest.approx(3 * 10_000 / 6.5 / 3600)
    assert plan["disk_bytes"]["bf16"] == pytest.approx(10_000 * 80 * 150)  # 80 context tokens per sample
    assert plan["export_bytes"] == pytest.approx(10_000 * 80 * 3 * 64 * 2)
    # a run setting one host did not measure is not the fleet's
    c = _pilot("c", [_measured("c", "inline", 1.0)])
    assert forecast([a, c])["run_setting"] == "inline"
    other = _pilot("d", [_measured("d", "inline", 1.0)])
    other["model"]["fingerprint"] = "g"
    with pytest.raises(Exception, match="another model"):
        forecast([a, other])


def test_a_candidate_whose_capture_failed_is_shown_as_such_and_never_recommended():
    from app.cli.pilot import setting_rows
    from app.pilot.forecast import capture_failure

    fast, slow = _measured("a", "inline", 9.0), _measured("a", "staged", 3.0)
    fast["measured"]["capture_check"] = {"checked": 6, "failed": 1, "failures": ["shard-000000 s1: layer 2 ..."],
                                         "modes": {}}
    slow["measured"]["capture_check"] = {"checked": 6, "failed": 0, "failures": [], "modes": {}}
    for entry in (fast, slow):  # what the table rows also read
        entry["measured"]["responses"] = {"max_tokens": 64, "median": 50, "p90": 60, "at_cap_share": 0.1,
                                          "stub_share": 0.0}
    plan = forecast([_pilot("a", [fast, slow])])
    assert plan["run_setting"] == "staged" and plan["fleet_samples_per_s"] == pytest.approx(3.0)  # not the 9.0
    assert capture_failure(fast).startswith("capture check: 1 of 6") and capture_failure(slow) is None
    rows = setting_rows(fast)
    assert rows["capture check"] == "FAILED: 1 of 6 differ"
    assert rows["result"].startswith("capture failed, not recommended: capture check")
    assert setting_rows(slow)["capture check"] == "6 re-captured, all agree" and "result" not in setting_rows(slow)
    # a reference check that failed, or a run the check paused, rules a candidate out the same way
    slow["reference"] = {"samples": 2, "ok": False, "problem": "s3: layer 1 token 5: error 0.9"}
    assert capture_failure(slow) == "verify --reference: s3: layer 1 token 5: error 0.9"
    with pytest.raises(Exception, match="no run setting"):
        forecast([_pilot("a", [fast, slow])])
    assert capture_failure({"capture_failed": "capture check failed on worker w"}) == "capture check failed on worker w"


def test_a_file_that_is_not_a_pilot_is_one_line(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    result = CliRunner().invoke(main, ["pilot", "--forecast-only", str(bad)])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "not a pilot JSON file" in result.output


# -- on the CPU, with real runs ------------------------------------------------------------------------------
def _pilot_cli(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**worker_env(PILOT_BROKER), "COLUMNS": "220", "REGEN_VISIBILITY_TIMEOUT": "120"}
    proc = subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc


def _run_pilot(tmp: Path, model: Path, name: str, *extra: str) -> tuple[str, dict, Path]:
    vllm_or_fail()
    redis_or_fail(PILOT_BROKER).flushdb()
    storage = tmp / "storage"
    proc = _pilot_cli(["pilot", str(_inputs(tmp)), "--model", str(model), "--cpu", "--name", name, "--sample", "6",
                       "--seed", "3", "--layers", LAYERS, "--max-tokens", "16", "--shard-size", "2",
                       "--storage", str(storage), "--broker", PILOT_BROKER, "--keep-runs", "--timeout", "600",
                       *extra], tmp, timeout=2400)
    return proc.stdout, json.loads((storage / "pilots" / f"{name}.json").read_text()), storage


@pytest.fixture(scope="module")
def dense_pilot(tiny_qwen3, tmp_path_factory):
    return _run_pilot(tmp_path_factory.mktemp("pilot-dense"), tiny_qwen3, "dense")


@pytest.fixture(scope="module")
def hybrid_pilot(tiny_hybrid, tmp_path_factory):
    return _run_pilot(tmp_path_factory.mktemp("pilot-hybrid"), tiny_hybrid, "hybrid", "--max-model-len", "2048",
                      "--vllm-arg", OPERATOR_ARG)


def _expected_candidates(pilot: dict) -> list[str]:
    """The default candidates, and staged + MTP where the checkpoint has an MTP head (app.pilot.forecast.mtp_available)."""
    from app.pilot.forecast import mtp_available

    return DEFAULT_CANDIDATES + (["staged-mtp2"] if mtp_available(pilot["model"]["path"]) else [])


def _cell(output: str, label: str) -> str:
    """The value column of the forecast table's row `label`."""
    for line in output.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line)]
        if len(cells) >= 3 and cells[1] == label:
            return cells[-2]
    raise AssertionError(f"no row {label!r} in:\n{output}")


def _settings_row(output: str, label: str) -> list[str]:
    for line in output.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line)]
        if len(cells) >= 3 and cells[1] == label:
            return cells[2:-1]
    raise AssertionError(f"no row {label!r} in:\n{output}")


def _check_measurements_against_the_runs(pilot: dict, storage: Path) -> None:
    """Each candidate's figures are its run's: samples, tokens, response lengths, stored bytes."""
    runs = storage / "pilots" / f"{pilot['name']}.work" / "storage"
    for entry in pilot["candidates"]:
        m, name = entry["measured"], entry["candidate"]["name"]
        store = RunStore(Storage(str(runs)), name)
        records, hidden_bytes = [], 0
        for shard in sorted(store.done_shards()):
            marker = store.done_marker(shard)
            records += loads_jsonl_zst(store.storage.read_bytes(marker["files"]["records"]["path"]))
            hidden = (json.loads((runs / store.captured_path(shard)).read_text())["hidden"]
                      if entry["candidate"]["capture"] == "staged" else marker["files"]["hidden"])
            hidden_bytes += hidden["bytes"]
            with open(runs / hidden["path"], "rb") as fh:
                assert len(HiddenFileReader(fh)) == marker["ok"]
        ok = [r for r in records if r["status"] == "ok"]
        assert m["samples"] == pilot["sample"]["size"] == 6 and len(ok) == 6, name
        assert m["generated_tokens"] == sum(r["num_output_tokens"] for r in ok)
        assert m["context_tokens"] == sum(len(r["input_ids"]) - 1 for r in ok)
        assert m["responses"]["median"] == statistics.median(r["num_output_tokens"] for r in ok)
        assert m["responses"]["at_cap_share"] == sum(r["finish_reason"] == "length" for r in ok) / 6
        # the yield: tokens of samples the default text export keeps (single-turn: all but unterminated thinking)
        assert m["trainable_tokens"] == sum(r["num_output_tokens"] for r in ok
                                            if "missing_think_end" not in r["flags"])
        assert sorted(m["lengths"]) == sorted([r["num_output_tokens"] - r["num_answer_tokens"], r["num_answer_tokens"],
                                               r["finish_reason"] == "length" or "missing_think_end" in r["flags"]
                                               or "truncated" in r["flags"], True, "missing_think_end" in r["flags"]]
                                              for r in ok)
        assert m["stored_states_bytes"] == hidden_bytes
        # the codec's bf16 output is the stored file's bulk (the file adds an index and headers)
        assert 0.5 * hidden_bytes < m["codec"]["bytes"]["bf16"] <= hidden_bytes and m["codec"]["samples"] == 6
        assert m["codec"]["bytes"]["fp8-e4m3"] < m["codec"]["bytes"]["bf16"]
        assert m["peak_memory_bytes"] > 100 << 20 and 0 < m["window_s"] < entry["seconds_with_start_up"]
        if entry["candidate"]["capture"] == "staged":
            assert m["capture_task_s"] > 0
        else:
            assert m["capture_task_s"] == 0


def _check_lengths(output: str, pilot: dict) -> None:
    """The recommendation printed is the one the pooled lengths give for the default share (95%)."""
    from app.pilot.lengths import recommend

    rows = [row for e in pilot["candidates"] for row in e["measured"]["lengths"]]
    rec = recommend(rows, 0.95, 16)
    assert _cell(output, "samples cut at the pilot's --max-tokens") == f"{rec['cut']} of {len(rows)}"
    want = "-" if rec["max_tokens"] is None else f"{rec['max_tokens']:,}"
    assert _cell(output, "recommended --max-tokens") == want
    if rec["max_tokens"] is None:  # the random tiny model rarely closes its thinking in 16 tokens
        assert _cell(output, "advice").startswith(f"{rec['cut']} of {len(rows)} samples")


def _check_forecast(output: str, pilots: list[dict]) -> dict:
    """The printed forecast, recomputed from the pilots' measurements alone."""
    n = pilots[0]["inputs"]["samples"]
    def setting_of(c: dict) -> str:  # capture mode and speculative generation: the whole run's
        return c["capture"] + (f"+{c['speculative']}" if c.get("speculative") else "")

    best_by_setting = {}
    for setting in {setting_of(e["candidate"]) for e in pilots[0]["candidates"]}:
        per_host = [max((e["measured"] for e in p["candidates"] if setting_of(e["candidate"]) == setting),
                        key=lambda m: m["samples"] / m["window_s"]) for p in pilots]
        best_by_setting[setting] = per_host
    setting, best = max(best_by_setting.items(), key=lambda kv: sum(m["samples"] / m["window_s"] for m in kv[1]))
    rate = sum(m["samples"] / m["window_s"] for m in best)
    samples = sum(m["samples"] for m in best)
    per_sample = sum(m["context_tokens"] for m in best) / samples
    wall = n / rate
    assert _cell(output, "run setting") == setting and _cell(output, "input samples") == f"{n:,}"
    assert _cell(output, "fleet samples/s") == f"{rate:,.3f}"
    days, rest = divmod(int(wall), 86400)
    assert _cell(output, "wall time") == (f"{days}d " if days else "") + f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    hours = len(pilots) * wall / 3600
    assert _cell(output, "device-hours") == (f"{hours:,.1f}" if hours >= 10 else f"{hours:.3g}")
    assert _cell(output, "generated tokens") == f"{n * sum(m['generated_tokens'] for m in best) / samples:,.0f}"
    trainable = n * sum(m["trainable_tokens"] for m in best) / samples
    generated = n * sum(m["generated_tokens"] for m in best) / samples
    assert _cell(output, "trainable tokens (default export)") == f"{trainable:,.0f} ({trainable / generated:.0%})"
    assert _cell(output, "trainable tokens per device-hour, the job") == f"{trainable / hours:,.0f}"
    for dtype in ("bf16", "fp8-e4m3"):
        per_token = sum(m["codec"]["bytes"][dtype] / m["codec"]["tokens"] * m["context_tokens"] for m in best) / samples
        assert _cell(output, f"disk, states {dtype}") == human_bytes(n * per_token)
    layers, hidden = best[0]["layers"], best[0]["hidden_size"]
    assert (layers, hidden) == (3, pilots[0]["model"]["hidden_size"])
    assert _cell(output, "export (raw bf16 of the captured layers)") == human_bytes(n * per_sample * layers * hidden * 2)
    return {"setting": setting, "rate": rate}


@pytest.mark.vllm
@pytest.mark.slow
def test_the_dense_pilot_prints_every_setting_and_a_forecast_recomputed_from_its_measurements(dense_pilot):
    output, pilot, storage = dense_pilot
    names = [e["candidate"]["name"] for e in pilot["candidates"]]
    assert names == _expected_candidates(pilot)
    assert all("measured" in e for e in pilot["candidates"]), pilot["candidates"]
    assert _settings_row(output, "setting") == names
    rates = _settings_row(output, "samples/s")
    assert rates == [f"{samples_per_s(e['measured']):,.3f}" for e in pilot["candidates"]]
    assert len(_settings_row(output, "generated tokens/s per device")) == len(names)
    assert pilot["inputs"] == {"files": pilot["inputs"]["files"], "read": 12, "samples": 10, "rejected": 1,
                               "duplicates": 1}
    _check_measurements_against_the_runs(pilot, storage)
    _check_forecast(output, [pilot])
    _check_lengths(output, pilot)
    # every capture candidate proved its capture on the host: the capture check's re-captures (each engine's
    # first samples) and verify --reference on two samples, all agreeing
    for entry in pilot["candidates"]:
        check = entry["measured"]["capture_check"]
        assert check["checked"] >= 4 and check["failed"] == 0, (entry["candidate"]["name"], check)
        assert entry["reference"]["ok"] and entry["reference"]["samples"] == 2, entry["reference"]
    assert set(_settings_row(output, "capture check")) == {
        f"{e['measured']['capture_check']['checked']} re-captured, all agree" for e in pilot["candidates"]}


@pytest.mark.vllm
@pytest.mark.slow
def test_the_hybrid_pilot_prints_every_setting_and_a_forecast_recomputed_from_its_measurements(hybrid_pilot):
    output, pilot, storage = hybrid_pilot
    expected = _expected_candidates(pilot)
    assert [e["candidate"]["name"] for e in pilot["candidates"]] == expected
    assert all("measured" in e for e in pilot["candidates"]), pilot["candidates"]
    assert _settings_row(output, "setting") == expected
    assert "full_attention" in pilot["model"]["layer_types"]  # the hybrid's manifest entry
    _check_measurements_against_the_runs(pilot, storage)
    _check_forecast(output, [pilot])


@pytest.mark.vllm
@pytest.mark.slow
def test_two_hosts_pilots_forecast_the_fleet_together(dense_pilot, tmp_path):
    _, pilot, storage = dense_pilot
    mine = storage / "pilots" / "dense.json"
    other = {**pilot, "name": "other", "host": "other-host"}
    (tmp_path / "other.json").write_text(json.dumps(other))
    proc = _pilot_cli(["pilot", "--forecast-only", str(mine), str(tmp_path / "other.json"), "--storage",
                       "/nfs/regen"], tmp_path, timeout=120)
    single = forecast([pilot])["fleet_samples_per_s"]
    both = _check_forecast(proc.stdout, [pilot, other])
    assert both["rate"] == pytest.approx(2 * single, rel=1e-3)
    assert "# on other-host:" in proc.stdout and f"# on {pilot['host']}:" in proc.stdout
    assert f"--pilot {tmp_path / 'other.json'}" in proc.stdout


@pytest.mark.vllm
@pytest.mark.slow
def test_a_run_with_the_recommended_settings_completes_and_status_compares_it_with_the_forecast(dense_pilot,
                                                                                               tmp_path):
    output, pilot, storage = dense_pilot
    produce_line = next(line for line in output.splitlines() if line.startswith("regen produce "))
    worker_line = next(line for line in output.splitlines() if line.startswith("regen worker "))
    capture = re.search(r"--capture (\w+)", produce_line).group(1)
    slots = re.search(r"--task-slots (\d+)", worker_line).group(1)
    seqs = re.search(r"--max-num-seqs (\d+)", worker_line)
    speculative = re.search(r"--speculative (\S+)", produce_line)
    pilot_file = re.search(r"--pilot (\S+)", produce_line).group(1)
    assert pilot_file == str(storage / "pilots" / "dense.json")
    inputs = shutil.copy(pilot["inputs"]["files"][0], tmp_path / "prompts.jsonl")
    run_storage = tmp_path / "runs"
    redis_or_fail(PILOT_BROKER).flushdb()
    _pilot_cli(["run", str(inputs), "--model", pilot["model"]["path"], "--cpu", "--run", "rec", "--storage",
                str(run_storage), "--broker", PILOT_BROKER, "--layers", LAYERS, "--max-tokens", "16",
                "--shard-size", "2", "--seed", "3", "--capture", capture, "--task-slots", slots,
                *(["--vllm-arg", f"max_num_seqs={seqs.group(1)}"] if seqs else []),
                *(["--speculative", speculative.group(1)] if speculative else []), "--pilot", pilot_file,
                "--timeout", "600"], tmp_path, timeout=900)
    store = RunStore(Storage(str(run_storage)), "rec")
    assert len(store.done_shards()) == 5 and not store.dead_shards()  # 10 samples, 2 a shard
    status = CliRunner().invoke(main, ["status", "rec", "--storage", str(run_storage), "--broker", PILOT_BROKER,
                                       "--json", "--inspect-timeout", "0"], catch_exceptions=False)
    compared = json.loads(status.output)["pilot"]
    assert compared["pilots"] == ["dense"]
    assert compared["run_setting"] == capture + (f"+{speculative.group(1)}" if speculative else "")
    assert compared["forecast_samples_per_s"] == pytest.approx(forecast([pilot])["fleet_samples_per_s"])
    assert compared["real_samples_per_s"] > 0
    shown = CliRunner().invoke(main, ["status", "rec", "--storage", str(run_storage), "--broker", PILOT_BROKER,
                                      "--inspect-timeout", "0"], catch_exceptions=False)
    assert "forecast by pilot dense" in shown.output


def test_a_mixed_runs_forecast_is_split_by_mode_from_each_modes_measurements():
    entry = _measured("a", "inline", 2.0)
    # 100 samples: 40 thinking with long answers, 60 non-thinking short ones
    entry["measured"]["modes"] = {
        "thinking": {"samples": 40, "generated_tokens": 4000, "context_tokens": 5000},
        "non_thinking": {"samples": 60, "generated_tokens": 1000, "context_tokens": 3000}}
    pilot = _pilot("a", [entry])
    pilot["settings"] = {**pilot["settings"], "thinking_mix": 0.4, "samples_per_prompt": 2}
    plan = forecast([pilot])
    assert plan["input_samples"] == 20_000 and plan["wall_s"] == pytest.approx(20_000 / 2.0)
    thinking, plain = plan["modes"]["thinking"], plan["modes"]["non_thinking"]
    assert (thinking["samples"], plain["samples"]) == (pytest.approx(8_000), pytest.approx(12_000))
    assert thinking["generated_tokens"] == pytest.approx(8_000 * 100) and plain["generated_tokens"] == pytest.approx(
        12_000 * 1000 / 60)
    assert thinking["device_hours"] == pytest.approx(plan["device_hours"] * 0.8)  # 4000 of 5000 generated tokens
    assert thinking["disk_bytes"]["bf16"] == pytest.approx(plan["disk_bytes"]["bf16"] * 5 / 8)  # context tokens
    produce = commands([pilot], plan, ["/p.json"])["produce"]
    assert "--thinking-mix 0.4" in produce and "--samples-per-prompt 2" in produce


def test_the_recommended_produce_line_repeats_the_mix_the_pilot_measured():
    """The forecast is of the rows --take draws with the pilot's seed, in its temperatures: the line that starts
    the run must draw the same rows with the same seed (docs/pilot.md)."""
    pilot = _pilot("a", [_measured("a", "inline", 2.0)])
    pilot["inputs"]["take"] = ["tool*.jsonl=1.0", "sharegpt*.jsonl=0.5"]
    pilot["sample"] = {"size": 300, "seed": 7}
    pilot["settings"] = {**pilot["settings"], "samples_per_prompt": 2,
                         "sampling": {"sample_temperatures": "0.6,0.9"}}
    produce = commands([pilot], forecast([pilot]), ["/p.json"])["produce"]
    for part in ("--take 'tool*.jsonl=1.0'", "--take 'sharegpt*.jsonl=0.5'", "--seed 7",
                 "--samples-per-prompt 2", "--sample-temperatures 0.6,0.9"):
        assert part in produce, (part, produce)
    plain = _pilot("b", [_measured("b", "inline", 2.0)])  # no mix, seed 0: nothing to repeat
    assert "--seed" not in commands([plain], forecast([plain]), ["/p.json"])["produce"]


def test_the_recommended_budget_and_cap_are_the_smallest_that_give_the_share():
    from app.pilot.lengths import recommend

    # 40 thinking samples, reasoning 10..400 and answers 3..42 tokens; 10 non-thinking answers of 50..95
    rows = [[10 * (i + 1), 3 + (7 * i) % 40, False, True, False] for i in range(40)]
    rows += [[0, 50 + 5 * i, False, False, False] for i in range(10)]
    rec = recommend(rows, 0.9, 4096)
    budget, cap = rec["thinking_budget"], rec["max_tokens"]

    def share_reasoning_within(n):
        return sum(r[0] <= n for r in rows if r[3]) / 40

    def share_within(b, m):
        return sum((min(r[0], b) if r[3] else 0) + r[1] <= m for r in rows) / len(rows)
    assert share_reasoning_within(budget) >= 0.9 > share_reasoning_within(budget - 1)
    assert share_within(budget, cap) >= 0.9 > share_within(budget, cap - 1)
    assert rec["within_max_tokens_share"] == share_within(budget, cap) and "advice" not in rec
    assert rec["complete_share"] == sum(
        (not r[3] or r[0] <= budget) and (min(r[0], budget) if r[3] else 0) + r[1] <= cap for r in rows) / len(rows)
    # samples the pilot's own cap cut are of unknown length: when they reach the quantile, no recommendation
    cut = [[r[0], r[1], i % 4 == 0, r[3], i % 4 == 0] for i, r in enumerate(rows)]  # a quarter cut, thinking open
    unknown = recommend(cut, 0.9, 64)
    assert unknown["thinking_budget"] is None and unknown["max_tokens"] is None
    assert unknown["advice"].startswith(f"{unknown['cut']} of 50 samples were cut at the pilot's --max-tokens 64")
    assert recommend(cut, 0.5, 64)["max_tokens"] is not None  # below the cut quarter: known


def test_the_forecast_counts_trainable_tokens_per_device_hour():
    entry = _measured("a", "inline", 2.0)
    entry["measured"]["trainable_tokens"] = 3000  # of 5000 generated
    plan = forecast([_pilot("a", [entry])])
    assert plan["trainable_tokens"] == pytest.approx(10_000 * 3000 / 100)
    assert plan["trainable_tokens_per_device_hour"] == pytest.approx(plan["trainable_tokens"] / plan["device_hours"])
    from app.pilot.forecast import rates

    assert rates(entry["measured"])["trainable_tokens_per_device_hour"] == pytest.approx(3000 / 50 * 3600)
    assert forecast([_pilot("b", [_measured("b", "inline", 2.0)])])["trainable_tokens"] is None  # an older pilot
