"""The producer renders every sample with the target's own template before it enqueues it: rows the template
refuses are rejects with the template's words, rows whose tool-call arguments vLLM would erase are rejects naming
the turn, string arguments (OpenAI wire form, ShareGPT `function_call`) render, and the manifest records the
template's sha256 and the keyword arguments it is called with. Runs against the local Redis, on a config+tokenizer
folder whose template follows the Qwen3.5/3.6 family's conventions (workers.tiny_chat_template)."""

from __future__ import annotations

import hashlib
import json

import pytest

from app.base.manifest import settings_diff
from producer.produce import produce
from producer.run_setup import ProduceOptions
from tests.support.models import build_tiny_model
from tests.support.producer import QUEUE, decode_queue, write_jsonl
from tests.support.redis_db import PRODUCER_REDIS
from workers.tiny_chat_template import FAMILY_CHAT_TEMPLATE

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def family_model(tmp_path_factory):
    """The producer's model folder (config and tokenizer) with the family-convention template."""
    from transformers import AutoTokenizer

    folder = build_tiny_model(tmp_path_factory.mktemp("family-model"))
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.chat_template = FAMILY_CHAT_TEMPLATE
    tok.save_pretrained(str(folder))
    return folder


def openai_row(i, arguments, **extra):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return {"id": f"tool-{i}", "tools": TOOLS, "messages": [
        {"role": "user", "content": f"Weather in Paris, case {i}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."}], **extra}


ROWS = [
    openai_row(0, '{"city": "Paris"}'),  # the OpenAI wire form: renders once parsed
    openai_row(1, {"city": "Paris"}),
    {"id": "sharegpt-call", "tools": json.dumps(TOOLS), "conversations": [
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": '{"city": "Oslo"}'})},
        {"from": "observation", "value": "rain"}, {"from": "gpt", "value": "Rain."}]},
    # refused by the template
    {"id": "late-system", "messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hello?"}]},
    {"id": "no-query", "messages": [{"role": "system", "content": "Tools."},
                                    {"role": "tool", "content": "orphan result"}]},
    # arguments vLLM would replace by {}
    openai_row(2, '{"city": Paris}'),
    openai_row(3, "[1, 2]"),
    {"id": "sharegpt-bad", "conversations": [
        {"from": "human", "value": "Weather?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": "city=Oslo"})},
        {"from": "observation", "value": "rain"}]},
    # refused by vLLM's chat path
    {"id": "not-a-function", "messages": [{"role": "user", "content": "Run it"},
                                          {"role": "assistant", "content": "", "tool_calls": [{"type": "code"}]},
                                          {"role": "tool", "content": "done"}]},
]


def options(tmp_path, model, inputs, **kw) -> ProduceOptions:
    return ProduceOptions(**{**dict(inputs=[str(p) for p in inputs], run_id="t1", storage=str(tmp_path / "store"),
                                    model=str(model), broker=PRODUCER_REDIS, queue=QUEUE, shard_size=4), **kw})


@pytest.mark.parametrize("processes", [1, 2], ids=["in-process", "pool"])
def test_refused_rows_are_rejects_with_the_templates_words_and_never_enqueued(producer_redis, tmp_path,
                                                                               family_model, processes):
    path = write_jsonl(tmp_path / "in.jsonl", ROWS * 150)  # 1,350 rows: batches of 512 (producer.template_check)
    result = produce(options(tmp_path, family_model, [path], render_processes=processes))
    acc = result.accounting
    assert dict(acc.rejected_by_reason) == {"template_error": 300, "tool_arguments_erased": 450, "bad_tool_call": 150}
    assert acc.enqueued == 3 and acc.duplicates == 3 * 149 and acc.read == len(ROWS) * 150
    rejects = [json.loads(line) for line in (tmp_path / "store/t1/rejects.jsonl").read_text().splitlines()]
    by_line = {r["line"]: r for r in rejects}
    assert by_line[4]["reason"] == "template_error"
    assert by_line[4]["detail"] == "TemplateError: System message must be at the beginning."
    assert by_line[5]["detail"] == "TemplateError: No user query found in messages."
    assert by_line[6]["reason"] == "tool_arguments_erased"
    assert by_line[6]["detail"].startswith("turn 1: tool call 'get_weather': arguments are not valid JSON")
    assert "JSON array, not an object" in by_line[7]["detail"]
    assert by_line[8]["detail"].startswith("turn 1: tool call 'get_weather'")
    assert by_line[9]["reason"] == "bad_tool_call"
    counts = json.loads((tmp_path / "store/t1/produce.json").read_text())["counts"]
    assert counts["rejected_by_reason"] == {"bad_tool_call": 150, "tool_arguments_erased": 450, "template_error": 300}
    assert [r["line"] for r in rejects] == sorted(r["line"] for r in rejects)  # in input order, pool or not
    sent = [s["source"]["source_id"] for m in decode_queue(producer_redis) for s in m["kwargs"]["samples"]]
    assert sorted(sent) == ["sharegpt-call", "tool-0", "tool-1"]


def test_in_all_mode_the_datasets_calls_are_regenerated_not_rendered(producer_redis, tmp_path, family_model):
    """`--regenerate all`: every assistant turn is generated anew, so the dataset's calls (erased or refused
    ones too) are never in a prompt; the template's refusals of the conversation still are rejects."""
    path = write_jsonl(tmp_path / "in.jsonl", ROWS)
    result = produce(options(tmp_path, family_model, [path], regenerate="all"))
    assert dict(result.accounting.rejected_by_reason) == {"template_error": 2}
    assert result.accounting.enqueued == len(ROWS) - 2


def test_the_manifest_records_the_templates_sha_and_kwargs(producer_redis, tmp_path, family_model):
    path = write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    produce(options(tmp_path, family_model, [path], preserve_thinking=True))
    settings = json.loads((tmp_path / "store/t1/run.json").read_text())["settings"]
    sha = hashlib.sha256(FAMILY_CHAT_TEMPLATE.encode()).hexdigest()
    assert settings["chat_template"] == {"sha256": sha,
                                         "kwargs": {"add_generation_prompt": True, "preserve_thinking": True}}
    assert settings["preserve_thinking"] is True
    # a run made before either was recorded reopens as it was; preserve_thinking is a setting like the others
    old = {k: v for k, v in settings.items() if k not in ("chat_template", "preserve_thinking")}
    assert settings_diff(old, {**old, "chat_template": settings["chat_template"]}) == []
    assert settings_diff(old, settings) == ["preserve_thinking"]


def test_a_model_without_a_template_is_produced_unchecked(producer_redis, tmp_path, tiny_config_model):
    path = write_jsonl(tmp_path / "in.jsonl", ROWS)
    result = produce(options(tmp_path, tiny_config_model, [path]))
    assert "template_error" not in result.accounting.rejected_by_reason
    assert "chat_template" not in json.loads((tmp_path / "store/t1/run.json").read_text())["settings"]
