"""The per-sample record a worker writes into `{attempt}.records.jsonl.zst` (one JSON object per line).

Fields (a record is either `status: "ok"` or `status: "rejected"` with `reject_reason`):

    run_id, shard_id, sample_id, index        where the sample lives
    source {file, line, source_id}            provenance from the producer
    messages, tools                           the normalised prompt that was rendered
    status, reject_reason, reject_detail
    input_ids                                  prompt ids + generated ids, exactly as the engine returned them
    loss_mask                                  0 over the prompt, 1 over the generated ids (same length)
    num_prompt_tokens, num_output_tokens, num_answer_tokens
    text, reasoning, answer                    decoded output, split at `</think>` (reasoning None if absent)
    finish_reason, stop_reason, seed
    flags                                      quality flags (workers/quality.py)
    hidden {index, n_tokens, layers}           where the states are in the shard's hidden file (None if off)
    seconds, worker, device                    timing and who produced it
"""

from __future__ import annotations

RECORD_FORMAT = "regen.record/1"


def loss_mask(num_prompt: int, num_output: int) -> list[int]:
    return [0] * num_prompt + [1] * num_output


def rejected_record(base: dict, reason: str, detail: str) -> dict:
    return {**base, "status": "rejected", "reject_reason": reason, "reject_detail": detail}
