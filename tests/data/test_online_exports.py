"""Token-only exports (`specforge-online`, `speculators-online`) read by the trainers' own code.

Two real CPU runs of the session's worker (tiny Qwen3), one `--capture off` and one capturing inline, are
exported in both formats; SpecForge 0.2.0's `prepare_prompt_tasks` (what `data.prompts_path` goes through) and
speculators 0.9.0's `ArrowDataset` must get every ok record, its ids and loss mask exactly as stored, in the
run's order. speculators' `on_missing="generate"` path then runs for real against a vLLM endpoint on the CPU
(tests/support/hidden_state_server.py), whose states must be those the capture run stored. What SpecForge does with over-long rows and rows with too few supervised ids (docs/formats.md says
it) is pinned against its code on a synthetic run, as are the staged-capture and resume cases.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from app.cli import main
from tests.support.hidden_state_server import hidden_state_server
from tests.support.runs import produce, prompts_file, run_records, run_states, wait_run_done
from tests.support.synthetic_run import Spec, build_run, ok_records

RUNS = {"off": "online-capture-off", "inline": "online-capture-inline"}


def export(storage, run_id: str, out: Path, fmt: str, *extra: str) -> str:
    result = CliRunner().invoke(main, ["export", run_id, "--storage", str(storage), "--format", fmt, "--out",
                                       str(out), *extra], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def specforge_prompts(path: Path, max_length: int = 1 << 20, min_loss_tokens: int = 1, loss_mask_filter=None):
    """The rows as SpecForge's online trainer prepares `data.prompts_path` (a pre-tokenized file needs no
    tokenizer or template: its first record has `input_ids` and `loss_mask`)."""
    from specforge.data.prompt_builder import prepare_prompt_tasks

    tasks = prepare_prompt_tasks(path, None, chat_template=None, max_length=max_length, is_preformatted=False,
                                 train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=None,
                                 min_loss_tokens=min_loss_tokens, loss_mask_filter=loss_mask_filter)
    return [(t["payload"]["input_ids"], t["payload"]["loss_mask"]) for t in tasks]


def check_speculators(folder: Path, records: list[dict]) -> None:
    """speculators' own loader takes the dataset: every row, and no states, so its generate path is the one taken."""
    import datasets
    from speculators.train.data import ArrowDataset, build_client_item

    assert not (folder / "hidden_states").exists()
    ds = ArrowDataset(max_len=4096, datapath=str(folder), on_missing="raise")
    assert len(ds) == len(records)
    assert ds.approx_lengths == [len(r["input_ids"]) for r in records]
    for i, rec in enumerate(records):  # export order = shard order = the run's record order
        row = ds.data[i]
        assert row["input_ids"].tolist() == rec["input_ids"]
        assert row["loss_mask"].tolist() == rec["loss_mask"]
        # on_missing="generate" sends exactly this to the vLLM endpoint, and checks the returned token_ids by it
        assert build_client_item(row)["input_ids"] == rec["input_ids"]
    with pytest.raises(RuntimeError, match="Failed to load hidden states for sample 0"):
        ds[0]  # no hidden_states/hs_0.safetensors: "raise" raises where "generate" would ask the endpoint
    plain = datasets.load_from_disk(str(folder))
    assert plain["id"] == [r["sample_id"] for r in records]


def check_token_freq(folder: Path, records: list[dict]) -> None:
    import torch

    freq = torch.load(folder / "token_freq.pt", weights_only=True)
    want = Counter(t for r in records for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m)
    assert freq == dict(want) and sum(freq.values()) > 0


@pytest.fixture(scope="module")
def runs(cpu_worker, e2e_storage, tiny_qwen3, tmp_path_factory) -> dict[str, list[dict]]:
    """Both runs produced at once on the session's worker, then waited for: capture kind -> ok records."""
    inputs = prompts_file(tmp_path_factory.mktemp("online-inputs"), n_synthetic=8, with_formats=False)
    produce(e2e_storage, RUNS["off"], [inputs], tiny_qwen3, "--max-tokens", "32", "--capture", "off")
    produce(e2e_storage, RUNS["inline"], [inputs], tiny_qwen3, "--max-tokens", "32")
    out = {}
    for kind, run_id in RUNS.items():
        wait_run_done(e2e_storage, run_id)
        out[kind] = [r for r in run_records(e2e_storage, run_id) if r["status"] == "ok"]
        assert len(out[kind]) == 8
    assert not any(r.get("hidden") for r in out["off"]) and all(r.get("hidden") for r in out["inline"])
    return out


@pytest.mark.parametrize("capture", ["off", "inline"])
def test_online_exports_of_a_real_run_load_in_specforge_and_speculators(capture, runs, e2e_storage, tmp_path):
    records = runs[capture]
    output = export(e2e_storage, RUNS[capture], tmp_path / "sf", "specforge-online")
    assert "samples exported" in output and "one file of every row" in output
    prompts = tmp_path / "sf" / "prompts.jsonl"
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert [r["id"] for r in rows] == [r["sample_id"] for r in records]
    assert specforge_prompts(prompts) == [(r["input_ids"], r["loss_mask"]) for r in records]
    check_token_freq(tmp_path / "sf", records)

    export(e2e_storage, RUNS[capture], tmp_path / "spec", "speculators-online")
    check_speculators(tmp_path / "spec", records)
    check_token_freq(tmp_path / "spec", records)


@pytest.fixture(scope="module")
def endpoint(tiny_qwen3, tmp_path_factory):
    """A vLLM endpoint on the runs' model that extracts vLLM layers 1-3 and the last one, 4, as speculators'
    launch_vllm.py would (`--target-layer-ids 1 2 3`, the last layer appended)."""
    folder = tmp_path_factory.mktemp("hidden-state-server")
    with hidden_state_server(tiny_qwen3, [1, 2, 3, 4], folder / "states", folder / "server.log") as url:
        yield url, folder / "states"


def test_speculators_generates_the_states_of_an_online_export_from_a_vllm_endpoint(runs, endpoint, e2e_storage,
                                                                                    tmp_path):
    """The whole online path: speculators' own loader asks a real vLLM endpoint for every row's states, and
    gets the states regen captured for the same ids (the endpoint also covers the last id, which no capture has)."""
    import torch
    from speculators.train.data import ArrowDataset

    url, scratch = endpoint
    records, captured = runs["inline"], run_states(e2e_storage, RUNS["inline"])
    export(e2e_storage, RUNS["inline"], tmp_path / "spec", "speculators-online")
    ds = ArrowDataset(max_len=4096, datapath=str(tmp_path / "spec"), vllm_endpoint=url, on_missing="generate")
    worst, equal = 0.0, 0
    for i, rec in enumerate(records):
        item = ds[i]
        assert isinstance(item, dict), f"speculators dropped sample {i}: {item}"
        n = len(rec["input_ids"])
        assert item["input_ids"].tolist() == rec["input_ids"] and item["loss_mask"].tolist() == rec["loss_mask"]
        got = torch.cat([item["hidden_states"].view(n, 3, -1), item["verifier_last_hidden_states"][:, None]], 1)
        tokens, states = captured[rec["sample_id"]]
        assert tokens.tolist() == rec["input_ids"][:-1]
        want = torch.from_numpy(states.view("<i2")).view(torch.bfloat16).float()
        err = (got[: n - 1].float() - want).abs().amax() / want.abs().amax()
        worst = max(worst, float(err))
        equal += bool(torch.equal(got[: n - 1].float(), want))
    print(f"online vs captured states: worst max error {worst:.2e} of the largest value, {equal} of "
          f"{len(records)} samples bit-equal")
    assert worst < 0.02  # bf16 noise between a prefill and generation's decode steps
    assert not [p for p in scratch.rglob("*.safetensors")]  # speculators deletes what it loaded


def test_specforge_cuts_rows_from_the_head_and_drops_rows_short_of_supervised_ids(tmp_path):
    """What docs/formats.md says SpecForge 0.2.0 does with the rows, checked against its own code."""
    from specforge.data.loss_mask import has_consecutive_supervised_tokens

    built = build_run(tmp_path / "s", Spec(capture="off"))
    export(tmp_path / "s", "synth", tmp_path / "o", "specforge-online")
    records = ok_records(built)
    path = tmp_path / "o" / "prompts.jsonl"
    assert specforge_prompts(path) == [(r["input_ids"], r["loss_mask"]) for r in records]
    cap = max(r["num_prompt_tokens"] for r in records)  # the longest prompts keep no supervised id under it
    for minimum, dflash in ((1, False), (2, True)):
        want = [(r["input_ids"][:cap], r["loss_mask"][:cap]) for r in records
                if sum(r["loss_mask"][:cap]) >= minimum
                and (not dflash or has_consecutive_supervised_tokens(r["loss_mask"][:cap]))]
        got = specforge_prompts(path, max_length=cap, min_loss_tokens=minimum,
                                loss_mask_filter=has_consecutive_supervised_tokens if dflash else None)
        assert got == want
        assert 0 < len(got) < len(records)  # some rows dropped, and the kept ones cut: the check can fail
        assert all(len(ids) == cap for ids, _ in got)


def test_a_staged_run_is_exported_without_waiting_for_its_capture(tmp_path):
    built = build_run(tmp_path / "s", Spec(capture="staged"))
    for marker in (tmp_path / "s" / "synth" / "captured").glob("*.json"):
        marker.unlink()  # generation done, capture not yet
    export(tmp_path / "s", "synth", tmp_path / "o", "specforge-online")
    assert specforge_prompts(tmp_path / "o" / "prompts.jsonl") == [(r["input_ids"], r["loss_mask"])
                                                                   for r in ok_records(built)]


def test_an_export_of_a_run_in_progress_then_the_rest_equals_one_export(tmp_path):
    built = build_run(tmp_path / "s", Spec(capture="off"))
    marker = tmp_path / "s" / built.store.done_path("shard-000001")
    saved = marker.read_bytes()
    marker.unlink()
    for fmt in ("specforge-online", "speculators-online"):
        export(tmp_path / "s", "synth", tmp_path / f"part-{fmt}", fmt)
    marker.write_bytes(saved)
    for fmt in ("specforge-online", "speculators-online"):
        export(tmp_path / "s", "synth", tmp_path / f"part-{fmt}", fmt)
        export(tmp_path / "s", "synth", tmp_path / f"whole-{fmt}", fmt)
    # numbering follows the export: shard 1 comes last in the resumed one, in place in the single one
    whole = (tmp_path / "whole-specforge-online" / "prompts.jsonl").read_text().splitlines()
    part = (tmp_path / "part-specforge-online" / "prompts.jsonl").read_text().splitlines()
    assert sorted(whole) == sorted(part) and len(whole) == len(ok_records(built))
    check_speculators(tmp_path / "whole-speculators-online", ok_records(built))
    import datasets

    resumed = datasets.load_from_disk(str(tmp_path / "part-speculators-online"))
    assert [json.loads(line)["id"] for line in part] == resumed["id"]


def test_layers_are_refused_in_one_line(tmp_path):
    build_run(tmp_path / "s", Spec(capture="off"))
    result = CliRunner().invoke(main, ["export", "synth", "--storage", str(tmp_path / "s"), "--format",
                                       "speculators-online", "--out", str(tmp_path / "o"), "--layers", "vllm:1"])
    assert result.exit_code == 2 and "writes no hidden states" in result.output
    assert "Traceback" not in result.output
