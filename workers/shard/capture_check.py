"""The capture checks itself on the engine that made it: a share of the samples re-captured and compared.

Why: on the users' hosts nothing else tells right states from wrong ones (shifted, swapped, foreign or zero
rows pass every other check), and a capture path that goes wrong with the batch does not go wrong the same way
twice. Which samples: one in `every` by a hash of the sample id, plus each engine's `first` samples
(`CheckPolicy`). They are re-captured in a prefill-only batch of their own and compared by app.base.states_compare;
a failure flags the sample `capture_inconsistent` and pauses the run. Details:
docs/capture.md#the-capture-check-on-the-worker.
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
