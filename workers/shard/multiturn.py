"""Multi-turn mode (`--regenerate all`): every assistant turn regenerated in order, each conditioned on the
model's own earlier regenerated turns, and each one a training sample of its own.

Rounds are batched across the shard (round r generates every conversation's r-th turn), and each turn goes the
single-turn path, capture included. A generated turn takes its place in the conversation; a rejected turn ends
it. Details: docs/formats.md#how-a-worker-regenerates-every-turn.
"""

from __future__ import annotations

from app.base.records import turn_sample_id
from app.base.samples import Sample


def turns_to_regenerate(messages: list[dict]) -> list[int]:
    return [i for i, m in enumerate(messages) if m.get("role") == "assistant" and m.get("content") is None
            and "original_content" in m]


def _clean(messages: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("original_")} for m in messages]


def regenerate_turns(gen, samples: list[dict]) -> tuple[list[dict], dict]:
    """(records, summary) for a shard of multi-turn samples: one record per regenerated turn, in conversation
    order then turn order."""
    convs = [[dict(m) for m in s["messages"]] for s in samples]
    for conv in convs:  # the producer always leaves one turn to regenerate; a sample without one gets the next
        if not turns_to_regenerate(conv):
            conv.append({"role": "assistant", "content": None, "original_content": None})
    slots = [turns_to_regenerate(m) for m in convs]
    where: dict[tuple[int, int], int] = {}  # (conversation, turn) -> position in gen.records
    alive = set(range(len(samples)))
    for r in range(max((len(t) for t in slots), default=0)):
        requests, turn_of = [], {}
        for i in sorted(alive):
            if r >= len(slots[i]):
                continue
            sample = samples[i]
            base = gen.base(Sample({**sample, "id": turn_sample_id(sample["id"], r)}), i, _clean(convs[i][: slots[i][r]]),
                            conversation_id=sample["id"], turn=r)
            where[(i, r)] = len(gen.records)
            req = gen.add(base)
            if req is None:
                alive.discard(i)  # rejected: later turns would need this one's answer
                continue
            requests.append(req)
            turn_of[req.request_id] = (i, r)

        def on_done(rec: dict, res, turn_of=turn_of) -> None:
            i, r = turn_of[res.request_id]
            turn = {"role": "assistant", "content": rec["answer"]}
            if rec["reasoning"]:
                turn["reasoning_content"] = rec["reasoning"]
            convs[i][slots[i][r]] = turn

        gen.run(requests, on_done)
    return gen.collect([where[k] for k in sorted(where)])
