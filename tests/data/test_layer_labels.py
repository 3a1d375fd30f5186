"""Slot labels are the layers the slots hold: ids typed in any order are stored ascending (vLLM's order), and a run
made before that (its manifest lists them out of order) is named by `regen verify` and refused by workers."""

from __future__ import annotations

import pytest

from app.base.errors import ConfigError
from app.base.layers import ascending_problem, parse_layers
from tests.support.synthetic_run import Spec, build_run
from tests.support.verify_runs import kinds, run_verify


@pytest.mark.parametrize(("spec", "vllm"), [("vllm:4,1,2", (1, 2, 4)), ("hf:3,1", (1, 3)),
                                            ("dflash:2,0", (1, 3)), ("vllm:1,2,4", (1, 2, 4))])
def test_typed_ids_in_any_order_are_stored_ascending(spec, vllm):
    selection = parse_layers(spec, 4)
    assert selection.vllm == vllm
    manifest = selection.to_manifest()
    assert manifest["spec"] == spec  # what the operator typed stays on record
    assert manifest["vllm_ids"] == list(vllm) and manifest["dflash_ids"] == [v - 1 for v in vllm]
    assert ascending_problem(manifest["vllm_ids"]) is None


def test_an_old_runs_out_of_order_ids_are_named():
    why = ascending_problem([4, 1, 2])
    assert "[4, 1, 2] out of ascending order" in why and "hold layers [1, 2, 4]" in why


def test_verify_names_a_run_whose_labels_are_out_of_order(tmp_path):
    build_run(tmp_path, Spec(layers=(4, 1, 2)))
    code, report = run_verify(tmp_path)
    assert code == 1
    assert ("layers_order", None, None) in kinds(report)


def test_verify_passes_ascending_labels(tmp_path):
    build_run(tmp_path, Spec(layers=(1, 2, 4)))
    code, report = run_verify(tmp_path)
    assert code == 0, report["problems"]


def test_a_worker_refuses_to_add_to_an_out_of_order_run(tmp_path):
    from workers.process.plan import settings_from_run

    build_run(tmp_path, Spec(layers=(4, 1, 2)))
    with pytest.raises(ConfigError, match=r"run synth: the run lists capture layers \(vLLM ids\) \[4, 1, 2\]"):
        settings_from_run(str(tmp_path), "synth", "regen")
    build_run(tmp_path / "fine", Spec(layers=(1, 2, 4)))
    assert settings_from_run(str(tmp_path / "fine"), "synth", "regen")[1] == [1, 2, 4]
