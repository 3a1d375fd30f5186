"""The tiny models' chat template follows each of the Qwen3.5/3.6 family's conventions, rendered through
transformers' own `apply_chat_template` (the path regen renders prompts with): tools in the system turn, XML tool
calls from `arguments|items` (a string fails as it does on the family's), reasoning only after the last user query
unless `preserve_thinking`, grouped tool responses, trimmed contents, content parts, each refusal, and both
generation prompts."""

from __future__ import annotations

import pytest
from jinja2.exceptions import TemplateError

from workers.tiny_chat_template import FAMILY_CHAT_TEMPLATE

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tok():
    """A word-level tokenizer that only carries the template: rendering to text needs no vocabulary."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    fast.chat_template = FAMILY_CHAT_TEMPLATE
    return fast


def render(tok, messages, tools=None, generation=True, **kwargs) -> str:
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation, **kwargs)


def call(name, arguments, wrapped=True):
    fn = {"name": name, "arguments": arguments}
    return {"type": "function", "id": f"call_{name}", "function": fn} if wrapped else fn


def test_a_plain_chat_renders_trimmed_turns_and_the_thinking_prompt(tok):
    text = render(tok, [{"role": "system", "content": "  Be brief.\n"}, {"role": "user", "content": "\n Hi there  "}])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n")


def test_thinking_off_closes_an_empty_think_block(tok):
    text = render(tok, [{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(tok, [{"role": "user", "content": "Hi"}], generation=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_tools_go_in_the_system_turn_as_json_lines_with_the_call_format_then_the_system_text(tok):
    import json

    text = render(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}], TOOLS)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools\n")
    inside = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert [json.loads(line) for line in inside.splitlines()] == TOOLS
    assert "<tool_call>\n<function=function_name>\n<parameter=parameter_name>\n" in system
    assert system.endswith("\n\nBe brief.")
    assert text.count("<|im_start|>system") == 1
    no_system = render(tok, [{"role": "user", "content": "Weather?"}], TOOLS)
    assert no_system.split("<|im_end|>")[0] == system.removesuffix("\n\nBe brief.")


@pytest.mark.parametrize("wrapped", [True, False], ids=["openai-function", "bare"])
def test_tool_calls_render_as_xml_from_the_arguments_items(tok, wrapped):
    msgs = [{"role": "user", "content": "Weather in Paris and Lyon?"},
            {"role": "assistant", "content": "Checking both.",
             "tool_calls": [call("get_weather", {"city": "Paris", "days": 3, "units": {"t": "C"}, "ok": True}, wrapped),
                            call("get_weather", {"city": "Lyon"}, wrapped)]}]
    text = render(tok, msgs, TOOLS, generation=False)
    assert text.split("<|im_start|>assistant\n")[1] == (
        "<think>\n\n</think>\n\nChecking both.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "<parameter=units>\n{\"t\": \"C\"}\n</parameter>\n<parameter=ok>\ntrue\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n</function>\n</tool_call><|im_end|>\n")


def test_a_call_with_no_content_starts_at_the_tool_call(tok):
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {})]}]
    assert render(tok, msgs, generation=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>\n</function>\n"
        "</tool_call><|im_end|>\n")


@pytest.mark.parametrize("wrapped", [True, False], ids=["openai-function", "bare"])
def test_string_arguments_fail_as_on_the_familys_template(tok, wrapped):
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call("get_weather", '{"city": "Paris"}', wrapped)]}]
    with pytest.raises(TypeError, match="Can only get item pairs from a mapping"):
        render(tok, msgs)


def test_reasoning_shows_only_after_the_last_user_query_unless_preserved(tok):
    msgs = [{"role": "user", "content": "First"},
            {"role": "assistant", "content": "Old answer", "reasoning_content": " old trace "},
            {"role": "user", "content": "Second"},
            {"role": "assistant", "content": "New answer", "reasoning_content": "\nnew trace\n"}]
    text = render(tok, msgs, generation=False)
    assert "<|im_start|>assistant\nOld answer<|im_end|>" in text and "old trace" not in text
    assert "<|im_start|>assistant\n<think>\nnew trace\n</think>\n\nNew answer<|im_end|>" in text
    kept = render(tok, msgs, generation=False, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nold trace\n</think>\n\nOld answer<|im_end|>" in kept
    assert render(tok, msgs, generation=False, preserve_thinking=False) == text


def test_a_think_block_inside_the_content_is_split_into_reasoning(tok):
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>\nsteps\n</think>\n\nA"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "<think>more</think>B"}]
    text = render(tok, msgs, generation=False)
    assert "<|im_start|>assistant\nA<|im_end|>" in text and "steps" not in text
    assert text.endswith("<|im_start|>assistant\n<think>\nmore\n</think>\n\nB<|im_end|>\n")


def test_tool_turns_in_a_row_are_one_user_turn_and_do_not_end_the_query(tok):
    msgs = [{"role": "user", "content": "Weather in two cities?"},
            {"role": "assistant", "content": "", "reasoning_content": "call both",
             "tool_calls": [call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "Lyon"})]},
            {"role": "tool", "content": " sunny "}, {"role": "tool", "content": "rain"},
            {"role": "assistant", "content": "", "reasoning_content": "one more",
             "tool_calls": [call("get_weather", {"city": "Nice"})]},
            {"role": "tool", "content": "fog"}]
    text = render(tok, msgs, TOOLS)
    assert ("</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain"
            "\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    assert text.endswith("<|im_start|>user\n<tool_response>\nfog\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n<think>\n")
    # Multi-step tool use: every assistant turn after the user's question keeps its reasoning.
    assert "<think>\ncall both\n</think>" in text and "<think>\none more\n</think>" in text
    assert text.count("<|im_start|>user") == 3


def test_content_parts_render_text_and_vision_placeholders(tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": " Compare "}, {"type": "image", "image": "a.png"},
                                         {"type": "image_url", "image_url": {"url": "b.png"}},
                                         {"type": "video", "video": "c.mp4"}, {"type": "text", "text": "please. "}]}]
    text = render(tok, msgs, generation=False)
    assert text == ("<|im_start|>user\nCompare <|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|>"
                    "<|vision_end|><|vision_start|><|video_pad|><|vision_end|>please.<|im_end|>\n")
    numbered = render(tok, msgs, generation=False, add_vision_id=True)
    assert "Picture 1: " in numbered and "Picture 2: " in numbered and "Video 1: " in numbered


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": "Hi"}, {"role": "system", "content": "late"}],
     "System message must be at the beginning."),
    ([{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}], "No user query found in messages."),
    ([{"role": "user", "content": "<tool_response>\nx\n</tool_response>"}], "No user query found in messages."),
    ([{"role": "user", "content": "Hi"}, {"role": "critic", "content": "no"}], "Unexpected message role."),
    ([{"role": "user", "content": {"text": "a mapping"}}], "Unknown content type"),
    ([{"role": "user", "content": 42}], "Unknown content type"),
    ([{"role": "user", "content": [{"type": "audio", "audio": "x.wav"}]}], "Unknown content part"),
    ([{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "Hi"}],
     "A system turn cannot hold an image."),
], ids=["late-system", "no-user", "only-tool-responses", "unknown-role", "mapping-content",
        "number-content", "unknown-part", "system-image"])
def test_the_template_refuses_what_the_familys_refuses(tok, messages, message):
    with pytest.raises(TemplateError, match=message):
        render(tok, messages)


def test_no_messages_is_refused_by_the_template_itself():
    """transformers' `apply_chat_template` refuses an empty chat before any template runs; its renderer does not."""
    from transformers.utils.chat_template_utils import render_jinja_template

    with pytest.raises(TemplateError, match="No messages provided."):
        render_jinja_template(conversations=[[]], chat_template=FAMILY_CHAT_TEMPLATE, add_generation_prompt=True)
