"""`regen verify` on real run files: passes on a good run, fails naming the shard and sample on each damage."""

from __future__ import annotations

import datetime as dt

import numpy as np
import orjson
import pytest
from click.testing import CliRunner

from app.base.clock import shared_now
from app.base.jsonl_zst import dumps_jsonl_zst, loads_jsonl_zst
from app.cli import main
from app.data.run_reader import RunReader
from app.data.verify import verify_run
from tests.support.synthetic_run import Spec, build_run
from tests.support.verify_runs import kinds, run_verify


@pytest.mark.parametrize("capture", ["inline", "staged", "off"])
def test_good_run_passes(tmp_path, capture):
    build_run(tmp_path, Spec(capture=capture, worker_rejects={5}))
    code, report = run_verify(tmp_path)
    assert code == 0, report["problems"]
    acc = report["accounting"]
    assert acc["identity_holds"] and acc["written"] == 12 and acc["rejected_worker"] == 1
    assert acc["read"] == 12 + 2 + 1
    assert report["shards"] == {"done": 3}


def test_human_output_names_problems(tmp_path):
    built = build_run(tmp_path)
    built.storage.delete(built.store.done_path("shard-000001"))
    result = CliRunner().invoke(main, ["verify", "synth", "--storage", str(tmp_path)])
    assert result.exit_code == 1
    assert "missing" in result.output and "shard-000001" in result.output and "FAILED" in result.output


def test_deleted_marker_is_missing_and_breaks_accounting(tmp_path):
    built = build_run(tmp_path)
    built.storage.delete(built.store.done_path("shard-000001"))
    code, report = run_verify(tmp_path)
    assert code == 1
    assert ("missing", "shard-000001", None) in kinds(report)
    assert ("accounting", None, None) in kinds(report)
    assert report["accounting"]["missing"] == 4


def test_a_dead_shard_is_accounted_for_and_fails_an_incomplete_run_unless_allowed(tmp_path):
    built = build_run(tmp_path)
    built.storage.delete(built.store.done_path("shard-000002"))
    built.storage.write_json(built.store.dead_path("shard-000002"), {"shard_id": "shard-000002", "reason": "boom"})
    code, report = run_verify(tmp_path)
    assert code == 1 and report["accounting"]["identity_holds"] and report["accounting"]["dead_lettered"] == 4
    assert [p["kind"] for p in report["problems"]] == ["dead"]
    assert report["headline"] == "INCOMPLETE: 4 samples missing: 1 shards dead-lettered (4 samples)"
    result = CliRunner().invoke(main, ["verify", "synth", "--storage", str(tmp_path)])
    assert result.exit_code == 1
    assert result.output.splitlines()[0] == "verify: INCOMPLETE: 4 samples missing: 1 shards dead-lettered (4 samples)"
    code, report = run_verify(tmp_path, "synth", "--allow-incomplete")  # a run in progress
    assert code == 0 and [p["severity"] for p in report["problems"]] == ["warning"]
    code, _ = run_verify(tmp_path, "synth", "--allow-incomplete", "--strict")
    assert code == 1


def test_a_run_in_progress_passes_with_allow_incomplete_and_says_what_is_missing(tmp_path):
    built = build_run(tmp_path)
    built.storage.delete(built.store.done_path("shard-000001"))  # not finished yet
    code, report = run_verify(tmp_path)
    assert code == 1 and report["headline"].startswith("INCOMPLETE: 4 samples missing: 1 shards without a")
    code, report = run_verify(tmp_path, "synth", "--allow-incomplete")
    assert code == 0, report["problems"]
    assert {p["kind"] for p in report["problems"]} == {"missing", "accounting"}


def test_deleted_records_and_hidden_files(tmp_path):
    built = build_run(tmp_path)
    marker = built.store.done_marker("shard-000000")
    built.storage.delete(marker["files"]["records"]["path"])
    marker2 = built.store.done_marker("shard-000002")
    built.storage.delete(marker2["files"]["hidden"]["path"])
    code, report = run_verify(tmp_path)
    assert code == 1
    found = kinds(report)
    assert ("missing_file", "shard-000000", None) in found
    assert ("missing_file", "shard-000002", None) in found
    assert ("accounting", None, None) in found  # shard 0's records are not there to count


def test_flipped_byte_in_hidden_file(tmp_path):
    built = build_run(tmp_path)
    rel = built.store.done_marker("shard-000001")["files"]["hidden"]["path"]
    path = tmp_path / rel
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01  # inside the first sample's blobs (the magic is 8 bytes)
    path.write_bytes(bytes(data))
    code, report = run_verify(tmp_path)
    assert code == 1
    found = kinds(report)
    assert ("sha256_mismatch", "shard-000001", None) in found
    first = built.records[4]["sample_id"]
    assert ("hidden_corrupt", "shard-000001", first) in found


def test_flipped_byte_in_hidden_index_is_a_sha256_mismatch(tmp_path):
    """The index and footer are hashed at the end of the one pass (after the samples); damage there is caught."""
    built = build_run(tmp_path)
    rel = built.store.done_marker("shard-000001")["files"]["hidden"]["path"]
    path = tmp_path / rel
    data = bytearray(path.read_bytes())
    data[-20] ^= 0x01  # in the footer's index offset/length: the file no longer opens as a hidden file
    path.write_bytes(bytes(data))
    code, report = run_verify(tmp_path)
    assert code == 1
    found = kinds(report)
    assert ("sha256_mismatch", "shard-000001", None) in found
    assert ("hidden_unreadable", "shard-000001", None) in found


def test_a_staged_runs_capture_marker_carries_sha256_and_the_shared_clock_and_verify_checks_it(tmp_path):
    """Generation's and capture's markers are published by one function: both name their files' sha256 and
    stamp `finished` on the fleet's shared clock, and verify holds the capture file to its marker's hash."""
    built = build_run(tmp_path, Spec(capture="staged"))
    captured = built.storage.read_json(built.store.captured_path("shard-000001"))
    assert len(captured["hidden"]["sha256"]) == 64
    assert abs(dt.datetime.fromisoformat(captured["finished"]).timestamp() - shared_now()) < 60
    assert run_verify(tmp_path)[0] == 0
    path = tmp_path / captured["hidden"]["path"]
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01  # inside the first sample's blobs
    path.write_bytes(bytes(data))
    code, report = run_verify(tmp_path)
    assert code == 1 and ("sha256_mismatch", "shard-000001", None) in kinds(report)
    # a capture marker written before markers carried the hash (no sha256) is read and checked as before
    old = {k: v for k, v in captured.items()}
    old["hidden"] = {k: v for k, v in captured["hidden"].items() if k != "sha256"}
    (tmp_path / built.store.captured_path("shard-000001")).write_bytes(orjson.dumps(old))
    code, report = run_verify(tmp_path)
    assert ("sha256_mismatch", "shard-000001", None) not in kinds(report)
    assert ("hidden_corrupt", "shard-000001", built.records[4]["sample_id"]) in kinds(report)


def test_verify_names_temporaries_left_on_a_finished_shard(tmp_path):
    """A duplicate that died mid-write after its twin published leaves `.ATTEMPT.hidden.rgh.tmp-*` (gigabytes at a
    real model's width); verify names it as a warning: the run's data is whole, the space is not free."""
    build_run(tmp_path)
    folder = tmp_path / "synth" / "shards" / "shard-000002"
    (folder / ".c7afc926d66e.hidden.rgh.tmp-0123456789ab").write_bytes(b"x" * 1000)
    code, report = run_verify(tmp_path)
    assert code == 0
    left = [p for p in report["problems"] if p["kind"] == "leftover_temporaries"]
    assert [(p["shard"], p["severity"]) for p in left] == [("shard-000002", "warning")]
    assert "1,000 bytes" in left[0]["detail"] and ".c7afc926d66e.hidden.rgh.tmp-0123456789ab" in left[0]["detail"]


def test_hidden_files_are_read_once(tmp_path, monkeypatch):
    """verify checks each hidden file's sha256 in the same pass that decodes its samples (not a second read)."""
    from app.base.storage import Storage

    built = build_run(tmp_path)
    read: dict[str, int] = {}
    original = Storage.open

    def counting_open(self, rel, mode="rb"):
        fh = original(self, rel, mode)
        inner_read = fh.read

        def read_and_count(n=-1):
            data = inner_read(n)
            read[rel] = read.get(rel, 0) + len(data)
            return data

        fh.read = read_and_count
        return fh

    monkeypatch.setattr(Storage, "open", counting_open)
    code, report = run_verify(tmp_path)
    assert code == 0, report["problems"]
    hidden = {s: built.store.done_marker(s)["files"]["hidden"] for s in built.store.done_shards()}
    for info in hidden.values():
        # Once through, plus what opening it reads again: the magic, the footer and the (small) index.
        assert info["bytes"] <= read[info["path"]] < info["bytes"] + 1024, (read[info["path"]], info["bytes"])


def test_one_pass_hash_gives_up_on_a_backward_seek():
    import hashlib
    import io

    from app.data.verify import OnePassSha256

    data = bytes(range(256)) * 100
    window = OnePassSha256(io.BytesIO(data))
    window.seek(10)
    assert window.read(5) == data[10:15]
    window.seek(1000)
    assert window.read(3) == data[1000:1003]
    assert window.finish() == hashlib.sha256(data).hexdigest()
    window = OnePassSha256(io.BytesIO(data))
    window.seek(1000)
    window.seek(10)
    assert window.read(5) == data[10:15]
    assert window.finish() is None


def test_zeroed_sample(tmp_path):
    built = build_run(tmp_path, Spec(zero_samples={6}))
    code, report = run_verify(tmp_path)
    assert code == 1
    assert kinds(report) == {("states_zero", "shard-000001", built.records[6]["sample_id"])}


def test_altered_input_id(tmp_path):
    built = build_run(tmp_path)
    rel = built.store.done_marker("shard-000002")["files"]["records"]["path"]
    rows = loads_jsonl_zst((tmp_path / rel).read_bytes())
    rows[1]["input_ids"][3] += 1
    (tmp_path / rel).write_bytes(dumps_jsonl_zst(rows))
    code, report = run_verify(tmp_path)
    assert code == 1
    found = kinds(report)
    assert ("sha256_mismatch", "shard-000002", None) in found
    assert ("token_mismatch", "shard-000002", rows[1]["sample_id"]) in found


def test_broken_loss_mask_and_marker_counts(tmp_path):
    built = build_run(tmp_path)
    rel = built.store.done_marker("shard-000000")["files"]["records"]["path"]
    rows = loads_jsonl_zst((tmp_path / rel).read_bytes())
    rows[0]["loss_mask"][0] = 1
    rows = rows[:3] + rows[3:]  # same count
    (tmp_path / rel).write_bytes(dumps_jsonl_zst(rows))
    _, report = run_verify(tmp_path)
    assert ("loss_mask", "shard-000000", rows[0]["sample_id"]) in kinds(report)


def test_reference_unavailable_is_a_failure(tmp_path):
    build_run(tmp_path)
    report = verify_run(RunReader(str(tmp_path), "synth"), reference=1)
    assert [p.kind for p in report.problems] == ["reference_unavailable"]
    assert not report.ok()


def test_states_equal_what_was_written(tmp_path):
    built = build_run(tmp_path, Spec(capture="staged"))
    reader = RunReader(str(tmp_path), "synth")
    for info, rec in reader.iter_records(status="ok"):
        tokens, states = reader.states(info, rec)
        assert tokens.tolist() == rec["input_ids"][:-1]
        assert np.array_equal(states, built.states[rec["sample_id"]])


@pytest.mark.vllm
@pytest.mark.slow
def test_verify_real_run_with_reference(cpu_worker, e2e_storage, tiny_qwen3, tmp_path_factory):
    """One real run from the session's CPU worker: every check holds, and 2 samples match transformers."""
    from tests.support.runs import produce, prompts_file, wait_run_done

    inputs = prompts_file(tmp_path_factory.mktemp("verify-e2e-inputs"), n_synthetic=4, with_formats=False)
    produce(e2e_storage, "verify-e2e", [inputs], tiny_qwen3)
    wait_run_done(e2e_storage, "verify-e2e")
    code, report = run_verify(e2e_storage, "verify-e2e", "--reference", "2")
    assert code == 0, report["problems"]
    ref = report["reference"]
    # vLLM's prefill and decode steps against one transformers forward, on the tiny random model whose rows have
    # no massive channel (norm ~11): ~1.2% of the row measured here (the absolute figure the old 0.05-per-value
    # check passed); on a model with a channel at 400 the same rounding is ~2e-5 of the row (tests/workers/
    # test_selfcheck.py). Half the bound leaves the run's batch composition room.
    assert ref["checked"] == 2 and ref["failed"] == 0 and 0 < ref["worst"]["error"] < ref["tolerance"] / 2
    assert report["accounting"]["identity_holds"] and report["accounting"]["written_ok"] == 4


def test_masks_with_zeros_over_forced_ids_pass_only_where_the_record_says_so(tmp_path):
    built = build_run(tmp_path)
    rel = built.store.done_marker("shard-000000")["files"]["records"]["path"]
    rows = loads_jsonl_zst((tmp_path / rel).read_bytes())
    for row in rows[:4]:
        n_p, n_o = row["num_prompt_tokens"], row["num_output_tokens"]
        first = n_p + min(1, n_o - 1)
        row["loss_mask"][first] = 0
        row["forced"] = [[first, first + 1]]
    rows[0]["budget_closed"] = True  # right: the zero is where the record says the engine forced an id
    rows[1]["loop_stopped"] = True
    rows[1]["loss_mask"][rows[1]["num_prompt_tokens"] + rows[1]["num_output_tokens"] - 1] = 0  # not in `forced`
    # rows[2]: `forced` without budget_closed or loop_stopped
    rows[3]["budget_closed"] = True
    rows[3]["forced"] = [[0, 1]]  # inside the prompt
    (tmp_path / rel).write_bytes(dumps_jsonl_zst(rows))
    _, report = run_verify(tmp_path)
    bad = {sample for kind, _, sample in kinds(report) if kind == "loss_mask"}
    assert bad == {rows[1]["sample_id"], rows[2]["sample_id"], rows[3]["sample_id"]}
