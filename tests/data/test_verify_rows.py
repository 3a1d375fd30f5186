"""Plain `regen verify` looks at every row: zero or non-finite rows inside a layer, and a row left over from
another sample, each written through the project's own writer (CRCs and the marker's sha256 valid again)."""

from __future__ import annotations

import numpy as np

from tests.support.corrupt_states import rewrite_states
from tests.support.synthetic_run import Spec, build_run
from tests.support.verify_runs import kinds, run_verify


def test_the_rewrite_alone_keeps_a_run_verifying(tmp_path):
    build_run(tmp_path)
    assert rewrite_states(tmp_path, "synth", "shard-000001", lambda sid, t, s: s) != []
    code, report = run_verify(tmp_path)
    assert code == 0, report["problems"]


def _first(change):
    done = []

    def once(sid, tokens, states):
        if done:
            return None
        done.append(sid)
        return change(states)
    return once


def test_a_quarter_of_one_layers_rows_zero_fails_plain_verify(tmp_path):
    build_run(tmp_path)

    def quarter(states):
        states[: max(1, len(states) // 4), 2] = 0
        return states
    (sid,) = rewrite_states(tmp_path, "synth", "shard-000001", _first(quarter))
    code, report = run_verify(tmp_path)
    assert code == 1
    assert ("states_zero", "shard-000001", sid) in kinds(report)
    detail = next(p["detail"] for p in report["problems"] if p["kind"] == "states_zero")
    assert detail.startswith("vllm layer 4: all-zero ") and "rows, first at token 0" in detail
    assert not [p for p in report["problems"] if p["kind"] in ("sha256_mismatch", "hidden_corrupt")]


def test_one_zero_row_fails_plain_verify(tmp_path):
    build_run(tmp_path)

    def one(states):
        states[len(states) // 2, 0] = 0x8000  # -0.0 throughout one row
        return states
    (sid,) = rewrite_states(tmp_path, "synth", "shard-000000", _first(one))
    _, report = run_verify(tmp_path)
    assert ("states_zero", "shard-000000", sid) in kinds(report)


def test_one_non_finite_value_fails_plain_verify(tmp_path):
    build_run(tmp_path)

    def nan(states):
        states[1, 1, 5] = 0x7FC0
        return states
    (sid,) = rewrite_states(tmp_path, "synth", "shard-000002", _first(nan))
    _, report = run_verify(tmp_path)
    detail = next(p["detail"] for p in report["problems"] if p["kind"] == "states_nonfinite")
    assert ("states_nonfinite", "shard-000002", sid) in kinds(report) and "NaN/Inf in 1 of" in detail


def test_one_row_of_another_sample_fails_plain_verify_as_stale(tmp_path):
    built = build_run(tmp_path, Spec(shard_size=4))
    samples = [r["sample_id"] for r in built.records if r["shard_id"] == "shard-000001" and r["status"] == "ok"]
    donor = built.states[samples[0]]

    def stale(sid, tokens, states):
        if sid != samples[2]:
            return None
        states[-1, 1] = donor[0, 1]  # the first sample's first row, as the state of another token
        return states
    assert rewrite_states(tmp_path, "synth", "shard-000001", stale) == [samples[2]]
    _, report = run_verify(tmp_path)
    assert ("states_stale", "shard-000001", samples[2]) in kinds(report)
    assert np.array_equal(donor[0, 1], built.states[samples[0]][0, 1])
