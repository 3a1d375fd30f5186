"""The whole fleet on the tiny hybrid (Qwen3.5: Gated DeltaNet + full attention), both checkpoint shapes.

One `regen worker --cpu` on the text-only shape serves the produce/worker tests (tests/support/workers.py);
`regen run --cpu` runs each shape end to end on its own. Captured states are compared with transformers at a
linear-attention layer (vLLM ids 1, 2) and at the full-attention layer (4, before the final norm).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from app.base.hidden_file import HiddenFileReader, bf16_to_float32
from app.base.ledger import attempt_errors
from app.base.storage import RunStore, Storage
from app.cli import main
from tests.support.faults import (
    assert_redone_elsewhere,
    in_flight_shard,
    in_flight_shards,
    prompts_beyond_the_slots,
    report,
)
from tests.support.polling import wait_for
from tests.support.redis_db import HYBRID_BROKER, redis_or_fail, redis_url
from tests.support.runs import (
    produce,
    prompts_file,
    run_records,
    run_states,
    wait_run_done,
    wait_run_done_after_kills,
)
from tests.support.workers import (
    HYBRID_KINDS,
    HYBRID_LAYERS,
    OPERATOR_ARG,
    engine_host_pid,
    process_gone,
    worker_env,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MAX_ABS = 0.05  # bf16 noise between vLLM's CPU kernels and transformers (measured ~0.001 on this model)
RUN_BROKER = redis_url(10)  # `regen run`'s own workers: apart from the session's hybrid worker


def assert_states_match_transformers(model: Path, states: dict, n: int = 6) -> float:
    from app.data.reference import ReferenceCapture

    ref = ReferenceCapture(str(model), [1, 2, 4])
    worst = 0.0
    for token_ids, got in list(states.values())[:n]:
        want = ref.capture(token_ids.tolist())
        diff = np.abs(bf16_to_float32(got) - bf16_to_float32(want))
        per_layer = diff.max(axis=(0, 2))  # linear, linear, full attention
        assert (per_layer < MAX_ABS).all(), per_layer
        assert (np.abs(bf16_to_float32(got)).max(axis=(0, 2)) > 0).all()
        worst = max(worst, float(diff.max()))
    ref.close()
    return worst


TOKEN_MISS = "token_outside_sampling"


def verify_ok(storage: Path, run_id: str, reference: int = 4) -> dict:
    """`regen verify --reference` passes, every generated token of the checked samples within its record's
    sampling (a capture engine's speculative sampler on these CPUs needs app.base.library_patches.fix_vllm_cpu_expand)."""
    result = CliRunner().invoke(main, ["verify", run_id, "--storage", str(storage), "--reference", str(reference),
                                       "--json"], catch_exceptions=False)
    report_ = json.loads(result.output[result.output.index("{"):])
    assert report_["ok"] and not report_["problems"], result.output[-3000:]
    assert report_["reference"]["checked"] == reference
    tokens = report_["reference"]["tokens"]
    assert tokens["outside"] == 0
    print(f"{run_id}: {tokens['tokens']} generated tokens judged, worst {tokens['worst_sigma']} sd from the edge")
    return report_


@pytest.fixture(scope="module")
def hybrid_storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hybrid-storage")


@pytest.fixture(scope="module")
def hybrid_inline(hybrid_worker, hybrid_storage, tiny_hybrid, tmp_path_factory):
    inputs = prompts_file(tmp_path_factory.mktemp("hybrid-inputs"))
    state = produce(hybrid_storage, "hybrid-inline", [inputs], tiny_hybrid, "--layers", HYBRID_LAYERS,
                    broker=HYBRID_BROKER)
    wait_run_done(hybrid_storage, "hybrid-inline")
    return state


def test_a_hybrid_runs_states_equal_transformers_at_linear_and_full_attention_layers(hybrid_inline, hybrid_storage,
                                                                                    tiny_hybrid):
    manifest = json.loads((hybrid_storage / "hybrid-inline" / "run.json").read_text())
    assert manifest["settings"]["layers"]["kinds"] == HYBRID_KINDS
    assert manifest["settings"]["model"]["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert manifest["software"]["vllm"] == __import__("vllm").__version__
    worst = assert_states_match_transformers(tiny_hybrid, run_states(hybrid_storage, "hybrid-inline"))
    print(f"hybrid inline: max |vLLM - transformers| {worst:.4f}")
    verify_ok(hybrid_storage, "hybrid-inline")


def test_a_token_the_targets_sampling_could_not_have_produced_fails_verify_reference(hybrid_inline, hybrid_storage,
                                                                                     tiny_hybrid, tmp_path):
    """A right run's tokens pass (every generated token judged at its record's sampling); one record's last token
    replaced by the test-only injector with the token transformers rates lowest there fails, naming its position."""
    import shutil

    import torch

    from app.data.reference import ReferenceCapture
    from tests.support.token_injection_for_tests import inject_last_token

    records = [r for r in run_records(hybrid_storage, "hybrid-inline") if r["status"] == "ok"]
    right = verify_ok(hybrid_storage, "hybrid-inline", reference=len(records))
    tokens = right["reference"]["tokens"]
    assert tokens["samples"] == len(records) and tokens["tokens"] == sum(r["num_output_tokens"] for r in records)
    shutil.copytree(hybrid_storage / "hybrid-inline", tmp_path / "hybrid-inline")
    rec = records[0]
    ref = ReferenceCapture(str(tiny_hybrid), [1])
    _, final = ref.capture_with_final(rec["input_ids"][:-1])
    with torch.inference_mode():
        lowest = int(ref.head(final[-1:]).float().argmin())
    ref.close()
    position = inject_last_token(tmp_path, "hybrid-inline", rec["shard_id"], rec["sample_id"], lowest)
    result = CliRunner().invoke(main, ["verify", "hybrid-inline", "--storage", str(tmp_path), "--reference",
                                       str(len(records)), "--json"], catch_exceptions=False)
    report_ = json.loads(result.output[result.output.index("{"):])
    assert result.exit_code == 1 and not report_["ok"]
    misses = {p["sample"]: p for p in report_["problems"] if p["kind"] == TOKEN_MISS}
    assert set(misses) == {rec["sample_id"]}, report_["problems"]
    assert misses[rec["sample_id"]]["shard"] == rec["shard_id"]
    index = rec["num_prompt_tokens"] + position
    assert f"output token {position} (input_ids[{index}]) = {lowest}: p=" in misses[rec["sample_id"]]["detail"]
    assert report_["reference"]["failed"] == 0  # its states are still the target's: only the token is wrong
    assert report_["reference"]["tokens"]["outside"] == 1


def test_a_hybrid_staged_capture_equals_transformers_too(hybrid_worker, hybrid_storage, tiny_hybrid,
                                                         tmp_path):
    inputs = prompts_file(tmp_path, n_synthetic=6, with_formats=False)
    produce(hybrid_storage, "hybrid-staged", [inputs], tiny_hybrid, "--layers", HYBRID_LAYERS, "--capture",
            "staged", broker=HYBRID_BROKER)
    wait_run_done(hybrid_storage, "hybrid-staged")
    wait_run_done(hybrid_storage, "hybrid-staged", marker="captured")
    assert_states_match_transformers(tiny_hybrid, run_states(hybrid_storage, "hybrid-staged", staged=True))
    verify_ok(hybrid_storage, "hybrid-staged")


def test_the_operators_vllm_setting_reaches_the_engine_and_its_attempt_records(hybrid_inline, hybrid_worker,
                                                                               hybrid_storage):
    # the engine's own config holds the value (logged from its VllmConfig once built), not just the command line
    assert "vLLM settings from --vllm-arg, as the engine holds them: max_num_batched_tokens=6144" in hybrid_worker.text()
    store = RunStore(Storage(str(hybrid_storage)), "hybrid-inline")
    for shard in sorted(store.done_shards()):
        for attempt in attempt_errors(store, shard):
            engine = dict(attempt["engine"])
            mode, key = engine.pop("mode"), engine.pop("mode_key")  # the built engine's mode (issue 35's record)
            assert engine == {"vllm": __import__("vllm").__version__, "vllm_args": [OPERATOR_ARG],
                              "speculative": None,  # a capture engine's own config is the capture's
                              "speculative_config": {"method": "extract_hidden_states",
                                                     "num_speculative_tokens": 1}}
            assert mode["max_num_batched_tokens"] == 6144 and key.startswith("cpu vLLM ")  # the operator's value


def test_layer_ids_typed_out_of_order_are_stored_under_true_labels(hybrid_worker, hybrid_storage, tiny_hybrid,
                                                                   tmp_path):
    """`--layers vllm:4,1,2` on the 4-layer model: vLLM returns the layers ascending whatever order they are asked
    in, so each stored slot must carry the label of the layer it holds (judged against transformers per row)."""
    from app.base.states_compare import compare
    from app.data.reference import ReferenceCapture

    inputs = prompts_file(tmp_path, n_synthetic=3, with_formats=False)
    produce(hybrid_storage, "hybrid-unsorted", [inputs], tiny_hybrid, "--layers", "vllm:4,1,2", "--max-tokens", "16",
            broker=HYBRID_BROKER)
    wait_run_done(hybrid_storage, "hybrid-unsorted")
    manifest = json.loads((hybrid_storage / "hybrid-unsorted" / "run.json").read_text())
    assert manifest["settings"]["layers"]["spec"] == "vllm:4,1,2"
    assert manifest["settings"]["layers"]["vllm_ids"] == [1, 2, 4]
    store = RunStore(Storage(str(hybrid_storage)), "hybrid-unsorted")
    checked = 0
    for shard in sorted(store.done_shards()):
        with store.storage.open(store.done_marker(shard)["files"]["hidden"]["path"]) as fh:
            reader = HiddenFileReader(fh)
            for i, entry in enumerate(reader.entries):
                tokens, states = reader.read(i)
                labels = list(entry["layers"])
                ref = ReferenceCapture.from_model(reference_model(tiny_hybrid), labels)
                try:
                    result = compare(ref.capture(tokens.tolist()), states, labels)
                finally:
                    ref.close()
                assert result.ok, (labels, result.line())
                checked += 1
    assert checked == 3
    code, report_ = verify_json(hybrid_storage, "hybrid-unsorted")
    assert code == 0, report_["problems"]


def test_the_padding_tokens_zero_rows_are_its_states_not_a_capture_fault(hybrid_worker, hybrid_storage, tiny_hybrid,
                                                                            tmp_path):
    """The padding token's embedding row is zero, and on a hybrid its rows stay zero through the linear-attention
    layers (transformers gives the same): the manifest lists the token, the worker stores those rows as they are
    (no flag, no re-capture), plain verify passes them, and they equal transformers'. (Found in CI: the random
    model sampled the padding token mid-answer, and the every-row check took its rows for a capture fault.)"""
    from transformers import AutoTokenizer

    pad = AutoTokenizer.from_pretrained(str(tiny_hybrid)).pad_token_id
    inputs = tmp_path / "prompts.jsonl"
    inputs.write_text("".join(json.dumps({"question": f"Repeat <|endoftext|> and then {i}."}) + "\n"
                              for i in range(3)))
    produce(hybrid_storage, "hybrid-padding", [inputs], tiny_hybrid, "--layers", HYBRID_LAYERS, "--max-tokens", "8",
            broker=HYBRID_BROKER)
    wait_run_done(hybrid_storage, "hybrid-padding")
    manifest = json.loads((hybrid_storage / "hybrid-padding" / "run.json").read_text())
    assert manifest["settings"]["model"]["zero_embedding_ids"] == [pad]
    states = run_states(hybrid_storage, "hybrid-padding")
    assert len(states) == 3
    for token_ids, rows in states.values():
        at_pad = np.flatnonzero(token_ids == pad)
        assert len(at_pad) >= 1
        values = bf16_to_float32(rows)
        assert (np.abs(values[at_pad, :2]).max(axis=-1) == 0).all()  # zero at the linear-attention layers
        assert (np.abs(values[at_pad, 2]).max(axis=-1) > 0).all()  # the full-attention layer mixes others in
    for rec in run_records(hybrid_storage, "hybrid-padding"):
        assert rec["status"] == "ok" and "states_zero" not in rec["flags"] and "capture_repaired" not in rec
    assert_states_match_transformers(tiny_hybrid, states, n=3)
    code, report_ = verify_json(hybrid_storage, "hybrid-padding")
    assert code == 0, report_["problems"]


_MODELS: dict = {}


def reference_model(path: Path):
    """The hybrid loaded once in transformers for the label test (hooks are added and removed per layer list)."""
    if path not in _MODELS:
        import torch
        from transformers import AutoModelForCausalLM

        _MODELS[path] = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    return _MODELS[path]


def verify_json(storage: Path, run_id: str) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["verify", run_id, "--storage", str(storage), "--json"], catch_exceptions=False)
    return result.exit_code, json.loads(result.output[result.output.index("{"):])


def test_a_hybrid_shard_survives_a_sigkill_of_its_worker(hybrid_worker, hybrid_storage, tiny_hybrid,
                                                         tmp_path):
    inputs = prompts_beyond_the_slots(hybrid_worker, tmp_path)
    state = produce(hybrid_storage, "hybrid-sigkill", [inputs], tiny_hybrid, "--layers", HYBRID_LAYERS,
                    "--max-tokens", "48", broker=HYBRID_BROKER)
    store = RunStore(Storage(str(hybrid_storage)), "hybrid-sigkill")
    starts = hybrid_worker.text().count("engine self-test passed")
    wait_for(lambda: in_flight_shard(store), 240, "a shard in flight", interval=0.05)
    child = hybrid_worker.child_pids()[0]
    engine = engine_host_pid(child)
    os.kill(child, signal.SIGKILL)
    killed = in_flight_shards(store)
    wait_for(lambda: process_gone(engine), 30, f"engine process {engine} to end with its worker")
    hybrid_worker.wait_ready(count=starts + 1)  # the supervisor's fresh worker redoes the killed shards
    wait_run_done_after_kills(hybrid_storage, "hybrid-sigkill", broker=HYBRID_BROKER)
    assert_redone_elsewhere(store, killed, child)
    report(hybrid_storage, "hybrid-sigkill", state["counts"]["enqueued"])
    assert not store.dead_shards()
    assert_states_match_transformers(tiny_hybrid, run_states(hybrid_storage, "hybrid-sigkill"), n=3)


@pytest.mark.parametrize("shape,capture", [("text-only", "inline"), ("multimodal", "staged")])
def test_regen_run_completes_on_both_hybrid_checkpoint_shapes(shape, capture, tiny_hybrid, tiny_hybrid_mm,
                                                              hybrid_redis, tmp_path):
    model = tiny_hybrid if shape == "text-only" else tiny_hybrid_mm
    redis_or_fail(RUN_BROKER).flushdb()  # nothing left from an earlier session's runs
    inputs = prompts_file(tmp_path, n_synthetic=8, with_formats=False)
    storage = tmp_path / "storage"
    env = {**worker_env(RUN_BROKER), "REGEN_VISIBILITY_TIMEOUT": "60"}
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "run", str(inputs), "--model", str(model), "--cpu", "--run", "h",
         "--storage", str(storage), "--broker", RUN_BROKER, "--layers", HYBRID_LAYERS, "--capture", capture,
         "--max-tokens", "24", "--shard-size", "4", "--max-model-len", "2048", "--vllm-arg", OPERATOR_ARG,
         "--timeout", "400"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert assert_states_match_transformers(model, run_states(storage, "h", staged=capture == "staged")) < MAX_ABS
    verify_ok(storage, "h", reference=2)
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / ".regen" / "logs" / "h").glob("*.log"))
    assert "max_num_batched_tokens=6144" in logs
