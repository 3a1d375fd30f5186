"""Token-only hand-offs: what a trainer that computes the target's hidden states itself reads, and nothing more.

Why: at the job's size the stored states are ~94 TB (lossless) and every hidden-state export writes them again,
raw (~140 TB; docs/formats.md has the figures). Both trainers can instead run the target during training, and
need only the ids and the loss mask for that -- which every run has, `--capture off` runs included:

- `specforge-online`: one plain JSONL file, `prompts.jsonl`, one row per sample `{"id", "input_ids",
  "loss_mask"}`, for SpecForge's `data.prompts_path`. SpecForge 0.2.0 (`specforge/data/prompt_builder.py`,
  `prepare_prompt_tasks`) takes a file as pre-tokenized when its first record has both `input_ids` and
  `loss_mask`; it wants one-dimensional integer lists of equal, non-zero length, a mask of 0/1, and ignores
  every other key (`id` is there for the user: the record's `sample_id`). It cuts each row to `data.max_length`
  ids from the head and drops rows left with fewer supervised ids than the algorithm's minimum.
- `speculators-online`: the `speculators` format's dataset (`save_to_disk`: `id`, `input_ids`, `loss_mask`,
  `seq_len`, torch format; `token_freq.pt`) without `hidden_states/`. speculators 0.9.0's `ArrowDataset`
  (`speculators/train/data.py`) looks for `hidden_states/hs_{i}.safetensors` per row and, with
  `on_missing="generate"` (its default), sends the row's `input_ids` to a vLLM endpoint that extracts the
  states, and checks that the returned `token_ids` equal them.

The ids are each record's `input_ids` whole and its `loss_mask` as stored: the target runs over every id here,
so unlike a capture (app.data.export_states) no id lacks a state and nothing is cut. Shards are exported as
soon as they are done; a `--capture staged` run's capture is not waited for. Sample numbering, resumability, the
left-out counts and `token_freq.pt` are the hidden-state exports' (app.data.export_trainers): the row order is
the same as theirs, so an online and an offline export of one run number their samples alike.
"""

from __future__ import annotations

import shutil

import orjson

from app.data.export_speculators import Speculators
from app.data.export_states import Sample
from app.data.export_trainers import StateExport
from app.errors import RegenError

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
