"""The sample the producer enqueues and a worker generates from, as a type: one Celery message carries a shard's
samples as JSON objects of this shape.

Written in one place (`Sample.new` at the producer, which adds each pass's id and mode with `for_pass`) and read
in one place (`read_samples` as a worker's task starts, which refuses a malformed one naming its shard and
place), so the producer and the workers cannot drift on a key's name or default.
"""

from __future__ import annotations

from typing import ClassVar

from app.base.documents import Document

_NONE = type(None)


class Sample(Document):
    """One prompt to answer: its id, normalised messages and tools, where it came from, and (runs that mix modes,
    several samples per prompt) its mode, the rule that chose it, its prompt and index."""

    REQUIRED = ("id", "messages")
    TYPES: ClassVar = {"id": str, "messages": list, "tools": (list, _NONE), "source": (dict, _NONE),
                       "input_thinking": bool, "thinking": bool, "mode_rule": str, "prompt_id": str,
                       "sample_index": int}

    @classmethod
    def new(cls, sid: str, messages: list[dict], tools: list | None, source: dict | None,
            input_thinking: bool | None = None) -> Sample:
        """`input_thinking`: the mode the input row names for itself; the producer turns it into `thinking`
        (app.base.thinking_modes) and drops it before the sample is enqueued."""
        out = cls({"id": sid, "messages": messages, "tools": tools, "source": source})
        if input_thinking is not None:
            out["input_thinking"] = input_thinking
        return out

    def for_pass(self, sid: str, prompt: str, index: int) -> Sample:
        """Sample `index` of this prompt (`--samples-per-prompt`): its own id, its prompt's and its index."""
        return Sample({**self, "id": sid, "prompt_id": prompt, "sample_index": index})

    @property
    def id(self) -> str:
        return self["id"]

    @property
    def messages(self) -> list[dict]:
        return self["messages"]

    @property
    def tools(self) -> list | None:
        return self.get("tools")

    @property
    def prompt_id(self) -> str:
        """The prompt this sample answers (sample 0 and runs of one sample per prompt: its own id)."""
        return self.get("prompt_id") or self["id"]

    @property
    def sample_index(self) -> int:
        return int(self.get("sample_index", 0))


def read_samples(samples: list, where: str) -> list[Sample]:
    """A shard message's samples, each checked against the type (`where` names the shard)."""
    return [Sample.from_dict(s, f"{where} sample {i}") for i, s in enumerate(samples)]
