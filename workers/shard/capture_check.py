"""The capture checks itself on the engine that made it: a share of the samples re-captured and compared.

Why: on the users' hosts nothing else tells right states from wrong ones. The stored `token_ids` are the engine's
bookkeeping and always match; the states always have one row per id; states shifted by a token, two layers
swapped, rows of another request or zero rows inside a layer pass every other check a worker can make without
the target loaded in transformers. What a worker can do is capture the same ids again, on its own engine, in
another batch, and see whether it gets the same states: a capture path that goes wrong with the batch (the
positions of a request inside a batch, chunked against one-shot prefill, async scheduling's extra step, a KV
group indexed wrongly, cache blocks not cleared) does not go wrong the same way twice.

Which samples (`CheckPolicy`, the run's `capture_check` setting, `regen produce --capture-check-every`):
- one in `every` samples (default 100), chosen by a hash of the sample id, so every worker of the run picks the
  same ones and a re-run checks the same samples again;
- the first `first` samples (default 4) every engine captures, whatever their ids: a new engine (a new host, a
  new vLLM, a restarted worker) is proven on its first shard, not after a hundred samples.

How: each chosen sample's stored ids (the record's `input_ids[:-1]`, what its states cover) go through a
prefill-only pass (max_tokens=1) on the worker's own engine, all of a shard's chosen samples in one batch of
their own once the shard's generation is done: generation captured them beside the shard's other requests
and decode steps (prompt rows in a prefill, response rows one decode step at a time), the re-capture takes them
in one prefill beside the other re-checks only. Staged capture is already a prefill: its re-check batch holds
only the chosen samples, where the stage's batch held the whole shard. The re-capture is compared with what the
worker stores (before a lossy codec: the check is of the capture, the codec has its own bound) by
app.states_compare.compare: each row's error relative to its row under the bf16 bound, each row nearer its own
counterpart than its neighbours (a massive-activation channel cannot hide a shift), each slot nearer its own
layer, no zero or non-finite row. An engine's first samples are also sent twice in that batch: equal requests
must give equal states.

A sample that fails is flagged `capture_inconsistent` with the comparison on its record (`capture_check`: the
worst layer, token and error), the shard's marker counts the checks, and the run is paused as the stub gate
pauses it (workers.shard.task_guards.pause_on_capture_check), naming the worker and its engine mode.
"""

from __future__ import annotations

import time

from workers.engine.recapture import (
    CheckOutcome,
    Pending,
    recheck,
)

FLAG = "capture_inconsistent"



def run_checks(ctx, items: list[Pending], layers: list[int]) -> list[CheckOutcome]:
    """`recheck` on the worker's engine, counted on its `EngineChecks`."""
    if not items:
        return []
    t0 = time.monotonic()
    outcomes = recheck(ctx.engine, items, layers)
    ctx.capture_checks.count(outcomes, time.monotonic() - t0)
    return outcomes


def mark(record: dict, outcome: CheckOutcome) -> None:
    """The outcome on the sample's record (`capture_check`), and its flag when it failed."""
    record["capture_check"] = outcome.as_record()
    if not outcome.ok and FLAG not in record["flags"]:
        record["flags"].append(FLAG)


def summary(outcomes: list[CheckOutcome]) -> dict:
    """A shard's checks for its marker: how many, how many failed, the first failure."""
    failed = [o for o in outcomes if not o.ok]
    out: dict = {"checked": len(outcomes), "failed": len(failed)}
    if failed:
        out["first_failure"] = {"sample_id": failed[0].sample_id, **failed[0].as_record()}
    return out
