"""`regen export`: each format loads with its consumer's reader and round-trips ids, masks and states exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from app.cli import main
from tests.synthetic_run import Spec, build_run, ok_records, stub_count


def export(root, out, fmt, *extra):
    result = CliRunner().invoke(main, ["export", "synth", "--storage", str(root), "--format", fmt,
                                       "--out", str(out), *extra], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def load_rows(out, fmt):
    import datasets

    files = sorted(str(p) for p in (out / "data").glob("*.parquet" if fmt == "parquet" else "*.jsonl"))
    ds = datasets.load_dataset("parquet" if fmt == "parquet" else "json", data_files=files, split="train",
                               cache_dir=str(out.parent / "hf-cache"))
    return list(ds)


def test_parquet_round_trip(tmp_path):
    built = build_run(tmp_path / "s", Spec(worker_rejects={2}))
    output = export(tmp_path / "s", tmp_path / "out", "parquet")
    rows = load_rows(tmp_path / "out", "parquet")
    want = ok_records(built)
    assert [r["sample_id"] for r in rows] == [r["sample_id"] for r in want]
    for got, rec in zip(rows, want, strict=True):
        assert got["input_ids"] == rec["input_ids"] and got["loss_mask"] == rec["loss_mask"]
        assert got["flags"] == rec["flags"] and got["answer"] == rec["answer"]
        assert json.loads(got["messages"]) == rec["messages"]
    assert "status:rejected" in output and "11" in output


def test_sharegpt_round_trip_and_filters(tmp_path):
    built = build_run(tmp_path / "s", Spec(stub_fraction=0.5))
    output = export(tmp_path / "s", tmp_path / "out", "sharegpt", "--exclude-flags", "stub_answer,truncated")
    rows = load_rows(tmp_path / "out", "sharegpt")
    keep = [r for r in ok_records(built) if not {"stub_answer", "truncated"} & set(r["flags"])]
    assert 0 < len(keep) < len(ok_records(built))
    assert [r["id"] for r in rows] == [r["sample_id"] for r in keep]
    for got, rec in zip(rows, keep, strict=True):
        conv = got["conversations"]
        assert [t["from"] for t in conv] == ["system", "human", "gpt"]
        assert conv[1]["value"] == rec["messages"][1]["content"]
        assert conv[-1]["value"] == rec["answer"] and conv[-1]["reasoning_content"] == rec["reasoning"]
    filtered = {}
    for f in (tmp_path / "out" / "done").glob("*.json"):
        for k, v in json.loads(f.read_text())["filtered"].items():
            filtered[k] = filtered.get(k, 0) + v
    assert filtered == {"flag:stub_answer": stub_count(built), "flag:truncated": 1} and stub_count(built) == 6
    assert "flag:stub_answer" in output and "flag:truncated" in output


def test_speculators_round_trip(tmp_path):
    import torch
    from safetensors.torch import load_file

    built = build_run(tmp_path / "s", Spec(capture="staged", stub_fraction=0.3))
    export(tmp_path / "s", tmp_path / "out", "speculators", "--min-response-tokens", "10")
    rows = load_rows(tmp_path / "out", "speculators")
    keep = [r for r in ok_records(built) if r["num_output_tokens"] >= 10]
    assert [r["id"] for r in rows] == [r["sample_id"] for r in keep] and len(keep) < len(ok_records(built))
    for got, rec in zip(rows, keep, strict=True):
        assert got["input_ids"] == rec["input_ids"] and got["loss_mask"] == rec["loss_mask"]
        tensors = load_file(str(tmp_path / "out" / got["hidden_states_path"]))
        assert str(tensors["hidden_states"].dtype) == "torch.bfloat16"
        bits = tensors["hidden_states"].view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(bits, built.states[rec["sample_id"]])
        assert tensors["token_ids"].tolist() == rec["input_ids"][:-1]
        assert tensors["token_ids"].dtype == torch.int64


def test_export_resumes_and_refuses_other_settings(tmp_path):
    build_run(tmp_path / "s")
    out = tmp_path / "out"
    export(tmp_path / "s", out, "sharegpt")
    first = (out / "data" / "shard-000001.jsonl").read_bytes()
    (out / "done" / "shard-000001.json").unlink()
    (out / "data" / "shard-000001.jsonl").unlink()
    mtime0 = (out / "data" / "shard-000000.jsonl").stat().st_mtime_ns
    output = export(tmp_path / "s", out, "sharegpt")
    assert "1 / 2" in output  # one shard redone, two skipped
    assert (out / "data" / "shard-000001.jsonl").read_bytes() == first
    assert (out / "data" / "shard-000000.jsonl").stat().st_mtime_ns == mtime0
    assert len(load_rows(out, "sharegpt")) == 12
    result = CliRunner().invoke(main, ["export", "synth", "--storage", str(tmp_path / "s"), "--format", "sharegpt",
                                       "--out", str(out), "--min-response-tokens", "5"])
    assert result.exit_code == 2 and "min_response_tokens" in result.output


def test_speculators_needs_states(tmp_path):
    build_run(tmp_path / "s", Spec(capture="off"))
    result = CliRunner().invoke(main, ["export", "synth", "--storage", str(tmp_path / "s"), "--format",
                                       "speculators", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "no hidden states" in result.output


@pytest.mark.parametrize("fmt", ["sharegpt", "parquet"])
def test_export_of_run_in_progress_then_rest(tmp_path, fmt):
    built = build_run(tmp_path / "s")
    marker = built.store.done_path("shard-000002")
    saved = (tmp_path / "s" / marker).read_bytes()
    (tmp_path / "s" / marker).unlink()
    export(tmp_path / "s", tmp_path / "out", fmt)
    assert len(load_rows(tmp_path / "out", fmt)) == 8
    (tmp_path / "s" / marker).write_bytes(saved)
    export(tmp_path / "s", tmp_path / "out", fmt)
    assert len(list((tmp_path / "out" / "done").glob("*.json"))) == 3
