"""The per-sample record a worker writes into `{attempt}.records.jsonl.zst` (one JSON object per line).

A record is `status: "ok"` or `status: "rejected"` with `reject_reason`; it holds the ids exactly as the
engine returned them, the loss mask, the decoded text split at `</think>`, flags, provenance and where its
states are. Every field: docs/formats.md#record-fields. Multi-turn runs write one record per regenerated turn
(`sample_id` `{conversation_id}-t{turn}`), and accounting counts conversations (`conversation_id()`):
docs/formats.md#multi-turn-runs---regenerate-all.
"""

from __future__ import annotations


def loss_mask(num_prompt: int, num_output: int) -> list[int]:
    return [0] * num_prompt + [1] * num_output


def rejected_record(base: dict, reason: str, detail: str) -> dict:
    return {**base, "status": "rejected", "reject_reason": reason, "reject_detail": detail}


def turn_sample_id(conversation: str, turn: int) -> str:
    return f"{conversation}-t{turn}"


def prompt_id(rec: dict) -> str:
    """The prompt a record answers (records made before several samples per prompt existed: their sample's)."""
    return rec.get("prompt_id") or conversation_id(rec)


def conversation_id(rec: dict) -> str:
    """The producer's sample id this record belongs to (its own id outside multi-turn runs)."""
    return rec.get("conversation_id") or rec["sample_id"]
