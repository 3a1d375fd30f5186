"""Multi-turn mode (`--regenerate all`): every assistant turn regenerated in order, each conditioned on the
model's own earlier regenerated turns.

The producer marks each turn to regenerate as `{"role": "assistant", "content": None, "original_content": ...}`.
Rounds are batched across the shard: round r generates the r-th such turn of every sample that has one, so
the engine still sees whole batches. All turns but the last are filled in here (answer as `content`, the
reasoning as `reasoning_content`, which the target's template keeps or drops as it does at serving time);
the last turn then goes through the normal single-turn path, with capture, and its record carries the
earlier turns under `turns`. `input_ids`/`loss_mask` cover the final turn's prompt (the whole conversation
as the template renders it) and the final turn's generated tokens: earlier turns reappear in that prompt
re-rendered by the template, not as generated, so they are context (mask 0), not targets.
"""

from __future__ import annotations

from app.ids import seed_for
from workers.engine import GenRequest, GenResult
from workers.quality import split_reasoning


def _turns_to_regenerate(messages: list[dict]) -> list[int]:
    return [i for i, m in enumerate(messages) if m.get("role") == "assistant" and m.get("content") is None
            and "original_content" in m]


def _clean(messages: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("original_")} for m in messages]


def fill_earlier_turns(ctx, settings: dict, samples: list[dict], render) -> list[dict]:
    """Return samples whose `messages` end just before their final turn to regenerate, earlier ones filled."""
    sampling = dict(settings["sampling"])
    run_seed = int(sampling.pop("seed", 0))
    thinking = bool(settings["thinking"])
    max_len = ctx.engine.options.max_model_len
    work = [{**s, "messages": [dict(m) for m in s["messages"]], "turns": []} for s in samples]
    slots = [_turns_to_regenerate(s["messages"]) for s in work]
    rounds = max((len(t) - 1 for t in slots), default=0)
    for r in range(rounds):
        requests, where = [], {}
        for i, s in enumerate(work):
            if len(slots[i]) - 1 <= r or s.get("skip"):
                continue
            context = _clean(s["messages"][: slots[i][r]])
            with ctx.tokenizer_lock:
                prompt_ids = render(ctx.tokenizer, context, s.get("tools"), thinking)
            if len(prompt_ids) + sampling["max_tokens"] > max_len:
                s["skip"] = True  # the final turn is longer still: the normal path rejects it with a reason
                continue
            seed = seed_for(run_seed, f"{s['id']}:{r}")
            requests.append(GenRequest(str(i), prompt_ids, {**sampling, "seed": seed}))
            where[str(i)] = seed

        def on_done(res: GenResult, r=r, where=where) -> None:
            s = work[int(res.request_id)]
            reasoning, answer = split_reasoning(res.text, thinking)
            turn = {"role": "assistant", "content": answer}
            if reasoning:
                turn["reasoning_content"] = reasoning
            s["messages"][slots[int(res.request_id)][r]] = turn
            s["turns"].append({"turn": r, "num_prompt_tokens": len(res.prompt_token_ids),
                               "output_ids": res.output_token_ids, "finish_reason": res.finish_reason,
                               "seed": where[res.request_id], "reasoning": reasoning, "answer": answer})

        ctx.engine.run(requests, on_done)
    out = []
    for i, s in enumerate(work):
        last = slots[i][-1] if slots[i] else len(s["messages"])
        out.append({**s, "messages": _clean(s["messages"][:last])})
    return out
