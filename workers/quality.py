"""The quality gate: per-sample flags, and the stub-rate window that pauses a run.

A dataset whose responses were 87% empty stubs trained drafters that accepted ~nothing; nobody looked until
after tokenising 914K samples. Every record therefore carries flags, and each worker keeps a sliding window of
its recent samples per run: when the stub-or-empty rate in it crosses the run's threshold, the worker writes
`{run}/PAUSED.json` and every worker stops taking that run's shards until `regen resume-run`.

Flags:
- `empty_reasoning`  thinking mode, `</think>` present, nothing between the think tags
- `missing_think_end` thinking mode, no `</think>` in the output
- `empty_answer`     nothing after `</think>` (or no output at all) although generation stopped on its own
- `stub_answer`      a handful of answer tokens (<= stub_max_answer_tokens), like `OK.`
- `truncated`        finish_reason == "length"
- `repetition_loop`  the output ends in an n-gram repeated many times
- `states_zero` / `states_nonfinite`  captured hidden states all-zero in some layer, or NaN/Inf
- `capture_mismatch` captured token_ids differ from the record's input_ids[:-1]
"""

from __future__ import annotations

from collections import deque

import numpy as np

STUB_FLAGS = frozenset({"empty_reasoning", "empty_answer", "stub_answer"})
THINK_END = "</think>"
THINK_START = "<think>"


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning, answer). Reasoning is None when the output has no `</think>`."""
    if THINK_END not in text:
        return None, text.strip()
    head, _, answer = text.partition(THINK_END)
    head = head.strip()
    if head.startswith(THINK_START):
        head = head[len(THINK_START):]
    return head.strip(), answer.strip()


def answer_token_count(output_ids: list[int], think_end_id: int | None, eos_ids: set[int], answer: str) -> int:
    """Tokens after `</think>`, not counting end-of-turn tokens; 0 for an empty answer."""
    if not answer:
        return 0
    if think_end_id is not None and think_end_id in output_ids:
        idx = len(output_ids) - 1 - output_ids[::-1].index(think_end_id)
        tail = output_ids[idx + 1:]
    else:
        tail = output_ids
    return sum(1 for t in tail if t not in eos_ids)


def repetition_loop(ids: list[int], min_repeats: int, max_period: int = 64, min_span: int = 16) -> bool:
    """True when the sequence ends with some period-p block repeated at least `min_repeats` times."""
    n = len(ids)
    if n < 2:
        return False
    last = ids[-1]
    arr = None
    for p in range(1, max_period + 1):
        span = max(p * min_repeats, min_span)
        if span > n:
            break
        if ids[n - 1 - p] != last:  # a period-p loop repeats the last token p back: most p fail here, cheaply
            continue
        if arr is None:
            arr = np.asarray(ids, dtype=np.int64)
        tail = arr[n - span:]
        if np.array_equal(tail[p:], tail[:-p]):
            return True
    return False


def states_problem(states_u16: np.ndarray) -> str | None:
    """'states_zero' if any layer is all zeros, 'states_nonfinite' if any NaN/Inf, else None (bf16 bits)."""
    if states_u16.size == 0:
        return "states_zero"
    exponent_all_ones = (states_u16 & 0x7F80) == 0x7F80
    if exponent_all_ones.any():
        return "states_nonfinite"
    magnitude = states_u16 & 0x7FFF
    per_layer_nonzero = magnitude.reshape(states_u16.shape[0], states_u16.shape[1], -1).any(axis=(0, 2))
    if not per_layer_nonzero.all():
        return "states_zero"
    return None


def sample_flags(
    *,
    thinking: bool,
    reasoning: str | None,
    answer: str,
    answer_tokens: int,
    finish_reason: str | None,
    output_ids: list[int],
    quality,
) -> list[str]:
    flags: list[str] = []
    truncated = finish_reason == "length"
    if truncated:
        flags.append("truncated")
    if thinking:
        if reasoning is None:
            flags.append("missing_think_end")
        elif reasoning == "":
            flags.append("empty_reasoning")
    if not truncated:  # a cut-off output is `truncated`, not a stub
        if answer_tokens == 0:
            flags.append("empty_answer")
        elif answer_tokens <= quality.stub_max_answer_tokens:
            flags.append("stub_answer")
    if repetition_loop(output_ids, quality.repetition_min_repeats):
        flags.append("repetition_loop")
    return flags


def is_stub(flags) -> bool:
    return bool(STUB_FLAGS.intersection(flags))


class StubWindow:
    """A sliding window of recent samples of one run, seen by this worker."""

    def __init__(self, size: int):
        self.values: deque[bool] = deque(maxlen=size)

    def add(self, stub: bool) -> None:
        self.values.append(stub)

    @property
    def rate(self) -> float:
        return sum(self.values) / len(self.values) if self.values else 0.0

    def should_pause(self, threshold: float, min_samples: int) -> bool:
        return len(self.values) >= min_samples and self.rate >= threshold
