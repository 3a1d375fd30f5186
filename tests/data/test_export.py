"""`regen export`: each format loads with its consumer's reader and round-trips ids, masks and states exactly."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from click.testing import CliRunner

from app.cli import main
from tests.support.synthetic_run import Spec, build_run, ok_records, stub_count


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


def test_speculators_rows_are_the_ids_the_states_cover_and_states_round_trip(tmp_path):
    """Synthetic staged run: row i is hs_i, token_ids == input_ids == the record's ids minus the uncovered last."""
    import datasets
    import torch
    from safetensors.torch import load_file

    built = build_run(tmp_path / "s", Spec(capture="staged", stub_fraction=0.3))
    export(tmp_path / "s", tmp_path / "out", "speculators", "--min-response-tokens", "10")
    ds = datasets.load_from_disk(str(tmp_path / "out"))
    keep = [r for r in ok_records(built) if r["num_output_tokens"] >= 10]
    assert ds["id"] == [r["sample_id"] for r in keep] and len(keep) < len(ok_records(built))
    for i, rec in enumerate(keep):
        row = ds[i]
        tensors = load_file(str(tmp_path / "out" / "hidden_states" / f"hs_{i}.safetensors"))
        assert row["input_ids"].tolist() == tensors["token_ids"].tolist() == rec["input_ids"][:-1]
        assert row["loss_mask"].tolist() == rec["loss_mask"][:-1] and int(row["seq_len"]) == len(rec["input_ids"]) - 1
        assert tensors["token_ids"].dtype == torch.int64 and tensors["hidden_states"].dtype == torch.bfloat16
        bits = tensors["hidden_states"].view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(bits, built.states[rec["sample_id"]])  # layers 1, 2 then the final 4: stored order
    freq = torch.load(tmp_path / "out" / "token_freq.pt", weights_only=True)
    want = Counter(t for r in keep for t, m in zip(r["input_ids"][:-1], r["loss_mask"][:-1], strict=True) if m)
    assert freq == dict(want)
    # samples.jsonl names each number's sample; a run made before modes and several samples per prompt: each
    # sample is its own prompt, in the run's one mode
    named = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert named == [{"index": i, "sample_id": r["sample_id"], "prompt_id": r["sample_id"], "thinking": True}
                     for i, r in enumerate(keep)]


def test_trainer_export_resumes_numbering_and_removes_a_killed_attempts_files(tmp_path):
    build_run(tmp_path / "s")
    out = tmp_path / "out"
    export(tmp_path / "s", out, "specforge-dflash")
    first = {p.name: p.read_bytes() for p in (out / "rows_0-2000").iterdir()}
    assert sorted(first) == sorted(f"data_{i}.ckpt" for i in range(12))
    (out / "done" / "shard-000002.json").unlink()  # as if killed while writing the last shard ...
    (out / "rows_0-2000" / "data_40.ckpt").write_bytes(b"junk")  # ... and a stray file past the count
    output = export(tmp_path / "s", out, "specforge-dflash")
    assert "1 / 2" in output
    assert {p.name: p.read_bytes() for p in (out / "rows_0-2000").iterdir()} == first


def test_a_format_without_the_layers_it_needs_is_refused_in_one_line(tmp_path):
    build_run(tmp_path / "s", Spec(layers=(1, 2)))
    for fmt, extra, words in [
        ("speculators", (), ["final layer (vLLM id 4)", "--layers vllm:1,2,4"]),
        ("specforge-eagle3", (), ["final layer (vLLM id 4)", "--layers vllm:1,2,4"]),
        ("specforge-dflash", ("--layers", "vllm:1,3"), ["[3]", "--layers vllm:1,2,3"]),
    ]:
        result = CliRunner().invoke(main, ["export", "synth", "--storage", str(tmp_path / "s"), "--format", fmt,
                                           "--out", str(tmp_path / fmt), *extra])
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
        assert all(w in result.output for w in words), result.output
    build_run(tmp_path / "t")  # layers 1, 2, 4: the final one but only two auxiliary layers
    result = CliRunner().invoke(main, ["export", "synth", "--storage", str(tmp_path / "t"), "--format",
                                       "specforge-eagle3", "--out", str(tmp_path / "e")])
    assert result.exit_code == 2 and "exactly 3 auxiliary layers" in result.output and "[1, 2]" in result.output


def test_the_eagle3_preset_captures_three_auxiliary_layers_and_the_final_one():
    from app.base.layers import parse_layers

    assert parse_layers("eagle3", 64).vllm == (2, 32, 61, 64)  # vLLM's / speculators' default plus N
    assert parse_layers("eagle3", 36).vllm == (2, 18, 33, 36)
    assert parse_layers("eagle3", 4).vllm == (1, 2, 3, 4)  # the default collides on tiny models: spread out


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


@pytest.mark.parametrize("fmt", ["speculators", "specforge-dflash", "specforge-eagle3"])
def test_hidden_state_formats_need_states(tmp_path, fmt):
    build_run(tmp_path / "s", Spec(capture="off"))
    result = CliRunner().invoke(main, ["export", "synth", "--storage", str(tmp_path / "s"), "--format",
                                       fmt, "--out", str(tmp_path / "o")])
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
