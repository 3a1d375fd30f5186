"""The one comparison of two captures of the same tokens, row by row: is `candidate` the states `reference` is?

Shared by the worker's re-capture check, `regen verify --reference` and `regen selfcheck`, so all three judge
alike and print the same line. Three tests, each catching what the others cannot: each row's error relative to
its row under `REL_BOUND` (measured GPU-vs-CPU noise, with margin); each row nearer its own counterpart than
its neighbours (a massive-activation channel hides a shift from the first test); each slot nearer its own
layer. `row_problems` is the check that needs no reference (zero or non-finite rows). Why each test, and how
the bound was measured: docs/capture.md#comparing-two-captures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from app.base.hidden_file import bf16_to_float32

UNIT_ROUNDOFF_BF16 = 2.0 ** -8
REL_BOUND = 32 * UNIT_ROUNDOFF_BF16  # 2^-3: 1.45x the worst GPU-vs-CPU row error measured at 64 x 5120 (docstring)
SEPARATION = 0.5  # a row's distance to its counterpart, as a share of the layer's typical token-to-token step
FORGIVE = 4 * UNIT_ROUNDOFF_BF16  # per value, in the shift and layer tests' distances: 4 bf16 roundings of it
NEIGHBOUR_SHARE = 0.25  # a neighbour judges a row's shift only when its step is this share of the typical or more
LAYER_PROBE_ROWS = 256  # rows the layer test compares across slots (it costs slots^2 passes over them)


@dataclass(frozen=True)
class LayerFigure:
    """One slot's worst figures: the largest relative error and its token, rows that failed the shift test."""

    layer: int
    worst_error: float
    worst_token: int
    shifted_rows: int = 0  # rows nearer a neighbour's reference than their own
    far_rows: int = 0  # rows farther from their counterpart than SEPARATION x the layer's token-to-token step
    holds_layer: int | None = None  # set when the slot's rows are nearer another slot's reference

    def as_dict(self) -> dict:
        return {"layer": self.layer, "worst_error": self.worst_error, "worst_token": self.worst_token,
                "shifted_rows": self.shifted_rows, "far_rows": self.far_rows, "holds_layer": self.holds_layer}


@dataclass(frozen=True)
class Comparison:
    """The verdict of `compare`: ok, one line saying what is wrong (None when ok), the worst figures."""

    ok: bool
    problem: str | None
    layer: int | None  # the worst layer (the failing one when not ok, else the largest error's)
    token: int | None
    error: float  # the largest relative error of any row
    bound: float
    tokens: int = 0
    per_layer: tuple[LayerFigure, ...] = field(default_factory=tuple)

    def line(self) -> str:
        """One line for a log or a report: the problem, or the worst figure against the bound."""
        if self.problem:
            return self.problem
        if self.layer is None:
            return "no rows compared"
        return (f"ok: worst error {self.error:.2g} of the row at layer {self.layer} token {self.token} "
                f"(bound {self.bound:.3g}), {self.tokens} tokens, no row shifted or foreign")

    def layers_line(self) -> str:
        """The worst error per layer, one line: `layer 1 3.1e-05 @12, layer 2 ...`."""
        return ", ".join(f"layer {f.layer} {f.worst_error:.2g} @{f.worst_token}" for f in self.per_layer)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "problem": self.problem, "layer": self.layer, "token": self.token,
                "error": self.error, "bound": self.bound, "tokens": self.tokens,
                "per_layer": [f.as_dict() for f in self.per_layer]}


def as_float(states: np.ndarray) -> np.ndarray:
    """float32 values of bf16 bit patterns (uint16) or of any float array."""
    if states.dtype == np.uint16:
        return bf16_to_float32(np.ascontiguousarray(states))
    return np.asarray(states, dtype=np.float32)


def _row_dist(a: np.ndarray, b: np.ndarray | None, forgive: float = 0.0) -> np.ndarray:
    """||a - b|| (||a|| when b is None) over the last axis, float32 (inf where a value is not finite), in blocks of
    rows so that a 3,000-token sample at width 5120 needs a few MB of scratch, not a copy of itself per distance.
    `forgive` > 0: each value's difference less `forgive` x its magnitude, clipped at 0 (see FORGIVE)."""
    out = np.empty(a.shape[:-1], dtype=np.float32)
    flat_a, flat_out = a.reshape(-1, a.shape[-1]), out.reshape(-1)
    flat_b = b.reshape(-1, b.shape[-1]) if b is not None else None
    block = max(1, _DIST_BLOCK_ELEMENTS // max(1, a.shape[-1]))
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, len(flat_a), block):
            d = flat_a[start:start + block]
            if flat_b is not None:
                x, y = d, flat_b[start:start + block]
                d = x - y
                if forgive:
                    d = np.maximum(np.abs(d) - forgive * np.maximum(np.abs(x), np.abs(y)), 0.0)
            flat_out[start:start + block] = np.sqrt(np.einsum("rh,rh->r", d, d))
    return np.where(np.isnan(out), np.inf, out)


_DIST_BLOCK_ELEMENTS = 1 << 18  # 1 MiB of float32 per block


def compare(reference: np.ndarray, candidate: np.ndarray, layers: Sequence[int] | None = None, *,
            bound: float = REL_BOUND, separation: float = SEPARATION,
            token_ids: Sequence[int] | np.ndarray | None = None) -> Comparison:
    """Judge `candidate` against `reference` (same shape `[T, L, H]`, slots in the same order; see the module
    docstring for the three tests). `layers` names the slots in messages (default 0..L-1); `bound` is the
    largest relative error per row (raise it by a lossy run's promised error when the candidate is stored).
    `token_ids` (the sample's ids, one per row): the far test's typical step is then taken between neighbours
    that are different tokens (a token repeated may give nearly the same row twice); give them where known."""
    if reference.shape != candidate.shape or reference.ndim != 3:
        n_ref = reference.shape[0] if reference.ndim else 0
        n_cand = candidate.shape[0] if candidate.ndim else 0
        problem = (f"{n_cand} rows stored for {n_ref} tokens" if reference.shape[1:] == candidate.shape[1:]
                   else f"shapes differ: {tuple(candidate.shape)} against the reference's {tuple(reference.shape)}")
        return Comparison(False, problem, None, None, math.inf, bound)
    n_tokens, n_slots, _ = reference.shape
    names = [int(x) for x in layers] if layers is not None else list(range(n_slots))
    if len(names) != n_slots:
        raise ValueError(f"{len(names)} layer names for {n_slots} slots")
    if n_tokens == 0:
        return Comparison(True, None, None, None, 0.0, bound)
    ref, cand = as_float(reference), as_float(candidate)

    d_own = _row_dist(cand, ref)  # [T, L]
    ref_norm = _row_dist(ref, None)
    with np.errstate(divide="ignore", invalid="ignore"):
        err = np.where(ref_norm > 0, d_own / ref_norm, np.where(d_own > 0, np.inf, 0.0))

    shifted = np.zeros((n_tokens, n_slots), dtype=bool)
    far = np.zeros((n_tokens, n_slots), dtype=bool)
    if n_tokens >= 2:
        own_f = _row_dist(cand, ref, FORGIVE)  # the shift test's distances forgive rounding per value
        step = _row_dist(ref[1:], ref[:-1], FORGIVE)  # [T-1, L]: reference neighbours' distance
        local = np.zeros((n_tokens, n_slots), dtype=np.float32)  # each row's larger step to a neighbour
        distinct = np.ones(n_tokens - 1, dtype=bool)
        if token_ids is not None and len(token_ids) >= n_tokens:
            ids = np.asarray(token_ids[:n_tokens])
            distinct = ids[1:] != ids[:-1]
        typical = np.zeros(n_slots, dtype=np.float32)  # each layer's median step between different tokens
        for k in range(n_slots):
            moving = step[:, k][(step[:, k] > 0) & distinct]
            typical[k] = float(np.median(moving)) if moving.size else 0.0
        for before, after, offset in ((cand[1:], ref[:-1], 1), (cand[:-1], ref[1:], 0)):
            d_neighbour = _row_dist(before, after, FORGIVE)
            own = own_f[offset:offset + n_tokens - 1]
            # clearly nearer a neighbour (half the distance or less) that is itself clearly another row (a
            # quarter of the layer's typical step or more): a shifted row sits on its neighbour's reference; a
            # right row beside a near-duplicate (a token repeated) is about as near both, and is not judged by it
            telling = step > NEIGHBOUR_SHARE * typical[None, :]
            shifted[offset:offset + n_tokens - 1] |= (2 * d_neighbour < own) & telling & (step > 0)
            np.maximum(local[offset:offset + n_tokens - 1], step, out=local[offset:offset + n_tokens - 1])
        shifted &= np.isfinite(d_own) & (d_own < ref_norm)  # a zero or wild row is the error test's
        for k in range(n_slots):
            if typical[k] > 0:
                far[:, k] = own_f[:, k] > separation * np.maximum(local[:, k], typical[k])
    holds = _layer_test(ref, cand, separation)
    per_layer = []
    for k in range(n_slots):
        t = int(np.argmax(err[:, k]))
        per_layer.append(LayerFigure(names[k], float(err[t, k]), t, int(shifted[:, k].sum()), int(far[:, k].sum()),
                                     names[holds[k]] if holds[k] is not None else None))
    worst_k = int(np.argmax([f.worst_error for f in per_layer]))
    worst = per_layer[worst_k]
    problem, at = _problem(per_layer, err, shifted, far, bound, n_tokens)
    layer, token = (at if at else (worst.layer, worst.worst_token))
    return Comparison(problem is None, problem, layer, token, worst.worst_error, bound, n_tokens, tuple(per_layer))


def _layer_test(ref: np.ndarray, cand: np.ndarray, separation: float) -> list[int | None]:
    """For each slot, the other slot whose reference its rows match (median distance over probe rows nearer it
    than the slot's own, and under `separation` x that slot's token-to-token step: a shifted slot is near no
    slot and is the shift test's), else None."""
    n_tokens, n_slots, _ = ref.shape
    if n_slots < 2:
        return [None] * n_slots
    rows = np.unique(np.linspace(0, n_tokens - 1, min(n_tokens, LAYER_PROBE_ROWS)).round().astype(int))
    r, c = ref[rows], cand[rows]
    out: list[int | None] = []
    for k in range(n_slots):
        medians = [float(np.median(_row_dist(c[:, k], r[:, j], FORGIVE))) for j in range(n_slots)]
        nearest = int(np.argmin(medians))
        step = (float(np.median(_row_dist(r[1:, nearest], r[:-1, nearest], FORGIVE))) if len(rows) > 1
                else math.inf)
        out.append(nearest if medians[nearest] < medians[k] and medians[nearest] < separation * step else None)
    return out


def _problem(per_layer, err, shifted, far, bound, n_tokens) -> tuple[str | None, tuple[int, int] | None]:
    """The first failed test as one line, with the (layer, token) it names."""
    for f in per_layer:
        if f.holds_layer is not None:
            return (f"the slot of layer {f.layer} holds layer {f.holds_layer}'s states (swapped or mislabelled "
                    f"layers)"), (f.layer, 0)
    for k, f in enumerate(per_layer):
        if f.shifted_rows:
            t = int(np.flatnonzero(shifted[:, k])[0])
            return (f"layer {f.layer}: {f.shifted_rows} of {n_tokens} rows nearer a neighbouring token's reference "
                    f"than their own (first at token {t}): states shifted"), (f.layer, t)
    for k, f in enumerate(per_layer):
        if f.worst_error > bound or not math.isfinite(f.worst_error):
            over = int((~(err[:, k] <= bound)).sum())
            return (f"layer {f.layer} token {f.worst_token}: error {f.worst_error:.3g} of the row (bound "
                    f"{bound:.3g}; {over} of {n_tokens} rows over it)"), (f.layer, f.worst_token)
    for k, f in enumerate(per_layer):
        if f.far_rows:
            t = int(np.flatnonzero(far[:, k])[0])
            return (f"layer {f.layer}: {f.far_rows} of {n_tokens} rows as far from their reference as another "
                    f"token's state (first at token {t}): foreign or stale rows"), (f.layer, t)
    return None, None


@dataclass(frozen=True)
class RowProblem:
    """A zero or non-finite row inside a layer: the kind (the quality flag), the first row, how many."""

    kind: str  # "states_zero" | "states_nonfinite"
    slot: int
    token: int
    rows: int  # such rows in that slot
    tokens: int

    def line(self, layers: Sequence[int] | None = None) -> str:
        name = layers[self.slot] if layers is not None else self.slot
        what = "all-zero" if self.kind == "states_zero" else "non-finite (NaN/Inf)"
        whole = " (the whole layer)" if self.rows == self.tokens else ""
        return f"layer {name}: {self.rows} of {self.tokens} rows {what}{whole}, first at token {self.token}"


def zero_rows_allowed(token_ids, zero_embedding_ids) -> np.ndarray | None:
    """`row_problems`' `zero_ok` for a sample's ids: True at the tokens whose embedding is zero (None: none)."""
    if not zero_embedding_ids or token_ids is None:
        return None
    return np.isin(np.asarray(token_ids), np.asarray(list(zero_embedding_ids)))


_ROWS_BLOCK_ELEMENTS = 1 << 16  # 128 KiB of uint16 per block: stays in L2


def row_problems(states: np.ndarray, zero_ok: np.ndarray | None = None) -> RowProblem | None:
    """The first zero or non-finite row inside any layer of `[T, L, H]` states (bf16 bits or floats), else None.
    `zero_ok`: a boolean per token, True where an all-zero row is the token's state (its input embedding is zero,
    app.base.model_info.zero_embedding_ids; `zero_rows_allowed` builds it from the ids).

    Non-finite rows are reported before zero ones. On bf16 bits it is one pass in cache-sized blocks: shifting
    left by one drops the sign, so a row's maximum is its largest magnitude x 2; 0 means an all-(+/-)zero row,
    0x7F80 << 1 or more an Inf or NaN in it (the cost of the old per-layer check, now per row).
    """
    if states.ndim != 3 or states.shape[0] == 0:
        return None
    n_tokens, n_slots = states.shape[:2]
    if states.dtype == np.uint16:
        top = np.empty((n_tokens, n_slots), dtype=np.uint16)
        block = max(1, _ROWS_BLOCK_ELEMENTS // max(1, states[0].size))
        scratch = np.empty((min(block, n_tokens), *states.shape[1:]), dtype=np.uint16)
        for start in range(0, n_tokens, block):
            part = states[start:start + block]
            top[start:start + len(part)] = np.left_shift(part, 1, out=scratch[:len(part)]).max(axis=2)
        nonfinite, zero = top >= (0x7F80 << 1), top == 0
    else:
        values = np.asarray(states)
        nonfinite = ~np.isfinite(values).all(axis=2)
        zero = ~(values != 0).any(axis=2)
    if zero_ok is not None:
        zero &= ~np.asarray(zero_ok, dtype=bool)[:n_tokens, None]
    for kind, bad in (("states_nonfinite", nonfinite), ("states_zero", zero)):
        if bad.any():
            slot = int(np.flatnonzero(bad.any(axis=0))[0])
            return RowProblem(kind, slot, int(np.flatnonzero(bad[:, slot])[0]), int(bad[:, slot].sum()), n_tokens)
    return None
