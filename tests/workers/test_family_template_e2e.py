"""A run on a tiny Qwen3 whose chat template follows the Qwen3.5/3.6 family's conventions
(workers.tiny_chat_template), through a real CPU worker of its own: tool calls with string arguments (the OpenAI
wire form; several in a turn, several tool responses in a row; a ShareGPT `function_call`) render as vLLM's chat
path renders them, so no worker rejects a sample for its template; the row the template refuses is a producer
reject; every record keeps the messages as rendered (arguments as objects) and its prompt ids are the
template's rendering of them; `--preserve-thinking` reaches the worker's template; `regen verify` re-renders every
prompt and names the sample whose prompt ids were altered."""

from __future__ import annotations

import json
import shutil

import orjson
import pytest
from click.testing import CliRunner

from app.base.jsonl_zst import dumps_jsonl_zst, loads_jsonl_zst
from app.base.storage import RunStore, Storage
from app.cli import main
from tests.support.redis_db import flushed_redis, redis_url
from tests.support.runs import produce, run_records, wait_run_done
from tests.support.workers import E2E_LAYERS, session_worker, worker_env
from workers.shard.generate import render_prompt
from workers.tiny_chat_template import FAMILY_CHAT_TEMPLATE

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
BROKER = redis_url(11)  # this module's own worker's db (no other suite uses 11)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time of a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
REASONING = "The user wants a colour; blue is the classic answer."


def _call(i, name, city):
    return {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps({"city": city})}}


ROWS = [
    {"id": "two-calls", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [_call(1, "get_weather", "Paris"),
                                                              _call(2, "get_time", "Paris")]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "14:00"},
        {"role": "assistant", "content": "Sunny, 14:00."}]},
    {"id": "multi-step", "tools": json.dumps(TOOLS), "messages": [
        {"role": "user", "content": "Weather in Oslo, then the time there?"},
        {"role": "assistant", "content": "", "tool_calls": [_call(3, "get_weather", "Oslo")]},
        {"role": "tool", "tool_call_id": "c3", "content": "rain"},
        {"role": "assistant", "content": "", "tool_calls": [_call(4, "get_time", "Oslo")]},
        {"role": "tool", "tool_call_id": "c4", "content": "09:00"}]},
    {"id": "sharegpt-call", "tools": json.dumps(TOOLS[:1]), "conversations": [
        {"from": "human", "value": "Weather in Rome?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": '{"city": "Rome"}'})},
        {"from": "observation", "value": "hot"}, {"from": "gpt", "value": "Hot."}]},
    {"id": "reasoning", "messages": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue.", "reasoning_content": REASONING},
        {"role": "user", "content": "And another?"}]},
    {"id": "late-system", "messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hello?"}]},
]


@pytest.fixture(scope="module")
def family_qwen3(tmp_path_factory):
    from transformers import AutoTokenizer

    from workers.tiny_model import build_tiny_qwen3

    folder = build_tiny_qwen3(str(tmp_path_factory.mktemp("family-qwen3")))
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = FAMILY_CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(family_qwen3, tmp_path_factory):
    flushed_redis(BROKER)
    storage = tmp_path_factory.mktemp("family-storage")
    inputs = tmp_path_factory.mktemp("family-inputs") / "rows.jsonl"
    inputs.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    env = worker_env(BROKER)
    with session_worker(family_qwen3, E2E_LAYERS, "family", tmp_path_factory.mktemp("family-logs"), env):
        counts = {"last": produce(storage, "fam-last", [inputs], family_qwen3, broker=BROKER)["counts"],
                  "kept": produce(storage, "fam-kept", [inputs], family_qwen3, "--preserve-thinking", "--no-thinking",
                                  broker=BROKER)["counts"],
                  "all": produce(storage, "fam-all", [inputs], family_qwen3, "--regenerate", "all",
                                 broker=BROKER)["counts"]}
        for run in ("fam-last", "fam-kept", "fam-all"):
            wait_run_done(storage, run, timeout=600)
    return storage, counts


@pytest.fixture(scope="module")
def tok(family_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(family_qwen3)


@pytest.mark.parametrize("run,preserve", [("fam-last", False), ("fam-kept", True), ("fam-all", False)])
def test_every_row_renders_and_prompts_are_the_templates(runs, tok, run, preserve):
    storage, counts = runs
    key = {"fam-last": "last", "fam-kept": "kept", "fam-all": "all"}[run]
    assert counts[key]["rejected_by_reason"] == {"template_error": 1}  # the late system turn, at the producer
    records = run_records(storage, run)
    assert records and all(r["status"] == "ok" for r in records), [r.get("reject_detail") for r in records]
    calls = [c for r in records for m in r["messages"] for c in m.get("tool_calls") or ()]
    assert all(isinstance(c["function"]["arguments"], dict) for c in calls)  # kept as rendered
    assert len(calls) == (0 if run == "fam-all" else 5)  # `all` regenerates the calls; `last` renders all five
    for rec in records:
        prompt = rec["input_ids"][: rec["num_prompt_tokens"]]
        assert prompt == render_prompt(tok, rec["messages"], rec["tools"], rec["thinking"], preserve)
    text = {r["sample_id"]: tok.decode(r["input_ids"][: r["num_prompt_tokens"]]) for r in records}
    with_reasoning = [t for t in text.values() if "Name a colour." in t]
    assert with_reasoning and all((REASONING in t) is preserve for t in with_reasoning)
    xml_call = "<function=get_time>\n<parameter=city>\nParis\n</parameter>"
    assert any(xml_call in t for t in text.values()) is (run != "fam-all")
    manifest = json.loads((storage / run / "run.json").read_text())["settings"]
    assert manifest["chat_template"]["kwargs"] == {"add_generation_prompt": True,
                                                   **({"preserve_thinking": True} if preserve else {})}


def test_verify_rerenders_every_prompt_and_names_an_altered_one(runs, tmp_path):
    storage, _ = runs
    ok = CliRunner().invoke(main, ["verify", "fam-last", "--storage", str(storage), "--json"], catch_exceptions=False)
    assert ok.exit_code == 0, ok.output
    copy = tmp_path / "copy"
    shutil.copytree(storage / "fam-last", copy / "fam-last")
    store = RunStore(Storage(str(copy)), "fam-last")
    shard = sorted(store.done_shards())[0]
    path = store.done_marker(shard)["files"]["records"]["path"]
    records = loads_jsonl_zst(store.storage.read_bytes(path))
    victim = next(r for r in records if r["status"] == "ok")
    victim["input_ids"][1] = (victim["input_ids"][1] + 1) % 900  # one prompt token changed, lengths as they were
    store.storage.write_bytes(path, dumps_jsonl_zst(records))
    bad = CliRunner().invoke(main, ["verify", "fam-last", "--storage", str(copy), "--json"], catch_exceptions=False)
    assert bad.exit_code == 1
    problems = orjson.loads(bad.output)["problems"]
    assert [(p["kind"], p["sample"]) for p in problems if p["kind"] == "prompt"] == [("prompt", victim["sample_id"])]


def test_the_sharegpt_export_loads_in_both_trainers_readers_to_the_rendered_prompt(runs, tok, tmp_path):
    """Tool calls are exported as the record keeps them (arguments as objects, what the template rendered):
    speculators hands a row's `tool_calls` to the template as they are (a string would fail the family's
    `arguments|items`), SpecForge's parser takes objects as they are (strings it would parse). Each reader's
    messages, rendered with the generation prompt, are the record's prompt ids."""
    from specforge.data.parse import ThinkingParser
    from specforge.data.template import TEMPLATE_REGISTRY
    from speculators.data_generation.preprocessing import _normalize_conversation

    storage, _ = runs
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", "fam-last", "--storage", str(storage), "--format", "sharegpt",
                                       "--out", str(out), "--include-unterminated"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for f in sorted((out / "data").glob("*.jsonl")) for line in f.read_text().splitlines()]
    records = {r["sample_id"]: r for r in run_records(storage, "fam-last")}
    specforge = ThinkingParser(tok, TEMPLATE_REGISTRY.get("qwen3.5"))  # SpecForge's template for the family
    assert len(rows) == len(records) == 4
    exported_calls = 0
    for row in rows:
        rec, tools = records[row["id"]], json.loads(row["tools"]) if row.get("tools") else None
        context = row["conversations"][:-1]
        exported_calls += sum(len(t.get("tool_calls") or ()) for t in context)
        assert all(isinstance(c["function"]["arguments"], dict) for t in context for c in t.get("tool_calls") or ())
        prompt = rec["input_ids"][: rec["num_prompt_tokens"]]
        for messages in (_normalize_conversation(context),
                         [specforge._sanitize_message(specforge._normalize_message(t)) for t in context]):
            text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                           enable_thinking=True)
            assert tok.encode(text, add_special_tokens=False) == prompt, row["id"]
    assert exported_calls == 5
