"""What every hidden-state export shares: which captured layers go where, one state per id, token counts.

A capture stores states for `input_ids[:-1]` (the last id never went through the model), and the trainers want
exactly one state per id, so an export keeps `input_ids[:n]` and `loss_mask[:n]`, n the number of states.
Formats take the auxiliary layers and, where needed, the final layer (vLLM id N); a run without a layer a
format needs is refused in one line. Why: docs/formats.md#one-state-per-id-and-which-layers-go-where.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from app.base.errors import ConfigError, RegenError
from app.base.layers import eagle3_preset, parse_layers


@dataclass(frozen=True)
class ExportLayers:
    """The layers one export writes, as slots of the run's stored states and as ids in each convention."""

    captured: tuple[int, ...]  # the run's vLLM ids, in the order the states store them
    aux: tuple[int, ...]  # vLLM ids of the auxiliary layers, in the order the export writes them
    final: int | None  # vLLM id N when the format writes the final layer, else None
    num_layers: int

    @property
    def aux_slots(self) -> list[int]:
        return [self.captured.index(v) for v in self.aux]

    @property
    def final_slot(self) -> int | None:
        return None if self.final is None else self.captured.index(self.final)

    @property
    def read_slots(self) -> list[int]:
        """The stored layers an export reads, in the order its samples hold them: the auxiliary ones, then the
        final one where the format writes it. A sample's states are decoded in this order
        (`HiddenFileReader.read`'s `slots`), so a format's layer block is already in place."""
        return [*self.aux_slots, *([] if self.final is None else [self.final_slot])]

    def to_meta(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "captured_vllm_ids": list(self.captured),
            "aux_vllm_ids": list(self.aux),
            "aux_dflash_ids": [v - 1 for v in self.aux],
            "final_vllm_id": self.final,
            "convention": "vllm id L = transformers hidden_states[L] = output of decoder layer L-1 (before the "
            "final norm); dflash/SpecForge id i = vllm id i+1",
        }


def _run_layers_hint(captured: list[int], need: list[int]) -> str:
    return "vllm:" + ",".join(str(v) for v in sorted(set(captured) | set(need)))


def choose_layers(fmt: str, run_id: str, captured: list[int] | None, num_layers: int, spec: str | None,
                  needs_final: bool, aux_count: int | None = None) -> ExportLayers:
    """The layers `fmt` writes from a run that captured `captured` (vLLM ids); refused in one line if missing."""
    if not captured:
        raise RegenError(f"run {run_id!r} captured no hidden states: the {fmt} format needs them")
    n = num_layers
    if needs_final and n not in captured:
        raise RegenError(
            f"run {run_id!r} captured vLLM layers {sorted(captured)}, without the final layer (vLLM id {n}) the "
            f"{fmt} format needs: produce it with --layers {_run_layers_hint(captured, [n])} (or --layers eagle3)")
    if spec:
        try:
            asked = list(parse_layers(spec, n).vllm)
        except ConfigError as exc:
            raise ConfigError(f"export --layers: {exc}") from exc
        missing = [v for v in asked if v not in captured]
        if missing:
            raise RegenError(
                f"export --layers {spec} asks for vLLM layer(s) {missing}, which run {run_id!r} did not capture "
                f"(it has {sorted(captured)}): produce it with --layers {_run_layers_hint(captured, asked)}")
        aux = sorted(v for v in asked if not (needs_final and v == n))
    else:
        aux = sorted(v for v in captured if not (needs_final and v == n))
    if aux_count is not None and len(aux) != aux_count:
        hint = ("pick them with export --layers vllm:A,B,C" if len(aux) > aux_count else
                f"produce it with --layers eagle3 (vLLM ids {sorted(set(eagle3_aux(n)) | {n})})")
        raise RegenError(f"the {fmt} format needs exactly {aux_count} auxiliary layers besides the final one; "
                         f"run {run_id!r} gives {aux}: {hint}")
    if not aux:
        raise RegenError(f"the {fmt} format needs at least one auxiliary layer; run {run_id!r} captured "
                         f"{sorted(captured)}")
    return ExportLayers(tuple(captured), tuple(aux), n if needs_final else None, n)


def eagle3_aux(num_layers: int) -> list[int]:
    """The eagle3 preset's auxiliary layers (app.base.layers), without the final layer."""
    return [v for v in eagle3_preset(num_layers) if v != num_layers]


@dataclass
class Sample:
    """One exported sample: the ids its states cover, their loss mask, and the states [n, L, H] (bf16 bits)."""

    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    # uint16 bf16 bit patterns, [n, layers, H]: the export's `ExportLayers.read_slots`, auxiliary layers then the
    # final one; None: a token-only format
    states: np.ndarray | None
    # What the format writes, built from the states by `StateExport.prepare` in the read-ahead thread (SpecForge:
    # the torch.save dict); None where the format builds nothing ahead
    tensors: dict | None = None
    # the prompt it answers and its mode (app.base.thinking_modes), for the export's `samples.jsonl`
    prompt_id: str | None = None
    thinking: bool | None = None


def covered_sample(rec: dict, tokens: np.ndarray, states: np.ndarray, where: str) -> Sample:
    """The record cut to the ids its states cover, after checking the states are for exactly those ids."""
    ids, mask = rec["input_ids"], rec["loss_mask"]
    n = int(tokens.shape[0])
    if n not in (len(ids) - 1, len(ids)) or states.shape[0] != n or tokens.tolist() != ids[:n]:
        raise RegenError(f"{where} sample {rec['sample_id']}: stored states are for {n} tokens that are not the "
                         f"record's first {n} of {len(ids)} ids; run `regen verify` on the run")
    return Sample(rec["sample_id"], list(ids[:n]), list(mask[:n]), states)


def supervision_problem(mask: list[int], consecutive: bool) -> str | None:
    """Why a sample has nothing to train on (None: it has): no supervised token, or (DFlash) no two in a row."""
    m = np.asarray(mask, dtype=np.int8)
    if not m.any():
        return "no_supervised_tokens"
    if consecutive and not (m[1:] & m[:-1]).any():
        return "no_two_consecutive_supervised_tokens"
    return None


def supervised_counts(sample: Sample) -> Counter:
    """Token id -> count over the sample's supervised positions (what a reduced draft vocabulary is built from)."""
    ids = np.asarray(sample.input_ids, dtype=np.int64)
    picked = ids[np.asarray(sample.loss_mask, dtype=bool)]
    values, counts = np.unique(picked, return_counts=True)
    return Counter(dict(zip(values.tolist(), counts.tolist(), strict=True)))
