"""Turn one input row of any common chat-dataset shape into one OpenAI-style sample, or a named reject.

Why one normaliser: the sample id is a hash of the normalised prompt, so one prompt read from a ShareGPT file
and from an OpenAI-`messages` file must come out identical, to be generated once. Shapes: ShareGPT, OpenAI
`messages`, single-turn columns, `tools`. Regeneration modes `last` and `all` are the contract with the
worker. Anything else raises `Rejected` with one of `REJECT_REASONS`. Shapes, roles, modes and the sample's
fields: docs/formats.md#inputs-the-row-shapes-the-producer-reads.
"""

from __future__ import annotations

import orjson

from app.base.config import DEFAULT_REGENERATE
from app.base.errors import PermanentError
from app.base.ids import sample_id
from app.base.samples import Sample

REJECT_REASONS = (
    "malformed_json",
    "not_utf8",
    "not_an_object",
    "no_conversation",
    "unknown_role",
    "empty_content",
    "content_not_text",
    "nothing_to_answer",
    "prompt_too_long",
    "bad_mode_field",
    "bad_tool_call",  # a tool call vLLM's chat path refuses (producer.template_check)
    "tool_arguments_erased",  # arguments vLLM's chat path would replace by {} (app.base.tool_calls)
    "template_error",  # the target's chat template refuses the conversation (producer.template_check)
)
REGENERATE_MODES = ("last", "all")

_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
    "developer": "system",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
    "function": "tool",
    "ipython": "tool",
    "function_call": "function_call",
}
_CONVERSATION_KEYS = ("conversations", "conversation", "messages")
_SINGLE_TURN_KEYS = ("prompt", "question", "instruction")
_ANSWER_KEYS = ("answer", "output", "response", "completion")
_SOURCE_ID_KEYS = ("id", "prompt_id", "idx")
_ANSWERABLE = ("user", "tool")


class Rejected(PermanentError):
    """A row that cannot become a sample; `reason` is one of REJECT_REASONS, `detail` says where and why.
    The producer records it as a reject and goes on (producer.produce); it is a PermanentError: the row
    never becomes one."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


def parse_line(raw: bytes) -> object:
    """Parse one JSON Lines line; undecodable bytes and bad JSON become rejects, never exceptions."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as uexc:
            raise Rejected("not_utf8", f"invalid UTF-8 at byte {uexc.start}") from None
        raise Rejected("malformed_json", str(exc)[:200]) from None


def _text(content, where: str) -> str | None:
    """Content as text: a string, None, or a list of parts whose text parts are joined with newlines.

    Anything else (a number, a boolean, an object) is refused with its own reason: `{"content": 42}` is a broken
    row, and enqueuing it as the text "42" would train on a prompt nobody wrote."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "\n".join(parts)
    raise Rejected("content_not_text", f"{where}: content is a JSON {_json_type(content)}, not a string or a list "
                   "of parts")


def _json_type(value) -> str:
    return {bool: "boolean", int: "number", float: "number", dict: "object"}.get(type(value), type(value).__name__)


def _function_call_turn(value: str | None) -> dict:
    """A ShareGPT `function_call` turn as an assistant tool call (the value is `{"name", "arguments"}` JSON)."""
    try:
        call = orjson.loads(value) if value else None
    except orjson.JSONDecodeError:
        call = None
    if isinstance(call, dict) and isinstance(call.get("name"), str):
        function = {"name": call["name"], "arguments": call.get("arguments", {})}
        return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": function}]}
    return {"role": "assistant", "content": value}


def _turn(raw, index: int) -> dict | None:
    """One turn in OpenAI form; None for an empty system turn (it carries nothing). Hot path: keep it lean."""
    if type(raw) is not dict:
        raise Rejected("unknown_role", f"turn {index} is not an object")
    name = raw.get("from")
    if name is not None:
        content = raw.get("value")
        if content is None:
            content = raw.get("content")
    else:
        name, content = raw.get("role"), raw.get("content")
    role = _ROLES.get(name) if type(name) is str else None
    if role is None:
        role = _ROLES.get(name.strip().lower()) if isinstance(name, str) else None
        if role is None:
            raise Rejected("unknown_role", f"turn {index}: role {name!r}"[:200])
    if type(content) is not str:
        content = _text(content, f"turn {index}")
    if role == "user":
        return {"role": "user", "content": content}
    if role == "assistant":
        message = {"role": "assistant", "content": content}
        reasoning = raw.get("reasoning_content")
        if reasoning and isinstance(reasoning, str):
            message["reasoning_content"] = reasoning
        tool_calls = raw.get("tool_calls")
        if tool_calls and isinstance(tool_calls, list):
            message["tool_calls"] = tool_calls
        return message
    if role == "function_call":
        return _function_call_turn(content)
    if role == "system":
        return {"role": "system", "content": content} if content and not content.isspace() else None
    message = {"role": role, "content": content}
    for key in ("tool_call_id", "name"):
        if isinstance(raw.get(key), str):
            message[key] = raw[key]
    return message


def _turns(turns: list) -> list[dict]:
    return [m for i, t in enumerate(turns) if (m := _turn(t, i)) is not None]


def _conversation(row: dict) -> list[dict]:
    for key in _CONVERSATION_KEYS:
        turns = row.get(key)
        if turns is not None:
            if type(turns) is not list or not turns:
                raise Rejected("no_conversation", f"{key!r} is empty or not a list")
            return _turns(turns)
    for key in _SINGLE_TURN_KEYS:
        value = row.get(key)
        if isinstance(value, list) and key == "prompt":  # some datasets put the messages in `prompt`
            if not value:
                raise Rejected("no_conversation", "'prompt' is an empty list")
            return _turns(value)
        if value is None:
            continue
        text = _text(value, key)
        extra = row.get("input") if key == "instruction" else None
        if isinstance(extra, str) and extra.strip():
            text = f"{text}\n\n{extra}"
        messages = []
        system = row.get("system")
        if isinstance(system, str) and system.strip():
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": text})
        for answer_key in _ANSWER_KEYS:  # the old answer: a turn to regenerate in `all` mode, dropped in `last`
            answer = row.get(answer_key)
            if isinstance(answer, str):
                messages.append({"role": "assistant", "content": answer})
                break
        return messages
    raise Rejected("no_conversation", "no conversations/messages/prompt/question/instruction column")


def _tools(row: dict) -> list | None:
    tools = row.get("tools")
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = orjson.loads(tools)
        except orjson.JSONDecodeError as exc:
            raise Rejected("malformed_json", f"'tools' column is not valid JSON: {exc}"[:200]) from None
        if not tools:
            return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise Rejected("malformed_json", "'tools' column is not a list of objects")
    return tools


def _select(messages: list[dict], regenerate: str) -> list[dict]:
    if regenerate == "last":
        for last in range(len(messages) - 1, -1, -1):
            if messages[last]["role"] in _ANSWERABLE:
                return messages if last == len(messages) - 1 else messages[: last + 1]
        raise Rejected("nothing_to_answer", "no user or tool turn")
    first = next((i for i, m in enumerate(messages) if m["role"] in _ANSWERABLE), -1)
    if first < 0:
        raise Rejected("nothing_to_answer", "no user or tool turn")
    out = messages[:first]
    for m in messages[first:]:
        if m["role"] == "assistant":
            original = {"role": "assistant", "content": None, "original_content": m["content"]}
            if m.get("tool_calls"):
                original["original_tool_calls"] = m["tool_calls"]
            if m.get("reasoning_content"):
                original["original_reasoning_content"] = m["reasoning_content"]
            out.append(original)
        else:
            out.append(m)
    if out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": None, "original_content": None})
    return out


def _check_and_measure(messages: list[dict], tools_chars: int) -> int:
    """Reject turns the model reads that carry nothing; return the prompt's length in characters.

    A turn must have text, except an assistant turn with tool calls or reasoning; turns to regenerate
    (`original_content`) are not read and not counted.
    """
    total = tools_chars
    for i, m in enumerate(messages):
        content = m["content"]
        if content is None and "original_content" in m:
            continue
        if content and not content.isspace():
            total += len(content)
        elif not (m["role"] == "assistant" and (m.get("tool_calls") or m.get("reasoning_content"))):
            raise Rejected("empty_content", f"{m['role']} turn {i} has no text")
        if m["role"] == "assistant":
            reasoning = m.get("reasoning_content")
            if reasoning:
                total += len(reasoning)
    return total


def normalise(row: object, *, file: str, line: int, regenerate: str = DEFAULT_REGENERATE,
              max_prompt_chars: int = 0) -> Sample:
    """One parsed row -> one sample dict (see the module docstring); raises Rejected.

    `max_prompt_chars` (0 = no cap) is a cheap character cap on the prompt; exact token limits are the worker's.
    """
    if not isinstance(row, dict):
        raise Rejected("not_an_object", f"row is a JSON {type(row).__name__}")
    messages = _conversation(row)
    if not messages:
        raise Rejected("no_conversation", "no turns")
    tools = _tools(row)
    messages = _select(messages, regenerate)
    chars = _check_and_measure(messages, len(orjson.dumps(tools)) if tools else 0)
    if max_prompt_chars and chars > max_prompt_chars:
        raise Rejected("prompt_too_long", f"{chars} characters > {max_prompt_chars}")
    source_id = None
    for key in _SOURCE_ID_KEYS:
        value = row.get(key)
        if value is not None:
            source_id = value if type(value) is str else None if isinstance(value, dict | list) else str(value)
            break
    own_mode = _own_mode(row)
    try:
        sid = sample_id(messages, tools)
    except TypeError as exc:  # orjson.JSONEncodeError: e.g. an integer beyond 64 bits in a .json array row
        raise Rejected("malformed_json", f"value not representable in JSON: {exc}"[:200]) from None
    return Sample.new(sid, messages, tools, {"file": file, "line": line, "source_id": source_id}, own_mode)


def _own_mode(row: dict) -> bool | None:
    """The mode the row names for itself (see the module docstring), or None."""
    value = row.get("enable_thinking")
    if value is not None:
        if type(value) is not bool:
            raise Rejected("bad_mode_field", f"'enable_thinking' is a JSON {_json_type(value)}, not true/false")
        return value
    value = row.get("thinking")
    return value if type(value) is bool else None
