"""What a caller hands an engine (`GenRequest`) and gets back per finished request (`GenResult`).

Prompts go in as token ids (the chat template is applied by the task, with the manifest's `enable_thinking`),
so `prompt_token_ids + output_token_ids` are exactly what the engine saw and produced; nothing is re-tokenised.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from app.base.errors import ConfigError
from workers.engine.options import EngineOptions


@dataclass
class GenRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict  # temperature, top_p, top_k, min_p, max_tokens, seed, repetition_penalty
    capture: bool = False
    include_output_tokens: bool = True


@dataclass
class GenResult:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    captured_token_ids: np.ndarray | None = None
    captured_states: np.ndarray | None = None  # uint16 bf16 bit patterns [T, L, H]
    seconds: float = 0.0
    # An engine process's engine leaves the capture file for the worker process to read and remove
    # (workers.engine.process).
    capture_path: str | None = None


EngineSpan = tuple[float, float]  # (requests added to vLLM, last one finished there), time.time() seconds


def check_capture_requests(options: EngineOptions, requests: list[GenRequest]) -> None:
    """Refuse a batch that asks for hidden states from an engine built without capture layers."""
    if options.capture_layers is None and any(r.capture for r in requests):
        raise ConfigError("capture requested but this engine was built without capture layers")
