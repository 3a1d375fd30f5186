"""The record-side rules of the thinking budget (app.base.thinking) and the loop stop (app.base.loops, and the engine's
logits processor, workers.engine.loop_stop, driven through vLLM's own batch-update objects)."""

from __future__ import annotations

import pytest

from app.base.loops import CHECK_EVERY, LOOP_STOP_ARG, loop_stopped, stop_request
from app.base.thinking import budget_mask, forced_span

START, END, NL, EOS = 7, 8, 9, 2
CLOSE = [NL, END, NL, NL]
PROMPT = [1, 1, 1, START, NL]  # a Qwen3.5-style prompt: the think block opened, one reasoning token already


def test_the_forced_close_starts_where_the_budget_runs_out_counting_the_prompts_reasoning():
    budget = 5
    out = [30, 31, 32, 33, *CLOSE, 40, 41, EOS]  # 1 prompt token + 4 = 5 reasoning tokens, then the close
    assert forced_span(PROMPT, out, budget, [START], CLOSE, END) == (4, 8)
    mask = budget_mask([0] * 5 + [1] * len(out), len(PROMPT), (4, 8))
    assert mask == [0] * 5 + [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1]


def test_a_tail_the_model_wrote_of_the_close_text_is_its_own():
    # the GPU runner keeps a "\n" the model wrote as the close's first id and forces only the rest
    out = [30, 31, 32, NL, END, NL, NL, 40]
    assert forced_span(PROMPT, out, 5, [START], CLOSE, END) == (4, 7)


def test_a_think_the_model_writes_inside_its_reasoning_restarts_the_count_where_vllm_restarts_it():
    out = [30, START, 31, 32, 33, 34, 35, *CLOSE, 40]  # the GPU runner counts from the last <think>
    assert forced_span(PROMPT, out, 5, [START], CLOSE, END) == (7, 11)


def test_a_reasoning_the_model_closed_itself_was_not_closed_by_the_budget():
    out = [30, END, NL, 33, *CLOSE, 40]  # </think> at 1, then by chance the close text at the budget's place
    assert forced_span(PROMPT, out, 5, [START], CLOSE, END) is None
    assert forced_span(PROMPT, [30, 31, 32, 33, 34, 35, 36], 5, [START], CLOSE, END) is None  # nothing there


def test_a_model_that_opens_the_block_itself_is_counted_from_its_think():
    prompt = [1, 1, 1]  # Qwen3's template: the model writes <think> itself
    out = [START, 30, 31, 32, *CLOSE, 40]
    assert forced_span(prompt, out, 3, [START], CLOSE, END) == (4, 8)
    assert forced_span(prompt + [START, NL, END, NL, NL], [30, 31, 32, *CLOSE], 3, [START], CLOSE, END) is None


def test_a_loop_stopped_output_is_a_loop_at_a_checked_length_then_the_forced_end():
    loop = [5, 6] * (CHECK_EVERY // 2) * 2
    assert loop_stopped([*loop, EOS], "stop", EOS, 6)
    assert not loop_stopped([*loop, 3, EOS], "stop", EOS, 6)  # not a checked length
    assert not loop_stopped([*loop, EOS], "length", EOS, 6)
    assert not loop_stopped(list(range(32)) + [EOS], "stop", EOS, 6)  # no loop before it


def test_the_engines_processor_forces_the_end_only_on_requests_that_ask_and_loop():
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from workers.engine.loop_stop import LoopStop

    proc = LoopStop(None, torch.device("cpu"), False)
    asks = SamplingParams(extra_args={LOOP_STOP_ARG: stop_request(6, EOS)})
    looping, other, fresh = [4] * (CHECK_EVERY - 1), [4] * CHECK_EVERY, [1, 2, 3]
    proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[],
                                  added=[(0, asks, [1], looping), (1, SamplingParams(), [1], other),
                                         (2, asks, [1], fresh)]))
    logits = torch.zeros(3, 16)
    proc.apply(logits)
    assert not torch.isinf(logits).any()  # 15 tokens: not a checked length yet
    looping.append(4)  # vLLM appends to the very lists the batch update handed over
    proc.apply(logits)
    assert logits[0].argmax() == EOS and torch.isinf(logits[0]).sum() == 15
    assert not torch.isinf(logits[1:]).any()  # row 1 did not ask; row 2 does not loop
    proc.update_state(BatchUpdate(batch_size=3, removed=[0], added=[],
                                  moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    assert set(proc.rows) == {0} and proc.rows[0][0] is fresh


def test_a_gpu_engine_refuses_the_loop_stop_unless_it_runs_vllms_v1_runner():
    from app.base.config import Config
    from app.base.loops import gpu_runner_refusal

    assert gpu_runner_refusal("cpu", False) is None
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in gpu_runner_refusal("cuda", Config.from_env({}).vllm_v1_runner)
    assert gpu_runner_refusal("cuda", Config.from_env({"VLLM_USE_V2_MODEL_RUNNER": "0"}).vllm_v1_runner) is None
