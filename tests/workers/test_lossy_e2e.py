"""End to end on the CPU: a `--states-dtype lossy` run through the real worker stores FP8, records each sample's
error, passes `regen verify --reference`, and reads back as bf16 within the bound of what transformers computes.

Both capture paths are run: inline (states encoded as each request finishes) and staged (the capture task), and
the tiny hybrid (Gated DeltaNet + full attention) is checked per layer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from app.base.states_compare import compare
from app.cli import main
from app.data.verify_reference import reference_bound
from tests.support.redis_db import HYBRID_BROKER
from tests.support.runs import produce, prompts_file, run_states, wait_run_done
from tests.support.workers import HYBRID_KINDS, HYBRID_LAYERS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
FP8 = "fp8-e4m3"


@pytest.mark.parametrize("capture", ["inline", "staged"])
def test_a_lossy_run_stores_fp8_within_its_bound_and_passes_verify_with_the_reference(
        capture, cpu_worker, e2e_storage, tiny_qwen3, tmp_path_factory):
    from app.data.reference import ReferenceCapture

    run_id = f"lossy-{capture}"
    inputs = prompts_file(tmp_path_factory.mktemp(f"{run_id}-inputs"), n_synthetic=4, with_formats=False)
    produce(e2e_storage, run_id, [inputs], tiny_qwen3, "--states-dtype", "lossy", "--capture", capture)
    wait_run_done(e2e_storage, run_id, marker="done" if capture == "inline" else "captured")
    settings = json.loads((e2e_storage / run_id / "run.json").read_text())["settings"]
    bound = settings["states"]["max_rel_error"]
    assert settings["states"]["dtype"] == FP8 and 0.06 < bound < 0.07

    result = CliRunner().invoke(main, ["verify", run_id, "--storage", str(e2e_storage), "--json", "--reference", "2"])
    report = json.loads(result.stdout)
    assert result.exit_code == 0, report["problems"]
    assert report["reference"]["checked"] == 2 and report["reference"]["states_dtype"] == FP8
    assert 0 < report["reference"]["excess"] <= 1

    from app.base.hidden_file import HiddenFileReader
    from app.base.storage import RunStore, Storage

    store = RunStore(Storage(str(e2e_storage)), run_id)
    entries = []
    for shard in store.done_shards():
        marker = store.done_marker(shard) if capture == "inline" else store.storage.read_json(store.captured_path(shard))
        path = marker["files"]["hidden"]["path"] if capture == "inline" else marker["hidden"]["path"]
        with store.storage.open(path) as fh:
            entries += HiddenFileReader(fh).entries
    assert len(entries) == 4 and {e["codec"] for e in entries} == {FP8}
    assert all(0 < max(e["max_rel_error"]) <= bound for e in entries)

    reference = ReferenceCapture(str(tiny_qwen3), settings["layers"]["vllm_ids"])
    for token_ids, stored in run_states(e2e_storage, run_id, staged=capture == "staged").values():
        assert stored.dtype == np.uint16  # bf16 bit patterns, whatever the file holds
        result = compare(reference.capture(token_ids.tolist()), stored, bound=reference_bound(bound))
        assert result.ok, result.line()


def test_a_lossy_hybrid_run_stays_within_its_bound_at_linear_and_full_attention_layers(
        hybrid_worker, tiny_hybrid, tmp_path_factory):
    from app.data.reference import ReferenceCapture

    storage = tmp_path_factory.mktemp("lossy-hybrid-storage")
    inputs = prompts_file(tmp_path_factory.mktemp("lossy-hybrid-inputs"), n_synthetic=4, with_formats=False)
    produce(storage, "lossy-hybrid", [inputs], tiny_hybrid, "--layers", HYBRID_LAYERS, "--states-dtype", "lossy",
            broker=HYBRID_BROKER)
    wait_run_done(storage, "lossy-hybrid")
    settings = json.loads((storage / "lossy-hybrid" / "run.json").read_text())["settings"]
    bound = settings["states"]["max_rel_error"]
    assert settings["layers"]["kinds"] == HYBRID_KINDS  # linear, linear, full attention

    result = CliRunner().invoke(main, ["verify", "lossy-hybrid", "--storage", str(storage), "--json",
                                       "--reference", "2"])
    report = json.loads(result.stdout)
    assert result.exit_code == 0, report["problems"]
    reference = ReferenceCapture(str(tiny_hybrid), settings["layers"]["vllm_ids"])
    states = run_states(storage, "lossy-hybrid")
    assert len(states) == 4
    for token_ids, stored in states.values():
        result = compare(reference.capture(token_ids.tolist()), stored, settings["layers"]["vllm_ids"],
                         bound=reference_bound(bound))
        # each layer, linear and full attention alike, within the bound
        assert result.ok and all(f.worst_error <= reference_bound(bound) for f in result.per_layer), result.line()
    reference.close()
