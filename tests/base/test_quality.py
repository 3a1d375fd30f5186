"""The quality gate on crafted outputs: the 87%-stub disaster must be visible per sample and per window."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.base.hidden_file import bf16_to_float32, float32_to_bf16
from app.base.manifest import QualitySettings
from app.base.quality import (
    StubWindow,
    answer_token_count,
    is_stub,
    repetition_loop,
    sample_flags,
    split_reasoning,
    states_problem,
    think_closed,
)

Q = QualitySettings()
THINK_END, EOS = 10, 2


def flags_for(text: str, output_ids: list[int], finish_reason: str = "stop", thinking: bool = True) -> list[str]:
    reasoning, answer = split_reasoning(text, thinking)
    n = answer_token_count(output_ids, THINK_END, {EOS}, answer)
    return sample_flags(thinking=thinking, reasoning=reasoning, think_closed=think_closed(text), answer=answer,
                        answer_tokens=n, finish_reason=finish_reason, output_ids=output_ids, quality=Q)


def test_the_known_stub_is_flagged_as_empty_reasoning_and_stub_answer():
    # <think>\n\n</think>\n\nOK.<|im_end|>: 6 response tokens, the shape of 87% of the broken dataset.
    flags = flags_for("<think>\n\n</think>\n\nOK.", [5, 6, THINK_END, 7, 8, EOS])
    assert set(flags) == {"empty_reasoning", "stub_answer"}
    assert is_stub(flags)


def test_a_real_thinking_answer_has_no_flags():
    out = list(range(20, 60)) + [THINK_END] + list(range(60, 90)) + [EOS]
    assert flags_for("<think>\nlet me see, 2+2 is 4\n</think>\n\nThe answer is 4 because ...", out) == []


def test_empty_answer_after_reasoning():
    out = list(range(20, 40)) + [THINK_END, EOS]
    assert flags_for("<think>\nsome reasoning\n</think>\n\n", out) == ["empty_answer"]


def test_truncated_thinking_is_truncated_not_stub():
    out = list(range(20, 52))
    flags = flags_for("<think>\nstill thinking about", out, finish_reason="length")
    assert set(flags) == {"truncated", "missing_think_end"}
    assert not is_stub(flags)


def test_missing_think_end_when_the_model_stops_without_closing():
    out = list(range(20, 60)) + [EOS]
    assert set(flags_for("an answer with no think block at all, long enough", out)) == {"missing_think_end",
                                                                                       "empty_answer"}


def test_unterminated_thinking_is_reasoning_with_an_empty_answer_never_an_answer_with_think():
    assert split_reasoning("<think>\nstill thinking about", thinking=True) == ("still thinking about", "")
    assert split_reasoning("still thinking about", thinking=True) == ("still thinking about", "")
    assert split_reasoning("a plain answer", thinking=False) == (None, "a plain answer")
    assert split_reasoning("<think>\nhm\n</think>\n\nYes.", thinking=True) == ("hm", "Yes.")


def test_non_thinking_mode_checks_only_the_answer():
    assert flags_for("OK.", [7, 8, EOS], thinking=False) == ["stub_answer"]
    assert flags_for("", [EOS], thinking=False) == ["empty_answer"]


@pytest.mark.parametrize("period", [1, 3, 7])
def test_repetition_loops_are_found(period):
    block = list(range(100, 100 + period))
    looping = list(range(20, 50)) + block * max(12, 16 // period + 1)  # a loop spans >= 16 tokens
    assert repetition_loop(looping, Q.repetition_min_repeats)
    assert "repetition_loop" in flags_for("x", looping, finish_reason="length")


def test_varied_text_is_not_a_loop():
    rng = np.random.default_rng(0)
    assert not repetition_loop(rng.integers(0, 5000, 400).tolist(), Q.repetition_min_repeats)


def _loop_by_definition(ids, min_repeats, max_period=64, min_span=16):
    """The definition, written the slow way: the last `span` tokens equal themselves shifted by `p`."""
    for p in range(1, max_period + 1):
        span = max(p * min_repeats, min_span)
        if span > len(ids):
            break
        tail = ids[len(ids) - span:]
        if all(tail[i] == tail[i + p] for i in range(span - p)):
            return True
    return False


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=120), st.lists(st.integers(0, 3), min_size=1, max_size=5),
       st.integers(0, 40), st.integers(2, 6))
def test_repetition_loop_matches_its_definition(prefix, block, repeats, min_repeats):
    ids = prefix + block * repeats  # a tiny alphabet makes near-misses and real loops both common
    assert repetition_loop(ids, min_repeats) == _loop_by_definition(ids, min_repeats)


def test_one_zero_row_inside_a_layer_is_flagged():
    good = float32_to_bf16(np.random.default_rng(2).normal(size=(3000, 5, 64)).astype(np.float32))
    one_row = good.copy()
    one_row[1234, 3] = 0  # one token's state in one layer: a capture fault, though the layer is not zero
    assert states_problem(one_row) == "states_zero"
    quarter = good.copy()
    quarter[:750, 2] = 0
    assert states_problem(quarter) == "states_zero"
    from app.base.quality import layer_detail

    assert layer_detail(quarter, [1, 16, 31, 46, 61]) == "vllm layer 31: all-zero 750 of 3000 rows, first at token 0"


def test_states_checks_find_zero_layers_and_non_finite_values():
    good = float32_to_bf16(np.random.default_rng(1).normal(size=(5, 3, 8)).astype(np.float32))
    assert states_problem(good) is None
    zero_layer = good.copy()
    zero_layer[:, 1, :] = 0
    assert states_problem(zero_layer) == "states_zero"
    negative_zero = np.full_like(good, 0x8000)  # -0.0 everywhere is still all zero
    assert states_problem(negative_zero) == "states_zero"
    for bad in (np.nan, np.inf, -np.inf):
        broken = good.copy()
        broken[2, 0, 3] = float32_to_bf16(np.array([bad], dtype=np.float32))[0]
        assert states_problem(broken) == "states_nonfinite"


def _states_problem_by_definition(states: np.ndarray) -> str | None:
    values = bf16_to_float32(states)
    if not np.isfinite(values).all():
        return "states_nonfinite"
    if states.size == 0 or not (values != 0).any(axis=2).all():  # any row of any layer all zero
        return "states_zero"
    return None


@settings(max_examples=150, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 40), st.integers(1, 4), st.sampled_from([1, 8, 4096, 20000])),
    seed=st.integers(0, 2**31),
    damage=st.sampled_from(["none", "zero_layer", "zero_row", "neg_zero_row", "nan", "inf", "neg_inf", "max_finite",
                            "tiny", "neg_zero"]),
    where=st.floats(0, 1, exclude_max=True),
)
def test_states_check_matches_its_definition_across_blocks(shape, seed, damage, where):
    # Wide rows (4096, 20000 channels) split the check into blocks of a few rows, or one row per block; the
    # damaged value lands anywhere, the last block included.
    rng = np.random.default_rng(seed)
    states = float32_to_bf16(rng.normal(size=shape).astype(np.float32))
    t, layer, ch = int(where * shape[0]), int(where * shape[1]), int(where * shape[2])
    special = {"nan": np.nan, "inf": np.inf, "neg_inf": -np.inf, "max_finite": 3.3e38, "tiny": 1e-40}
    if damage == "zero_layer":
        states[:, layer, :] = 0
    elif damage == "neg_zero":
        states[:, layer, :] = 0x8000
    elif damage == "zero_row":
        states[t, layer, :] = 0
    elif damage == "neg_zero_row":
        states[t, layer, :] = 0x8000
    elif damage in special:
        states[t, layer, ch] = float32_to_bf16(np.array([special[damage]], dtype=np.float32))[0]
    assert states_problem(states) == _states_problem_by_definition(states)


def test_the_window_pauses_after_enough_stubs_only():
    window = StubWindow(size=10)
    for _ in range(4):
        window.add(True)
    assert not window.should_pause(0.2, min_samples=5)  # too few samples to judge
    window.add(False)
    assert window.should_pause(0.2, min_samples=5)
    for _ in range(10):
        window.add(False)
    assert window.rate == 0.0 and not window.should_pause(0.2, min_samples=5)


def _sample_states(seed: int, n_tokens: int = 3000, n_layers: int = 5, hidden: int = 64) -> np.ndarray:
    return float32_to_bf16(np.random.default_rng(seed).normal(size=(n_tokens, n_layers, hidden)).astype(np.float32))


def test_one_stale_row_in_a_3000_token_sample_is_found_wherever_it_lies():
    from app.base.quality import StaleRows

    earlier_ids, earlier = np.arange(3000), _sample_states(1)
    rng = np.random.default_rng(5)
    for trial in range(20):
        seen = StaleRows()
        assert seen.check(earlier_ids, earlier) is None
        ids, states = np.arange(10_000, 13_000), _sample_states(100 + trial)
        assert seen.check(ids, states) is None  # a clean later sample
        t, source, layer = (int(x) for x in (rng.integers(3000), rng.integers(3000), rng.integers(5)))
        ids, states = np.arange(20_000, 23_000), _sample_states(200 + trial)
        states[t, layer] = earlier[source, layer]  # one row left over from the earlier request
        assert seen.check(ids, states) == "states_stale", (t, source, layer)


def test_the_old_16_position_probe_misses_most_single_stale_rows():
    """What the full hash replaced: 16 probed positions a sample see a stale row only where both ends were probed."""
    from app.base.quality import StaleRows

    earlier_ids, earlier = np.arange(3000), _sample_states(1)
    found = 0
    for t in range(0, 3000, 150):
        seen = StaleRows(positions=16)
        seen.check(earlier_ids, earlier)
        ids, states = np.arange(20_000, 23_000), _sample_states(2)
        states[t, 0] = earlier[(t * 7) % 3000, 0]
        found += seen.check(ids, states) == "states_stale"
    assert found <= 2


def test_a_stale_row_within_one_sample_and_the_table_bound():
    from app.base.quality import StaleRows

    ids, states = np.arange(3000), _sample_states(3)
    states[2000, 1] = states[10, 1]  # another token's row of this very request
    assert StaleRows().check(ids, states) == "states_stale"
    small = StaleRows(capacity=20_000)
    for seed in range(6):
        assert small.check(np.arange(seed * 5000, seed * 5000 + 3000), _sample_states(10 + seed)) is None
    assert len(small) <= 20_000 + 15_000  # the oldest runs are dropped as new ones arrive


def test_the_same_token_repeating_its_row_is_not_stale():
    from app.base.quality import StaleRows

    ids, states = np.arange(3000), _sample_states(4)
    later_ids = np.arange(5000, 8000)
    later_ids[:100] = ids[:100]  # a shared prefix: the same tokens in the same context
    later = _sample_states(6)
    later[:100] = states[:100]
    seen = StaleRows()
    assert seen.check(ids, states) is None and seen.check(later_ids, later) is None


def test_a_full_table_keeps_the_previous_samples_rows():
    """The table is full of older samples' rows; one row of the sample just before, at another token, is found
    nearly wherever it lies: a row gives way only to newer ones, and here a sample is a quarter of the table (at
    the default size a tiny sample is 0.04% of it, a real one 0.7%), so a few of its rows lost each other's slots."""
    from app.base.quality import StaleRows

    seen = StaleRows(capacity=60_000)
    for seed in range(8):  # 120,000 rows through 60,000 slots
        assert seen.check(np.arange(seed * 5000, seed * 5000 + 3000), _sample_states(30 + seed)) is None
    previous = _sample_states(37)
    rng = np.random.default_rng(7)
    found = 0
    for trial in range(40):
        ids, states = np.arange(90_000, 93_000), _sample_states(300 + trial)
        t, source, layer = (int(x) for x in (rng.integers(3000), rng.integers(3000), rng.integers(5)))
        states[t, layer] = previous[source, layer]
        table = StaleRows(capacity=60_000)
        table._table[:], table._written = seen._table, seen._written
        found += table.check(ids, states) == "states_stale"
    assert found >= 36, found
    assert StaleRows(capacity=60_000).check(ids, states) is None  # an empty table finds nothing to repeat
