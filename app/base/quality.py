"""The quality gate: per-sample flags, and the stub-rate window that pauses a run.

Why: empty stubs train drafters that accept nothing, and nobody looks until it is too late. So every record
carries flags (empty or stub answers, truncation, loops, zero/non-finite/repeated/stale states, a capture
mismatch), and each worker keeps a sliding window of its recent samples per run: when the stub-or-empty rate
in it crosses the run's threshold, the worker writes `{run}/PAUSED.json` until `regen resume-run`. Every flag
and the story behind the gate: docs/checking.md#every-flag.
"""

from __future__ import annotations

import functools
import threading
from collections import deque

import numpy as np
import xxhash

from app.base.states_compare import row_problems

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


def states_problem(states_u16: np.ndarray, zero_ok: np.ndarray | None = None) -> str | None:
    """'states_nonfinite' if any row holds a NaN/Inf, 'states_zero' if any row of any layer is all zeros (an empty
    array too), else None (bf16 bits). One pass in cache-sized blocks (app.base.states_compare.row_problems): at a real
    model's size ([3000, 5, 5120]) the cost of the per-layer check it replaced (bench/bench_row_checks.py)."""
    if states_u16.size == 0:
        return "states_zero"
    problem = row_problems(states_u16.reshape(states_u16.shape[0], states_u16.shape[1], -1), zero_ok)
    return problem.kind if problem else None


STATE_PROBLEMS = {
    "states_zero": "all-zero rows",
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
    """Content hashes of the rows of recent samples, each with the token it is the state of.

    A row is the state of one token in its context: the token's own embedding runs through the residual stream
    of every layer, so two different tokens never get the same row. The same token in two contexts can (a
    shared prefix, or a context whose contribution rounds away in bf16, as in a small random model's early
    layers), so only a row seen before *for a different token* is flagged: a value left over from another
    request. Every row of every layer is hashed (`positions` > 0 hashes only that many rows a sample, spread over
    its tokens: the old probe, which found one stale row of a 3,000-token sample with a chance of about
    (16/3000)^2); all-zero rows are skipped (`states_zero` covers them).

    The table is `capacity` slots (16 bytes each: 32 MiB at the default, ~140 samples of 3,000 tokens x 5
    layers). A row's key may sit in either of two slots (the two halves of its hash) and goes into the one
    written by the older sample, so the newest rows stay: a row is lost early only when both its slots were
    taken by newer ones. A sample's lookup is two gathers per row, not a binary search per row in each of the
    sorted runs this replaced (~1.5 ms of a worker's side CPU per tiny sample, docs/performance.md).
    Thread-safe: encoder threads share one per process.
    """

    def __init__(self, capacity: int = 1 << 21, positions: int = 0):
        self.capacity, self.positions = capacity, positions
        # key 0: an empty slot; sample: which sample wrote the slot (1, 2, ...); one slot is one 16-byte record,
        # so a lookup costs one cache line
        self._table = np.zeros(capacity, dtype=SLOT)
        self._written = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(np.count_nonzero(self._table["sample"]))

    def check(self, token_ids: np.ndarray, states_u16: np.ndarray) -> str | None:
        """'states_stale' if a row of this sample was seen before as another token's state; records its rows."""
        n_tokens = min(len(token_ids), states_u16.shape[0])
        if n_tokens == 0:
            return None
        if self.positions:
            picks = np.array(sorted({round(k * (n_tokens - 1) / max(1, self.positions - 1))
                                     for k in range(self.positions)}))
        else:
            picks = None
        keys, tokens = row_keys(states_u16[:n_tokens], picks, np.asarray(token_ids[:n_tokens], dtype=np.int64))
        keys, tokens = keys[keys != 0], tokens[keys != 0].astype(np.int32)
        order = np.argsort(keys, kind="stable")
        same = keys[order][1:] == keys[order][:-1]
        stale = bool((same & (tokens[order][1:] != tokens[order][:-1])).any())  # within this sample
        first, second = keys % self.capacity, (keys >> np.uint64(32)) % self.capacity
        with self._lock:
            one, two = self._table[first], self._table[second]
            for slot in (one, two):
                if ((slot["key"] == keys) & (slot["token"] != tokens)).any():
                    stale = True
            self._add(keys, tokens, (first, one), (second, two))
        return "states_stale" if stale else None

    def _add(self, keys: np.ndarray, tokens: np.ndarray, first: tuple, second: tuple) -> None:
        """Each key into the slot of its two that holds it already, else the one the older sample wrote; a key
        that lost its slot to another key of this sample takes its other slot unless this sample wrote that."""
        if not len(keys):
            return
        (at1, one), (at2, two) = first, second
        self._written += 1
        new = np.empty(len(keys), dtype=SLOT)
        new["key"], new["token"], new["sample"] = keys, tokens, self._written
        target = np.where(one["key"] == keys, at1,
                          np.where(two["key"] == keys, at2, np.where(one["sample"] <= two["sample"], at1, at2)))
        self._table[target] = new
        lost = self._table["key"][target] != keys
        if lost.any():
            other = np.where(target == at1, at2, at1)[lost]
            free = self._table["sample"][other] != self._written
            self._table[other[free]] = new[lost][free]


SLOT = np.dtype([("key", "<u8"), ("token", "<i4"), ("sample", "<u4")])


def row_keys(states_u16: np.ndarray, picks: np.ndarray | None, token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(64-bit key, token) of every row at `picks` (None: every row) in every layer, all-(+)zero rows left out (the
    layer is the hash's seed, so the same values in two layers are two keys). Rows of up to `NARROW_ROW` bytes
    (a small model's) are hashed together in numpy (`narrow_row_keys`); wider ones by one xxh3 call each, where
    they lie: no copy of the sample."""
    n_tokens, n_layers = states_u16.shape[0], states_u16.shape[1]
    rows = states_u16.reshape(n_tokens, n_layers, -1)
    if picks is not None or not rows.flags.c_contiguous:
        rows = np.ascontiguousarray(rows[picks if picks is not None else slice(None)])
    width = rows.shape[2] * 2
    tokens = np.repeat(token_ids if picks is None else token_ids[picks], n_layers)
    if width <= NARROW_ROW and width % 8 == 0:
        words = rows.view(np.uint64)
        keep = words.any(axis=2).reshape(-1)
        return narrow_row_keys(words)[keep], tokens[keep]
    flat = memoryview(rows.reshape(-1).view(np.uint8))
    keys = np.fromiter((xxhash.xxh3_64_intdigest(flat[i * width:(i + 1) * width], seed=i % n_layers)
                        for i in range(rows.shape[0] * n_layers)), dtype=np.uint64, count=rows.shape[0] * n_layers)
    zero = np.array([xxhash.xxh3_64_intdigest(bytes(width), seed=k) for k in range(n_layers)], dtype=np.uint64)
    keep = keys != np.tile(zero, rows.shape[0])
    return keys[keep], tokens[keep]


# Row width (bytes) up to which `narrow_row_keys` hashes: one xxh3 call a row costs ~0.35 us of Python beside the
# hash, numpy's ~4 ns a 64-bit word (0.1 against 0.3 ms for a tiny model's 870 rows of 256 bytes).
NARROW_ROW = 1024
_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_SHIFTS = (np.uint64(30), np.uint64(27), np.uint64(31))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, in place on uint64 (wrapping arithmetic)."""
    x ^= x >> _SHIFTS[0]
    x *= _MIX[1]
    x ^= x >> _SHIFTS[1]
    x *= _MIX[2]
    x ^= x >> _SHIFTS[2]
    return x


def narrow_row_keys(words: np.ndarray) -> np.ndarray:
    """A 64-bit key per row of `words` [tokens, layers, words] (uint64), token-major: each word mixed with its
    position (splitmix64), the mixes summed, the sum mixed with the layer. Equal rows of one layer get equal
    keys; two different rows the same key with a chance of about 2^-64."""
    x = words + (np.arange(words.shape[2], dtype=np.uint64) + np.uint64(1)) * _MIX[0]
    summed = _mix(x).sum(axis=2, dtype=np.uint64)
    summed += (np.arange(words.shape[1], dtype=np.uint64) + np.uint64(1)) * _MIX[1]
    return _mix(summed).reshape(-1)


@functools.lru_cache(maxsize=1)
def process_stale_rows() -> StaleRows:
    """The worker process's StaleRows (built on first use, shared by its encoder threads)."""
    return StaleRows()


def implausible_states(token_ids: np.ndarray, states_u16: np.ndarray, stale: StaleRows | None) -> str | None:
    """The plausibility checks after `states_problem`: repeated rows within the sample, stale rows across samples."""
    return repeated_rows(states_u16, token_ids) or (stale.check(token_ids, states_u16) if stale is not None
                                                     else None)


def layer_detail(states_u16: np.ndarray, layers: list[int], kinds: list[str] | None = None,
                 zero_ok: np.ndarray | None = None) -> str:
    """Which captured layers have all-zero or non-finite rows (how many, the first token), named with their
    kind on a hybrid: for messages."""
    out = []
    for k, layer in enumerate(layers):
        problem = row_problems(states_u16[:, k:k + 1].reshape(states_u16.shape[0], 1, -1), zero_ok)
        if problem:
            kind = f" ({kinds[k]})" if kinds and k < len(kinds) else ""
            if problem.kind == "states_zero" and problem.rows == problem.tokens:
                what = "all-zero layer"
            else:
                what = (f"{'all-zero' if problem.kind == 'states_zero' else 'NaN/Inf in'} {problem.rows} of "
                        f"{problem.tokens} rows, first at token {problem.token}")
            out.append(f"vllm layer {layer}{kind}: {what}")
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
