"""`regen verify --reference` judged row by row (app/base/states_compare.py) on a run whose stored states are the tiny
model's own, with a massive-activation channel (400 in every token): right states pass, also moved by a few bf16
roundings per value (another device's kernels); shifted, swapped, foreign and zeroed rows fail. Every corruption is
written through the project's writer with valid CRCs and sha256 (tests/support/corrupt_states.py). No vLLM here:
the stored states are transformers' (tests/workers/test_selfcheck.py compares vLLM's with them)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from app.base.hidden_file import bf16_to_float32, float32_to_bf16
from app.base.states_compare import REL_BOUND, UNIT_ROUNDOFF_BF16
from app.cli import main
from tests.support.corrupt_states import rewrite_states
from tests.support.synthetic_run import LAYERS, Spec, build_run
from tests.support.verify_runs import kinds

SHARD = "shard-000001"


@pytest.fixture(scope="module")
def massive_model(tmp_path_factory) -> Path:
    from workers.tiny_model import build_tiny_qwen3

    return Path(build_tiny_qwen3(str(tmp_path_factory.mktemp("tiny-massive")), massive=400.0))


@pytest.fixture(scope="module")
def reference(massive_model):
    from app.data.reference import ReferenceCapture

    ref = ReferenceCapture(str(massive_model), LAYERS)
    yield ref
    ref.close()


def true_run(root: Path, model: Path, reference) -> dict[str, np.ndarray]:
    """A synthetic run made true: the model it names is `model`, every sample's states are the model's own."""
    build_run(root, Spec())
    manifest_path = root / "synth" / "run.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["settings"]["model"].update(path=str(model), hidden_size=128)
    manifest_path.write_text(json.dumps(manifest))
    states = {}
    for shard in ("shard-000000", "shard-000001", "shard-000002"):
        def own(sid, tokens, _states):
            states[sid] = reference.capture(tokens.tolist())
            return states[sid]
        rewrite_states(root, "synth", shard, own)
    return states


def verify_reference(root: Path, *extra: str) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["verify", "synth", "--storage", str(root), "--json", "--reference", "11",
                                       *extra])
    return result.exit_code, json.loads(result.output[result.output.index("{"):])


def test_the_model_carries_a_massive_channel(reference):
    states = bf16_to_float32(reference.capture(list(range(10, 60))))
    assert np.abs(states[:, :, 7] - 400).max() < 8  # ~400 in every token, every layer
    share = states[:, :, 7] ** 2 / (states ** 2).sum(axis=-1)
    assert share.min() > 0.9  # it dominates every row's norm


def test_right_states_pass_with_the_worst_figures_per_layer(tmp_path, massive_model, reference):
    true_run(tmp_path, massive_model, reference)
    code, report = verify_reference(tmp_path)
    assert code == 0, report["problems"]
    ref = report["reference"]
    assert ref["checked"] == 11 and ref["failed"] == 0 and ref["device"] == "cpu"
    assert ref["tolerance"] == REL_BOUND and ref["worst"]["error"] == 0.0
    assert [row["layer"] for row in ref["per_layer"]] == LAYERS
    from app.data.verify_reference import reference_line

    line = reference_line(ref)
    assert line.startswith("11 samples on cpu, 0 failed; worst error 0 of the row at layer ")
    assert line.endswith(f"(bound {REL_BOUND:.3g}); worst per layer: 1 0, 2 0, 4 0")
    human = CliRunner().invoke(main, ["verify", "synth", "--storage", str(tmp_path), "--reference", "2"])
    assert human.exit_code == 0 and "worst per" in human.output and "samples on cpu" in human.output


def test_states_a_few_bf16_roundings_off_pass_at_a_massive_channel(tmp_path, massive_model, reference):
    """Another device's kernels: every value moved by up to 3 of its own roundings (6.0 in the channel at 400)."""
    true_run(tmp_path, massive_model, reference)
    rng = np.random.default_rng(0)

    def noisy(sid, tokens, states):
        values = bf16_to_float32(states)
        return float32_to_bf16(values * (1 + rng.uniform(-3, 3, values.shape) * UNIT_ROUNDOFF_BF16))
    for shard in ("shard-000000", SHARD, "shard-000002"):
        rewrite_states(tmp_path, "synth", shard, noisy)
    code, report = verify_reference(tmp_path)
    assert code == 0, report["problems"]
    assert 0 < report["reference"]["worst"]["error"] < REL_BOUND / 4


def _one_sample(states_by_id, change):
    chosen = []

    def once(sid, tokens, states):
        if chosen:
            return None
        chosen.append(sid)
        return change(sid, states) if change.__code__.co_argcount == 2 else change(sid, states, tokens)
    return once, chosen


def _fails(tmp_path, sid, *words):
    code, report = verify_reference(tmp_path)
    assert code == 1
    mismatches = [p for p in report["problems"] if p["kind"] == "reference_mismatch"]
    assert [(p["shard"], p["sample"]) for p in mismatches] == [(SHARD, sid)], report["problems"]
    for word in words:
        assert word in mismatches[0]["detail"], mismatches[0]["detail"]
    assert report["reference"]["failed"] == 1
    return mismatches[0]["detail"]


def test_states_shifted_by_one_token_fail(tmp_path, massive_model, reference):
    truth = true_run(tmp_path, massive_model, reference)
    def shifted(sid, s, tokens):  # each row the next token's state (the last one's from one token more)
        return np.ascontiguousarray(reference.capture(tokens.tolist() + [33])[1:])
    change, chosen = _one_sample(truth, shifted)
    rewrite_states(tmp_path, "synth", SHARD, change)
    detail = _fails(tmp_path, chosen[0], "states shifted")
    assert "rows nearer a neighbouring token's reference than their own" in detail


def test_reference_errors_are_counted_per_engine_mode(tmp_path, massive_model, reference):
    """Two hosts' engine modes in one run (an sm_100 host made shard 0, an sm_120 host shards 1 and 2): the reference
    check says which mode's states failed, so a GPU path that writes wrong states is named by its mode."""
    truth = true_run(tmp_path, massive_model, reference)
    sm100 = "sm_100 vLLM 0.33.0 V2 async chunked(8192) graphs tp1"
    sm120 = "sm_120 vLLM 0.33.0 V2 async chunked(8192) graphs tp1"
    for shard, mode in (("shard-000000", sm100), (SHARD, sm120), ("shard-000002", sm120)):
        path = tmp_path / "synth" / "done" / f"{shard}.json"
        marker = json.loads(path.read_text())
        marker["engine_mode"] = mode
        path.write_text(json.dumps(marker))

    def shifted(sid, s, tokens):
        return np.ascontiguousarray(reference.capture(tokens.tolist() + [33])[1:])
    change, chosen = _one_sample(truth, shifted)
    rewrite_states(tmp_path, "synth", SHARD, change)
    _fails(tmp_path, chosen[0], "states shifted")
    code, report = verify_reference(tmp_path)
    modes = report["reference"]["per_engine_mode"]
    assert set(modes) == {sm100, sm120}
    assert sum(m["checked"] for m in modes.values()) == 11
    assert (modes[sm100]["failed"], modes[sm120]["failed"]) == (0, 1)
    assert modes[sm100]["worst_error"] == 0.0 < modes[sm120]["worst_error"]  # a shift: caught by the shift test
    from app.data.verify_reference import reference_line

    line = reference_line(report["reference"])
    assert "; per engine mode: " in line and f"{sm100} 3 samples, 0 failed" in line and f"{sm120} 8 samples, 1 failed" in line


def test_two_swapped_layers_fail(tmp_path, massive_model, reference):
    truth = true_run(tmp_path, massive_model, reference)
    change, chosen = _one_sample(truth, lambda sid, s: np.ascontiguousarray(s[:, [1, 0, 2]]))
    rewrite_states(tmp_path, "synth", SHARD, change)
    _fails(tmp_path, chosen[0], "the slot of layer 1 holds layer 2")


def test_another_requests_rows_fail(tmp_path, massive_model, reference):
    truth = true_run(tmp_path, massive_model, reference)

    def foreign(sid, s):  # the states of another request of the same length
        return reference.capture(np.random.default_rng(1).integers(100, 400, len(s)).tolist())
    change, chosen = _one_sample(truth, foreign)
    rewrite_states(tmp_path, "synth", SHARD, change)
    _fails(tmp_path, chosen[0])


def test_a_stale_block_inside_a_sample_fails(tmp_path, massive_model, reference):
    truth = true_run(tmp_path, massive_model, reference)
    donor = next(iter(truth.values()))

    def block(sid, s):
        s[2:6] = donor[10:14]  # four rows of another request, for other tokens
        return s
    change, chosen = _one_sample(truth, block)
    rewrite_states(tmp_path, "synth", SHARD, change)
    _fails(tmp_path, chosen[0], "token")


def test_zeroed_rows_fail_plain_verify_before_the_reference_is_asked(tmp_path, massive_model, reference):
    truth = true_run(tmp_path, massive_model, reference)

    def zero(sid, s):
        s[: len(s) // 4, 1] = 0
        return s
    change, chosen = _one_sample(truth, zero)
    rewrite_states(tmp_path, "synth", SHARD, change)
    code, report = verify_reference(tmp_path, "--allow-incomplete")
    assert code == 1 and ("states_zero", SHARD, chosen[0]) in kinds(report)


def test_device_is_checked_in_one_line(tmp_path, massive_model, reference):
    import torch

    true_run(tmp_path, massive_model, reference)
    bad = CliRunner().invoke(main, ["verify", "synth", "--storage", str(tmp_path), "--device", "tpu", "--reference",
                                    "1"])
    assert bad.exit_code == 2 and "--device 'tpu'" in bad.output
    if not torch.cuda.is_available():
        code, report = verify_reference(tmp_path, "--device", "cuda")
        assert code == 1 and [p["kind"] for p in report["problems"]] == ["reference_unavailable"]
        assert "torch sees no GPU" in report["problems"][0]["detail"]
        code, report = verify_reference(tmp_path, "--device", "auto")
        assert code == 0 and report["reference"]["device"] == "cpu"
