"""Each sample's generation mode (thinking or not), and the sampling it is generated with.

Why per sample: a draft trained on one mode collapses in the other, so one run can hold both (`--thinking-mix
P`). The producer decides the mode (rules `input`, `mix`, `run`, in that order) and it travels in the sample's
message, so every worker and redelivery renders and samples it alike. A record without a mode (runs made
before) is in the run's mode (`record_thinking`). The rules: docs/configuration.md#each-samples-mode.
"""

from __future__ import annotations

import hashlib

from app.base.manifest import RunSettings, mode_name

RULES = ("input", "mix", "run")


def mode_draw(run_seed: int, sample_id: str) -> float:
    """A uniform number in [0, 1) from the run seed and the sample id (independent of the sample's seed)."""
    digest = hashlib.blake2b(f"mode:{run_seed}:{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def draw_thinking(mix: float, run_seed: int, sample_id: str) -> bool:
    return mode_draw(run_seed, sample_id) < mix


def sample_mode(settings: RunSettings | dict, sample: dict) -> tuple[bool, str]:
    """(thinking, rule) for a sample the producer is about to shard; see the module docstring."""
    s = RunSettings.view(settings)
    if s.thinking_mix is None:
        return bool(s.thinking), "run"
    own = sample.get("input_thinking")
    if own is not None:
        return bool(own), "input"
    return draw_thinking(float(s.thinking_mix), int(s.sampling.seed), sample["id"]), "mix"


def record_thinking(rec: dict, settings: RunSettings | dict) -> bool:
    """A record's (or a sample message's) mode; one without its own is in the run's mode."""
    own = rec.get("thinking")
    return bool(RunSettings.view(settings).thinking) if own is None else bool(own)


def record_mode(rec: dict, settings: RunSettings | dict) -> str:
    """`thinking` or `non_thinking`, for tables and counts."""
    return mode_name(record_thinking(rec, settings))


def run_modes(settings: RunSettings | dict) -> tuple[str, ...]:
    """The modes a run's samples can be in."""
    s = RunSettings.view(settings)
    if s.thinking_mix is None:
        return (mode_name(bool(s.thinking)),)
    return ("thinking", "non_thinking")


def sampling_for(settings: RunSettings | dict, thinking: bool, sample_index: int = 0) -> dict:
    """The sampling one sample is generated with (the run seed included; the sample's own seed is drawn apart)."""
    s = RunSettings.view(settings)
    by_mode = s.mode_sampling
    out = dict(by_mode[mode_name(thinking)] if by_mode else s.sampling_dict())
    temperatures = s.sample_temperatures
    if temperatures:
        out["temperature"] = float(temperatures[sample_index % len(temperatures)])
    return out


def prompt_ends_in_mode(prompt_ids: list[int], tails: dict, thinking: bool) -> bool:
    """Whether a prompt ends as its mode's generation prompt does (and not as the other mode's)."""
    own, other = tails[mode_name(thinking)], tails[mode_name(not thinking)]

    def ends(tail):
        return len(prompt_ids) >= len(tail) and list(prompt_ids[len(prompt_ids) - len(tail):]) == list(tail)

    return ends(own) and not (len(other) > len(own) and ends(other))
