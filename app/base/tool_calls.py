"""Tool calls as vLLM's chat path prepares them before any chat template sees them.

OpenAI-format datasets carry `function.arguments` as a JSON string; templates that iterate `arguments|items`
(the Qwen3.5/3.6 family's) need a mapping, and vLLM's chat path (`_postprocess_messages`) parses it. The worker
calls vLLM's own function (`vllm_prepare`); the producer and `regen verify` use `prepare` here, held equal to
vLLM's by tests/producer/test_tool_calls.py. Arguments vLLM would quietly erase to `{}` are named by
`erased_arguments` and the row is rejected (`tool_arguments_erased`): docs/formats.md#prompts-tool-calls-and-the-chat-template.
"""

from __future__ import annotations

import copy
import json
import sys

from app.base.errors import RegenError


class ToolCallError(RegenError, ValueError):
    """A tool call vLLM's chat path refuses (an entry that is not an object, a call that is not a function)."""


def parse_arguments(value) -> tuple[dict, str | None]:
    """(the arguments vLLM renders, why they are erased or None when nothing is lost)."""
    if not value:
        return {}, None
    if isinstance(value, dict):
        return value, None
    if isinstance(value, str):
        try:
            parsed = json.loads(value)  # the stdlib parser, as vLLM's (it takes NaN, which orjson does not)
        except json.JSONDecodeError:
            return {}, f"arguments are not valid JSON ({len(value)} chars)"
    else:
        parsed = value
    if isinstance(parsed, dict):
        return parsed, None
    if parsed is None:
        return {}, None
    return {}, f"arguments are a JSON {_json_type(parsed)}, not an object"


def _json_type(value) -> str:
    return {bool: "boolean", int: "number", float: "number", list: "array", str: "string"}.get(
        type(value), type(value).__name__)


def _calls(message: dict) -> list | None:
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    return calls if isinstance(calls, list) else None


def _function(item) -> dict:
    if not isinstance(item, dict):
        raise ToolCallError("assistant tool_calls entries must be objects.")
    function = item.get("function")
    if item.get("type", "function") != "function" or not isinstance(function, dict):
        raise ToolCallError("chat completions only support assistant tool_calls of type 'function'.")
    return function


def prepare(messages: list[dict]) -> list[dict]:
    """The messages as vLLM's chat path hands them to the template (a copy; the input is left as it is).
    Raises ToolCallError where vLLM refuses the request."""
    out = []
    for message in messages:
        calls = _calls(message)
        if calls is not None:
            message = dict(message)
            if not calls:
                del message["tool_calls"]
            else:
                fixed = []
                for item in calls:
                    function = _function(item)
                    args, _ = parse_arguments(function.get("arguments"))
                    fixed.append({**item, "function": {**function, "arguments": args}})
                message["tool_calls"] = fixed
        out.append(message)
    return out


def erased_arguments(messages: list[dict]) -> str | None:
    """Where vLLM's chat path would erase a call's arguments: "turn N: tool call 'name': ..."; None if nowhere.
    Raises ToolCallError where vLLM refuses the request."""
    for i, message in enumerate(messages):
        for item in _calls(message) or ():
            function = _function(item)
            _, why = parse_arguments(function.get("arguments"))
            if why:
                return (f"turn {i}: tool call {function.get('name')!r}: {why}; vLLM's chat path would render "
                        "them as {}")
    return None


def vllm_prepare(messages: list[dict]) -> list[dict]:
    """The messages through vLLM's own `_postprocess_messages` (on a deep copy: it edits in place); raises
    vLLM's validation error where it refuses the request."""
    from vllm.renderers.chat_utils import _postprocess_messages

    conversation = copy.deepcopy(messages)
    _postprocess_messages(conversation)
    return conversation


def worker_prepare(messages: list[dict]) -> list[dict]:
    """The worker's path: vLLM's own function where the process has vLLM loaded (a GPU worker, whose engine runs
    in it), else `prepare` (a CPU worker, whose engine runs in a child process: importing vLLM here would cost
    ~600 MB and seconds for a function the test holds equal to `prepare`)."""
    return vllm_prepare(messages) if "vllm" in sys.modules else prepare(messages)
