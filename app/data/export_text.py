"""Text exports that keep what the model saw: one row per conversation, every turn the template rendered.

A trainer that re-tokenises text (SpecForge's online mode, LLaMA-Factory, axolotl) rebuilds the prompt from the
row, so a row must hold everything the target's template was given: the system turn, the tool definitions,
assistant tool calls with their ids, tool responses, and the reasoning of earlier turns (the template keeps or
drops it, as it did at generation). Re-rendering a row's conversation up to its last turn with the target's
template gives the record's prompt ids exactly (tests/data/test_export_text.py).

Rows are per conversation, not per record: a multi-turn run (`--regenerate all`) writes one record per
regenerated turn, and the trainers supervise every assistant turn of a row, so one row per turn would train on
early turns again and again. The row is built from the conversation's last ok turn, whose prompt already holds
the earlier regenerated turns; a rejected turn (its prompt too long) ends the row at the turn before it
(`cut_turn:...` counts those). A conversation is left out, counted under the first reason, when any of its
turns is filtered (flags, `--min-response-tokens`, unterminated thinking).

Unterminated thinking (`missing_think_end`: the output never reached `</think>`) is reasoning with an empty
answer; text exports leave those samples out unless `--include-unterminated`, and count them as
`unterminated_thinking`.

Formats:
- `sharegpt`: `{"id", "conversations": [{"from", "value", ...}], "tools", "finish_reason"}` with
  from = system/human/gpt/tool. Assistant turns keep `reasoning_content` and `tool_calls` (OpenAI shape, ids
  included); tool turns keep `tool_call_id` and `name`; `tools` is the definitions as a JSON string (Hermes
  and LLaMA-Factory convention). regen's own producer reads these rows back into the same messages,
  except a row holding a generated turn that came out empty (kept by `--include-unterminated`), which it
  refuses as input (`empty_content`) as it refuses any empty turn.
- `specforge-jsonl`: SpecForge's regenerated-data rows (what its `scripts/regenerate_train_data.py` writes and
  `scripts/validate_regenerated_data.py` checks): `{"id", "conversations": [{"role", "content",
  "reasoning_content"}], "status": "success"}`; optional system turns, then user/assistant alternation, ending
  on an assistant turn, every content a non-empty string, no `<think>`/`</think>` in content or reasoning,
  `reasoning_content` non-empty on every assistant turn of a thinking sample (a thinking run's rows pass
  `--expect-reasoning`) and absent in a non-thinking one (passes `--expect-non-reasoning`); a mixed run's
  rows are each in their own mode. SpecForge supervises every assistant turn
  of such a row, so a row must be the target's own words throughout: conversations that keep an original
  (not regenerated) assistant turn as context, which happens in `--regenerate last` runs, are left out as
  `specforge:context_not_regenerated` (`--regenerate all` regenerates them). The format has no tool
  definitions, tool roles or calls, so conversations with any of them are left out as `specforge:tools`
  (use `sharegpt`). The
  per-shard files are also joined into one `regenerated.jsonl` at the end of every export call, because
  SpecForge's validator and its `data.train_data_path` take one file.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

import orjson

from app.manifest import RunSettings
from app.modes import record_thinking
from app.records import conversation_id, prompt_id

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
