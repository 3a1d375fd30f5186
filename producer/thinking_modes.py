"""The per-sample side of the producer: each prompt's K samples in their modes (app.base.thinking_modes), and the token ids
the target's template ends each mode's generation prompt with.

Why the tails are measured here: a mixed run is only as good as the template's `enable_thinking`; a template
without it renders both modes alike, and the "non-thinking" half of the run would be thinking samples. The
producer renders one probe conversation in both modes with the target's own tokenizer: what follows their common
prefix is each mode's tail (Qwen3: nothing for thinking, `<think>\\n\\n</think>\\n\\n` for non-thinking). Equal
tails refuse the mix at produce; the manifest keeps them, and `regen verify` holds every record's prompt to
its mode's tail.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from app.base.errors import ConfigError
from app.base.ids import prompt_sample_id
from app.base.manifest import MODES, RunSettings, mode_name
from app.base.thinking_modes import sample_mode

_PROBE = [{"role": "user", "content": "Which mode is this?"}]


def mode_prompt_tails(model_path: str) -> dict[str, list[int]]:
    """{mode: ids after the common prefix of the probe rendered in both modes}; ConfigError when they are equal."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = {}
    for mode in MODES:
        text = tokenizer.apply_chat_template(_PROBE, add_generation_prompt=True, enable_thinking=mode == "thinking",
                                             tokenize=False)
        ids[mode] = tokenizer.encode(text, add_special_tokens=False)
    a, b = ids["thinking"], ids["non_thinking"]
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    tails = {mode: ids[mode][common:] for mode in MODES}
    if tails["thinking"] == tails["non_thinking"]:
        raise ConfigError(f"--thinking-mix: {model_path}'s chat template renders both modes alike (no "
                          "enable_thinking), so its non-thinking samples would not be non-thinking")
    return tails


class ModeCounts:
    """What the producer decided for the samples it sharded: per mode, per rule, and the rows of a single-mode
    run whose own mode field was overridden by the run's mode."""

    def __init__(self):
        self.samples = 0
        self.modes = dict.fromkeys(MODES, 0)
        self.rules: dict[str, int] = {}
        self.input_mode_overridden = 0

    def count_prompt(self, sample: dict, per_prompt: int, settings: dict) -> None:
        """Count the modes a prompt's samples will be in without making them (the dry run)."""
        own = sample.get("input_thinking")
        for k in range(per_prompt):
            thinking, rule = sample_mode(settings, {"id": prompt_sample_id(sample["id"], k), "input_thinking": own})
            self.add(thinking, rule, own)

    def add(self, thinking: bool, rule: str, own: bool | None, mixed: bool = True) -> None:
        if not mixed and own is not None and own != thinking:
            self.input_mode_overridden += 1
        self.samples += 1
        self.modes[mode_name(thinking)] += 1
        self.rules[rule] = self.rules.get(rule, 0) + 1

    def to_dict(self) -> dict:
        return {"samples": self.samples, "modes": dict(self.modes), "mode_rules": dict(self.rules),
                "input_mode_overridden": self.input_mode_overridden}


def pass_samples(samples: Iterable[tuple[dict, int]], index: int, settings: dict,
                 counts: ModeCounts) -> Iterator[tuple[dict, int]]:
    """Sample `index` of every prompt (the producer's pass `index`), each with its mode when the run mixes."""
    mixed = RunSettings.view(settings).mixed
    for sample, nbytes in samples:
        own = sample.pop("input_thinking", None)
        if index:
            sample = sample.for_pass(prompt_sample_id(sample.id, index), sample.id, index)
        thinking, rule = sample_mode(settings, {"id": sample["id"], "input_thinking": own})
        if mixed:
            sample["thinking"] = thinking
            sample["mode_rule"] = rule
        counts.add(thinking, rule, own, mixed)
        yield sample, nbytes
