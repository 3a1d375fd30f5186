"""`regen run` takes every `regen produce` option that decides the data, and they reach the run's manifest."""

from __future__ import annotations

import json

from click.testing import CliRunner

from app.cli import main
from app.cli.produce import SETTING_FLAGS, produce_command
from app.cli.run import run
from tests.support.redis_db import PRODUCER_REDIS


def test_regen_run_has_every_produce_option_that_decides_the_data_with_the_same_default():
    produce = {p.name: p for p in produce_command.params}
    have = {p.name: p for p in run.params}
    assert set(SETTING_FLAGS) <= set(have)
    for name in SETTING_FLAGS:
        if name != "model":  # run requires --model
            assert have[name].default == produce[name].default, name


def test_regen_run_writes_regenerate_and_sampling_into_the_run_before_starting_workers(tmp_path, monkeypatch,
                                                                                        producer_redis, tiny_model):
    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "yo"},
                                                {"role": "user", "content": "more"}]}) + "\n")
    result = CliRunner().invoke(main, [
        "run", str(prompts), "--model", str(tiny_model), "--run", "opts", "--storage", str(tmp_path / "s"),
        "--broker", PRODUCER_REDIS, "--layers", "vllm:1,2", "--max-tokens", "32", "--regenerate", "all",
        "--temperature", "0.7", "--top-p", "0.9", "--seed", "7", "--max-prompt-tokens", "2000",
        "--pause-stub-rate", "0.5", "--gpus", "99"])
    # No GPU 99 anywhere: the workers are refused, after the producer made the run with these settings.
    assert result.exit_code == 2 and "no such GPU 99" in result.output, result.output
    settings = json.loads((tmp_path / "s" / "opts" / "run.json").read_text())["settings"]
    assert settings["regenerate"] == "all" and settings["max_prompt_tokens"] == 2000
    assert settings["sampling"]["temperature"] == 0.7 and settings["sampling"]["top_p"] == 0.9
    assert settings["sampling"]["seed"] == 7 and settings["quality"]["pause_stub_rate"] == 0.5
