"""A run with a lossy `--states-dtype`: recorded in the manifest, checked by verify, reported by stats, read as bf16.

The producer records the stored dtype and its bound; the worker's quality gate reads the states before they are
quantised; every lossy sample's measured error sits in its hidden file's index, `regen verify` holds it to the
manifest's bound, `regen stats` sums it per layer, and every reader returns bf16.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from app.base.errors import ConfigError
from app.base.hidden_file import bf16_to_float32, float32_to_bf16
from app.base.states_codec import bound, promised_bound
from app.cli import main
from app.data.dataset import RegenDataset
from app.data.run_reader import RunReader
from producer.estimate import build_estimate
from producer.produce import produce
from producer.run_setup import ProduceOptions
from tests.support.producer import QUEUE, sharegpt_row, write_jsonl
from tests.support.redis_db import PRODUCER_REDIS
from tests.support.synthetic_run import HIDDEN, LAYERS, Spec, build_run, ok_records
from tests.support.verify_runs import kinds, run_verify
from workers.shard.states import check_and_encode

FP8 = "fp8-e4m3"


def _row_errors(a_u16: np.ndarray, b_u16: np.ndarray) -> np.ndarray:
    a, b = bf16_to_float32(a_u16).astype(np.float64), bf16_to_float32(b_u16).astype(np.float64)
    return np.linalg.norm(b - a, axis=-1) / np.linalg.norm(a, axis=-1)


# -- the worker's encoder ---------------------------------------------------------------------------------


def test_the_quality_gate_reads_the_states_before_they_are_quantised():
    rng = np.random.default_rng(0)
    ids = np.arange(6)
    good = float32_to_bf16(rng.standard_normal((6, 2, 32)).astype(np.float32))
    problems, sample = check_and_encode("a", ids.tolist(), ids, good, [1, 2], 1, stored=FP8)
    assert problems == [] and sample.codec == FP8
    nan = good.copy()
    nan[2, 1, 7] = 0x7FC0
    problems, sample = check_and_encode("b", ids.tolist(), ids, nan, [1, 2], 1, stored=FP8)
    assert problems == ["states_nonfinite"] and sample.codec == "bf16"  # kept exactly as the engine gave it
    zero = good.copy()
    zero[:, 1] = 0
    problems, sample = check_and_encode("c", ids.tolist(), ids, zero, [1, 2], 1, stored=FP8)
    assert problems == ["states_zero"]


# -- verify ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capture", ["inline", "staged"])
def test_a_lossy_run_passes_verify_and_every_sample_records_its_error(tmp_path, capture):
    built = build_run(tmp_path, Spec(capture=capture, states_dtype=FP8))
    code, report = run_verify(tmp_path)
    assert code == 0, report["problems"]
    manifest = json.loads((tmp_path / "synth" / "run.json").read_text())
    assert manifest["settings"]["states"] == {"dtype": FP8, "max_rel_error": promised_bound(FP8, HIDDEN)}
    with RunReader(str(tmp_path), "synth") as reader:
        for info in reader.shards():
            for entry in reader.hidden_reader(info).entries:
                assert entry["codec"] == FP8 and 0 < max(entry["max_rel_error"]) <= bound(FP8, HIDDEN)
    assert len(built.states) == 12


def _set_states(tmp_path, **states) -> None:
    path = tmp_path / "synth" / "run.json"
    manifest = json.loads(path.read_text())
    manifest["settings"]["states"].update(states)
    path.write_text(json.dumps(manifest))


def test_verify_fails_every_sample_whose_recorded_error_is_above_the_manifests_bound(tmp_path):
    built = build_run(tmp_path, Spec(states_dtype=FP8))
    _set_states(tmp_path, max_rel_error=0.001)
    code, report = run_verify(tmp_path)
    assert code == 1
    errors = {(k, s) for k, _, s in kinds(report)}
    assert errors == {("states_error", r["sample_id"]) for r in ok_records(built)}
    assert "above the run's bound 0.001" in report["problems"][0]["detail"]


def test_verify_fails_samples_stored_in_another_dtype_than_the_run_says(tmp_path):
    build_run(tmp_path, Spec(states_dtype="bf16-m4"))
    _set_states(tmp_path, dtype=FP8)
    code, report = run_verify(tmp_path)
    assert code == 1 and {k for k, _, _ in kinds(report)} == {"states_dtype"}


def test_verify_of_a_lossless_run_is_unchanged(tmp_path):
    build_run(tmp_path)
    code, report = run_verify(tmp_path)
    assert code == 0 and report["problems"] == []


# -- stats and readers ---------------------------------------------------------------------------------------


def test_stats_reports_the_recorded_error_per_layer(tmp_path):
    build_run(tmp_path, Spec(states_dtype=FP8, shards=2))
    result = CliRunner().invoke(main, ["stats", "synth", "--storage", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    states = json.loads(result.stdout)["states"]
    assert states["dtype"] == FP8 and states["lossy_samples"] == 8 and states["lossless_samples"] == 0
    assert [row["layer"] for row in states["layers"]] == LAYERS
    with RunReader(str(tmp_path), "synth") as reader:
        entries = [e for info in reader.shards() for e in reader.hidden_reader(info).entries]
    for k, row in enumerate(states["layers"]):
        assert row["max"] == max(e["max_rel_error"][k] for e in entries) <= states["max_rel_error_bound"]
        tokens = sum(e["n_tokens"] for e in entries)
        rms = np.sqrt(sum(e["rms_rel_error"][k] ** 2 * e["n_tokens"] for e in entries) / tokens)
        assert row["rms"] == pytest.approx(rms) and 0 < row["rms"] <= row["max"]
    report = tmp_path / "report.html"
    text = CliRunner().invoke(main, ["stats", "synth", "--storage", str(tmp_path), "--html", str(report)],
                              terminal_width=200).output
    assert f"stored states: {FP8}" in text and "8 samples stored fp8-e4m3, 0 lossless" in text
    page = report.read_text()
    first = states["layers"][0]
    assert f"<h2>stored states: {FP8}" in page and f"<td>{LAYERS[0]}</td><td>{first['max']:.5f}</td>" in page
    plain = tmp_path / "plain"
    build_run(plain)
    lossless = json.loads(CliRunner().invoke(main, ["stats", "synth", "--storage", str(plain), "--json"]).stdout)
    assert lossless["states"] == {"dtype": "bf16", "max_rel_error_bound": 0.0}


@pytest.mark.parametrize("capture", ["inline", "staged"])
def test_the_dataset_returns_bf16_within_the_bound_of_what_was_captured(tmp_path, capture):
    built = build_run(tmp_path, Spec(capture=capture, states_dtype=FP8))
    ds = RegenDataset(str(tmp_path), "synth")
    for i, rec in enumerate(ok_records(built)):
        item = ds[i]
        hs = item["hidden_states"]
        assert hs.dtype == torch.bfloat16 and hs.shape == (len(rec["input_ids"]) - 1, len(LAYERS), HIDDEN)
        stored = hs.view(torch.int16).numpy().view(np.uint16)
        captured = built.states[rec["sample_id"]]
        assert not np.array_equal(stored, captured)  # lossy indeed
        assert _row_errors(captured, stored).max() <= promised_bound(FP8, HIDDEN)


# -- the producer ----------------------------------------------------------------------------------------------


def test_produce_records_the_resolved_dtype_and_its_bound_and_resume_keeps_it(producer_redis, tmp_path,
                                                                               tiny_config_model):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i) for i in range(5)])
    opts = ProduceOptions(inputs=[str(path)], run_id="r1", storage=str(tmp_path / "store"),
                          model=str(tiny_config_model), broker=PRODUCER_REDIS, queue=QUEUE, shard_size=4,
                          states_dtype="lossy")
    produce(opts)
    manifest = json.loads((tmp_path / "store" / "r1" / "run.json").read_text())
    hidden = manifest["settings"]["model"]["hidden_size"]
    assert manifest["settings"]["states"] == {"dtype": FP8, "max_rel_error": promised_bound(FP8, hidden)}
    result = produce(ProduceOptions(run_id="r1", resume=True, storage=opts.storage, broker=PRODUCER_REDIS, queue=QUEUE))
    assert result.status == "produced"
    with pytest.raises(Exception, match="states.dtype"):
        produce(ProduceOptions(**{**opts.__dict__, "states_dtype": "bf16"}))


def test_a_run_made_before_the_setting_existed_reopens_as_bf16(producer_redis, tmp_path,
                                                               tiny_config_model):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i) for i in range(5)])
    opts = ProduceOptions(inputs=[str(path)], run_id="r1", storage=str(tmp_path / "store"),
                          model=str(tiny_config_model), broker=PRODUCER_REDIS, queue=QUEUE, shard_size=4)
    produce(opts)
    run_json = tmp_path / "store" / "r1" / "run.json"
    manifest = json.loads(run_json.read_text())
    del manifest["settings"]["states"]
    run_json.write_text(json.dumps(manifest))
    assert produce(opts).status == "already_produced"
    with pytest.raises(Exception, match="states"):
        produce(ProduceOptions(**{**opts.__dict__, "states_dtype": FP8}))


def test_a_lossy_dtype_without_capture_is_refused(tmp_path, tiny_config_model):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(0)])
    with pytest.raises(ConfigError, match="--capture off"):
        produce(ProduceOptions(inputs=[str(path)], model=str(tiny_config_model), capture="off", states_dtype=FP8,
                               storage=str(tmp_path / "s"), dry_run=True))


def test_the_dry_run_shows_the_disk_for_each_stored_dtype(producer_redis, tmp_path, tiny_model):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i, "hello world " * 20) for i in range(20)])
    result = CliRunner().invoke(main, ["produce", str(path), "--storage", str(tmp_path / "store"), "--model",
                                       str(tiny_model), "--broker", PRODUCER_REDIS, "--queue", QUEUE, "--dry-run",
                                       "--states-dtype", "lossy"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    by_dtype = {ln.split()[0]: ln for ln in lines if ln.startswith("  ") and ln.split()[0] in
                ("bf16", FP8, "bf16-m3", "bf16-m4")}
    assert set(by_dtype) == {"bf16", FP8, "bf16-m3", "bf16-m4"}
    assert by_dtype[FP8].startswith(f"  {FP8} *") and "lossless" in by_dtype["bf16"]
    assert [dtype for dtype, line in by_dtype.items() if " * " in line] == [FP8]
    e = build_estimate(samples=914_000, token_counts=[1000], max_tokens=4000, assumed_response_tokens=2000,
                       layers=5, hidden_size=5120, states_dtype=FP8)
    text = "\n".join(e.stored_lines())
    assert "140.4 TB" not in text and " 96.8 TB" in text and " 61.0 TB" in text  # 140.4 TB raw: / 1.45, / 2.30
    assert "error <= 0.0671" in text
