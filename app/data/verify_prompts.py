"""`regen verify`'s prompt check: every ok record's prompt ids are its messages as the run's template renders them.

Why: a record's prompt is what the drafter learns to continue; ids that are not the template's rendering of
the record's messages (another template, other keyword arguments, a worker that rendered differently) would
train it on prompts the target never sees. The manifest records the template's sha256 and the keyword
arguments the run renders with (app.base.chat_render); each record is rendered again with them, in its own mode
(`enable_thinking`), its messages prepared as vLLM's chat path prepares them (app.base.tool_calls), and its
`input_ids[:num_prompt_tokens]` must equal the result.

A run made before the manifest recorded a template has no check (its prompts read as they were). Where the
model folder the manifest names is missing here, or holds another template, the check cannot run: one warning
says so (`--strict` fails on it).
"""

from __future__ import annotations

import os
import threading
from functools import lru_cache

from app.base.chat_render import has_tokenizer, load_tokenizer, render_ids, template_sha256
from app.base.manifest import RunSettings
from app.base.thinking_modes import record_thinking
from app.base.tool_calls import prepare
from app.data.verify_checks import Problem, ShardResult


class PromptCheck:
    def __init__(self, tokenizer, preserve_thinking: bool):
        self.tokenizer = tokenizer
        self.preserve = preserve_thinking
        self.lock = threading.Lock()  # verify checks shards on threads; one tokenizer renders at a time

    def check(self, res: ShardResult, rec: dict, settings: dict) -> bool:
        """False (and a problem naming the sample) when the record's prompt ids are not the template's."""
        sid = rec.get("sample_id")
        n_prompt = int(rec.get("num_prompt_tokens") or 0)
        try:
            with self.lock:
                want = render_ids(self.tokenizer, prepare(rec.get("messages") or []), rec.get("tools"),
                                  record_thinking(rec, settings), self.preserve)
        except Exception as exc:  # the template refuses the record's messages
            res.add("prompt", f"the run's chat template cannot render the record's messages: "
                    f"{type(exc).__name__}: {exc}"[:300], sid)
            return False
        got = rec["input_ids"][:n_prompt]
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            res.add("prompt", f"prompt ids ({len(got)}) are not the template's rendering of the record's messages "
                    f"({len(want)} ids); first difference at token {at}", sid)
            return False
        return True


def prompt_check(settings: dict) -> tuple[PromptCheck | None, Problem | None]:
    """The run's prompt check, or None with the warning that says why it cannot run (None, None: a run made
    before templates were recorded)."""
    s = RunSettings.view(settings)
    entry = s.chat_template
    if not entry:
        return None, None
    return _load(s.model_path or "", entry["sha256"], bool(s.preserve_thinking))


@lru_cache(maxsize=4)
def _load(path: str, sha: str, preserve: bool) -> tuple[PromptCheck | None, Problem | None]:
    if not (os.path.isdir(path) and has_tokenizer(path)):
        return None, Problem("prompt_check_skipped", None, None, f"the run's model folder {path} is not here: "
                             "prompt ids not re-rendered", severity="warning")
    tokenizer = load_tokenizer(path)
    have = template_sha256(tokenizer)
    if have != sha:
        return None, Problem("prompt_check_skipped", None, None, f"{path}'s chat template (sha256 {have}) is not "
                             f"the run's ({sha}): prompt ids not re-rendered", severity="warning")
    return PromptCheck(tokenizer, preserve), None
