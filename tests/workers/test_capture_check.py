"""The capture check's parts without an engine: which samples it picks, the test-only faults, and that the
comparison it runs tells each fault from right states on rows that carry a massive-activation channel.

The same check on real vLLM captures: tests/workers/test_capture_check_e2e.py (a worker pausing its run) and
tests/workers/test_start_test.py (the engine's start test, on a model with a massive channel)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.base.hidden_file import float32_to_bf16
from app.base.manifest import CaptureCheckSettings, settings_diff
from app.base.states_compare import compare
from workers.doubles.capture_faults_for_tests import FAULTS, CaptureFaultsForTests, apply_fault
from workers.engine.engine_mode import mode_key
from workers.engine.recapture import CheckPolicy, EngineChecks

MASSIVE = 400.0  # a channel this large in every token, as trained Qwen models carry in their residual stream


def massive_rows(rng, n_tokens=48, n_layers=4, hidden=256) -> np.ndarray:
    """float32 `[T, L, H]`: token-dependent rows (~1 per value) plus one channel at MASSIVE in every row."""
    base = rng.standard_normal((n_tokens, 1, hidden)).astype(np.float32)
    layers = np.cumsum(rng.standard_normal((n_tokens, n_layers, hidden)).astype(np.float32) * 0.5, axis=1)
    x = base + layers
    x[:, :, 7] = MASSIVE + rng.standard_normal((n_tokens, n_layers)).astype(np.float32)
    return x


def test_one_sample_in_every_is_chosen_by_its_id_the_same_everywhere():
    policy = CheckPolicy(every=100)
    ids = [f"sample-{i}" for i in range(20000)]
    chosen = [s for s in ids if policy.by_id(s)]
    assert 150 < len(chosen) < 250  # ~1 in 100
    assert chosen == [s for s in ids if CheckPolicy(every=100).by_id(s)]  # any worker, any process: the same
    assert not any(CheckPolicy(every=0).by_id(s) for s in ids)
    assert all(CheckPolicy(every=1).by_id(s) for s in ids[:50])


def test_every_engines_first_samples_are_checked_whatever_their_ids():
    policy = CheckPolicy(every=0, first=3)
    checks = EngineChecks()
    got = [checks.wants(f"s{i}", policy) for i in range(6)]
    assert got == [(True, True)] * 3 + [(False, False)] * 3


def test_the_policy_comes_from_the_manifest_and_older_runs_get_the_default():
    assert CheckPolicy.of({}) == CheckPolicy(100, 4)
    assert CheckPolicy.of({"capture_check": {"every": 7, "first": 2}}) == CheckPolicy(7, 2)
    # a manifest written before the setting existed is reopened with the default without a change of settings
    assert settings_diff({"model": 1}, {"model": 1, "capture_check": CaptureCheckSettings().__dict__}) == []
    assert settings_diff({"model": 1}, {"model": 1, "capture_check": {"every": 5, "first": 4}}) == [
        "capture_check.every"]


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_fails_the_comparison_and_right_states_pass_with_a_massive_channel(fault):
    rng = np.random.default_rng(3)
    truth = massive_rows(rng)
    previous = float32_to_bf16(massive_rows(np.random.default_rng(4)))
    stored = float32_to_bf16(truth)
    # a re-capture by other kernels: the same values with rounding-sized noise, rounded to bf16 again
    again = float32_to_bf16(truth * (1 + rng.standard_normal(truth.shape).astype(np.float32) * 2 ** -9))
    right = compare(again, stored, [1, 2, 3, 4])
    assert right.ok, right.line()
    # the massive channel makes every wrong row look close by the error relative to its norm alone
    faulted = apply_fault(fault, stored, previous)
    assert faulted is not None and not np.array_equal(faulted, stored)
    verdict = compare(again, faulted, [1, 2, 3, 4])
    assert not verdict.ok, f"{fault} passed: {verdict.line()}"
    assert verdict.layer in (1, 2, 3, 4) and verdict.problem


def test_faults_that_need_an_earlier_capture_or_more_rows_are_not_applied_rather_than_faked():
    one = float32_to_bf16(np.ones((1, 1, 8), dtype=np.float32))
    assert apply_fault("shift", one, None) is None and apply_fault("swap", one, None) is None
    assert apply_fault("foreign", one, None) is None and apply_fault("stale", one, None) is None
    with pytest.raises(ValueError, match="unknown fault"):
        apply_fault("melt", one, None)


def test_the_injector_corrupts_only_the_runs_its_file_lists_and_reads_changes(tmp_path):
    path = tmp_path / "faults.json"
    injector = CaptureFaultsForTests(str(path))
    states = float32_to_bf16(massive_rows(np.random.default_rng(5), n_tokens=8))
    assert injector.corrupt("r1", "s0", states) == (states, None)  # no file: nothing
    path.write_text(json.dumps({"r1": "zero"}))
    out, fault = injector.corrupt("r1", "s1", states)
    assert fault == "zero" and (out[2:4, 0] == 0).all() and out[:2].any()
    assert injector.corrupt("r2", "s2", states)[1] is None
    path.write_text(json.dumps({"r1": "boil"}))
    with pytest.raises(ValueError, match="unknown faults"):
        injector.fault_for("r1")


def test_the_engine_mode_label_tells_the_users_paths_apart():
    cpu = {"device": "cpu", "vllm": "0.32.0", "model_runner": "V1", "async_scheduling": False,
           "chunked_prefill": False, "max_num_batched_tokens": 4096, "enforce_eager": True,
           "cudagraph_mode": "NONE", "tensor_parallel_size": 1}
    gpu = {**cpu, "device": "cuda", "compute_capability": "12.0", "model_runner": "V2", "async_scheduling": True,
           "chunked_prefill": True, "max_num_batched_tokens": 8192, "enforce_eager": False,
           "cudagraph_mode": "FULL_AND_PIECEWISE"}
    assert mode_key(cpu) == "cpu vLLM 0.32.0 V1 sync unchunked eager tp1"
    assert mode_key(gpu) == "sm_120 vLLM 0.32.0 V2 async chunked:8192 cudagraph:FULL_AND_PIECEWISE tp1"
    assert mode_key({**gpu, "compute_capability": "10.0"}) != mode_key(gpu)  # an sm_100 host is another mode
    assert mode_key(None) == mode_key({"error": "no config"}) == "unknown"
