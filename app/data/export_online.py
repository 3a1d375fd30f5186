"""Token-only hand-offs: what a trainer that computes the target's hidden states itself reads, and nothing more.

Why: the stored states are ~94 TB at the job's size and a hidden-state export writes them again; both trainers
can run the target during training and need only ids and loss masks, which every run has. `specforge-online`
writes `prompts.jsonl`; `speculators-online` the `speculators` dataset without `hidden_states/`. Ids and masks
are each record's, whole; numbering and resumability are the hidden-state exports' (app.data.export_trainers).
What each trainer reads and checks: docs/formats.md#token-only-hand-offs-in-detail.
"""

from __future__ import annotations

import shutil

import orjson

from app.base.errors import RegenError
from app.data.export_speculators import Speculators
from app.data.export_states import Sample
from app.data.export_trainers import StateExport

PROMPTS_FILE = "prompts.jsonl"  # app.data.export_formats names it as the format's one file


def token_sample(info, rec: dict) -> Sample:
    """The record as a token-only sample: every id and the mask as stored (no states)."""
    ids, mask = rec["input_ids"], rec["loss_mask"]
    if not ids or len(ids) != len(mask):
        raise RegenError(f"shard {info.shard_id} sample {rec['sample_id']}: {len(ids)} input_ids and {len(mask)} "
                         "loss_mask values; run `regen verify` on the run")
    return Sample(rec["sample_id"], list(ids), list(mask), None)


def _no_layers(fmt: str, layers_spec: str | None) -> None:
    if layers_spec:
        raise RegenError(f"export --layers {layers_spec}: the {fmt} format writes no hidden states (the trainer "
                         "computes them); leave --layers out")


class SpecForgeOnline(StateExport):
    name = "specforge-online"
    needs_states = False

    def __init__(self, reader, out, layers_spec):
        _no_layers(self.name, layers_spec)
        super().__init__(reader, out, layers_spec)
        self._rows: list[bytes] = []

    def meta(self) -> dict:
        return {"specforge": {"prompts_path": PROMPTS_FILE, "row": ["id", "input_ids", "loss_mask"]},
                "ids": "each record's input_ids whole and its loss_mask as stored (no hidden states)"}

    def sample(self, info, rec: dict) -> Sample:
        return token_sample(info, rec)

    def write_sample(self, index: int, sample: Sample) -> None:
        self._rows.append(orjson.dumps({"id": sample.sample_id, "input_ids": sample.input_ids,
                                        "loss_mask": sample.loss_mask}))

    def shard_done(self, info, first: int, end: int) -> None:
        with self.out.atomic_writer(f"rows/{info.shard_id}.jsonl") as fh:
            for row in self._rows:
                fh.write(row + b"\n")
        self._rows = []

    def finish(self, done: set[str], samples: int) -> None:
        """`token_freq.pt`, then `prompts.jsonl`: every exported shard's rows in sample-number order, atomically."""
        super().finish(done, samples)
        with self.out.atomic_writer(PROMPTS_FILE) as fh:
            for shard in self.shards_in_order():
                with self.out.open(f"rows/{shard}.jsonl") as src:
                    shutil.copyfileobj(src, fh, 1 << 20)


class SpeculatorsOnline(Speculators):
    name = "speculators-online"
    needs_states = False

    def __init__(self, reader, out, layers_spec):
        _no_layers(self.name, layers_spec)
        super().__init__(reader, out, layers_spec)

    def meta(self) -> dict:
        return {"speculators": {"hidden_states": "none: ArrowDataset(on_missing='generate') asks a vLLM endpoint"},
                "ids": "each record's input_ids whole and its loss_mask as stored (no hidden states)"}

    def sample(self, info, rec: dict) -> Sample:
        return token_sample(info, rec)

    def write_sample(self, index: int, sample: Sample) -> None:
        self.keep_row(index, sample)
