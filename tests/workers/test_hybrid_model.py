"""Hybrid targets (Qwen3.5/3.6: Gated DeltaNet + full attention) without an engine: the tiny model in both
checkpoint shapes, everything that reads the language model's settings, the engine settings chosen from the
config, the operator's vLLM arguments, the hybrid state checks and the CPU torchvision stand-in."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from app.base.errors import ConfigError
from app.base.layers import parse_layers
from app.base.model_info import read_model_info
from app.base.quality import StaleRows, layer_detail, repeated_rows, states_problem
from app.cli import main
from workers.engine.llm_arguments import llm_kwargs
from workers.engine.model_arguments import check_hybrid_capture_vllm, model_engine_arguments
from workers.engine.options import EngineOptions

MIX = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_tiny_model_builds_both_hybrid_shapes_and_keeps_qwen3_the_default(tmp_path):
    runner = CliRunner()
    for args in (["--arch", "qwen3_5"], ["--arch", "qwen3_5", "--multimodal"], []):
        result = runner.invoke(main, ["tiny-model", str(tmp_path / "-".join(args or ["dense"])), *args])
        assert result.exit_code == 0, result.output
    text, wrapper = config(tmp_path / "--arch-qwen3_5"), config(tmp_path / "--arch-qwen3_5---multimodal")
    dense = config(tmp_path / "dense")
    assert text["architectures"] == ["Qwen3_5ForCausalLM"] and text["layer_types"] == MIX
    assert wrapper["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert wrapper["text_config"]["layer_types"] == MIX and wrapper["vision_config"]["depth"] == 1
    assert "layer_types" not in wrapper  # the language model's settings live under text_config only
    assert dense["architectures"] == ["Qwen3ForCausalLM"]
    refused = runner.invoke(main, ["tiny-model", str(tmp_path / "x"), "--multimodal"])
    assert refused.exit_code != 0 and "--multimodal needs --arch qwen3_5" in refused.output


def test_the_hybrid_template_opens_the_think_block_in_thinking_mode(tiny_hybrid):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_hybrid))
    msgs = [{"role": "user", "content": "Hi"}]
    on = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_manifest_reads_the_language_model_from_text_config(tiny_hybrid_mm):
    info = read_model_info(str(tiny_hybrid_mm))
    assert (info.num_layers, info.hidden_size, info.model_type) == (4, 128, "qwen3_5_text")
    manifest = info.to_manifest()
    assert manifest["layer_types"] == MIX and manifest["architectures"] == ["Qwen3_5ForConditionalGeneration"]


def test_a_27b_wrappers_presets_and_estimate_come_from_text_config(tmp_path):
    # Qwen3.6-27B's shape: 64 layers of 5120 under text_config (a wrapper's own top level has neither)
    folder = tmp_path / "qwen36-27b"
    folder.mkdir()
    types = ["full_attention" if (k + 1) % 4 == 0 else "linear_attention" for k in range(64)]
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 64, "hidden_size": 5120,
                        "layer_types": types, "num_attention_heads": 24, "linear_num_key_heads": 16,
                        "linear_num_value_heads": 48}}))
    info = read_model_info(str(folder))
    layers = parse_layers("dflash", info.num_layers)
    assert layers.dflash == (1, 16, 31, 46, 61) and layers.vllm == (2, 17, 32, 47, 62)
    assert [info.architecture.layer_kind(v) for v in layers.vllm] == [
        "linear_attention", "linear_attention", "full_attention", "linear_attention", "linear_attention"]
    from producer.estimate import build_estimate

    est = build_estimate(samples=1, token_counts=[1], max_tokens=2, assumed_response_tokens=1,
                         layers=len(layers.vllm), hidden_size=info.hidden_size)
    assert "5 layers x 5120 x 2 bytes = 51,200 B per token" in "\n".join(est.lines())


def test_dry_run_on_the_multimodal_wrapper_sizes_states_by_its_language_model(tiny_hybrid_mm, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question": "What is 2+2?"}) + "\n")
    result = CliRunner().invoke(main, ["produce", str(prompts), "--model", str(tiny_hybrid_mm), "--layers",
                                       "vllm:1,4", "--storage", str(tmp_path / "s"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "2 layers x 128 x 2 bytes = 512 B per token" in result.output


def test_tensor_parallel_sizing_divides_the_linear_attention_heads_too(tmp_path):
    from workers.process.devices import Device, choose_tensor_parallel, head_counts

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"text_config": {
        "num_attention_heads": 8, "linear_num_key_heads": 8, "linear_num_value_heads": 6}}))
    with open(folder / "model.safetensors", "wb") as fh:
        fh.truncate(100 << 30)  # 100 GiB of (sparse) weights: too much for one 96 GiB GPU
    assert head_counts(str(folder)) == {"attention heads": 8, "linear-attention key heads": 8,
                                        "linear-attention value heads": 6}
    gpus = [Device(str(k), "RTX PRO 6000", "sm_120", 97887) for k in range(4)]
    assert choose_tensor_parallel(str(folder), gpus, 0.9).size == 2  # 4 would not divide 6 value heads
    with pytest.raises(ConfigError, match="6 linear-attention value heads"):
        choose_tensor_parallel(str(folder), gpus[:1] * 1, 0.9)


def test_the_reference_reads_a_multimodal_wrappers_language_model(tiny_hybrid_mm):
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    from app.data.reference import ReferenceCapture

    ids = list(range(5, 25))
    got = ReferenceCapture(str(tiny_hybrid_mm), [1, 4]).capture(ids)
    wrapper = Qwen3_5ForConditionalGeneration.from_pretrained(str(tiny_hybrid_mm), dtype=torch.bfloat16)
    wrapped = ReferenceCapture.from_model(wrapper, [1, 4]).capture(ids)
    with torch.inference_mode():
        out = wrapper.model.language_model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    layer1 = out.hidden_states[1][0].contiguous().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(got, wrapped) and np.array_equal(got[:, 0], layer1)


def test_engine_settings_follow_the_models_config(tiny_hybrid, tiny_hybrid_mm, tiny_qwen3):
    # capture: never prefix caching; hybrid on the CPU (chunked prefill off): vLLM cannot have it either
    assert model_engine_arguments(str(tiny_qwen3), "cuda", capture=False) == {}
    assert model_engine_arguments(str(tiny_qwen3), "cuda", capture=True) == {"enable_prefix_caching": False}
    assert model_engine_arguments(str(tiny_hybrid), "cpu", capture=False) == {"enable_prefix_caching": False}
    assert model_engine_arguments(str(tiny_hybrid), "cuda", capture=False) == {}
    assert model_engine_arguments(str(tiny_hybrid_mm), "cuda", capture=False) == {"language_model_only": True}
    kwargs = llm_kwargs(EngineOptions(model=str(tiny_hybrid_mm), capture_layers=(1, 4),
                                      vllm_args=["max_num_batched_tokens=8192"]))
    assert kwargs["enable_prefix_caching"] is False and kwargs["language_model_only"] is True
    assert kwargs["enable_chunked_prefill"] is False and kwargs["max_num_batched_tokens"] == 8192


def test_a_hybrid_capture_refuses_a_vllm_without_the_nan_fix(tiny_hybrid, tiny_qwen3):
    with pytest.raises(ConfigError, match=r"vLLM 0\.24\.1 returns NaN or garbage hidden states .* >= 0\.25"):
        check_hybrid_capture_vllm(str(tiny_hybrid), "0.24.1")
    check_hybrid_capture_vllm(str(tiny_hybrid), "0.32.0")
    check_hybrid_capture_vllm(str(tiny_qwen3), "0.24.1")  # a dense target never had that bug


def test_operator_vllm_args_are_typed_by_vllms_parser_and_typos_fail_with_its_message():
    from app.base.vllm_args import parse_vllm_args, worker_vllm_args

    assert parse_vllm_args(["max-num-batched-tokens=8192", "enable_prefix_caching=false", "enforce_eager=true"]) == {
        "max_num_batched_tokens": 8192, "enable_prefix_caching": False, "enforce_eager": True}
    with pytest.raises(ConfigError, match="unrecognized arguments: --max-num-batched-tokns 8192"):
        parse_vllm_args(["max_num_batched_tokns=8192"])
    with pytest.raises(ConfigError, match="invalid human_readable_int value: 'lots'"):
        parse_vllm_args(["max_num_batched_tokens=lots"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_vllm_args(["max_num_batched_tokens"])
    # data-changing: refused, unless the run's manifest pins the same value (then it comes from the manifest)
    with pytest.raises(ConfigError, match=r"dtype=float16 would change dtype, which run 'r'"):
        worker_vllm_args(["dtype=float16"], capture=True, run_id="r")
    assert worker_vllm_args(["dtype=float16"], capture=True, pinned={"dtype": "float16"}) == [
        "dtype=float16", "dtype=float16"]
    with pytest.raises(ConfigError, match="quantization"):
        worker_vllm_args(["quantization=fp8"], capture=False)
    with pytest.raises(ConfigError, match="capture engines run without prefix caching"):
        worker_vllm_args(["enable_prefix_caching=true"], capture=True)
    assert worker_vllm_args(["enable_prefix_caching=true"], capture=False) == ["enable_prefix_caching=true"]


def test_the_worker_command_fails_at_start_up_on_a_misspelt_or_data_changing_vllm_arg(tiny_hybrid):
    runner = CliRunner()
    base = ["worker", "--cpu", "--model", str(tiny_hybrid), "--layers", "vllm:1,4"]
    typo = runner.invoke(main, [*base, "--vllm-arg", "max_num_batched_tokns=8192"])
    assert typo.exit_code == 2 and "unrecognized arguments: --max-num-batched-tokns 8192" in typo.output
    data = runner.invoke(main, [*base, "--vllm-arg", "kv_cache_dtype=fp8"])
    assert data.exit_code == 2 and "kv_cache_dtype=fp8 would change the attention numerics" in data.output


def _states(n_tokens=12, n_layers=3, hidden=128, seed=0) -> np.ndarray:
    from app.base.hidden_file import float32_to_bf16

    return float32_to_bf16(np.random.default_rng(seed).normal(size=(n_tokens, n_layers, hidden)).astype(np.float32))


def test_a_layer_whose_rows_repeat_token_after_token_is_caught_in_linear_and_full_layers():
    good = _states()
    assert repeated_rows(good) is None and states_problem(good) is None
    for layer in (0, 2):  # a linear-attention layer's slot, then the full-attention one's
        bad = good.copy()
        bad[:, layer] = bad[0, layer]  # one row broadcast over every token
        assert repeated_rows(bad) == "states_repeated"
        assert repeated_rows(bad, np.arange(12)) == "states_repeated"
        # one token repeated: a small model's early layer may round its context away; not a capture fault
        assert repeated_rows(bad, np.full(12, 7)) is None
    zero = good.copy()
    zero[:, 1] = 0
    assert layer_detail(zero, [1, 2, 4], ["linear_attention", "linear_attention", "full_attention"]) == (
        "vllm layer 2 (linear_attention): all-zero layer")
    nan = good.copy()
    nan[3, 2, 5] = 0x7FC0
    assert layer_detail(nan, [1, 2, 4], ["linear_attention"] * 2 + ["full_attention"]).startswith(
        "vllm layer 4 (full_attention): NaN/Inf")


def test_rows_left_over_from_an_earlier_sample_are_stale_but_the_same_token_in_a_shared_prefix_is_not():
    seen = StaleRows()
    a_ids, a = np.arange(12), _states(seed=1)
    assert seen.check(a_ids, a) is None
    b_ids = np.concatenate([a_ids[:6], np.arange(100, 106)])  # shares 6 tokens: equal rows there are right
    b = _states(seed=2)
    b[:6] = a[:6]
    assert seen.check(b_ids, b) is None
    d_ids, d = np.arange(300, 312), _states(seed=4)
    d_ids[-1] = a_ids[-1]
    d[-1] = a[-1]  # the same token whose context rounded away (a random model's early layer): not stale
    assert seen.check(d_ids, d) is None
    c_ids, c = np.arange(200, 212), _states(seed=3)
    c[-1] = a[-1]  # an earlier request's last rows, never overwritten, as the state of another token
    assert seen.check(c_ids, c) == "states_stale"


def test_the_cpu_torchvision_stand_in_satisfies_imports_fails_on_use_and_yields_to_a_real_one(monkeypatch):
    if os.environ.get("CI"):
        import torchvision  # scripts/setup.sh installs the stand-in on CPU hosts
    else:
        torchvision = pytest.importorskip("torchvision")
    if not torchvision.__version__.endswith("regen.cpu.standin"):
        pytest.skip(f"a real torchvision {torchvision.__version__} is installed")
    import regen_cpu_torchvision_standin as standin
    from torchvision.transforms.v2 import functional

    with pytest.raises(standin.TorchvisionUnavailable, match="regen-cpu-torchvision-standin"):
        functional.resize(None, [2, 2])
    importable = os.path.dirname(os.path.dirname(torchvision.__file__))
    site = os.path.dirname(os.path.dirname(standin.__file__))
    assert sys.path.index(importable) > sys.path.index(site)  # a real torchvision in site-packages wins
    monkeypatch.setattr(standin, "real_torchvision_version", lambda: "0.28.0")
    with pytest.raises(ImportError, match="must never stand in beside a real torchvision"):
        standin.refuse_beside_real_torchvision()


def test_data_changing_vllm_args_reach_workers_only_through_the_run_manifest(tiny_hybrid, tmp_path):
    from app.base.manifest import RunSettings
    from app.base.vllm_args import worker_vllm_args
    from producer.run_setup import ProduceOptions, build_settings, run_engine_args

    assert run_engine_args(["kv_cache_dtype=fp8", "max_num_batched_tokens=8192"], capture=True) == {
        "kv_cache_dtype": "fp8", "max_num_batched_tokens": "8192"}
    with pytest.raises(ConfigError, match="capture engines run without prefix caching"):
        run_engine_args(["enable_prefix_caching=true"], capture=True)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question": "hi"}) + "\n")
    plain = build_settings(ProduceOptions(inputs=[str(prompts)], model=str(tiny_hybrid)), [str(prompts)])
    assert "engine_args" not in plain.to_dict()  # older runs' settings compare equal when reopened
    pinned = build_settings(ProduceOptions(inputs=[str(prompts)], model=str(tiny_hybrid),
                                           vllm_args=["kv_cache_dtype=fp8"]), [str(prompts)]).to_dict()
    assert pinned["engine_args"] == {"kv_cache_dtype": "fp8"} and isinstance(plain, RunSettings)
    # a worker of that run gets the manifest's setting, and may repeat it, but not change it
    assert worker_vllm_args([], capture=True, pinned=pinned["engine_args"]) == ["kv_cache_dtype=fp8"]
    with pytest.raises(ConfigError, match="kv_cache_dtype=auto would change the attention numerics"):
        worker_vllm_args(["kv_cache_dtype=auto"], capture=True, pinned=pinned["engine_args"])
