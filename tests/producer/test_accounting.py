"""Every row read is accounted for exactly once, whatever the mix of good, bad and repeated rows."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from producer.accounting import Accounting, RejectLog
from producer.produce import iter_samples
from producer.run_setup import ProduceOptions
from producer.sharding import Deduper, shard_samples

ROW_KINDS = [
    b'{"prompt": "same prompt"}',
    b'{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]}',
    b'{"messages": [{"role": "system", "content": "only system"}]}',
    b'{"conversations": [{"from": "alien", "value": "x"}]}',
    b'{"conversations": [',
    b'{"prompt": "caf\xe9"}',
    b"[1, 2]",
    b'{"messages": []}',
]


@settings(max_examples=60, deadline=None)
@given(picks=st.lists(st.tuples(st.integers(0, len(ROW_KINDS) - 1), st.integers(0, 3)), max_size=60),
       shard_size=st.integers(1, 7))
def test_read_equals_enqueued_plus_duplicates_plus_rejected(tmp_path_factory, picks, shard_size):
    path = tmp_path_factory.mktemp("acc") / "in.jsonl"
    lines = []
    for kind, variant in picks:
        raw = ROW_KINDS[kind]
        if kind == 0:  # a few distinct prompts, so duplicates happen
            raw = json.dumps({"prompt": f"prompt {variant}"}).encode()
        lines.append(raw)
    path.write_bytes(b"\n".join(lines) + b"\n")
    acc = Accounting()
    with RejectLog(acc) as rejects:
        shards = list(shard_samples(iter_samples([str(path)], ProduceOptions(), acc, rejects, Deduper()), shard_size))
    acc.check_identity()
    assert acc.read == len([line for line in lines if line.strip()])
    assert sum(len(s.samples) for s in shards) == acc.enqueued
    assert all(len(s.samples) == shard_size for s in shards[:-1])
    ids = [x["id"] for s in shards for x in s.samples]
    assert len(ids) == len(set(ids))
