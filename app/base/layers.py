"""Capture layers in one documented convention, converted once.

`vllm:L` / `hf:L` are the same number (transformers' `hidden_states[L]`); `dflash:i` is requested as i+1.
Presets: `dflash`, `dflash-K`, `eagle3`. Slots are ascending whatever order the ids are typed in, because vLLM
returns the layers in ascending order; `ascending_problem` names a run made before this, whose labels are
wrong. Conventions: docs/measured-facts.md; presets and slot order:
docs/capture.md#layer-presets-and-slot-order.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.base.errors import ConfigError

CONVENTIONS = ("vllm", "hf", "dflash")


@dataclass(frozen=True)
class LayerSelection:
    """The layers to capture, in vLLM ids (the engine's) and DFlash ids (the trainer's), plus what was asked."""

    vllm: tuple[int, ...]
    spec: str
    num_layers: int

    @property
    def dflash(self) -> tuple[int, ...]:
        return tuple(v - 1 for v in self.vllm)

    def to_manifest(self) -> dict:
        return {
            "spec": self.spec,
            "num_layers": self.num_layers,
            "vllm_ids": list(self.vllm),
            "dflash_ids": list(self.dflash),
            "convention": "vllm id L = transformers hidden_states[L] = output of decoder layer L-1 "
            "(pre-final-norm); dflash id i = vllm id i+1",
        }


def dflash_preset(num_layers: int, count: int = 5) -> list[int]:
    """DFlash's default: `count` ids spaced evenly over [1, N-3] (DFlash ids)."""
    lo, hi = 1, num_layers - 3
    if hi < lo:
        return [lo]
    if count == 1:
        return [lo]
    return sorted({round(lo + (hi - lo) * k / (count - 1)) for k in range(count)})


def eagle3_preset(num_layers: int) -> list[int]:
    """EAGLE-3's three auxiliary layers and the final one (vLLM ids), for both trainers."""
    n = num_layers
    aux = {2, n // 2, n - 3}
    if len(aux) < 3 or min(aux) < 1:
        aux = {round(1 + (n - 2) * k / 2) for k in range(3)} if n >= 4 else set(range(1, n))
    return sorted(aux | {n})


def parse_layers(spec: str, num_layers: int) -> LayerSelection:
    """Parse `dflash:1,16,31`, `vllm:2,17`, `hf:4`, `dflash`, `dflash-3` or `eagle3` for an N-layer model."""
    spec = spec.strip()
    if num_layers < 1:
        raise ConfigError(f"model has {num_layers} layers")
    if spec == "eagle3":
        vllm = eagle3_preset(num_layers)
    elif spec == "dflash" or spec.startswith("dflash-"):
        count = 5 if spec == "dflash" else _int(spec.split("-", 1)[1], spec)
        vllm = [i + 1 for i in dflash_preset(num_layers, count)]
    else:
        conv, sep, ids = spec.partition(":")
        if not sep or conv not in CONVENTIONS:
            raise ConfigError(
                f"layers {spec!r}: expected CONVENTION:IDS with CONVENTION in {', '.join(CONVENTIONS)}, "
                "or a preset (dflash, dflash-K, eagle3)"
            )
        values = [_int(x, spec) for x in ids.split(",") if x.strip()]
        if not values:
            raise ConfigError(f"layers {spec!r}: no layer ids")
        vllm = [v + 1 for v in values] if conv == "dflash" else values
    bad = [v for v in vllm if not 1 <= v <= num_layers]
    if bad:
        raise ConfigError(
            f"layers {spec!r}: vLLM ids {bad} outside 1..{num_layers} for a {num_layers}-layer model"
        )
    if len(set(vllm)) != len(vllm):
        raise ConfigError(f"layers {spec!r}: repeated layer ids")
    return LayerSelection(vllm=tuple(sorted(vllm)), spec=spec, num_layers=num_layers)


def ascending_problem(vllm_ids) -> str | None:
    """Why a run's recorded capture layers cannot be the labels of its slots (ids out of ascending order: vLLM
    stored them ascending), else None."""
    ids = [int(v) for v in vllm_ids or ()]
    if ids == sorted(ids):
        return None
    return (f"the run lists capture layers (vLLM ids) {ids} out of ascending order; vLLM stores captured layers "
            f"ascending, so its slots hold layers {sorted(ids)} in that order under the labels {ids} (a run made "
            "before regen sorted the ids): produce it again")


def _int(text: str, spec: str) -> int:
    try:
        return int(text.strip())
    except ValueError as exc:
        raise ConfigError(f"layers {spec!r}: {text!r} is not an integer") from exc
