"""The engine that stands in for a GPU (workers/doubles/stand_in.py): what the fleet harness's figures rest on.

The harness (bench/bench_fleet_scale.py) counts the fleet's costs per shard and converts its times back to a real
device's by the stand-in's rate; these check the stand-in does what its spec says: the thinking-mode length shape,
the same outputs for a re-delivered request, real token ids and their text, states of the configured width with
no row repeated, never faster than `rate / seqs` per sequence, at most `seqs` sequences at once, and its busy and
idle seconds. Time is asserted only as lower bounds (a loaded machine makes it slower, never faster).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from app.base.errors import ConfigError
from workers.doubles.stand_in import StandInEngine, StandInSpec, thinking_output
from workers.engine.options import EngineOptions
from workers.engine.request import GenRequest


def test_the_spec_parses_round_trips_and_refuses_bad_keys_in_one_line():
    spec = StandInSpec.parse("stand-in:rate=2000,scale=25,seqs=8,width=64,devices=3")
    assert (spec.rate, spec.scale, spec.seqs, spec.width, spec.devices) == (2000.0, 25.0, 8, 64, 3)
    assert StandInSpec.parse(spec.text()) == spec
    assert StandInSpec.parse("") == StandInSpec()
    for bad, names in (("speed=3", "'speed=3'"), ("rate=fast", "rate='fast'"), ("rate=0", "rate and scale"),
                       ("devices=0", "devices >= 1")):
        with pytest.raises(ConfigError) as err:
            StandInSpec.parse(bad)
        assert names in str(err.value) and "\n" not in str(err.value)


def test_output_lengths_have_the_thinking_mode_shape():
    rng = np.random.default_rng(7)
    draws = [thinking_output(rng, 8192) for _ in range(20_000)]
    kinds = {k: sum(1 for _, kind in draws if kind == k) / len(draws) for k in ("stub", "cap", "stop")}
    lengths = np.array([n for n, kind in draws if kind == "stop"])
    assert 0.015 < kinds["stub"] < 0.025  # 2% stubs
    assert 0.035 < kinds["cap"] < 0.055  # ~4.5% cut at the cap
    assert 2000 < np.median(lengths) < 2600 and lengths.max() < 8192
    assert all(n == 8192 for n, kind in draws if kind == "cap")
    assert all(4 <= n < 40 for n, kind in draws if kind == "stub")
    assert thinking_output(np.random.default_rng(1), 16)[0] <= 16  # a small cap holds


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    options = EngineOptions(model=str(tiny_qwen3), capture_layers=(1, 2), max_num_seqs=4)
    # 4 sequences at once, each at 40,000 / 4 = 10,000 tokens/s: a 3,000-token sample takes ~0.3 s
    eng = StandInEngine(options, "rate=40000,seqs=4,width=32")
    yield eng
    eng.shutdown()


def _requests(n: int, max_tokens: int = 4096, capture: bool = False, seed0: int = 0) -> list[GenRequest]:
    return [GenRequest(f"r{i}", [1, 2, 3, 4], {"max_tokens": max_tokens, "seed": seed0 + i}, capture=capture)
            for i in range(n)]


def _run(engine, requests):
    results, lock = [], threading.Lock()

    def on_done(result):
        with lock:
            results.append(result)

    t0 = time.time()
    span = engine.run(requests, on_done)
    return {r.request_id: r for r in results}, span, time.time() - t0


def test_outputs_are_real_token_ids_the_same_for_a_redelivered_request(engine):
    first, _, _ = _run(engine, _requests(6))
    again, _, _ = _run(engine, _requests(6))
    assert first.keys() == again.keys() == {f"r{i}" for i in range(6)}
    vocab = engine.tokenizer.get_vocab()
    for rid, r in first.items():
        assert r.output_token_ids == again[rid].output_token_ids and r.text == again[rid].text
        assert r.prompt_token_ids == [1, 2, 3, 4]
        assert set(r.output_token_ids) <= set(vocab.values())
        if r.finish_reason == "stop":  # reasoning, </think>, an answer, end of turn
            assert r.output_token_ids[-1] == vocab["<|im_end|>"] and vocab["</think>"] in r.output_token_ids
        decoded = engine.tokenizer.decode(r.output_token_ids, skip_special_tokens=True,
                                           clean_up_tokenization_spaces=False)
        assert decoded == r.text  # `</think>` is an added, not a special, token: its text stays, as in vLLM's


def test_states_have_the_configured_width_and_no_row_repeats(engine):
    results, _, _ = _run(engine, _requests(2, max_tokens=3000, capture=True, seed0=100))
    for r in results.values():
        n = len(r.prompt_token_ids) + len(r.output_token_ids) - 1  # the context the drafter trains on
        assert r.captured_states.shape == (n, 2, 32) and r.captured_states.dtype == np.uint16
        assert np.array_equal(r.captured_token_ids, (r.prompt_token_ids + r.output_token_ids)[:-1])
        rows = r.captured_states.reshape(n, -1)
        assert rows.any(axis=1).all()
        assert len({row.tobytes() for row in rows}) == n


def test_it_is_never_faster_than_its_rate_and_holds_at_most_seqs_sequences(engine):
    per_seq = engine.per_seq_rate
    lengths = {}
    for req in _requests(8, seed0=1000):  # the lengths the engine will draw for these seeds
        rng = np.random.default_rng([engine.spec.seed, req.sampling["seed"]])
        lengths[req.request_id] = thinking_output(rng, 4096)[0]
    before = engine.stats()
    results, span, wall = _run(engine, _requests(8, seed0=1000))
    after = engine.stats()
    for rid, r in results.items():
        assert len(r.output_token_ids) == lengths[rid]
        assert r.seconds >= lengths[rid] / per_seq * 0.999  # each sequence at rate / seqs, or slower
    # 8 sequences, 4 at a time: the device's time is at least the best packing of 8 lengths on 4 lanes
    lanes = sorted(lengths.values(), reverse=True)
    assert wall >= max(lanes[0], sum(lanes) / 4) / per_seq * 0.999
    assert span[1] - span[0] <= wall + 0.05
    generated = sum(len(r.output_token_ids) for r in results.values())
    assert after["generated_tokens"] - before["generated_tokens"] == generated
    assert after["busy_seconds"] - before["busy_seconds"] >= max(lanes[0], sum(lanes) / 4) / per_seq * 0.999


def test_capture_without_capture_layers_is_refused(tiny_qwen3):
    eng = StandInEngine(EngineOptions(model=str(tiny_qwen3), max_num_seqs=2), "rate=1000")
    try:
        with pytest.raises(ConfigError, match="without capture layers"):
            eng.run(_requests(1, capture=True), lambda r: None)
        idle = eng.stats()["idle_seconds"]
        time.sleep(0.05)
        _run(eng, _requests(1, max_tokens=16))
        assert eng.stats()["idle_seconds"] >= idle + 0.04  # it counted the wait before the request as idle
    finally:
        eng.shutdown()
