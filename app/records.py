"""The per-sample record a worker writes into `{attempt}.records.jsonl.zst` (one JSON object per line).

Fields (a record is either `status: "ok"` or `status: "rejected"` with `reject_reason`):

    run_id, shard_id, sample_id, index        where the sample lives (index: the input sample's place in the shard)
    prompt_id, sample_index                    the prompt this sample answers and which of its samples it is
                                               (`--samples-per-prompt`: sample k of prompt P has id `P-s{k}`,
                                               sample 0 has P's own); split train and eval by prompt_id
    thinking                                   the sample's mode (app.modes); records made before it existed
                                               are in the run's mode
    conversation_id, turn                      multi-turn runs only (`--regenerate all`): the producer's sample id
                                               and which regenerated turn (0, 1, ...) this record is
    source {file, line, source_id}            provenance from the producer
    messages, tools                           the normalised prompt that was rendered (multi-turn: the conversation
                                               so far, earlier turns as the model regenerated them)
    status, reject_reason, reject_detail
    input_ids                                  prompt ids + generated ids, exactly as the engine returned them
    loss_mask                                  0 over the prompt, 1 over the generated ids (same length), but 0
                                               over `forced`
    budget_closed, loop_stopped, forced        only when true: the thinking budget closed the reasoning (app.thinking),
                                               the loop stop ended the output (app.loops); `forced` lists the
                                               [first, end) spans of input_ids the engine forced
    num_prompt_tokens, num_output_tokens, num_answer_tokens
    text, reasoning, answer                    decoded output, split at `</think>`; in thinking mode an output that
                                               never reached `</think>` is all reasoning, answer "" (flagged
                                               missing_think_end); outside thinking mode reasoning is None
    finish_reason, stop_reason, seed
    sampling {temperature, top_p, top_k, min_p} what the sample was sampled with (its mode's, its index's
                                               temperature; `thinking_budget` N on a budgeted thinking sample);
                                               records made before it: the run's `sampling`
    flags                                      quality flags (app.quality)
    hidden {index, n_tokens, layers}           where the states are in the shard's hidden file (None if off)
    seconds, worker, device                    timing and who produced it

Multi-turn runs: a conversation whose assistant turns are all regenerated gives one record per turn, each a
training sample of its own (prompt = the conversation up to that turn as the target's template renders it,
response = that turn's generated ids, states for that sequence). `sample_id` is then
`{conversation_id}-t{turn}`. The producer counts conversations, so accounting counts distinct
`conversation_id`s (`conversation_id()`), and a turn the worker rejects (prompt too long) ends its conversation:
later turns would need its answer.
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
