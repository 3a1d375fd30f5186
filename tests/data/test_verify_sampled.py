"""`regen verify --sample`: every shard's records and index are checked, the states of only a few are decoded."""

from __future__ import annotations

from app.base.jsonl_zst import dumps_jsonl_zst, loads_jsonl_zst
from app.data.run_reader import RunReader
from app.data.verify import verify_run
from tests.support.synthetic_run import Spec, build_run
from tests.support.verify_runs import kinds, run_verify


def _spread_over_workers(built, n_workers: int) -> None:
    """Give each shard's marker a worker of its own (the synthetic run has one), as a fleet's run has."""
    for k, shard in enumerate(sorted(built.store.done_shards())):
        marker = built.store.done_marker(shard)
        marker["worker"] = f"w{k % n_workers}"
        built.storage.delete(built.store.done_path(shard))
        built.storage.write_json(built.store.done_path(shard), marker)


def test_a_sampled_verify_decodes_as_many_states_as_asked_spread_over_workers(tmp_path):
    built = build_run(tmp_path, Spec(shards=6))
    _spread_over_workers(built, 3)
    code, report = run_verify(tmp_path, "synth", "--sample", "3")
    assert code == 0, report["problems"]
    sampled = report["sampled"]
    assert sampled["states_decoded"] == 3 and sampled["of_samples"] == 24
    assert sampled["by_worker"] == {"w0": 1, "w1": 1, "w2": 1}
    assert "states of 21 samples" in sampled["not_read"]
    _, report = run_verify(tmp_path, "synth", "--sample", "0.5")  # a fraction of the ok samples
    assert report["sampled"]["states_decoded"] == 12


def test_a_sampled_verify_still_finds_a_broken_record_in_a_shard_it_does_not_decode(tmp_path):
    built = build_run(tmp_path)
    rel = built.store.done_marker("shard-000000")["files"]["records"]["path"]
    rows = loads_jsonl_zst((tmp_path / rel).read_bytes())
    rows[0]["loss_mask"][0] = 1
    rows[1]["input_ids"].append(5)  # one token more than the hidden file's index holds
    rows[1]["num_output_tokens"] += 1
    rows[1]["loss_mask"].append(1)
    (tmp_path / rel).write_bytes(dumps_jsonl_zst(rows))
    report = verify_run(RunReader(str(tmp_path), "synth"), sample=1)
    found = {(p.kind, p.shard, p.sample) for p in report.problems if p.severity == "error"}
    assert ("loss_mask", "shard-000000", rows[0]["sample_id"]) in found
    assert ("token_mismatch", "shard-000000", rows[1]["sample_id"]) in found


def test_a_zeroed_sample_is_found_when_its_states_are_decoded(tmp_path):
    built = build_run(tmp_path, Spec(zero_samples={6}))
    code, report = run_verify(tmp_path, "synth", "--sample", "100")  # more than the run holds: every sample
    assert code == 1
    assert kinds(report) == {("states_zero", "shard-000001", built.records[6]["sample_id"])}
    assert report["sampled"]["states_decoded"] == 12
