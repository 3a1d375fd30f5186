"""What a run promises about its stored hidden states, and the checks and summaries of that promise.

A run's manifest records `settings.states`: the stored dtype and `max_rel_error`, the largest relative error
`||stored - captured|| / ||captured||` any (token, layer) of any sample may have (app.base.states_codec). Each lossy
sample's hidden-file entry records what its encoding measured, per layer. `regen verify` holds every entry to the
promise (`sample_problem`), `regen verify --reference` allows the promised error on top of the capture tolerance
(app.data.verify_reference.reference_bound), and `regen stats` sums the recorded errors per layer (`LayerErrors`). A bf16 entry is
exact; a lossy run stores a sample its quality gate flagged as bf16, so such entries are always allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from app.base.manifest import RunSettings


@dataclass(frozen=True)
class StatesPromise:
    dtype: str = "bf16"
    max_rel_error: float = 0.0

    @property
    def lossy(self) -> bool:
        return self.dtype != "bf16"


def promise(settings: dict) -> StatesPromise:
    """The run's promise from its manifest settings (runs made before the setting existed store bf16)."""
    states = RunSettings.view(settings).states
    return StatesPromise(states.dtype, float(states.max_rel_error))


def sample_problem(entry: dict, run: StatesPromise) -> tuple[str, str] | None:
    """(kind, detail) when a hidden-file entry breaks the run's promise, else None."""
    codec = entry.get("codec", "bf16")
    if codec == "bf16":
        return None
    if codec != run.dtype:
        return "states_dtype", f"states stored as {codec}, the run stores {run.dtype}"
    errors = entry.get("max_rel_error")
    layers = entry.get("layers") or []
    if (not isinstance(errors, list) or len(errors) != len(layers)
            or not all(isinstance(e, int | float) and math.isfinite(e) and e >= 0 for e in errors)):
        return "states_error", f"no per-layer error recorded for this {codec} sample ({errors!r})"
    worst = max(range(len(errors)), key=errors.__getitem__) if errors else None
    if worst is not None and errors[worst] > run.max_rel_error:
        return "states_error", (f"relative error {errors[worst]:.5f} at layer {layers[worst]} is above the run's "
                                f"bound {run.max_rel_error} ({codec})")
    return None


@dataclass
class LayerErrors:
    """Recorded errors of a run's samples summed per layer: the worst, and the RMS over all tokens."""

    layers: list[int]
    lossy_samples: int = 0
    lossless_samples: int = 0
    tokens: int = 0
    worst: list[float] = field(default_factory=list)
    _sum_squares: list[float] = field(default_factory=list)

    def add(self, entry: dict) -> None:
        if "codec" not in entry:
            self.lossless_samples += 1
            return
        n = int(entry["n_tokens"])
        if not self.worst:
            self.worst, self._sum_squares = [0.0] * len(self.layers), [0.0] * len(self.layers)
        self.lossy_samples += 1
        self.tokens += n
        for k, (worst, rms) in enumerate(zip(entry["max_rel_error"], entry["rms_rel_error"], strict=True)):
            self.worst[k] = max(self.worst[k], float(worst))
            self._sum_squares[k] += float(rms) ** 2 * n

    @property
    def rms(self) -> list[float]:
        return [math.sqrt(s / self.tokens) if self.tokens else 0.0 for s in self._sum_squares]

    def rows(self) -> list[tuple[int, float, float]]:
        """(layer, max, RMS) per layer; empty when no sample is stored lossy."""
        return list(zip(self.layers, self.worst, self.rms, strict=True)) if self.worst else []
