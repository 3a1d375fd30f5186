"""Text exports keep what the model saw, one row per conversation, and SpecForge's regenerated-data rows hold.

SpecForge's `scripts/validate_regenerated_data.py` is not in the `specforge` 0.2.0 wheel on PyPI (only the
`specforge` package is), and the project's tests may not run fetched code, so `specforge_validation_error`
below restates its rules (read in SpecForge a6b6b023, with `scripts/conversation_validation.py`) and the
tests apply them with `--strict-think-markers` and `--expect-reasoning` / `--expect-non-reasoning`.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from click.testing import CliRunner

from app.base.manifest import RunSettings, Sampling, open_or_create
from app.base.records import loss_mask, rejected_record, turn_sample_id
from app.base.storage import RunStore, Storage
from app.cli import main
from producer.accounting import Accounting, write_produce_state
from producer.normalise import normalise
from tests.support.paths import FIXTURES_DIR
from workers.shard.generate import shard_summary
from workers.shard.shard_output import publish_shard

FIXTURES = FIXTURES_DIR / "chat"


def specforge_validation_error(row: dict, expect_reasoning: bool, expect_non_reasoning: bool) -> str | None:
    """SpecForge's rules for one regenerated-data row (strict think markers on); None when the row passes."""
    if not isinstance(row.get("id"), str) or not row["id"].strip():
        return "id must be a non-empty string"
    if row.get("status") != "success":
        return "status must be 'success'"
    messages = row.get("conversations")
    if not isinstance(messages, list) or not messages:
        return "conversations must be a non-empty list"
    expected, saw_user = "user", False
    for i, m in enumerate(messages):
        if not isinstance(m.get("content"), str) or not m["content"].strip():
            return f"message {i} content must be a non-empty string"
        if m.get("role") == "system" and not saw_user:
            continue
        if m.get("role") != expected:
            return f"message {i} expected role {expected}, got {m.get('role')}"
        saw_user, expected = True, "assistant" if m["role"] == "user" else "user"
    if not saw_user:
        return "conversation has no user message"
    assistant = [m for m in messages if m["role"] == "assistant"]
    for m in assistant:
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            return "reasoning_content must be a string or null"
        if expect_non_reasoning and reasoning and reasoning.strip():
            return "non-empty reasoning_content"
        if expect_reasoning and (not isinstance(reasoning, str) or not reasoning.strip()):
            return "empty reasoning_content"
        for text in (m["content"], reasoning or ""):
            if "<think>" in text.lower() or "</think>" in text.lower():
                return "thinking marker"
    if not assistant:
        return "conversation has no assistant message"
    if messages[-1]["role"] != "assistant":
        return "conversation must end with an assistant message"
    return None


def fixture_samples(name: str, regenerate: str = "last") -> list[dict]:
    lines = (FIXTURES / name).read_bytes().splitlines()
    return [normalise(orjson.loads(raw), file=name, line=n + 1, regenerate=regenerate) for n, raw in enumerate(lines)]


def ok_record(sample: dict, messages: list[dict], *, reasoning: str | None = "Let me think.", answer: str = "Done.",
              closed: bool = True, **extra) -> dict:
    prompt, out = [11, 12, 13], [21, 22, 23, 2]
    flags = [] if closed else ["missing_think_end", "truncated"]
    text = f"{reasoning}</think>\n\n{answer}" if closed else reasoning
    return {"sample_id": sample["id"], "source": sample["source"], "messages": messages, "tools": sample["tools"],
            "status": "ok", "input_ids": prompt + out, "loss_mask": loss_mask(len(prompt), len(out)),
            "num_prompt_tokens": len(prompt), "num_output_tokens": len(out), "num_answer_tokens": 2,
            "text": text, "reasoning": reasoning, "answer": answer if closed else "",
            "finish_reason": "stop" if closed else "length", "stop_reason": None, "seed": 1, "flags": flags,
            "hidden": None, "worker": "w0", "device": "cpu", **extra}


def multi_turn_records(sample: dict, answers: list[str], reject_at: int | None = None) -> list[dict]:
    """What workers/shard/multiturn.py writes for one conversation: a record per turn, the turn's prompt being the
    conversation so far with the earlier turns as regenerated."""
    from workers.shard.multiturn import turns_to_regenerate

    conv = [dict(m) for m in sample["messages"]]
    out = []
    for r, slot in enumerate(turns_to_regenerate(conv)):
        context = [{k: v for k, v in m.items() if not k.startswith("original_")} for m in conv[:slot]]
        base = {**sample, "id": turn_sample_id(sample["id"], r)}
        extra = {"conversation_id": sample["id"], "turn": r}
        if r == reject_at:
            out.append(rejected_record({"sample_id": base["id"], "messages": context, "tools": sample["tools"],
                                        "source": sample["source"], **extra}, "prompt_too_long", "test"))
            break
        out.append(ok_record(base, context, reasoning=f"Thinking {r}.", answer=answers[r], **extra))
        conv[slot] = {"role": "assistant", "content": answers[r], "reasoning_content": f"Thinking {r}."}
    return out


def write_run(root: Path, shards: list[list[dict]], *, regenerate: str = "last", thinking: bool = True,
              conversations: int | None = None) -> None:
    """A run on storage with these records (capture off), written with the producer's and workers' own code."""
    store = RunStore(Storage(str(root)), "txt")
    open_or_create(store, RunSettings(
        model={"path": "m", "num_layers": 4, "hidden_size": 16, "model_type": "qwen3", "fingerprint": "x"},
        sampling=Sampling.defaults(thinking, 64), thinking=thinking, capture_mode="off", layers=None,
        shard_size=max(len({r.get("conversation_id", r["sample_id"]) for r in s}) for s in shards),
        max_prompt_tokens=4096, regenerate=regenerate, inputs=[]))
    ctx = SimpleNamespace(worker_name="w0", config=SimpleNamespace(device_class="cpu"), engine_mode_key="synthetic")
    total = 0
    for k, records in enumerate(shards):
        sid = f"shard-{k:06d}"
        records = [{"run_id": "txt", "shard_id": sid, "index": i, **r} for i, r in enumerate(records)]
        summary = shard_summary(records, 1.0, ctx)
        total += summary["samples"]
        publish_shard(store, sid, f"a{k}", records, None, summary)
    acc = Accounting(read=total, enqueued=total, duplicates=0, shards=len(shards))
    write_produce_state(store, producer_settings={}, accounting=acc, complete=True, queue="regen")


def export(root: Path, fmt: str, *extra: str) -> tuple[list[dict], dict, str]:
    out = root.parent / f"out-{fmt}-{len(extra)}"
    result = CliRunner().invoke(main, ["export", "txt", "--storage", str(root), "--format", fmt, "--out", str(out),
                                       *extra], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for f in sorted((out / "data").glob("*.jsonl")) for line in f.read_text().splitlines()]
    left_out: dict = {}
    for f in (out / "done").glob("*.json"):
        for k, v in json.loads(f.read_text())["filtered"].items():
            left_out[k] = left_out.get(k, 0) + v
    return rows, left_out, result.output


def test_sharegpt_rows_keep_tools_tool_calls_with_ids_tool_responses_and_reasoning(tmp_path):
    samples = fixture_samples("toolcall_openai.jsonl") + fixture_samples("hermes_toolcall.jsonl")
    records = [ok_record(s, s["messages"]) for s in samples]
    write_run(tmp_path / "s", [records])
    rows, left_out, _ = export(tmp_path / "s", "sharegpt")
    assert left_out == {} and [r["id"] for r in rows] == [s["id"] for s in samples]
    first = rows[0]["conversations"]
    assert [t["from"] for t in first] == ["system", "human", "gpt", "tool", "tool", "gpt"]
    assert [c["id"] for c in first[2]["tool_calls"]] == ["call_a1", "call_b2"]
    assert first[2]["reasoning_content"] == "Two lookups: weather for Paris, time for Lyon."
    assert [(t["tool_call_id"], t["name"]) for t in first[3:5]] == [("call_a1", "get_weather"), ("call_b2", "get_time")]
    assert json.loads(rows[0]["tools"]) == samples[0]["tools"]
    assert first[-1] == {"from": "gpt", "value": "Done.", "reasoning_content": "Let me think."}
    for row, sample in zip(rows, samples, strict=True):
        # Read back with regen's own reader, the row is the prompt the model saw, turn for turn, and its tools.
        again = normalise(row, file="export", line=1)
        assert again["tools"] == sample["tools"]
        assert [_rendered(m) for m in again["messages"]] == [_rendered(m) for m in sample["messages"]]


def _rendered(m: dict) -> dict:
    """A message as a chat template sees it: a null content renders as an empty one."""
    return {**m, "content": m.get("content") or ""}


def test_unterminated_thinking_is_left_out_and_counted_unless_asked(tmp_path):
    samples = fixture_samples("toolcall_openai.jsonl")
    records = [ok_record(samples[0], samples[0]["messages"]),
               ok_record(samples[1], samples[1]["messages"], reasoning="still thinking about it", closed=False)]
    write_run(tmp_path / "s", [records])
    for fmt in ("sharegpt", "parquet"):
        out = tmp_path / f"o-{fmt}"
        result = CliRunner().invoke(main, ["export", "txt", "--storage", str(tmp_path / "s"), "--format", fmt,
                                           "--out", str(out)], catch_exceptions=False)
        assert result.exit_code == 0 and "left out: unterminated_thinking" in result.output, result.output
    rows, left_out, output = export(tmp_path / "s", "sharegpt")
    assert [r["id"] for r in rows] == [samples[0]["id"]] and left_out == {"unterminated_thinking": 1}
    rows, left_out, _ = export(tmp_path / "s", "sharegpt", "--include-unterminated")
    assert len(rows) == 2 and left_out == {}
    final = rows[1]["conversations"][-1]
    assert final == {"from": "gpt", "value": "", "reasoning_content": "still thinking about it"}
    result = CliRunner().invoke(main, ["export", "txt", "--storage", str(tmp_path / "s"), "--format",
                                       "specforge-jsonl", "--out", str(tmp_path / "sf"), "--include-unterminated"])
    assert result.exit_code == 2 and "non-empty answer" in result.output


def test_a_multi_turn_run_gives_one_row_per_conversation_with_every_regenerated_turn(tmp_path):
    rows_in = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Colour {i}?"},
                                            {"role": "assistant", "content": "Blue."},
                                            {"role": "user", "content": "Another?"},
                                            {"role": "assistant", "content": "Red."}]} for i in range(3)]
    samples = [normalise(r, file="m.jsonl", line=i + 1, regenerate="all") for i, r in enumerate(rows_in)]
    records = [multi_turn_records(samples[0], ["Green.", "Gold."]),
               multi_turn_records(samples[1], ["Teal.", "Pink."], reject_at=1),
               multi_turn_records(samples[2], ["Grey.", "Navy."], reject_at=0)]
    write_run(tmp_path / "s", [[r for rs in records for r in rs]], regenerate="all")
    rows, left_out, _ = export(tmp_path / "s", "sharegpt")
    assert [r["id"] for r in rows] == [samples[0]["id"], samples[1]["id"]]
    assert [(t["from"], t["value"]) for t in rows[0]["conversations"]] == [
        ("human", "Colour 0?"), ("gpt", "Green."), ("human", "Another?"), ("gpt", "Gold.")]
    assert rows[0]["conversations"][1]["reasoning_content"] == "Thinking 0."
    assert [t["value"] for t in rows[1]["conversations"]] == ["Colour 1?", "Teal."]  # ends before the rejected turn
    assert left_out == {"cut_turn:status:rejected": 1, "status:rejected": 1}
    import pyarrow.parquet as pq

    CliRunner().invoke(main, ["export", "txt", "--storage", str(tmp_path / "s"), "--format", "parquet",
                              "--out", str(tmp_path / "pq")], catch_exceptions=False)
    table = pq.read_table(str(tmp_path / "pq" / "data" / "shard-000000.parquet")).to_pylist()
    assert [(r["conversation_id"], r["turn"]) for r in table] == [  # one parquet row per ok turn sample
        (samples[0]["id"], 0), (samples[0]["id"], 1), (samples[1]["id"], 0)]


def test_verify_counts_a_multi_turn_conversation_once(tmp_path):
    from app.data.run_reader import RunReader
    from app.data.verify import verify_run

    samples = [normalise({"messages": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": "A"},
                                       {"role": "user", "content": "More?"}]}, file="m", line=i + 1,
                         regenerate="all") for i in range(2)]
    records = multi_turn_records(samples[0], ["x", "y"]) + multi_turn_records(samples[1], ["z", "w"], reject_at=1)
    write_run(tmp_path / "s", [records], regenerate="all")
    report = verify_run(RunReader(str(tmp_path / "s"), "txt"))
    assert report.ok(), report.problems
    assert report.accounting["written"] == 2 and report.accounting["written_ok"] == 3
    assert report.accounting["identity_holds"]


def test_verify_finds_a_multi_turn_conversation_with_a_turn_missing(tmp_path):
    from app.data.run_reader import RunReader
    from app.data.verify import verify_run

    sample = normalise({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
                                     {"role": "user", "content": "More?"}, {"role": "assistant", "content": "B"},
                                     {"role": "user", "content": "Last?"}]}, file="m", line=1, regenerate="all")
    records = multi_turn_records(sample, ["x", "y", "z"])
    del records[1]  # turn 1 lost: turn 2's prompt holds an answer no record has
    write_run(tmp_path / "s", [records], regenerate="all")
    report = verify_run(RunReader(str(tmp_path / "s"), "txt"))
    assert [p.kind for p in report.problems] == ["turns"] and "turns [0, 2]" in report.problems[0].detail
    assert report.accounting["written"] == 1 and report.accounting["identity_holds"]


@pytest.mark.parametrize("thinking", [True, False])
def test_specforge_rows_pass_the_validators_rules(tmp_path, thinking):
    multi = [normalise({"id": f"m{i}", "messages": [
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": f"Hi {i}"},
        {"role": "assistant", "content": "old"}, {"role": "user", "content": "And then?"}]},
        file="m", line=i + 1, regenerate="all") for i in range(2)]
    records = [r for s in multi for r in multi_turn_records(s, ["First answer.", "Second answer."])]
    if not thinking:
        for r in records:
            r["reasoning"] = None
            r["messages"] = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in r["messages"]]
    marker = normalise({"messages": [{"role": "user", "content": "Say <think>"}]}, file="m", line=9)
    records.append(ok_record(marker, marker["messages"], reasoning="hm" if thinking else None,
                             answer="Here: </think>"))
    write_run(tmp_path / "s", [records], regenerate="all", thinking=thinking)
    rows, left_out, _ = export(tmp_path / "s", "specforge-jsonl")
    assert len(rows) == 2 and left_out == {"specforge:think_marker": 1}
    for row in rows:
        assert specforge_validation_error(row, expect_reasoning=thinking, expect_non_reasoning=not thinking) is None
        assert [m["role"] for m in row["conversations"]] == ["system", "user", "assistant", "user", "assistant"]
        assert [m["content"] for m in row["conversations"][2::2]] == ["First answer.", "Second answer."]
    joined = (tmp_path / "out-specforge-jsonl-0" / "regenerated.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in joined] == rows


def test_specforge_leaves_out_what_its_rows_cannot_hold_and_says_why(tmp_path):
    tools = fixture_samples("toolcall_openai.jsonl")
    context = normalise({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "old A"},
                                      {"role": "user", "content": "Q2"}]}, file="m", line=1)
    plain = normalise({"messages": [{"role": "user", "content": "Plain question"}]}, file="m", line=2)
    empty = normalise({"messages": [{"role": "user", "content": "Empty reasoning"}]}, file="m", line=3)
    records = [ok_record(s, s["messages"]) for s in (*tools, context, plain)]
    records.append(ok_record(empty, empty["messages"], reasoning=""))
    write_run(tmp_path / "s", [records])
    rows, left_out, _ = export(tmp_path / "s", "specforge-jsonl")
    assert [r["id"] for r in rows] == [plain["id"]]
    assert specforge_validation_error(rows[0], expect_reasoning=True, expect_non_reasoning=False) is None
    assert left_out == {"specforge:tools": 2, "specforge:context_not_regenerated": 1,
                        "specforge:no_reasoning": 1}
