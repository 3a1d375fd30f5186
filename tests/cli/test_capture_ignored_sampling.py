"""`min_p` and `logit_bias` are refused with inline capture, at produce and at a worker's start, in one line: vLLM
builds no processor for them in an engine with a speculative config, and inline capture is one."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from app.base.errors import ConfigError
from app.base.speculative import ignored_with_capture
from app.cli import main
from tests.support.producer import sharegpt_row, write_jsonl
from tests.support.redis_db import PRODUCER_REDIS
from tests.support.synthetic_run import Spec, build_run


def _produce(tmp_path, model, *args):
    prompts = write_jsonl(tmp_path / "p.jsonl", [sharegpt_row(i) for i in range(3)])
    return CliRunner().invoke(main, ["produce", str(prompts), "--run", "mp", "--storage", str(tmp_path / "s"),
                                     "--broker", PRODUCER_REDIS, "--model", str(model), "--layers", "vllm:1,2",
                                     "--dry-run", *args])


def test_produce_refuses_min_p_with_inline_capture_in_one_line(tmp_path, tiny_qwen3):
    result = _produce(tmp_path, tiny_qwen3, "--capture", "inline", "--min-p", "0.05")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("regen: error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert "--min-p 0.05 with --capture inline" in errors[0] and "extract_hidden_states" in errors[0]


@pytest.mark.parametrize("args", [("--capture", "staged", "--min-p", "0.05"), ("--capture", "off", "--min-p", "0.05"),
                                  ("--capture", "inline", "--min-p", "0")])
def test_min_p_is_taken_where_the_engine_applies_it(tmp_path, tiny_qwen3, args):
    assert _produce(tmp_path, tiny_qwen3, *args).exit_code == 0


def test_logit_bias_is_named_too():
    why = ignored_with_capture({"min_p": 0.0, "logit_bias": {"5": -100}}, "inline")
    assert why.startswith("--logit-bias") and "inline capture is one" in why
    assert ignored_with_capture({"min_p": 0.05}, "staged") is None


def test_a_worker_refuses_at_start_a_run_made_with_min_p_and_inline_capture(tmp_path):
    from workers.process.plan import refuse_unrunnable

    build_run(tmp_path, Spec())
    manifest_path = tmp_path / "synth" / "run.json"
    manifest = json.loads(manifest_path.read_text())
    refuse_unrunnable(str(tmp_path), "synth")  # the run as made: nothing to refuse
    manifest["settings"]["sampling"]["min_p"] = 0.05  # a run produced before produce refused it
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"workers refuse run synth: --min-p 0.05 with --capture inline"):
        refuse_unrunnable(str(tmp_path), "synth")
