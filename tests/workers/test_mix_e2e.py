"""A mixed run end to end on the session's worker: `--thinking-mix 0.5 --samples-per-prompt 2` through the real
producer, Redis, worker and vLLM, then verify, stats and the text exports. The trainers' own readers and
SpecForge's trainer take the same kind of run in tests/data/test_trainer_exports.py."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from click.testing import CliRunner

from app.base.thinking_modes import draw_thinking
from app.cli import main
from app.data.run_reader import RunReader
from app.data.verify_checks import ShardResult, check_mode
from tests.support.producer import decode_queue
from tests.support.runs import produce, prompts_file, run_records, wait_run_done
from tests.support.verify_runs import run_verify

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RUN = "mixed"
SEED = 5


@pytest.fixture(scope="module")
def mixed_run(cpu_worker, e2e_storage, tiny_qwen3, tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixed-inputs")
    inputs = prompts_file(folder, n_synthetic=6)
    lines = inputs.read_text().splitlines()
    # two rows name their own mode, against what the draw would give them half of the time
    lines[-1] = json.dumps({**json.loads(lines[-1]), "enable_thinking": False})
    lines[-2] = json.dumps({**json.loads(lines[-2]), "enable_thinking": True})
    inputs.write_text("\n".join(lines) + "\n")
    state = produce(e2e_storage, RUN, [inputs], tiny_qwen3, "--thinking-mix", "0.5", "--samples-per-prompt", "2",
                    "--seed", str(SEED))
    wait_run_done(e2e_storage, RUN)
    return inputs, state, run_records(e2e_storage, RUN)


def ok(records):
    return [r for r in records if r["status"] == "ok"]


def test_every_record_is_rendered_and_sampled_in_its_own_mode(mixed_run, tiny_qwen3):
    from transformers import AutoTokenizer

    from workers.shard.generate import render_prompt

    _, state, records = mixed_run
    tok = AutoTokenizer.from_pretrained(str(tiny_qwen3))
    assert len(records) == state["counts"]["samples"] == 2 * state["counts"]["enqueued"]
    for rec in ok(records):
        want = render_prompt(tok, rec["messages"], rec["tools"], rec["thinking"])
        assert rec["input_ids"][:rec["num_prompt_tokens"]] == want, rec["sample_id"]
        # each mode's Qwen sampling
        assert rec["sampling"] == ({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0} if rec["thinking"]
                                   else {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0})
        if not rec["thinking"]:
            assert rec["reasoning"] is None and "missing_think_end" not in rec["flags"]
        rule = rec["mode_rule"]
        assert rule in ("mix", "input")
        if rule == "mix":
            assert rec["thinking"] == draw_thinking(0.5, SEED, rec["sample_id"])
    assert {r["thinking"] for r in ok(records)} == {True, False}
    assert sum(r["mode_rule"] == "input" for r in records) == 4  # two rows, two samples each
    assert state["counts"]["modes"] == {"thinking": sum(r["thinking"] for r in records),
                                        "non_thinking": sum(not r["thinking"] for r in records)}


def test_a_second_produce_with_the_same_seed_sends_the_same_modes(mixed_run, e2e_storage, tiny_qwen3, e2e_redis):
    inputs, _, records = mixed_run
    queue = "regen-mixed-idle"  # nobody consumes it: the messages are read back, then dropped
    produce(e2e_storage, "mixed-again", [inputs], tiny_qwen3, "--thinking-mix", "0.5", "--samples-per-prompt", "2",
            "--seed", str(SEED), queue=queue)
    try:
        sent = {s["id"]: s["thinking"] for m in decode_queue(e2e_redis, queue) for s in m["kwargs"]["samples"]}
    finally:
        e2e_redis.delete(queue)
    assert sent == {r["sample_id"]: r["thinking"] for r in records}


def test_each_prompt_has_k_samples_with_their_own_seeds_and_outputs(mixed_run):
    _, state, records = mixed_run
    by_prompt = defaultdict(list)
    for rec in records:
        by_prompt[rec["prompt_id"]].append(rec)
    assert len(by_prompt) == state["counts"]["enqueued"]
    for prompt, recs in by_prompt.items():
        assert sorted(r["sample_index"] for r in recs) == [0, 1]
        assert {r["sample_id"] for r in recs} == {prompt, f"{prompt}-s1"}
        assert len({r["seed"] for r in recs}) == 2
        outs = [r["input_ids"][r["num_prompt_tokens"]:] for r in recs if r["status"] == "ok"]
        assert len(outs) < 2 or outs[0] != outs[1], prompt


def test_verify_passes_and_holds_each_record_to_its_modes_prompt(mixed_run, e2e_storage):
    code, report = run_verify(e2e_storage, RUN)
    assert code == 0, report["problems"]
    assert report["accounting"]["identity_holds"] and report["accounting"]["samples"] == len(mixed_run[2])
    settings = RunReader(str(e2e_storage), RUN).settings
    rec = ok(mixed_run[2])[0]
    res = ShardResult(rec["shard_id"], "done")
    assert check_mode(res, rec, settings) and not res.problems
    assert not check_mode(res, {**rec, "thinking": not rec["thinking"]}, settings)
    assert [p.kind for p in res.problems] == ["mode"]


def test_stats_split_every_table_by_mode(mixed_run, e2e_storage, tmp_path):
    records = ok(mixed_run[2])
    html = tmp_path / "stats.html"
    result = CliRunner().invoke(main, ["stats", RUN, "--storage", str(e2e_storage), "--json", "--html", str(html)])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout[:result.stdout.rindex("}") + 1])
    for mode, thinking in (("thinking", True), ("non_thinking", False)):
        mine = [r for r in records if r["thinking"] == thinking]
        assert stats["modes"][mode]["ok"] == len(mine)
        assert stats["modes"][mode]["output_tokens"] == sum(r["num_output_tokens"] for r in mine)
        assert stats["modes"][mode]["answer_tokens"] == sum(r["num_answer_tokens"] for r in mine)
    text = html.read_text()
    assert "<h2>per mode</h2>" in text and 'alt="flags_per_mode"' in text and "non-thinking: stub-or-empty" in text
    terminal = CliRunner().invoke(main, ["stats", RUN, "--storage", str(e2e_storage)])
    assert "per mode" in terminal.output and "answer tokens (non-thinking)" in terminal.output


def test_text_exports_keep_each_sample_in_its_own_mode_and_name_its_prompt(mixed_run, e2e_storage, tmp_path):
    records = {r["sample_id"]: r for r in ok(mixed_run[2])}
    out = tmp_path / "sharegpt"
    result = CliRunner().invoke(main, ["export", RUN, "--storage", str(e2e_storage), "--format", "sharegpt",
                                       "--out", str(out), "--include-unterminated"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for f in sorted(out.rglob("*.jsonl")) for line in f.read_text().splitlines()]
    assert rows and {r["id"] for r in rows} <= set(records)
    for row in rows:
        rec = records[row["id"]]
        assert row["prompt_id"] == rec["prompt_id"] and row["thinking"] == rec["thinking"]
        last = row["conversations"][-1]
        assert (last["reasoning_content"] is None) == (not rec["thinking"]) or not rec["reasoning"]


def test_the_pilots_measurement_and_forecast_split_by_mode(mixed_run, e2e_storage, tmp_path):
    """What `regen pilot` measures of a mixed run, per mode, and the forecast it makes of the whole job from it
    (a pilot's runs are `regen run`s with the run's --thinking-mix; this run stands in for one)."""
    from app.pilot.forecast import forecast
    from app.pilot.measure import measure_run

    records = ok(mixed_run[2])
    measured = measure_run(str(e2e_storage), RUN, devices=1)
    for mode, thinking in (("thinking", True), ("non_thinking", False)):
        mine = [r for r in records if r["thinking"] == thinking]
        got = measured["modes"][mode]
        assert got["samples"] == len(mine)
        assert got["generated_tokens"] == sum(r["num_output_tokens"] for r in mine)
        assert got["context_tokens"] == sum(len(r["input_ids"]) - 1 for r in mine)
    settings = RunReader(str(e2e_storage), RUN).settings
    pilot = {"version": 1, "name": "mixed", "host": "here",
             "device": {"kind": "cpu", "class": "cpu", "count": 1, "names": ["cpu"], "indices": None},
             "sample": {"size": measured["ok"], "seed": SEED},
             "model": settings["model"], "inputs": {"files": ["/data/in.jsonl"], "samples": 1000},
             "settings": {"layers": "vllm:1,2,3,4", "max_tokens": 24, "shard_size": 4, "thinking": True,
                          "thinking_mix": 0.5, "samples_per_prompt": 2},
             "candidates": [{"candidate": {"name": "inline", "capture": "inline", "task_slots": 2},
                             "measured": measured}]}
    plan = forecast([pilot])
    assert plan["input_samples"] == 2000  # 1000 prompts x 2 samples
    modes = plan["modes"]
    assert sum(m["samples"] for m in modes.values()) == pytest.approx(2000)
    assert modes["thinking"]["samples"] == pytest.approx(2000 * measured["modes"]["thinking"]["samples"]
                                                         / measured["ok"])
    for key in ("generated_tokens", "context_tokens", "device_hours", "export_bytes"):
        assert sum(m[key] for m in modes.values()) == pytest.approx(plan[key])
    assert sum(m["disk_bytes"]["bf16"] for m in modes.values()) == pytest.approx(plan["disk_bytes"]["bf16"])
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(pilot))
    shown = CliRunner().invoke(main, ["pilot", "--forecast-only", str(path)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "non-thinking: device-hours" in shown.output and "thinking: samples (" in shown.output
    assert "--thinking-mix 0.5" in shown.output and "--samples-per-prompt 2" in shown.output
