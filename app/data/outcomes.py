"""What became of each generated sample, and whether the text exports keep it: one classification for every reader.

`regen stats` splits tokens and engine seconds by outcome and `regen pilot` forecasts trainable tokens per
device-hour; both classify a record the same way, and "trainable" is computed by the export's own filter, so it
means exactly what `regen export` keeps by default. One outcome per record, the first that applies: rejected,
looped, cut, stub, budget_closed, complete. The rules: docs/checking.md#outcomes-what-became-of-each-sample-appdataoutcomespy.
"""

from __future__ import annotations

from collections.abc import Iterable

from app.base.quality import is_stub
from app.data.export import ExportOptions, filter_reason
from app.data.export_text import conversations

OUTCOMES = ("complete", "budget_closed", "cut", "looped", "stub", "rejected")
CUT_FLAGS = frozenset({"truncated", "missing_think_end"})
DEFAULT_TEXT_EXPORT = ExportOptions("sharegpt")  # `regen export`'s defaults; every text format filters alike


def outcome(rec: dict) -> str:
    """The record's outcome (see the module docstring)."""
    if rec.get("status") != "ok":
        return "rejected"
    flags = set(rec.get("flags") or ())
    if rec.get("loop_stopped") or "repetition_loop" in flags:
        return "looped"
    if rec.get("finish_reason") == "length" or flags & CUT_FLAGS:
        return "cut"
    if is_stub(flags):
        return "stub"
    if rec.get("budget_closed"):
        return "budget_closed"
    return "complete"


def trainable(records: Iterable[dict]) -> list[bool]:
    """For each record (one shard's, in order), whether a default text export keeps its tokens: its conversation's
    ok turns up to the first rejected one, all of them passing the export's filter."""
    out: list[bool] = []
    for group in conversations(records):
        turns = 0
        while turns < len(group) and group[turns].get("status") == "ok":
            turns += 1
        kept = turns > 0 and all(filter_reason(r, DEFAULT_TEXT_EXPORT) is None for r in group[:turns])
        out += [kept] * turns + [False] * (len(group) - turns)
    return out
