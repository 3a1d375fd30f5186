"""The target's final RMSNorm, applied to captured states with the weight read from the checkpoint.

Why: vLLM id N (the last decoder layer's output) is captured *before* the final norm, while SpecForge's EAGLE-3
trains on the state SGLang returns, *after* it (the frozen LM head is applied to it). The norm is recomputed
here exactly as transformers computes it, so the exported state equals transformers' `hidden_states[-1]` for the
same pre-norm input, bit for bit:

- Llama/Qwen2/Qwen3 style: `weight * (x32 * rsqrt(mean(x32^2) + eps)).to(bf16)`.
- Zero-centred (Qwen3-Next, Qwen3.5/3.6): `(x32 * rsqrt(mean(x32^2) + eps) * (1 + weight32)).to(bf16)`.

The weight is read from the checkpoint's safetensors (through `model.safetensors.index.json` when sharded),
found by its name (`model.norm.weight`, or `model.language_model.norm.weight` in multimodal checkpoints).
"""

from __future__ import annotations

import json
import os

from safetensors import safe_open

from app.base.architecture import text_config
from app.base.errors import RegenError

NORM_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight")
ZERO_CENTRED = {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}


class FinalNorm:
    """`FinalNorm(path)(states_bf16)` -> the normed states (torch bf16), as the checkpoint's model computes them."""

    def __init__(self, model_path: str):
        import torch

        cfg_path = os.path.join(model_path, "config.json")
        if not os.path.isfile(cfg_path):
            raise RegenError(f"the final norm's weight is read from the target checkpoint, and {model_path} has "
                             "no config.json (pass the checkpoint folder with export --model)")
        with open(cfg_path, encoding="utf-8") as fh:
            config = json.load(fh)
        text = text_config(config)
        self.eps = float(text.get("rms_norm_eps", 1e-6))
        self.model_type = str(text.get("model_type") or config.get("model_type"))
        self.zero_centred = self.model_type in ZERO_CENTRED
        self.key, file = _find_norm(model_path)
        with safe_open(os.path.join(model_path, file), framework="pt") as st:
            self.weight = st.get_tensor(self.key)
        self.torch = torch

    def __call__(self, x):
        torch = self.torch
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centred:
            return (normed * (1.0 + self.weight.to(torch.float32))).to(x.dtype)
        return self.weight.to(x.dtype) * normed.to(x.dtype)

    def meta(self) -> dict:
        return {"weight": self.key, "eps": self.eps,
                "form": "zero-centred (1 + weight)" if self.zero_centred else "weight * normed"}


def _find_norm(model_path: str) -> tuple[str, str]:
    """(tensor name, safetensors file) of the final norm's weight."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map", {})
        for key in NORM_KEYS:
            if key in weight_map:
                return key, weight_map[key]
    else:
        files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
        for file in files:
            with safe_open(os.path.join(model_path, file), framework="pt") as st:
                names = set(st.keys())
            for key in NORM_KEYS:
                if key in names:
                    return key, file
    raise RegenError(f"{model_path}: no final-norm weight ({' / '.join(NORM_KEYS)}) in its safetensors files")
