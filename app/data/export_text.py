"""Text exports that keep what the model saw: one row per conversation, every turn the template rendered.

A trainer that re-tokenises text rebuilds the prompt from the row, so a row holds everything the template was
given (system turn, tools, tool calls and responses, earlier reasoning); re-rendering it gives the record's
prompt ids exactly. One row per conversation, not per record, so the trainers do not supervise early turns
again and again. Formats: `sharegpt` and `specforge-jsonl` (also joined into one `regenerated.jsonl`). What
each row holds and what is left out, and why: docs/formats.md#text-exports-one-row-per-conversation.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

import orjson

from app.base.manifest import RunSettings
from app.base.records import conversation_id, prompt_id
from app.base.thinking_modes import record_thinking

UNTERMINATED = "unterminated_thinking"
SPECFORGE_FILE = "regenerated.jsonl"  # app.data.export_formats names it as the format's one file
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}
_THINK_MARKERS = ("<think>", "</think>")


def unterminated_reason(rec: dict, include_unterminated: bool) -> str | None:
    """`unterminated_thinking` for an ok record whose thinking never ended, unless asked to keep those."""
    if not include_unterminated and "missing_think_end" in (rec.get("flags") or ()):
        return UNTERMINATED
    return None


def conversations(records: Iterable[dict]) -> Iterator[list[dict]]:
    """Consecutive records of one conversation (a multi-turn run's turns; else each record alone)."""
    group: list[dict] = []
    for rec in records:
        if group and conversation_id(rec) != conversation_id(group[0]):
            yield group
            group = []
        group.append(rec)
    if group:
        yield group


def conversation_rows(fmt: str, records: Iterable[dict], reason: Callable[[dict], str | None],
                      settings: dict) -> tuple[list[dict], Counter]:
    """(rows, left-out counts) for one shard's records; `reason(rec)` says why a record is left out (or None)."""
    rows: list[dict] = []
    counts: Counter = Counter()
    for group in conversations(records):
        turns = []
        for rec in group:  # the ok prefix: a rejected turn ends the conversation
            if rec.get("status") != "ok":
                break
            turns.append(rec)
        if not turns:
            counts[reason(group[0]) or f"status:{group[0].get('status')}"] += 1
            continue
        for rec in group[len(turns):]:
            counts[f"cut_turn:status:{rec.get('status')}"] += 1
        why = next((r for r in map(reason, turns) if r), None)
        if why is None:
            row, why = (sharegpt_row(turns[-1], settings), None) if fmt == "sharegpt" else specforge_row(turns[-1], settings)
            if why is None:
                rows.append(row)
                continue
        counts[why] += 1
    return rows, counts


def final_turn(rec: dict) -> dict:
    """The record's generated turn as an OpenAI message (reasoning apart, as the trainers want it)."""
    turn = {"role": "assistant", "content": rec["answer"]}
    if rec.get("reasoning"):
        turn["reasoning_content"] = rec["reasoning"]
    return turn


def sharegpt_row(rec: dict, settings: dict) -> dict:
    turns = [_sharegpt_turn(m) for m in rec.get("messages") or []]
    turns.append({"from": "gpt", "value": rec["answer"], "reasoning_content": rec.get("reasoning")})
    row = {"id": conversation_id(rec), "prompt_id": prompt_id(rec), "conversations": turns,
           "finish_reason": rec.get("finish_reason")}
    row["thinking"] = record_thinking(rec, settings)
    if rec.get("tools"):
        row["tools"] = json.dumps(rec["tools"], ensure_ascii=False)
    return row


def _sharegpt_turn(m: dict) -> dict:
    role = m.get("role")
    turn = {"from": SHAREGPT_ROLES.get(role, role), "value": _text(m.get("content"))}
    if role == "assistant":
        for key in ("reasoning_content", "tool_calls"):
            if m.get(key):
                turn[key] = m[key]
    elif role == "tool":
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                turn[key] = m[key]
    return turn


def _text(content) -> str:
    if isinstance(content, list):  # content parts (normalised records hold text already)
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def specforge_row(rec: dict, settings: dict) -> tuple[dict | None, str | None]:
    """(SpecForge regenerated-data row, None), or (None, why the conversation cannot be one)."""
    context = rec.get("messages") or []
    if rec.get("tools") or any(m.get("role") == "tool" or m.get("tool_calls") for m in context):
        return None, "specforge:tools"  # its rows have no tool definitions, tool roles or calls
    if RunSettings.view(settings).regenerate != "all" and any(m.get("role") == "assistant" for m in context):
        return None, "specforge:context_not_regenerated"
    lead = next((k for k, m in enumerate(context) if m.get("role") != "system"), len(context))
    roles = [m.get("role") for m in context[lead:]]
    if roles != ["user", "assistant"] * (len(roles) // 2) + ["user"]:  # system turns only before the first user
        return None, "specforge:turn_order"
    out = []
    for m in [*context, final_turn(rec)]:
        turn = {"role": m["role"], "content": _text(m.get("content"))}
        if m["role"] == "assistant" and m.get("reasoning_content"):
            turn["reasoning_content"] = m["reasoning_content"]
        out.append(turn)
    if any(not t["content"].strip() for t in out):
        return None, "specforge:empty_content"
    assistant = [t for t in out if t["role"] == "assistant"]
    if any(mark in (t["content"] + t.get("reasoning_content", "")).lower()
           for t in assistant for mark in _THINK_MARKERS):
        return None, "specforge:think_marker"
    thinking = record_thinking(rec, settings)  # the sample's own mode (a mixed run has both)
    if thinking and any(not t.get("reasoning_content", "").strip() for t in assistant):
        return None, "specforge:no_reasoning"
    if not thinking and any(t.get("reasoning_content") for t in assistant):
        return None, "specforge:reasoning_in_non_thinking_sample"
    return {"id": conversation_id(rec), "conversations": out, "status": "success"}, None


def join_shard_files(out, done_names: list[str]) -> int:
    """Write `regenerated.jsonl`, every exported shard's rows in shard order, atomically; return the rows."""
    n = 0
    with out.atomic_writer(SPECFORGE_FILE) as fh:
        for name in sorted(done_names):
            done = out.read_json(f"done/{name}")
            if done.get("file"):
                data = out.read_bytes(done["file"])
                fh.write(data)
                n += data.count(b"\n")
    return n


def dumps(row: dict) -> bytes:
    return orjson.dumps(row) + b"\n"
