"""`--thinking-budget`, `--thinking-close`, `--stop-loops`: recorded in the manifest (left out at their defaults,
so older runs compare equal), refused in one line where vLLM does not honour them (measured: docs/formats.md), and
a worker whose engine lacks them refuses the run's generate shards. No engine starts here; the end-to-end run is
tests/workers/test_thinking_budget_e2e.py."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from app.base.manifest import RunSettings
from app.base.thinking import DEFAULT_THINKING_CLOSE
from app.cli import main
from tests.support.producer import sharegpt_row, write_jsonl
from tests.support.redis_db import PRODUCER_REDIS
from workers.shard.task_guards import Worker, generation_features_missing


def _produce(tmp_path, model, *args, run="budget"):
    prompts = write_jsonl(tmp_path / "p.jsonl", [sharegpt_row(i) for i in range(3)])
    return CliRunner().invoke(main, ["produce", str(prompts), "--run", run, "--storage", str(tmp_path / "s"),
                                     "--broker", PRODUCER_REDIS, "--model", str(model), "--layers", "vllm:1,2",
                                     "--max-tokens", "64", *args])


@pytest.mark.parametrize(("args", "words"), [
    (("--thinking-budget", "8"), ("--capture inline", "extract_hidden_states")),
    (("--capture", "staged", "--thinking-budget", "8", "--speculative", "mtp"), ("--speculative mtp:2",)),
    (("--capture", "off", "--stop-loops"), ()),  # accepted: the control
    (("--stop-loops",), ("--capture inline", "logits processor")),
    (("--capture", "staged", "--stop-loops", "--speculative", "mtp"), ("--speculative mtp:2", "logits processor")),
    (("--capture", "off", "--thinking-close", "\n</think>\n"), ("without --thinking-budget",)),
    (("--capture", "off", "--thinking-budget", "8", "--thinking-close", "done"), ("no </think>",)),
    (("--capture", "off", "--thinking-budget", "8", "--no-thinking"), ("no sample thinks",)),
    (("--capture", "off", "--thinking-budget", "64"), ("not below --max-tokens 64",)),
])
def test_combinations_vllm_does_not_honour_are_refused_in_one_line(args, words, tmp_path, tiny_model):
    result = _produce(tmp_path, tiny_model, "--dry-run", *args)
    if not words:
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("regen: error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    for word in words:
        assert word in errors[0], errors[0]


def test_regen_run_refuses_them_before_any_worker_starts(tmp_path, tiny_model):
    prompts = write_jsonl(tmp_path / "p.jsonl", [sharegpt_row(i) for i in range(2)])
    result = CliRunner().invoke(main, ["run", str(prompts), "--model", str(tiny_model), "--storage",
                                       str(tmp_path / "s"), "--broker", PRODUCER_REDIS, "--cpu", "--max-tokens", "32",
                                       "--thinking-budget", "8"])
    assert result.exit_code == 2 and "--capture inline" in result.output, result.output
    assert "workers:" not in result.output


def test_the_manifest_records_them_and_leaves_them_out_at_their_defaults(tmp_path, tiny_model):
    assert _produce(tmp_path, tiny_model, "--capture", "off", run="plain").exit_code == 0
    plain = json.loads((tmp_path / "s" / "plain" / "run.json").read_text())["settings"]
    assert not {"thinking_budget", "thinking_close", "stop_loops"} & set(plain)
    assert RunSettings.view(plain).thinking_budget is None and RunSettings.view(plain).stop_loops is False
    result = _produce(tmp_path, tiny_model, "--capture", "staged", "--thinking-budget", "8", "--stop-loops")
    assert result.exit_code == 0, result.output
    settings = json.loads((tmp_path / "s" / "budget" / "run.json").read_text())["settings"]
    assert settings["thinking_budget"] == 8 and settings["thinking_close"] == DEFAULT_THINKING_CLOSE
    assert settings["stop_loops"] is True
    again = _produce(tmp_path, tiny_model, "--capture", "staged", "--thinking-budget", "9", "--stop-loops")
    assert again.exit_code == 2 and "thinking_budget" in again.output


def test_a_worker_whose_engine_lacks_them_refuses_the_runs_generate_shards():
    settings = {"thinking_budget": 8, "thinking_close": DEFAULT_THINKING_CLOSE, "stop_loops": True}
    bare = Worker("cpu@host", "f", "/m", [1, 2])
    problems = generation_features_missing(settings, bare)
    assert len(problems) == 2 and "no reasoning config" in problems[0] and "no loop stop" in problems[1]
    other = Worker("cpu@host", "f", "/m", [], thinking_close="</think>", stop_loops=True)
    assert "closes with '</think>'" in generation_features_missing(settings, other)[0]
    ready = Worker("cpu@host", "f", "/m", [], thinking_close=DEFAULT_THINKING_CLOSE, stop_loops=True)
    assert generation_features_missing(settings, ready) == [] and generation_features_missing({}, bare) == []
