"""The producer's preparation of tool calls (app.base.tool_calls.prepare) is vLLM's own (`_postprocess_messages`,
what `LLM.chat` and the OpenAI server run before the template): the same messages out, the same refusals, and
`erased_arguments` names a turn exactly where vLLM warns that it replaced the arguments by `{}`."""

from __future__ import annotations

import copy
import logging

import pytest

from app.base.tool_calls import ToolCallError, erased_arguments, parse_arguments, prepare, vllm_prepare


def call(arguments, name="get_weather", **extra):
    fn = {"name": name} if arguments is ... else {"name": name, "arguments": arguments}
    return {"id": f"call_{name}", "type": "function", "function": fn, **extra}


def chat(*calls, content=""):
    return [{"role": "system", "content": "Tools."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": content, "tool_calls": list(calls)},
            {"role": "tool", "tool_call_id": "call_get_weather", "content": "sunny"}]


ARGUMENTS = [
    '{"city": "Paris"}', '{"city": "Paris", "days": 3, "units": {"t": "C"}}', '{}', '', None, ..., 'null', '[1, 2]',
    '42', 'true', '"Paris"', 'not json', '   ', '{"x": NaN}', '{"a": 1} trailing', {"city": "Paris"}, {}, [1], [],
    5, 0, False, '{"nested": {"deep": [1, {"k": "v"}]}}', '{"unicode": "Zürich \\u00e9"}',
]
SHAPES = [pytest.param(chat(call(a)), id=f"arguments={a!r}") for a in ARGUMENTS] + [
    pytest.param(chat(call('{"city": "Paris"}'), call('oops', name="second"), call({"q": 1}, name="third")),
                 id="three calls, one unparseable"),
    pytest.param(chat(), id="empty tool_calls"),
    pytest.param([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "tool_calls": None}],
                 id="tool_calls None"),
    pytest.param([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "tool_calls": "calls"}],
                 id="tool_calls a string"),
    pytest.param([{"role": "user", "content": "x", "tool_calls": [call("oops")]}], id="a user turn's calls"),
    pytest.param(chat({"function": {"name": "f", "arguments": '{"a": 1}'}}), id="no type"),
    pytest.param(chat(call('{"a": 1}'), content=None), id="content None"),
]
REFUSED = [
    pytest.param(chat("a string"), id="entry not an object"),
    pytest.param(chat({"type": "code_interpreter", "function": {"name": "f"}}), id="not a function call"),
    pytest.param(chat({"type": "function"}), id="no function"),
    pytest.param(chat({"type": "function", "function": "f"}), id="function not an object"),
]


@pytest.fixture(scope="module")
def vllm_warnings():
    """What vLLM's chat path warns about: records of its logger, cleared per use."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("vllm.renderers.chat_utils")
    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


@pytest.mark.parametrize("messages", SHAPES)
def test_prepare_is_vllms_preparation(messages, vllm_warnings):
    before = copy.deepcopy(messages)
    vllm_warnings.clear()
    theirs = vllm_prepare(messages)
    warned = [r.getMessage() for r in vllm_warnings if "coercing" in r.getMessage()]
    ours = prepare(messages)
    assert ours == theirs
    assert messages == before  # neither edits the row the producer holds
    assert (erased_arguments(messages) is not None) == bool(warned), warned


@pytest.mark.parametrize("messages", REFUSED)
def test_prepare_refuses_what_vllm_refuses(messages):
    with pytest.raises(Exception) as theirs:
        vllm_prepare(messages)
    with pytest.raises(ToolCallError) as ours:
        prepare(messages)
    assert str(ours.value) in str(theirs.value)
    with pytest.raises(ToolCallError):
        erased_arguments(messages)


def test_the_erased_turn_is_named_with_the_call_and_why():
    messages = chat(call('{"city": "Paris"}'), call('{"city": Paris}', name="get_time"))
    assert erased_arguments(messages) == ("turn 2: tool call 'get_time': arguments are not valid JSON (15 chars); "
                                          "vLLM's chat path would render them as {}")
    assert erased_arguments(chat(call("[1]"))).startswith("turn 2: tool call 'get_weather': arguments are a JSON "
                                                          "array, not an object")
    assert parse_arguments('{"city": "Paris"}') == ({"city": "Paris"}, None)
    assert parse_arguments("") == ({}, None)  # no arguments: nothing erased
