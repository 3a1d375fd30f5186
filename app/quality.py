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
- `states_zero` / `states_nonfinite`  captured hidden states all-zero in some layer, or NaN/Inf (every layer is
  checked: on a hybrid the linear-attention layers and the full-attention ones alike)
- `states_repeated`  in some layer most tokens' rows equal the previous (different) token's: a buffer not written
  per token
- `states_stale`     a row of this sample equals, bit for bit, a row an earlier sample had as the state of a
  different token: values left over from another request (uncleared cache blocks, a wrong cache-group index:
  the failure vLLM PR 45849 fixed for hybrids). The same token may get equal rows in two contexts (a shared
  prefix) and is not flagged.
- `capture_mismatch` captured token_ids differ from the record's input_ids[:-1]
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict, deque

import numpy as np
import xxhash

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

STATE_PROBLEMS = {
    "states_zero": "all-zero layer",
    "states_nonfinite": "NaN/Inf in states",
    "states_repeated": "most tokens' rows repeat the previous token's in a layer",
    "states_stale": "rows equal to an earlier sample's rows for other tokens (stale values)",
}
REPEAT_SHARE = 0.5  # a layer with more than this share of rows equal to the previous row is `states_repeated`
_PROBE = 64  # channels compared first; only layers whose probes repeat are compared in full


def repeated_rows(states_u16: np.ndarray, token_ids: np.ndarray | None = None) -> str | None:
    """'states_repeated' when, in some layer, more than REPEAT_SHARE of the tokens' rows equal the previous
    token's bit for bit although the two tokens differ. A token's own embedding runs through every layer, so a
    real forward pass gives different tokens different rows; a capture that broadcast one row, or kept writing
    the same slot, does not. (The same token twice in a row may legitimately round to one row in a small model's
    early layers, so such pairs do not count.) Compares a 64-channel probe of every row, and whole rows only
    where the probes repeat, so it costs a small fraction of `states_problem`."""
    n_tokens = states_u16.shape[0]
    if n_tokens < 4:
        return None
    rows = states_u16.reshape(n_tokens, states_u16.shape[1], -1)
    differ = np.ones(n_tokens - 1, dtype=bool)
    if token_ids is not None and len(token_ids) >= n_tokens:
        ids = np.asarray(token_ids[:n_tokens])
        differ = ids[1:] != ids[:-1]
    limit = REPEAT_SHARE * max(1, int(differ.sum()))
    if differ.sum() < 3:
        return None
    probe = rows[:, :, :_PROBE]
    same = ((probe[1:] == probe[:-1]).all(axis=2) & differ[:, None]).sum(axis=0)  # per layer
    for layer in np.flatnonzero(same > limit):
        full = ((rows[1:, layer] == rows[:-1, layer]).all(axis=1) & differ).sum()
        if full > limit:
            return "states_repeated"
    return None


class StaleRows:
    """Content hashes of a few rows of recent samples, each with the token it is the state of.

    A row is the state of one token in its context: the token's own embedding runs through the residual stream
    of every layer, so two different tokens never get the same row. The same token in two contexts can (a
    shared prefix, or a context whose contribution rounds away in bf16, as in a small random model's early
    layers), so only a row seen before *for a different token* is flagged: a value left over from another
    request. Each sample contributes `positions` rows per layer (spread over its tokens), and the table keeps the
    newest `capacity`; all-zero rows are skipped (`states_zero` covers them). Thread-safe: encoder threads share
    one per process.
    """

    def __init__(self, capacity: int = 1 << 16, positions: int = 16):
        self.capacity, self.positions = capacity, positions
        self._seen: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, token_ids: np.ndarray, states_u16: np.ndarray) -> str | None:
        """'states_stale' if a row of this sample was seen before as another token's state; records its rows."""
        n_tokens = min(len(token_ids), states_u16.shape[0])
        if n_tokens == 0:
            return None
        picks = sorted({round(k * (n_tokens - 1) / max(1, self.positions - 1)) for k in range(self.positions)})
        entries = []
        for t in picks:
            token = int(token_ids[t])
            for layer in range(states_u16.shape[1]):
                row = np.ascontiguousarray(states_u16[t, layer])
                if row.any():
                    entries.append((xxhash.xxh3_64_intdigest(row.tobytes(), seed=layer), token))
        stale = False
        with self._lock:
            for key, token in entries:
                seen = self._seen.get(key)
                if seen is not None and seen != token:
                    stale = True
                self._seen[key] = token
                self._seen.move_to_end(key)
            while len(self._seen) > self.capacity:
                self._seen.popitem(last=False)
        return "states_stale" if stale else None


@functools.lru_cache(maxsize=1)
def process_stale_rows() -> StaleRows:
    """The worker process's StaleRows (built on first use, shared by its encoder threads)."""
    return StaleRows()


def implausible_states(token_ids: np.ndarray, states_u16: np.ndarray, stale: StaleRows | None) -> str | None:
    """The plausibility checks after `states_problem`: repeated rows within the sample, stale rows across samples."""
    return repeated_rows(states_u16, token_ids) or (stale.check(token_ids, states_u16) if stale is not None
                                                     else None)


def layer_detail(states_u16: np.ndarray, layers: list[int], kinds: list[str] | None = None) -> str:
    """Which captured layers are all-zero or non-finite, named with their kind on a hybrid: for messages."""
    out = []
    for k, layer in enumerate(layers):
        problem = states_problem(states_u16[:, k:k + 1])
        if problem:
            kind = f" ({kinds[k]})" if kinds and k < len(kinds) else ""
            out.append(f"vllm layer {layer}{kind}: {STATE_PROBLEMS[problem]}")
    return "; ".join(out)


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
