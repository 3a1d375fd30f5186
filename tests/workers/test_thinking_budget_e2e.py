"""A thinking budget and the loop stop end to end on the tiny Qwen3.5 hybrid, whose template opens the think block
in the prompt (as Qwen3.5/3.6's do), on one real CPU worker started from the run's manifest (`--run`).

Run `budget` samples at the thinking defaults with `--thinking-budget 8`; run `loops` samples near-greedy (where a
random model loops at once) with the budget and `--stop-loops`. Both `--capture off`: the generation engine a
staged run's generate stage has too (vLLM honours neither feature with inline capture; those combinations are
refused in tests/cli/test_thinking_budget_options.py).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from app.base.loops import CHECK_EVERY
from app.base.thinking import DEFAULT_THINKING_CLOSE
from app.cli import main
from tests.data.test_online_exports import check_speculators, specforge_prompts
from tests.support.engines import vllm_or_fail
from tests.support.redis_db import redis_or_fail, redis_url
from tests.support.runs import produce, prompts_file, run_records, wait_run_done
from tests.support.workers import WorkerProcess, worker_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
BROKER = redis_url(8)
BUDGET = 8
COMMON = ("--capture", "off", "--thinking", "--thinking-budget", str(BUDGET), "--stop-loops")


@pytest.fixture(scope="module")
def runs(tiny_hybrid, tmp_path_factory):
    """Runs `budget` and `loops`, done, with their ok records and the tokenizer."""
    vllm_or_fail()
    from transformers import AutoTokenizer

    redis_or_fail(BROKER).flushdb()
    storage = tmp_path_factory.mktemp("budget-storage")
    inputs = prompts_file(tmp_path_factory.mktemp("budget-inputs"), n_synthetic=8, with_formats=False)
    produce(storage, "budget", [inputs], tiny_hybrid, *COMMON, "--max-tokens", "40", queue="regen-budget",
            broker=BROKER)
    produce(storage, "loops", [inputs], tiny_hybrid, *COMMON, "--max-tokens", "160", "--temperature", "0.01",
            queue="regen-loops", broker=BROKER)
    logs = tmp_path_factory.mktemp("budget-logs")
    worker = WorkerProcess(["--cpu", "--run", "budget", "--storage", str(storage), "--queue", "regen-budget,regen-loops",
                            "--max-num-seqs", "16", "--max-attempts", "2", "--name", "budget"], logs / "w.log",
                           worker_env(BROKER))
    try:
        worker.wait_ready(timeout=600)
        for run in ("budget", "loops"):
            wait_run_done(storage, run, timeout=600)
    finally:
        worker.stop()
    tok = AutoTokenizer.from_pretrained(str(tiny_hybrid))
    out = {run: [r for r in run_records(storage, run) if r["status"] == "ok"] for run in ("budget", "loops")}
    assert all(len(records) == 8 for records in out.values())
    return storage, out, tok


def _budget_position(rec: dict, tok) -> int:
    """Where the budget runs out, in input_ids: `BUDGET` tokens after the prompt's `<think>` (as vLLM counts)."""
    start = tok.convert_tokens_to_ids("<think>")
    prompt = rec["input_ids"][:rec["num_prompt_tokens"]]
    return len(prompt) - prompt[::-1].index(start) + BUDGET


def test_every_reasoning_ends_within_the_budget_and_closed_ones_are_marked_and_answered(runs):
    _, out, tok = runs
    close = tok.encode(DEFAULT_THINKING_CLOSE, add_special_tokens=False)
    end = tok.convert_tokens_to_ids("</think>")
    closed = 0
    for rec in out["budget"]:
        assert rec["sampling"]["thinking_budget"] == BUDGET
        ids, at = rec["input_ids"], _budget_position(rec, tok)
        first_end = ids.index(end, rec["num_prompt_tokens"])  # every sample's reasoning ended...
        assert first_end <= at + close.index(end), rec["sample_id"]  # ...within the budget
        if rec.get("budget_closed"):
            closed += 1
            assert ids[at:at + len(close)] == close  # vLLM's forced close, where the budget ran out
            assert "missing_think_end" not in rec["flags"] and rec["answer"] and rec["num_answer_tokens"] > 0
            assert rec["forced"][0] == [at, at + len(close)]
        else:  # the model closed it itself, before the budget
            assert first_end < at and "forced" not in rec
    assert closed >= len(out["budget"]) // 2  # a random model rarely writes </think> within 8 tokens


def test_masks_leave_out_exactly_the_forced_ids(runs):
    _, out, tok = runs
    close = tok.encode(DEFAULT_THINKING_CLOSE, add_special_tokens=False)
    eos = tok.eos_token_id
    for rec in out["budget"] + out["loops"]:
        n_p, n_o = rec["num_prompt_tokens"], rec["num_output_tokens"]
        want = [0] * n_p + [1] * n_o
        if rec.get("budget_closed"):
            at = _budget_position(rec, tok)
            want[at:at + len(close)] = [0] * len(close)
        if rec.get("loop_stopped"):
            assert rec["input_ids"][-1] == eos
            want[-1] = 0
        assert rec["loss_mask"] == want, rec["sample_id"]
        assert sum(rec["loss_mask"]) == n_o - (len(close) if rec.get("budget_closed") else 0) - bool(
            rec.get("loop_stopped"))


def test_looping_requests_are_stopped_early_and_flagged(runs):
    _, out, tok = runs
    stopped = [r for r in out["loops"] if r.get("loop_stopped")]
    assert stopped, [r["num_output_tokens"] for r in out["loops"]]
    for rec in stopped:
        assert "repetition_loop" in rec["flags"] and rec["finish_reason"] == "stop"
        assert rec["num_output_tokens"] < 160 and (rec["num_output_tokens"] - 1) % CHECK_EVERY == 0
        assert not {"empty_answer", "stub_answer"} & set(rec["flags"])
    # an output the stop did not end never loops at its end unflagged
    for rec in out["loops"]:
        if not rec.get("loop_stopped"):
            assert rec["finish_reason"] == "length" or rec["input_ids"][-1] == tok.eos_token_id


def test_verify_passes(runs):
    storage, _, _ = runs
    for run in ("budget", "loops"):
        result = CliRunner().invoke(main, ["verify", run, "--storage", str(storage), "--json"],
                                    catch_exceptions=False)
        report = json.loads(result.output[result.output.index("{"):])
        assert result.exit_code == 0 and report["ok"], result.output[-3000:]


def test_both_trainers_read_the_exports_with_the_zeros_in_place(runs, tmp_path):
    storage, out, _ = runs
    records = out["budget"]
    assert any(0 in r["loss_mask"][r["num_prompt_tokens"]:] for r in records)
    for fmt in ("specforge-online", "speculators-online"):
        result = CliRunner().invoke(main, ["export", "budget", "--storage", str(storage), "--format", fmt, "--out",
                                           str(tmp_path / fmt)], catch_exceptions=False)
        assert result.exit_code == 0, result.output
    assert specforge_prompts(tmp_path / "specforge-online" / "prompts.jsonl") == [
        (r["input_ids"], r["loss_mask"]) for r in records]
    check_speculators(tmp_path / "speculators-online", records)
