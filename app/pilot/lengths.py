"""The pilot's reasoning and answer lengths, and the `--max-tokens` and `--thinking-budget` they call for.

The budget is the smallest N such that `share` of the thinking samples reason for at most N tokens; max_tokens
the smallest M such that `share` of all samples end within M under that budget. A sample the pilot's own cap cut
has unknown lengths and counts as longer than any figure, so when cut samples reach the quantile there is no
recommendation, only the advice to rerun with a larger --max-tokens. The arithmetic: docs/pilot.md#the-lengths-and-the-settings-they-call-for-apppilotlengthspy.
"""

from __future__ import annotations

import math

DEFAULT_COMPLETE_SHARE = 0.95


def upper_quantile(values: list[float], share: float) -> float | None:
    """The smallest value at or above which no more than 1 - `share` of `values` lie; None when it is unknown
    (an infinite value: a cut sample) or there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    v = ordered[max(0, math.ceil(share * len(ordered)) - 1)]
    return None if math.isinf(v) else v


def _spread(values: list[int]) -> dict:
    if not values:
        return {}
    s = sorted(values)
    return {"median": s[len(s) // 2], "p90": s[int(0.9 * (len(s) - 1))], "p99": s[int(0.99 * (len(s) - 1))],
            "max": s[-1]}


def recommend(lengths: list[list], share: float, pilot_max_tokens: int) -> dict:
    """--thinking-budget and --max-tokens for `share` of the samples (module docstring); `lengths` are measure's."""
    inf = math.inf
    thinking = [row for row in lengths if row[3]]
    budget = upper_quantile([inf if row[4] else row[0] for row in thinking], share) if thinking else None
    b = inf if budget is None else budget
    under = [inf if row[2] else (min(row[0], b) if row[3] else 0) + row[1] for row in lengths]
    cap = upper_quantile(under, share)
    out = {"share": share, "samples": len(lengths), "cut": sum(1 for row in lengths if row[2]),
           "pilot_max_tokens": pilot_max_tokens, "thinking_budget": None if budget is None else int(budget),
           "max_tokens": None if cap is None else int(cap),
           "reasoning": _spread([row[0] for row in thinking if not row[4]]),
           "answer": _spread([row[1] for row in lengths if not row[2]])}
    if cap is not None and lengths:
        m = cap
        out["complete_share"] = sum(1 for row, n in zip(lengths, under, strict=True)
                                    if n <= m and (not row[3] or row[0] <= b)) / len(lengths)
        out["within_max_tokens_share"] = sum(1 for n in under if n <= m) / len(lengths)
    if (thinking and budget is None) or cap is None:
        out["advice"] = (f"{out['cut']} of {len(lengths)} samples were cut at the pilot's --max-tokens "
                         f"{pilot_max_tokens}: their lengths are unknown and reach the {share:.0%} quantile; rerun "
                         "the pilot with a larger --max-tokens")
    return out


def pooled_lengths(pilot: dict) -> list[list]:
    """Every measured candidate's samples' lengths (each candidate ran the same sample)."""
    return [row for entry in pilot["candidates"] for row in (entry.get("measured") or {}).get("lengths") or []]
