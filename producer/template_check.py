"""The producer renders every sample with the target's own chat template before it enqueues it.

A row the template refuses (a late system turn, no user query, non-mapping tool-call arguments) is one line of
`rejects.jsonl` with the template's own message (`template_error`), found here rather than on a GPU worker;
arguments vLLM would erase are `tool_arguments_erased`, calls it refuses `bad_tool_call`. Each sample is
rendered as the worker will render it (prepared messages, `preserve_thinking`, every mode, every turn of
`--regenerate all`), text only. Cost and the pool's figures: docs/performance.md#2026-12-06-the-producers-render-check-python-benchbench_producepy;
the rules: docs/formats.md#prompts-tool-calls-and-the-chat-template.
"""

from __future__ import annotations

import multiprocessing

from app.base.chat_render import load_tokenizer, render_text, template_sha256
from app.base.errors import ConfigError
from app.base.ids import prompt_sample_id
from app.base.manifest import RunSettings
from app.base.thinking_modes import sample_mode
from app.base.tool_calls import ToolCallError, erased_arguments, prepare
from producer.estimate import turn_prompts

BATCH = 512  # samples checked at once (one round trip to the pool)
_IN_WORKER: TemplateCheck | None = None  # a pool process's check


class TemplateCheck:
    """`problem(sample)`: (reason, detail) when the sample cannot be rendered as the worker would, else None;
    `problems(samples)` for a batch, on the pool when there is one. Close it (or use `with`) to stop the pool."""

    def __init__(self, tokenizer, settings: dict, processes: int = 1):
        self.tokenizer = tokenizer
        self.settings = settings
        self.preserve = bool(RunSettings.view(settings).preserve_thinking)
        self.per_prompt = int(RunSettings.view(settings).samples_per_prompt)
        self.pool = None
        self.processes = processes
        if processes > 1:  # forkserver: the children start clean, whatever threads this process runs
            ctx = multiprocessing.get_context("forkserver")
            self.pool = ctx.Pool(processes, initializer=_start_worker, initargs=(settings,))

    @classmethod
    def for_run(cls, settings: dict, processes: int = 1) -> TemplateCheck | None:
        """The run's check, or None when its manifest records no template (see the module docstring)."""
        entry = RunSettings.view(settings).chat_template
        if not entry:
            return None
        tokenizer = _run_tokenizer(settings)
        return cls(tokenizer, settings, processes)

    def problems(self, samples: list[dict]) -> list[tuple[str, str] | None]:
        if self.pool is None or len(samples) < 2:
            return [self.problem(s) for s in samples]
        return self.pool.map(_problem_in_worker, samples, chunksize=max(1, len(samples) // (4 * self.processes)))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.join()
            self.pool = None

    def __enter__(self) -> TemplateCheck:
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None

    def modes(self, sample: dict) -> set[bool]:
        """Every mode the prompt's samples will be drawn in (as producer.thinking_modes.pass_samples draws them)."""
        own = sample.get("input_thinking")
        return {sample_mode(self.settings, {"id": prompt_sample_id(sample["id"], k), "input_thinking": own})[0]
                for k in range(self.per_prompt)}

    def problem(self, sample: dict) -> tuple[str, str] | None:
        messages = sample["messages"]
        try:
            erased = erased_arguments(messages)
        except ToolCallError as exc:
            return "bad_tool_call", str(exc)
        if erased:
            return "tool_arguments_erased", erased
        tools = sample.get("tools")
        modes = sorted(self.modes(sample))
        for prompt in turn_prompts(messages):
            prompt = prepare(prompt)
            for thinking in modes:
                try:
                    render_text(self.tokenizer, prompt, tools, thinking, self.preserve)
                except Exception as exc:  # the template's own refusal (raise_exception) or failure (TypeError)
                    return "template_error", f"{type(exc).__name__}: {exc}"[:500]
        return None


def _run_tokenizer(settings: dict):
    s = RunSettings.view(settings)
    entry = s.chat_template
    tokenizer = load_tokenizer(s.model_path)
    sha = template_sha256(tokenizer)
    if sha != entry["sha256"]:
        raise ConfigError(f"{s.model_path}: its chat template (sha256 {sha}) is not the one the run "
                          f"was produced with ({entry['sha256']})")
    return tokenizer


def _start_worker(settings: dict) -> None:
    global _IN_WORKER
    _IN_WORKER = TemplateCheck(_run_tokenizer(settings), settings)


def _problem_in_worker(sample: dict) -> tuple[str, str] | None:
    return _IN_WORKER.problem(sample)
