"""Loops stopped in the engine: a vLLM logits processor that ends a request whose output has started repeating one
span, instead of letting it run to `max_tokens`.

vLLM has no stop condition that sees the output as ids, so the processor checks a request's output every `every`
tokens with the quality gate's own test (app.base.quality.repetition_loop) and then forces the end-of-turn id. vLLM
refuses custom logits processors under any speculative config (inline capture, MTP), so loops are stopped in
runs captured `staged` or `off` without `--speculative`, and only flagged elsewhere. A request asks for it in
`SamplingParams.extra_args[LOOP_STOP_ARG]` (app.base.loops.stop_request). Details and figures:
docs/formats.md#ids-the-engine-forced-thinking-budget-and-loop-stop.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from app.base.loops import CHECK_EVERY, LOOP_STOP_ARG, MAX_PERIOD
from app.base.quality import repetition_loop


class LoopStop(LogitsProcessor):
    """Per row: the request's live output list and its settings; forces its end-of-turn id once it loops."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.rows: dict[int, tuple[list[int], int, int, int]] = {}  # row -> (output ids, min_repeats, eos, every)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt, output in batch_update.added:
            asked = (params.extra_args or {}).get(LOOP_STOP_ARG) if params is not None else None
            if asked:
                self.rows[index] = (output, int(asked["min_repeats"]), int(asked["eos"]), int(asked.get("every", CHECK_EVERY)))
            else:
                self.rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            first, second = self.rows.pop(a, None), self.rows.pop(b, None)
            if first is not None:
                self.rows[b] = first
            if direction == MoveDirectionality.SWAP and second is not None:
                self.rows[a] = second

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (output, min_repeats, eos, every) in self.rows.items():
            n = len(output)
            if n == 0 or n % every or row >= logits.shape[0]:
                continue
            if repetition_loop(output[-MAX_PERIOD * min_repeats:], min_repeats):
                logits[row].fill_(float("-inf"))
                logits[row, eos] = 0.0
        return logits
