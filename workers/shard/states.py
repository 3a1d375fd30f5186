"""A sample's captured states, from the engine to the attempt's file: checked, encoded, and captured again where
they came back broken. Generation (workers.shard.generate, inline capture) and staged capture
(workers.shard.capture_stage) both store states through here, so both check and store them alike.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from app.base.hidden_file import encode_sample
from app.base.manifest import RunSettings
from app.base.quality import implausible_states, process_stale_rows, states_problem
from app.base.states_compare import zero_rows_allowed
from workers.engine.recapture import PREFILL_ONLY
from workers.engine.request import GenRequest, GenResult

if TYPE_CHECKING:
    from workers.process.context import WorkerContext

log = logging.getLogger("regen.generate")


def zero_embedding_ids(settings: dict | RunSettings) -> tuple[int, ...]:
    """The run's token ids whose embedding row is zero (the producer reads them from the checkpoint; runs made
    before it did have none recorded)."""
    return RunSettings.view(settings).zero_embedding_ids


def states_dtype(settings: dict | RunSettings) -> str:
    """The run's stored states dtype (app.base.states_codec); runs made before the setting existed store bf16."""
    return RunSettings.view(settings).states_dtype


def encode_into(hidden_out, sample_id: str, *args, hold_repairable: bool = False,
                **kwargs) -> tuple[list[str], int | None, int]:
    """check_and_encode, then append to the attempt's file (a HiddenFileStream): (flags, position, tokens).
    With `hold_repairable`, states with zero or non-finite rows are not appended (position None): the caller
    captures them again (`repair_states`)."""
    problems, sample = check_and_encode(sample_id, *args, **kwargs)
    if hold_repairable and REPAIRABLE.intersection(problems):
        return problems, None, sample.n_tokens
    return problems, hidden_out.append(sample), sample.n_tokens


# Rows a capture path left zero or non-finite: captured again before anything is stored (`repair_states`).
REPAIRABLE = frozenset({"states_zero", "states_nonfinite"})


def repair_states(ctx: WorkerContext, hidden_out, held: dict[int, tuple[str, list[int], list[str]]],
                  layers: list[int], level: int, stored: str,
                  zero_ids: tuple[int, ...] = ()) -> dict[int, tuple[list[str], int, int, dict]]:
    """Capture again, prefill-only and in a batch of their own, the samples whose states came back with zero or
    non-finite rows, and store the new capture: {position in the caller: (flags, file position, tokens, note)}.

    Why: engines have written zero or NaN rows into captured states (vLLM PRs 45849 and 46301, hybrids: cache
    blocks not cleared, a KV group indexed wrongly), and a fault that depends on the batch a request ran in is gone
    in another one. A sequence's states depend on its ids alone, so a prefill of the ids the record keeps (what
    staged capture does for every sample) gives the states the first capture should have. (A token whose
    embedding row is zero has zero rows for real: `zero_ids`, not repaired.) The new capture goes through
    the same checks; the record's `capture_repaired` names what the first capture had, and a re-capture that is
    wrong too is stored with its flags, as before. `held` maps the caller's position to (sample id, the ids the
    states cover, the first capture's flags)."""
    if not held:
        return {}
    order = sorted(held)
    got: dict[str, GenResult] = {}
    ctx.engine.run([GenRequest(f"repair-{i}", list(held[i][1]), dict(PREFILL_ONLY), capture=True,
                               include_output_tokens=False) for i in order],
                   lambda res: got.__setitem__(res.request_id, res))
    out = {}
    for i in order:
        sample_id, ids, first = held[i]
        res = got.get(f"repair-{i}")
        if res is None or res.captured_states is None:
            raise RuntimeError(f"sample {sample_id}: the re-capture of states with {', '.join(first)} returned none")
        problems, sample = check_and_encode(sample_id, ids, res.captured_token_ids, res.captured_states, layers,
                                            level, trim=True, stored=stored, zero_ids=zero_ids)
        ok = not REPAIRABLE.intersection(problems)
        log.warning("sample %s: the capture had %s; captured again prefill-only: %s", sample_id, ", ".join(first),
                    "clean, stored" if ok else f"{', '.join(problems)} again, stored flagged")
        out[i] = (problems, hidden_out.append(sample), sample.n_tokens,
                  {"first_capture": [p for p in first if p in REPAIRABLE], "ok": ok})
    return out


def check_and_encode(sample_id: str, expected_ids: list[int], captured_ids: np.ndarray, states: np.ndarray,
                     layers: list[int], level: int, trim: bool = False, stored: str = "bf16",
                     zero_ids: tuple[int, ...] = ()):
    """(capture flags, encoded sample) for one finished sample, on an encoder thread.

    The quality gate's checks (all-zero layer, NaN/Inf) read the states as captured, before a lossy `stored`
    dtype quantises them; a sample they flag is stored losslessly (app.base.hidden_file.encode_sample).

    The check reads every state once (~50 ms for a real model's [4000, 5, 5120] sample) and encoding ~0.4 s: both
    run here, several samples at a time, rather than on the engine's single delivery thread, which would otherwise
    cap a worker at a few samples per second of real size. Flags are added to the record when the shard collects
    the results, before anything counts or writes them. `expected_ids` are the record's `input_ids[:-1]`; with
    `trim` (staged capture, whose prefill also covers the last id) only that many captured tokens are checked
    and kept. `zero_ids`: the run's tokens whose embedding is zero, where an all-zero row is the state.
    """
    want = np.asarray(expected_ids, dtype=np.int64)
    if trim:
        captured_ids, states = captured_ids[: len(want)], states[: len(want)]
    problems = []
    if captured_ids.shape != want.shape or not np.array_equal(captured_ids, want):
        problems.append("capture_mismatch")
    problem = (states_problem(states, zero_rows_allowed(captured_ids, zero_ids))
               or implausible_states(captured_ids, states, process_stale_rows()))
    if problem:
        problems.append(problem)
    return problems, encode_sample(sample_id, captured_ids, np.ascontiguousarray(states), layers, level,
                                   stored=stored)
