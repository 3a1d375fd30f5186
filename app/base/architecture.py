"""What kind of language model a checkpoint holds, read from its config.json without loading it.

Qwen3.5/3.6 (and Qwen3-Next) are *hybrids*: most decoder layers are Gated DeltaNet linear attention and every
fourth is full attention, named per layer in the language model's `layer_types`. Their released checkpoints are
multimodal wrappers (`Qwen3_5ForConditionalGeneration`) whose language model's settings sit under `text_config`.
Engine arguments (workers.engine.model_arguments), the quality gate and `regen verify` need to know both facts; this
module is the one place that reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


@dataclass(frozen=True)
class Architecture:
    architectures: tuple[str, ...]
    model_type: str
    multimodal: bool  # the language model sits under text_config (a wrapper with a vision tower)
    layer_types: tuple[str, ...] | None  # per decoder layer, when the config names them

    @property
    def hybrid(self) -> bool:
        return bool(self.layer_types and LINEAR_ATTENTION in self.layer_types) or (
            self.layer_types is None and self.model_type in HYBRID_MODEL_TYPES)

    def layer_kind(self, vllm_id: int) -> str:
        """The kind of decoder layer whose output vLLM id L is (layer L-1, app.base.layers)."""
        if not self.layer_types or not 1 <= vllm_id <= len(self.layer_types):
            return FULL_ATTENTION
        return self.layer_types[vllm_id - 1]


def text_config(config: dict) -> dict:
    """The language model's settings of a parsed config.json: under `text_config` in a multimodal wrapper
    (Qwen3.5/3.6's released checkpoints), the file itself otherwise. The one place that unwraps it."""
    return config.get("text_config") or config


def read_architecture(config: dict) -> Architecture:
    """The Architecture of a parsed config.json (the whole file, wrapper included)."""
    text = text_config(config)
    types = text.get("layer_types")
    if not types and text.get("full_attention_interval"):  # Qwen3-Next names the interval instead
        every = int(text["full_attention_interval"])
        types = [FULL_ATTENTION if (k + 1) % every == 0 else LINEAR_ATTENTION
                 for k in range(int(text.get("num_hidden_layers", 0)))]
    return Architecture(
        architectures=tuple(config.get("architectures") or ()),
        model_type=str(text.get("model_type") or config.get("model_type") or "?"),
        multimodal="text_config" in config,
        layer_types=tuple(str(t) for t in types) if types else None,
    )
