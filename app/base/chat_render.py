"""The target's chat template, called the one way regen calls it everywhere it renders a prompt.

Why one place: a record's prompt ids are only right if the worker, the producer's check, the estimate and
`regen verify` give the template the same messages and the same keyword arguments. `template_kwargs` are those
arguments: the generation prompt, the sample's mode (`enable_thinking`) and, only when the run sets it,
`preserve_thinking` (the Qwen3.5/3.6 family's template keeps earlier turns' reasoning with it; off, as the
template has it by default, a run renders exactly as runs made before the setting did). The manifest records the
template's sha256 and these arguments (`manifest_entry`), so `regen verify` re-renders with what was used.

Messages are rendered as vLLM's chat path hands them to the template (app.base.tool_calls); the caller prepares them
(the worker with vLLM's own function, the others with `app.base.tool_calls.prepare`).
"""

from __future__ import annotations

import hashlib
import json
import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def template_kwargs(thinking: bool, preserve_thinking: bool = False) -> dict:
    """The keyword arguments every render of a prompt passes to the template."""
    kwargs = {"add_generation_prompt": True, "enable_thinking": bool(thinking)}
    if preserve_thinking:
        kwargs["preserve_thinking"] = True
    return kwargs


def render_text(tokenizer, messages: list[dict], tools, thinking: bool, preserve_thinking: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         **template_kwargs(thinking, preserve_thinking))


def render_ids(tokenizer, messages: list[dict], tools, thinking: bool, preserve_thinking: bool = False) -> list[int]:
    """The prompt's token ids as the engine sees them: the rendered text encoded without added special tokens."""
    text = render_text(tokenizer, messages, tools, thinking, preserve_thinking)
    return tokenizer.encode(text, add_special_tokens=False)


def template_source(tokenizer) -> str | None:
    """The template text the tokenizer renders with (a named set as sorted JSON), or None when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    return template if isinstance(template, str) else json.dumps(template, sort_keys=True)


def template_sha256(tokenizer) -> str | None:
    source = template_source(tokenizer)
    return None if source is None else hashlib.sha256(source.encode()).hexdigest()


def has_tokenizer(model_path: str) -> bool:
    return any(os.path.isfile(os.path.join(model_path, name)) for name in TOKENIZER_FILES)


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def manifest_entry(model_path: str, preserve_thinking: bool) -> dict | None:
    """The manifest's `chat_template`: {"sha256", "kwargs"} (`enable_thinking` is each record's own mode), or None
    for a model folder without a tokenizer or template (nothing to render with: the producer's check is off)."""
    if not has_tokenizer(model_path):
        return None
    sha = template_sha256(load_tokenizer(model_path))
    if sha is None:
        return None
    kwargs = template_kwargs(True, preserve_thinking)
    del kwargs["enable_thinking"]
    return {"sha256": sha, "kwargs": kwargs}
