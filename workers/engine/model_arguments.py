"""Engine arguments chosen from the target model's config, and the vLLM versions a hybrid target needs.

Prefix caching is off in every engine that captures hidden states: a cache hit skips the forward pass, so a
sample's states would be missing or rest on another request's pass. Generation-only engines keep vLLM's
default except where vLLM cannot have it (hybrids without chunked prefill, MTP on the CPU); multimodal
wrappers run `language_model_only`. A hybrid capture engine refuses a vLLM older than the floor that fixed its
states. Why each rule, and where the floor comes from:
docs/workers.md#engine-settings-chosen-from-the-models-config.
"""

from __future__ import annotations

import json
import os

from app.base.architecture import Architecture, read_architecture
from app.base.errors import ConfigError

HYBRID_CAPTURE_MIN_VLLM = (0, 25)


def model_architecture(model_path: str) -> Architecture:
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as fh:
            return read_architecture(json.load(fh))
    except (OSError, ValueError):
        return read_architecture({})


def model_engine_arguments(model_path: str, device: str, capture: bool, speculative: bool = False) -> dict:
    """vLLM arguments this model needs on this device (before the operator's own, which come last)."""
    arch = model_architecture(model_path)
    out: dict = {}
    if capture or (arch.hybrid and device == "cpu") or (speculative and device == "cpu"):
        out["enable_prefix_caching"] = False
    if arch.multimodal:
        out["language_model_only"] = True
    return out


def check_hybrid_capture_vllm(model_path: str, version: str | None = None) -> None:
    """Refuse to capture from a hybrid target on a vLLM older than HYBRID_CAPTURE_MIN_VLLM, in one line."""
    arch = model_architecture(model_path)
    if not arch.hybrid:
        return
    if version is None:
        import vllm

        version = vllm.__version__
    have = tuple(int(x) if x.isdigit() else 0 for x in version.split(".")[:2])
    if have < HYBRID_CAPTURE_MIN_VLLM:
        need = ".".join(map(str, HYBRID_CAPTURE_MIN_VLLM))
        raise ConfigError(f"{model_path} is a hybrid ({arch.model_type}, linear + full attention) and vLLM "
                          f"{version} returns NaN or garbage hidden states for hybrids (fixed by vLLM PR 45849): "
                          f"use vLLM >= {need}")
