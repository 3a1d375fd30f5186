"""Trainer-ready exports of a real CPU run, checked against each trainer's contract and loaded by its own code.

One small mixed run of the session's worker (tiny Qwen3, vLLM layers 1-4 = the `eagle3` preset; both modes,
`--thinking-mix 0.5`, and two samples per prompt, `--samples-per-prompt 2`) is exported as
speculators, SpecForge DFlash and SpecForge EAGLE-3 data. Each export is read back with the trainer's own
reader (speculators' `ArrowDataset`, SpecForge's `OfflineManifestReader` and its per-algorithm normalisers), its
values compared with the run's stored states bit for bit, and SpecForge's own trainer runs a few DFlash and
EAGLE-3 steps on it on the CPU, with its CPU switches (`SPECFORGE_DEVICE=cpu`, `NO_SHARD`, `sdpa`, no loader
workers; `TRITON_INTERPRET=1` for EAGLE-3's Triton loss).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from app.cli import main
from tests.support.runs import produce, prompts_file, run_records, run_states, wait_run_done

RUN = "trainer-exports"
N = 4  # the tiny model's layers: vLLM id 4 is the final one, before the final norm
H = 128


@pytest.fixture(scope="module")
def run(cpu_worker, e2e_storage, tiny_qwen3, tmp_path_factory):
    inputs = prompts_file(tmp_path_factory.mktemp("trainer-inputs"), n_synthetic=8, with_formats=False)
    produce(e2e_storage, RUN, [inputs], tiny_qwen3, "--max-tokens", "32", "--thinking-mix", "0.5",
            "--samples-per-prompt", "2")
    wait_run_done(e2e_storage, RUN)
    records = [r for r in run_records(e2e_storage, RUN) if r["status"] == "ok"]
    assert len(records) == 16 and {r["thinking"] for r in records} == {True, False}
    return records, run_states(e2e_storage, RUN)


def test_loss_masks_cover_exactly_the_generated_tokens_in_either_mode(run, tiny_qwen3):
    from transformers import AutoTokenizer

    records, _ = run
    tok = AutoTokenizer.from_pretrained(str(tiny_qwen3))
    empty_block = tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    for rec in records:
        n_prompt, n_out = rec["num_prompt_tokens"], rec["num_output_tokens"]
        assert rec["loss_mask"] == [0] * n_prompt + [1] * n_out
        prompt = rec["input_ids"][:n_prompt]
        # a non-thinking sample's empty think block is the template's, in the prompt, never supervised
        assert (prompt[-len(empty_block):] == empty_block) == (not rec["thinking"]), rec["sample_id"]


@pytest.fixture(scope="module")
def target(tiny_qwen3, tmp_path_factory) -> Path:
    """The tiny model as SpecForge loads a target (weights indexed by model.safetensors.index.json), with a
    random final-norm weight (the built model's is all ones, which would hide a norm applied without it)."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("specforge-target")
    for f in tiny_qwen3.iterdir():
        if f.name != "model.safetensors":
            (folder / f.name).symlink_to(f)
    weights = load_file(str(tiny_qwen3 / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    weights["model.norm.weight"] = (0.5 + torch.rand(H, generator=gen)).to(weights["model.norm.weight"].dtype)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in weights}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def export(storage, out: Path, fmt: str, *extra: str) -> Path:
    result = CliRunner().invoke(main, ["export", RUN, "--storage", str(storage), "--format", fmt, "--out", str(out),
                                       *extra], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def dflash_export(run, e2e_storage, tmp_path_factory) -> Path:
    return export(e2e_storage, tmp_path_factory.mktemp("export") / "dflash", "specforge-dflash")


@pytest.fixture(scope="module")
def eagle3_export(run, e2e_storage, target, tmp_path_factory) -> Path:
    return export(e2e_storage, tmp_path_factory.mktemp("export") / "eagle3", "specforge-eagle3", "--model",
                  str(target))


def _bits(t) -> np.ndarray:
    import torch

    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def test_speculators_arrow_dataset_loads_every_sample_with_the_run_states(run, e2e_storage, tmp_path):
    import torch
    from speculators.train.data import ArrowDataset

    records, states = run
    export(e2e_storage, tmp_path / "spec", "speculators")
    meta = json.loads((tmp_path / "spec" / "export.json").read_text())["trainer"]
    assert meta["speculators"] == {"target_layer_ids": [1, 2, 3], "hidden_states_slots": [1, 2, 3, 4]}
    ds = ArrowDataset(max_len=4096, datapath=str(tmp_path / "spec"), on_missing="raise")
    assert len(ds) == len(records)
    for i, rec in enumerate(records):  # export order = shard order = the run's record order
        item = ds[i]
        tokens, stored = states[rec["sample_id"]]
        assert isinstance(item, dict), f"speculators dropped sample {i}"
        assert item["input_ids"].tolist() == tokens.tolist() == rec["input_ids"][:-1]
        assert item["loss_mask"].tolist() == rec["loss_mask"][:-1]
        assert item["hidden_states"].dtype == torch.bfloat16 and item["hidden_states"].shape == (len(tokens), 3 * H)
        assert np.array_equal(_bits(item["hidden_states"]), stored[:, :3, :].reshape(len(tokens), -1))
        assert np.array_equal(_bits(item["verifier_last_hidden_states"]), stored[:, 3, :])  # vLLM id 4, pre-norm
    freq = torch.load(tmp_path / "spec" / "token_freq.pt", weights_only=True)
    want = Counter(t for r in records for t, m in zip(r["input_ids"][:-1], r["loss_mask"][:-1], strict=True) if m)
    assert freq == dict(want) and sum(freq.values()) > 0
    # which prompt and mode each numbered sample is: the split a trainer makes by prompt
    named = [json.loads(line) for line in (tmp_path / "spec" / "samples.jsonl").read_text().splitlines()]
    assert named == [{"index": i, "sample_id": r["sample_id"], "prompt_id": r["prompt_id"], "thinking": r["thinking"]}
                     for i, r in enumerate(records)]


def test_specforge_dflash_reader_and_normaliser_take_every_file(run, dflash_export):
    import torch
    from specforge.algorithms.common.dflash_family_data import build_offline_reader, normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    records, states = run
    meta = json.loads((dflash_export / "export.json").read_text())["trainer"]
    assert meta["specforge"]["dflash_config.target_layer_ids"] == [0, 1, 2, 3]
    refs = build_offline_reader("dflash", str(dflash_export), run_id="t", ttt_length=1, max_len=4096).read()
    assert len(refs) == len(records)
    by_index = {int(Path(r.feature_store_uri).stem.split("_")[1]): r.feature_store_uri[len("file://"):] for r in refs}
    for i, rec in enumerate(records):
        raw = load_feature_file(by_index[i])
        tokens, stored = states[rec["sample_id"]]
        assert raw["input_ids"].dtype == raw["loss_mask"].dtype == torch.long
        assert raw["input_ids"].tolist() == tokens.tolist() == rec["input_ids"][:-1]
        assert raw["loss_mask"].tolist() == rec["loss_mask"][:-1]
        assert raw["hidden_states"].dtype == torch.bfloat16 and raw["hidden_states"].shape == (1, len(tokens), 4 * H)
        # layers side by side in ascending id order: [layer 1 | layer 2 | layer 3 | layer 4] per token
        assert np.array_equal(_bits(raw["hidden_states"][0]), stored.reshape(len(tokens), -1))
        normalize_offline_sample(raw, max_len=4096)  # SpecForge's own checks: lengths, consecutive supervision
    # token_freq.pt is what SpecForge counts itself to build its reduced draft vocabulary (vocab_mapping)
    freq = torch.load(dflash_export / "token_freq.pt", weights_only=True)
    assert freq == dict(count_effective_feature_tokens(str(dflash_export)))


def test_specforge_eagle3_final_state_is_normed_with_the_checkpoint_weight(run, eagle3_export, target):
    import torch
    from specforge.algorithms.eagle3.data import build_offline_reader, normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from transformers import AutoModelForCausalLM

    records, states = run
    meta = json.loads((eagle3_export / "export.json").read_text())["trainer"]
    assert meta["specforge"]["aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert meta["layers"]["final_vllm_id"] == N and meta["final_norm"]["weight"] == "model.norm.weight"
    refs = build_offline_reader(str(eagle3_export), run_id="t", ttt_length=1, max_len=4096).read()
    assert len(refs) == len(records)
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.bfloat16)
    worst = 0.0
    for i, rec in enumerate(records):
        raw = load_feature_file(str(eagle3_export / "rows_0-2000" / f"data_{i}.ckpt"))
        tokens, stored = states[rec["sample_id"]]
        assert raw["input_ids"].tolist() == tokens.tolist() == rec["input_ids"][:-1]
        assert raw["aux_hidden_state"].shape == (1, len(tokens), 3 * H) and raw["hidden_state"].shape == (1, len(tokens), H)
        assert np.array_equal(_bits(raw["aux_hidden_state"][0]), stored[:, :3, :].reshape(len(tokens), -1))
        pre = torch.from_numpy(stored[:, 3, :].view(np.int16).copy()).view(torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(raw["hidden_state"][0], hf.model.norm(pre))  # the checkpoint's norm, bit for bit
            out = hf(torch.tensor([tokens.tolist()]), output_hidden_states=True)
        normed = out.hidden_states[-1][0].float()  # transformers' own forward pass, after its final norm
        diff = (raw["hidden_state"][0].float() - normed).abs().max().item()
        worst = max(worst, diff)
        assert diff < 0.05 * normed.abs().max().item()
        assert (raw["hidden_state"][0].float() - pre.float()).abs().max().item() > 0.1  # normed, not as captured
        normalize_offline_sample(raw, max_len=4096)
    print(f"max |exported normed state - transformers hidden_states[-1]|: {worst:.4f}")


def _specforge_train(tmp_path: Path, strategy: str, data: Path, target: Path, draft: dict, extra_model: dict,
                     extra_training: dict) -> list[float]:
    """Run `python -m specforge.cli train` on the CPU for 2 steps with `draft` as the draft config; its losses."""
    import yaml

    (tmp_path / "draft.json").write_text(json.dumps(draft))
    config = {
        "model": {"target_model_path": str(target), "torch_dtype": "bfloat16",
                  "draft_model_config": str(tmp_path / "draft.json"), **extra_model},
        "data": {"hidden_states_path": str(data), "max_length": 512, "dataloader_num_workers": 0,
                 "cache_dir": str(tmp_path / "cache")},
        "training": {"strategy": strategy, "max_steps": 2, "batch_size": 1, "learning_rate": 1e-4,
                     "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD", "log_interval": 1,
                     "save_interval": 100000, "seed": 0, **extra_training},
        "run_id": f"regen-{strategy}", "output_dir": str(tmp_path / "out"),
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
    }
    path = tmp_path / f"{strategy}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "SPECFORGE_DEVICE": "cpu", "TRITON_INTERPRET": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "specforge.cli", "train", "-c", str(path)], capture_output=True,
                          text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [float(x) for x in re.findall(r"step \d+: \{.*?'loss': ([^,}]+)", proc.stdout + proc.stderr)]


def _draft_base(target: Path) -> dict:
    """A one-layer draft config with the tiny target's shapes (SpecForge's shipped ones are for real targets)."""
    cfg = json.loads((target / "config.json").read_text())
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "max_position_embeddings", "rms_norm_eps", "vocab_size", "eos_token_id", "pad_token_id")
    return {**{k: cfg[k] for k in keep}, "num_hidden_layers": 1, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}


def test_specforge_trains_dflash_on_the_export(dflash_export, target, tmp_path):
    meta = json.loads((dflash_export / "export.json").read_text())["trainer"]
    draft = {**_draft_base(target), "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
             "num_target_layers": N, "block_size": 16, "layer_types": ["full_attention"],
             "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
             # the export's own record of its layers, as a user copies it into the draft config
             "dflash_config": {"target_layer_ids": meta["specforge"]["dflash_config.target_layer_ids"]}}
    losses = _specforge_train(tmp_path, "dflash", dflash_export, target, draft, {}, {})
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), losses


def test_specforge_trains_eagle3_on_the_export(eagle3_export, target, tmp_path):
    # A reduced draft vocabulary: SpecForge builds its d2t/t2d mapping from the export's ids and loss masks.
    draft = {**_draft_base(target), "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
             "draft_vocab_size": 256, "rope_theta": 1e6}
    losses = _specforge_train(tmp_path, "eagle3", eagle3_export, target, draft,
                              {"lm_head_key": "model.embed_tokens.weight"},  # the tiny model ties its head
                              {"ttt_length": 2})
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), losses
