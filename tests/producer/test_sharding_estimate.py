"""Dedupe and shard arithmetic, and the dry-run's disk estimate."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from producer.estimate import (
    Reservoir,
    build_estimate,
    compressed_bytes,
    hidden_state_bytes,
    human_bytes,
)
from producer.sharding import Deduper, shard_samples


def test_deduper_counts_repeats_by_sample_id():
    d = Deduper()
    ids = ["00000000000000ff", "ffffffffffffffff", "00000000000000ff", "ffffffffffffffff", "0000000000000001"]
    assert [d.first_time(i) for i in ids] == [True, True, False, False, True]
    assert d.duplicates == 2 and len(d) == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**63, 2**64 - 1])), max_size=400),
       st.integers(1, 40))
def test_deduper_agrees_with_a_plain_set_across_archive_merges(keys, window):
    """Small windows force many merges into the sorted archive and its bitmap: answers must stay exact."""
    d, seen = Deduper(window=window), set()
    for key in keys:
        sid = f"{key:016x}"
        assert d.first_time(sid) == (sid not in seen)
        seen.add(sid)
    assert len(d) == len(seen) and d.duplicates == len(keys) - len(seen)


def test_shards_are_fixed_size_groups_in_input_order_with_deterministic_ids():
    samples = [({"id": str(i)}, 10) for i in range(10)]
    shards = list(shard_samples(iter(samples), 4))
    assert [s.id for s in shards] == ["shard-000000", "shard-000001", "shard-000002"]
    assert [[x["id"] for x in s.samples] for s in shards] == [["0", "1", "2", "3"], ["4", "5", "6", "7"], ["8", "9"]]
    assert [s.approx_bytes for s in shards] == [40, 40, 20]
    again = list(shard_samples(iter(samples), 4))
    assert [(s.id, s.samples) for s in again] == [(s.id, s.samples) for s in shards]


def test_disk_estimate_for_the_914k_sample_run_in_notes():
    raw = hidden_state_bytes(914_000 * 3000, 5, 5120)
    assert raw == 914_000 * 3000 * 5 * 5120 * 2
    assert human_bytes(raw) == "140.4 TB"
    assert human_bytes(compressed_bytes(raw)) == "96.8 TB"


def test_human_bytes_units():
    assert human_bytes(999) == "999 B"
    assert human_bytes(1500) == "1.5 KB"
    assert human_bytes(2_500_000_000) == "2.5 GB"


def test_build_estimate_scales_the_sampled_prompt_tokens_and_assumes_half_the_max_response():
    e = build_estimate(samples=1000, token_counts=[100, 300], max_tokens=4096, assumed_response_tokens=None,
                       layers=5, hidden_size=5120)
    assert e.prompt_tokens == 200_000
    assert e.response_tokens_assumed == 1000 * 2048
    assert e.response_tokens_max == 1000 * 4096
    assert e.raw_bytes == (200_000 + 2_048_000) * 51_200
    text = "\n".join(e.lines())
    assert "estimate from 2 of 1,000 prompts" in text and "1.45" in text and "115.1 GB" in text


def test_reservoir_is_uniform_enough_and_bounded():
    r = Reservoir(100, seed=1)
    for i in range(10_000):
        r.offer(i)
    assert len(r.items) == 100 and r.seen == 10_000
    assert 3000 < sum(r.items) / 100 < 7000


def test_a_multi_turn_estimate_counts_every_regenerated_turns_prompt_and_response():
    from producer.estimate import turn_prompts
    from producer.normalise import normalise

    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    prompts = turn_prompts(normalise(row, file="f", line=1, regenerate="all")["messages"])
    assert [[m["content"] for m in p] for p in prompts] == [["a"], ["a", "b", "c"]]  # old answers stand in
    assert turn_prompts(normalise(row, file="f", line=1)["messages"]) == [[{"role": "user", "content": "a"},
                                                                            {"role": "assistant", "content": "b"},
                                                                            {"role": "user", "content": "c"}]]
    e = build_estimate(samples=1000, token_counts=[100, 300], max_tokens=4096, assumed_response_tokens=None,
                       layers=5, hidden_size=5120, response_counts=[2, 4])
    assert e.responses == 3000 and e.response_tokens_assumed == 3000 * 2048 and e.response_tokens_max == 3000 * 4096
    assert "responses: 3,000" in "\n".join(e.lines())
