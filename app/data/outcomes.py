"""What became of each generated sample, and whether the text exports keep it: one classification for every reader.

Why: the device's hours go into generated tokens, and only the tokens of samples a drafter trains on are the job's
output. `regen stats` splits tokens and engine seconds by outcome and `regen pilot` forecasts trainable tokens per
device-hour; both must classify a record the same way, and "trainable" must mean exactly what `regen export`
keeps by default, so it is computed by the export's own filter (app.data.export.filter_reason with default text
options, per conversation as app.data.export_text.conversation_rows keeps rows), not restated here.

One outcome per record, the first that applies:
- `rejected`: status is not ok (the worker refused it; its tokens, if any, are lost);
- `looped`: ended for repeating one span (`loop_stopped`, set by the engine's loop stop) or flagged `repetition_loop`;
- `cut`: stopped by `max_tokens` (finish `length`, flag `truncated`) or thinking never closed (`missing_think_end`);
- `stub`: an empty or stub answer or empty reasoning (app.quality.STUB_FLAGS);
- `budget_closed`: the thinking budget closed the reasoning (`budget_closed`), then the answer ended normally;
- `complete`: the rest.
A looped, stub or budget-closed sample may still be trainable: the exports keep them unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable

from app.data.export import ExportOptions, filter_reason
from app.data.export_text import conversations
from app.quality import is_stub

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
