"""Which export formats a run's capture layers allow, known before any GPU time is spent.

Why: `--layers dflash` leaves out the final layer (vLLM id N) that the `speculators` and `specforge-eagle3`
exports need, and a user used to learn it at export time, after the run. `regen produce --dry-run` and `regen
pilot` print these lines from the resolved layer ids, with the `--layers` that would allow a ruled-out format.
The rules are the exporters' own (app.data.export_formats: `final_layer`, `aux_layers`; app.data.export_states
applies them to a finished run).
"""

from __future__ import annotations

from dataclasses import dataclass

from app.base.layers import eagle3_preset
from app.data import export_formats
from app.data.export_formats import STATES


@dataclass(frozen=True)
class Fit:
    """One format's answer: allowed or not, and what it takes (an export flag, or the `--layers` to produce with)."""

    format: str
    allowed: bool
    note: str = ""


def _spec(ids) -> str:
    return "vllm:" + ",".join(str(v) for v in sorted(ids))


def fits(vllm_ids: list[int] | None, num_layers: int) -> list[Fit]:
    """Every export format against a run capturing `vllm_ids` (None or []: capture off) of an N-layer model."""
    n, captured = num_layers, sorted(vllm_ids or ())
    out = []
    for f in export_formats.FORMATS.values():
        if f.kind != STATES:
            out.append(Fit(f.name, True))
            continue
        if not captured:
            out.append(Fit(f.name, False, "no hidden states (--capture off): produce with --capture inline or "
                                          "staged"))
            continue
        aux = [v for v in captured if not (f.final_layer and v == n)]
        want = set(captured) | ({n} if f.final_layer else set())
        if f.aux_layers is not None and len(aux) < f.aux_layers:
            extra = [v for v in eagle3_preset(n) if v not in want]
            out.append(Fit(f.name, False, f"needs {f.aux_layers} auxiliary layers and the final one (vLLM id {n}): "
                                          f"--layers {_spec(want | set(extra))} or --layers eagle3"))
        elif f.final_layer and n not in captured:
            out.append(Fit(f.name, False, f"needs the final layer (vLLM id {n}): --layers {_spec(want)}"))
        elif not aux:
            out.append(Fit(f.name, False, "needs an auxiliary layer besides the final one"))
        elif f.aux_layers is not None and len(aux) > f.aux_layers:
            out.append(Fit(f.name, True, f"with `regen export --layers vllm:A,B,C` picking {f.aux_layers} of "
                                         f"{','.join(map(str, aux))}"))
        elif not f.final_layer and f.aux_layers is None and n in captured and len(captured) > 1:
            out.append(Fit(f.name, True, f"every captured layer, the final one too; `regen export --layers "
                                         f"{_spec(v for v in captured if v != n)}` leaves it out"))
        else:
            out.append(Fit(f.name, True))
    return out


def layer_lines(layers: dict | None) -> list[str]:
    """The lines `--dry-run` and the pilot print: the resolved ids, the formats allowed and those ruled out."""
    if not layers:
        ids, n, head = None, 0, "layers: none (--capture off): no hidden states are stored"
    else:
        ids, n = layers["vllm_ids"], int(layers["num_layers"])
        head = (f"layers: --layers {layers['spec']} on a {n}-layer model: vLLM ids {','.join(map(str, ids))} "
                f"(DFlash ids {','.join(str(v - 1) for v in ids)}; the final layer is vLLM id {n})")
    answers = fits(ids, n)
    allowed = [f"{a.format} ({a.note})" if a.note else a.format for a in answers if a.allowed]
    lines = [head, f"export formats allowed: {', '.join(allowed)}"]
    ruled = [a for a in answers if not a.allowed]
    if ruled:
        lines.append("export formats ruled out:")
        lines += [f"  {a.format}: {a.note}" for a in ruled]
    if ids and ruled:
        every = sorted(set(ids) | {n} | (set(eagle3_preset(n)) if len(set(ids) - {n}) < 3 else set()))
        lines.append(f"every format: --layers {_spec(every)}")
    return lines
