"""Multi-turn mode (`--regenerate all`): every assistant turn regenerated in order, each conditioned on the
model's own earlier regenerated turns, and each one a training sample of its own.

The producer marks each turn to regenerate as `{"role": "assistant", "content": None, "original_content": ...}`.
Rounds are batched across the shard: round r generates the r-th such turn of every conversation that has one,
so the engine still sees whole batches. Every turn goes through the same path as a single-turn sample
(workers.shard.generate.ShardGeneration), capture included: its record's prompt is the conversation up to that turn
as the target's template renders it, its response the turn's exact generated ids, its states captured for that
sequence. This is how speculators and SpecForge build multi-turn training data: a turn that was only context
would leave most of what was generated without states or loss.

Once a turn is generated, it takes its place in the conversation (answer as `content`, reasoning as
`reasoning_content`, which the target's template keeps or drops as it does at serving time). A turn whose
prompt the worker rejects (too long, or the template refuses it) ends the conversation there, since later
turns would be conditioned on an answer that does not exist; the rejected record says so and accounting still
counts the conversation once (app.records).
"""

from __future__ import annotations

from app.records import turn_sample_id
from app.samples import Sample


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
