"""`regen stats` on a crafted run with 87% stubs: the terminal summary and the HTML report both show it."""

from __future__ import annotations

import base64
import json
import re

import pytest
from click.testing import CliRunner

from app.base.records import prompt_id
from app.cli import main
from app.data.run_reader import RunReader
from app.data.stats import collect, plots
from tests.support.synthetic_run import Spec, build_run, ok_records, stub_count


def stubby(tmp_path):
    # 100 samples, 87 of them stubs (`<think></think>OK.`), 1 worker-rejected.
    return build_run(tmp_path / "s", Spec(shards=10, shard_size=10, stub_fraction=0.87))


def test_stub_rate_in_terminal_and_html(tmp_path):
    built = stubby(tmp_path)
    assert stub_count(built) == 87 and len(ok_records(built)) == 100
    report = tmp_path / "report.html"
    result = CliRunner().invoke(main, ["stats", "synth", "--storage", str(tmp_path / "s"), "--html", str(report)],
                                catch_exceptions=False, terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "stub-or-empty: 87.0% of samples (87 of 100; pause threshold 20%)" in result.output
    page = report.read_text()
    assert re.search(r'color:#cc3311[^>]*>stub-or-empty: 87\.0% of samples', page)
    assert "<td>a.jsonl</td><td>50</td>" in page and "<td>b.jsonl</td><td>50</td>" in page
    assert "<td>flag empty_reasoning</td><td>87</td><td>87.0%</td>" in page
    assert "<td>flag stub_answer</td><td>79</td><td>79.0%</td>" in page  # 8 stubs are also truncated
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 3 and all(base64.b64decode(i).startswith(b"\x89PNG") for i in images)


def test_numbers(tmp_path):
    built = stubby(tmp_path)
    st = collect(RunReader(str(tmp_path / "s"), "synth"))
    ok = ok_records(built)
    assert st.total.ok == 100 and st.total.stubs == 87 and st.stub_alarm
    assert st.prompt == [r["num_prompt_tokens"] for r in ok]
    assert st.reasoning == [r["num_output_tokens"] - r["num_answer_tokens"] for r in ok]
    assert st.mask_sum == [r["num_output_tokens"] for r in ok]
    assert st.total.finish["length"] == sum(1 for r in ok if r["finish_reason"] == "length")
    assert {s: g.ok for s, g in st.sources.items()} == {"a.jsonl": 50, "b.jsonl": 50}
    assert len(st.speed) == 10 and {w for w, _, _ in st.speed} == {"w0", "w1"}
    pngs = plots(st)
    (tmp_path / "hist.png").write_bytes(pngs["token_histograms"])
    assert set(pngs) == {"token_histograms", "finish_and_flags", "speed"}


def test_healthy_run_is_green_and_json(tmp_path):
    build_run(tmp_path / "s", Spec(stub_fraction=0.1))
    result = CliRunner().invoke(main, ["stats", "synth", "--storage", str(tmp_path / "s"), "--json"])
    data = json.loads(result.output)
    assert data["ok"] == 12 and data["stub_alarm"] is False and 0 < data["stub_rate"] < 0.2


def test_in_progress_run_reads_done_shards(tmp_path):
    built = build_run(tmp_path / "s")
    built.storage.delete(built.store.done_path("shard-000002"))
    st = collect(RunReader(str(tmp_path / "s"), "synth"))
    assert st.shards_done == 2 and st.shards_total == 3 and st.total.ok == 8


def test_a_mixed_runs_source_and_flag_tables_are_split_by_mode():
    """A source's stub rate means nothing across modes (non-thinking answers are short by design): in a mixed run
    each source row is followed by its modes' rows, the run-wide flags and finish reasons carry a rate per mode,
    and the HTML report has the finish reasons per mode."""
    from app.data.stats import RunStats, ShardRead, _flag_rows, _source_rows, add_shard, render_html

    st = RunStats("mixed", 0.2, run_modes=("thinking", "non_thinking"))
    ok = [("a.jsonl", 10, 50, 5, 50, ["stub_answer"], "stop", "thinking"),
          ("a.jsonl", 10, 8, 8, 8, [], "stop", "non_thinking"),
          ("a.jsonl", 10, 64, 0, 64, ["truncated"], "length", "non_thinking"),
          ("b.jsonl", 10, 40, 10, 40, [], "stop", "thinking")]
    add_shard(st, ShardRead(None, [], ok, ["prompt_too_long"]))
    flags = sorted(st.total.flags)
    rows = _source_rows(st, flags)
    assert [r[:3] for r in rows] == [["a.jsonl", "3", "33.3%"], ["  a.jsonl, thinking", "1", "100.0%"],
                                     ["  a.jsonl, non-thinking", "2", "0.0%"], ["b.jsonl", "1", "0.0%"],
                                     ["  b.jsonl, thinking", "1", "0.0%"]]
    by_what = {r[0]: r[1:] for r in _flag_rows(st, flags)}
    assert by_what["flag truncated"] == [1, "25.0%", "0.0%", "50.0%"]
    assert by_what["finish stop"] == [3, "75.0%", "100.0%", "50.0%"]
    assert by_what["rejected prompt_too_long"] == [1, "", "", ""]
    page = render_html(st, {})
    assert "<h2>finish reasons per mode</h2>" in page and "<th>rate, non-thinking</th>" in page
    assert "<td>  a.jsonl, non-thinking</td><td>2</td>" in page
    single = RunStats("plain", 0.2)
    add_shard(single, ShardRead(None, [], [("a.jsonl", 10, 50, 5, 50, [], "stop", "thinking")], []))
    assert _source_rows(single, []) == [["a.jsonl", "1", "0.0%", "50"]]  # one mode: the tables as before
    assert _flag_rows(single, []) == [["finish stop", 1, "100.0%"]]


def test_the_yield_splits_tokens_and_seconds_by_outcome_and_counts_what_export_keeps(tmp_path):
    """A run with every outcome: 12 samples, index 3 worker-rejected, 7 and 11 stubs, 10 cut at max_tokens (its
    thinking had closed, so the export keeps it), 6 never closed its thinking (left out), 5 stopped for looping,
    1 and 8 closed by the thinking budget; the yield is what `regen export` really writes."""
    marks = {1: {"budget_closed": True}, 8: {"budget_closed": True}, 6: {"flags": ["missing_think_end"]},
             5: {"loop_stopped": True, "flags": ["repetition_loop"]}}
    seconds = (0.5, 2.0, 0.25, 0.0, 1.0, 4.0, 8.0, 0.5, 2.0, 1.0, 16.0, 0.25)
    for i, s in enumerate(seconds):
        marks.setdefault(i, {})["seconds"] = s
    built = build_run(tmp_path / "s", Spec(stub_fraction=0.25, worker_rejects={3}, marks=marks))
    by_index = {int(r["sample_id"], 16): r for r in built.records}
    expected = {"complete": [0, 2, 4, 9], "budget_closed": [1, 8], "cut": [6, 10], "looped": [5], "stub": [7, 11],
                "rejected": [3]}
    st = collect(RunReader(str(tmp_path / "s"), "synth"))
    for name, indices in expected.items():
        o = st.outcomes[name]
        tokens = sum(by_index[i].get("num_output_tokens") or 0 for i in indices)
        assert (o.samples, o.tokens) == (len(indices), tokens), name
        assert o.seconds == pytest.approx(sum(by_index[i].get("seconds") or 0 for i in indices)), name
    # what the export writes: every ok conversation but index 6's (unterminated thinking)
    out = tmp_path / "export"
    result = CliRunner().invoke(main, ["export", "synth", "--storage", str(tmp_path / "s"), "--format", "sharegpt",
                                       "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    kept = {row["id"] for path in out.rglob("*.jsonl") for row in map(json.loads, path.read_text().splitlines())}
    kept_tokens = sum(r["num_output_tokens"] for r in ok_records(built) if prompt_id(r) in kept)
    assert len(kept) == 10 and st.trainable_tokens == kept_tokens
    assert st.outcomes["cut"].trainable_samples == 1 and st.outcomes["rejected"].trainable_tokens == 0
    generated = sum(r["num_output_tokens"] for r in ok_records(built))
    line = (f"yield: {100 * kept_tokens / generated:.1f}% of generated tokens end in a trainable sample "
            f"({kept_tokens:,} of {generated:,}; what `regen export` keeps by default)")
    report = tmp_path / "report.html"
    shown = CliRunner().invoke(main, ["stats", "synth", "--storage", str(tmp_path / "s"), "--html", str(report)],
                               catch_exceptions=False, terminal_width=250)
    assert line in shown.output and "budget" in shown.output and "looped" in shown.output
    page = report.read_text()
    assert line in page
    looped = st.outcomes["looped"]
    assert (f"<tr><td>looped</td><td>1</td><td>{looped.tokens:,}</td><td>{100 * looped.tokens / generated:.1f}%</td>"
            f"<td>4.0</td>") in page
    data = json.loads(CliRunner().invoke(main, ["stats", "synth", "--storage", str(tmp_path / "s"), "--json"]).output)
    assert data["yield"]["trainable_tokens"] == kept_tokens
    assert data["yield"]["outcomes"]["budget_closed"]["samples"] == 2
