"""Every input shape the producer meets normalises to the messages the worker expects, or to a named reject."""

from __future__ import annotations

import json

import orjson
import pytest

from app.base.ids import sample_id
from producer.normalise import Rejected, normalise, parse_line
from tests.support.paths import FORMATS_DIR


def shape_row(name: str) -> dict:
    lines = (FORMATS_DIR / f"{name}.jsonl").read_bytes().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    assert len(rows) == 1
    return rows[0]


def norm(row, regenerate="last", **kw) -> dict:
    return normalise(row, file="f.jsonl", line=7, regenerate=regenerate, **kw)


def roles(sample) -> list[str]:
    return [m["role"] for m in sample["messages"]]


def rejected(row, regenerate="last", **kw) -> str:
    with pytest.raises(Rejected) as info:
        norm(row, regenerate, **kw)
    return info.value.reason


# -- one row of each dataset shape, tests/fixtures/formats ---------------------------------------------------
def test_sharegpt_multiturn_drops_the_final_gpt_turn_and_keeps_earlier_ones_as_context():
    row = shape_row("sharegpt_multiturn")
    s = norm(row)
    assert roles(s) == ["user", "assistant", "user", "assistant", "user"]
    conv = row["conversations"]
    assert [m["content"] for m in s["messages"]] == [t["value"] for t in conv[:5]]
    assert all(set(m) == {"role", "content"} for m in s["messages"])  # the null markdown/text keys are gone
    assert s["tools"] is None
    assert s["source"] == {"file": "f.jsonl", "line": 7, "source_id": "kq7Rw2m_0"}
    assert s["id"] == sample_id(s["messages"], None)


def test_sharegpt_multiturn_in_all_mode_regenerates_every_gpt_turn_in_place():
    row = shape_row("sharegpt_multiturn")
    s = norm(row, "all")
    assert roles(s) == ["user", "assistant"] * 3
    answers = [m for m in s["messages"] if m["role"] == "assistant"]
    assert [a["original_content"] for a in answers] == ["The Brisa 900 espresso machine...", "Now the Veloce Pro grinder", "cheers"]
    assert all(a["content"] is None for a in answers)


def test_ultrachat_uses_messages_over_the_prompt_column_and_prompt_id_as_source():
    row = shape_row("ultrachat_messages")
    s = norm(row)
    assert roles(s) == ["user", "assistant", "user", "assistant", "user", "assistant", "user"]
    assert s["messages"] == [{"role": m["role"], "content": m["content"]} for m in row["messages"][:7]]
    assert s["messages"][0]["content"] == row["prompt"]
    assert s["source"]["source_id"] == row["prompt_id"]


def test_hermes_toolcall_ends_on_the_tool_turn_with_tools_parsed_from_a_json_string():
    row = shape_row("hermes_toolcall")
    s = norm(row)
    assert roles(s) == ["system", "user", "assistant", "tool"]
    assert s["tools"] == json.loads(row["tools"])
    assert [t["function"]["name"] for t in s["tools"]] == ["set_thermostat_mode", "schedule_thermostat"]
    assert s["messages"][0]["content"].startswith("You are a function calling AI model.")
    assert s["messages"][2]["content"].startswith("<tool_call>\n")
    assert s["messages"][3]["content"].startswith("<tool_response>\n")
    assert s["source"]["source_id"] == "5d2f8a61-93c4-4e0b-a7d8-1f6b2c9e0a34"


def test_hermes_toolcall_tools_as_a_list_give_the_same_sample():
    row = shape_row("hermes_toolcall")
    as_list = {**row, "tools": json.loads(row["tools"])}
    assert norm(as_list)["id"] == norm(row)["id"]


def test_dolphin_reasoning_prompt_is_the_question_and_all_mode_keeps_the_old_reasoning():
    row = shape_row("dolphin_reasoning")
    s = norm(row)
    assert roles(s) == ["user"]
    assert s["messages"][0]["content"] == row["conversations"][0]["value"]
    a = norm(row, "all")["messages"][-1]
    assert a["original_content"] == row["conversations"][1]["value"]
    assert a["original_reasoning_content"] == row["conversations"][1]["reasoning_content"]


def test_reasoning_content_of_earlier_assistant_turns_is_kept():
    row = shape_row("dolphin_reasoning")
    conv = row["conversations"] + [{"from": "human", "value": "Shorter, please."}]
    s = norm({"conversations": conv})
    assert roles(s) == ["user", "assistant", "user"]
    assert s["messages"][1]["reasoning_content"] == conv[1]["reasoning_content"]


def test_gsm8k_single_turn_question_becomes_one_user_turn():
    row = shape_row("gsm8k_singleturn")
    s = norm(row)
    assert s["messages"] == [{"role": "user", "content": row["question"]}]
    assert s["source"]["source_id"] is None
    assert norm(row, "all")["messages"][-1]["original_content"] == row["answer"]


# -- other shapes ------------------------------------------------------------------------------------------
def test_openai_content_parts_tool_calls_and_tool_results():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    row = {"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is 42."},
    ], "tools": [{"type": "function", "function": {"name": "f"}}], "idx": 3}
    s = norm(row)
    assert s["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert s["tools"] == row["tools"]
    assert s["source"]["source_id"] == "3"


def test_sharegpt_function_call_and_observation_turns():
    row = {"conversations": [
        {"from": "human", "value": "weather?"},
        {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": "sunny"},
        {"from": "gpt", "value": "Sunny."},
    ]}
    s = norm(row)
    assert roles(s) == ["user", "assistant", "tool"]
    assert s["messages"][1]["tool_calls"] == [
        {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    ]


def test_instruction_input_and_system_columns():
    s = norm({"instruction": "Translate", "input": "bonjour", "system": "You translate.", "output": "hello"})
    assert s["messages"] == [{"role": "system", "content": "You translate."},
                             {"role": "user", "content": "Translate\n\nbonjour"}]


def test_same_prompt_in_two_shapes_has_the_same_id():
    a = norm({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]})
    b = norm({"messages": [{"role": "user", "content": "hi"}]})
    c = norm({"prompt": "hi"})
    assert a["id"] == b["id"] == c["id"]


def test_empty_system_turns_are_dropped_not_rejected():
    s = norm({"conversations": [{"from": "system", "value": ""}, {"from": "human", "value": "hi"}]})
    assert roles(s) == ["user"]


def test_all_mode_appends_a_turn_to_answer_a_trailing_user_turn():
    s = norm({"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                           {"role": "user", "content": "q2"}]}, "all")
    assert s["messages"][-1] == {"role": "assistant", "content": None, "original_content": None}
    assert s["messages"][1] == {"role": "assistant", "content": None, "original_content": "a1"}


# -- rejects -----------------------------------------------------------------------------------------------
def test_parse_line_tells_bad_utf8_from_bad_json():
    assert parse_line(b'{"a": 1}') == {"a": 1}
    with pytest.raises(Rejected) as info:
        parse_line(b'{"prompt": "caf\xe9"}')
    assert info.value.reason == "not_utf8"
    with pytest.raises(Rejected) as info:
        parse_line(b'{"prompt": ')
    assert info.value.reason == "malformed_json"


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ([1, 2], "not_an_object"),
        ("text", "not_an_object"),
        ({"foo": 1}, "no_conversation"),
        ({"conversations": []}, "no_conversation"),
        ({"messages": "hi"}, "no_conversation"),
        ({"conversations": [{"from": "alien", "value": "hi"}]}, "unknown_role"),
        ({"messages": [{"content": "no role"}]}, "unknown_role"),
        ({"messages": [{"role": "user", "content": "  "}]}, "empty_content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "empty_content"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
                       {"role": "user", "content": "q2"}]}, "empty_content"),
        ({"messages": [{"role": "system", "content": "s"}]}, "nothing_to_answer"),
        ({"messages": [{"role": "assistant", "content": "a"}]}, "nothing_to_answer"),
        ({"prompt": "hi", "tools": "[not json"}, "malformed_json"),
        ({"messages": [{"role": "user", "content": 42}]}, "content_not_text"),
        ({"messages": [{"role": "user", "content": 4.2}]}, "content_not_text"),
        ({"messages": [{"role": "user", "content": True}]}, "content_not_text"),
        ({"messages": [{"role": "user", "content": {"text": "hi"}}]}, "content_not_text"),
        ({"conversations": [{"from": "human", "value": 42}]}, "content_not_text"),
    ],
)
def test_reject_reasons(row, reason):
    assert rejected(row) == reason


def test_a_number_as_content_is_refused_with_a_reason_that_names_it():
    with pytest.raises(Rejected) as info:
        normalise({"messages": [{"role": "user", "content": 42}]}, file="f.jsonl", line=3)
    assert info.value.reason == "content_not_text"
    assert "turn 0: content is a JSON number" in info.value.detail


def test_prompt_too_long_counts_characters_of_the_prompt_only():
    row = {"conversations": [{"from": "human", "value": "x" * 100}, {"from": "gpt", "value": "y" * 10_000}]}
    assert norm(row, max_prompt_chars=100)["messages"][0]["content"] == "x" * 100
    assert rejected(row, max_prompt_chars=99) == "prompt_too_long"


def test_sample_round_trips_through_json():
    s = norm(shape_row("hermes_toolcall"))
    assert orjson.loads(orjson.dumps(s)) == s
    assert set(s) == {"id", "messages", "tools", "source"}
