"""The quality gate: per-sample flags, and the stub-rate window that pauses a run.

A dataset whose responses were 87% empty stubs trained drafters that accepted ~nothing; nobody looked until
after tokenising 914K samples. Every record therefore carries flags, and each worker keeps a sliding window of
its recent samples per run: when the stub-or-empty rate in it crosses the run's threshold, the worker writes
`{run}/PAUSED.json` and every worker stops taking that run's shards until `regen resume-run`.

Flags:
- `empty_reasoning`  thinking mode, `</think>` present, nothing between the think tags
- `missing_think_end` thinking mode, no `</think>` in the output: the whole output is reasoning, the answer empty
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
    """(reasoning, answer), split at the first `</think>`.

    In thinking mode an output that never reached `</think>` is all reasoning and has an empty answer (and
    is flagged `missing_think_end`): the text is the model still thinking, and calling it the answer would put
    `<think>` and half a thought where a trainer expects the reply. Outside thinking mode an output without
    `</think>` is all answer and reasoning is None.
    """
    if THINK_END not in text:
        if not thinking:
            return None, text.strip()
        head = text.strip()
        return (head[len(THINK_START):] if head.startswith(THINK_START) else head).strip(), ""
    head, _, answer = text.partition(THINK_END)
    head = head.strip()
    if head.startswith(THINK_START):
        head = head[len(THINK_START):]
    return head.strip(), answer.strip()


def think_closed(text: str) -> bool:
    """Whether the output reached `</think>`."""
    return THINK_END in text


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
    ids = list(ids)  # plain ints: slices of at most max_period * min_repeats compare in C, with none of numpy's
    n = len(ids)     # per-call overhead, which made this the delivery thread's costliest check on short outputs
    if n < 2:
        return False
    last = ids[-1]
    for p in range(1, max_period + 1):
        span = max(p * min_repeats, min_span)
        if span > n:
            break
        if ids[n - 1 - p] != last:  # a period-p loop repeats the last token p back: most p fail here, cheaply
            continue
        if ids[n - span + p:] == ids[n - span:n - p]:
            return True
    return False


def states_problem(states_u16: np.ndarray) -> str | None:
    """'states_zero' if any layer is all zeros, 'states_nonfinite' if any NaN/Inf, else None (bf16 bits).

    One pass, in blocks of rows that stay in cache: shifting left by one drops the sign bit, so each block's
    column maxima hold every (layer, channel)'s largest magnitude x 2. A magnitude with all exponent bits set
    (>= 0x7F80) is NaN or Inf; a layer whose maxima are all 0 is all (+/-)zero. This runs on every sample beside
    the engine; at a real model's size ([4000, 5, 5120]) it takes ~50 ms where three whole-array passes took ~200.
    """
    if states_u16.size == 0:
        return "states_zero"
    n_tokens, n_layers = states_u16.shape[0], states_u16.shape[1]
    rows = states_u16.reshape(n_tokens, n_layers, -1)
    block = max(1, _STATES_BLOCK_ELEMENTS // rows[0].size)
    top = np.zeros(rows.shape[1:], dtype=np.uint16)
    scratch = np.empty((min(block, n_tokens), *rows.shape[1:]), dtype=np.uint16)
    for start in range(0, n_tokens, block):
        part = rows[start:start + block]
        shifted = np.left_shift(part, 1, out=scratch[:len(part)])
        np.maximum(top, shifted.max(axis=0), out=top)
    if top.max() >= 0x7F80 << 1:
        return "states_nonfinite"
    if not top.any(axis=1).all():
        return "states_zero"
    return None


_STATES_BLOCK_ELEMENTS = 1 << 16  # 128 KiB of uint16 per block: stays in L2


def sample_flags(
    *,
    thinking: bool,
    reasoning: str | None,
    think_closed: bool,
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
        if not think_closed:
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
