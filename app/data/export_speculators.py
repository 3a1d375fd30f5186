"""speculators' training data: a `datasets` dataset saved with `save_to_disk`, states by row, `token_freq.pt`.

Written as speculators 0.9.0's `ArrowDataset` reads it: rows with `input_ids`, `loss_mask`, `seq_len`, and
`hidden_states/hs_{i}.safetensors` per row (the auxiliary layers ascending, then the verifier's final layer).
States are written shard by shard; the dataset is rebuilt in sample-number order when the export is assembled,
with a fingerprint named from the exported shards, so two exports of the same shards are the same bytes.
What speculators reads, field by field: docs/formats.md#speculators-dataset-in-detail.
"""

from __future__ import annotations

import shutil
import struct
import tempfile

import numpy as np
import orjson

from app.data.export_plan import digest
from app.data.export_trainers import StateExport


def write_safetensors(fh, tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]]) -> None:
    """A safetensors file from little-endian, C-ordered arrays (numpy has no bf16; this avoids a torch round trip).

    Each array's memory goes to `fh` as it is: joining `tobytes()` copies into one `bytes` copied the states
    twice more before the write (bench/bench_export_speed.py).
    """
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    raw = orjson.dumps(header)
    raw += b" " * (-len(raw) % 8)
    fh.write(struct.pack("<Q", len(raw)) + raw)
    for _, _, data in tensors.values():
        fh.write(memoryview(np.ascontiguousarray(data)).cast("B"))


class Speculators(StateExport):
    name = "speculators"

    def __init__(self, reader, out, layers_spec):
        super().__init__(reader, out, layers_spec)
        self._rows: list[bytes] = []

    def meta(self) -> dict:
        return {**super().meta(), "speculators": {"target_layer_ids": list(self.layers.aux),
                                                  "hidden_states_slots": [*self.layers.aux, self.layers.final]}}

    def remove_from(self, end: int) -> None:
        for name in self.out.listdir("hidden_states"):
            if name.startswith("hs_") and name.endswith(".safetensors") and int(name[3:-12]) >= end:
                self.out.delete(f"hidden_states/{name}")

    def write_sample(self, index: int, sample) -> None:
        # The sample's states are the auxiliary layers then the final one (`ExportLayers.read_slots`), decoded in
        # that order: speculators' [T, k+1, H] as they are, no copy.
        states = sample.states.astype("<u2", copy=False)
        ids = np.asarray(sample.input_ids, dtype="<i8")
        with self.out.atomic_writer(f"hidden_states/hs_{index}.safetensors") as fh:
            write_safetensors(fh, {"hidden_states": ("BF16", states.shape, states),
                                   "token_ids": ("I64", ids.shape, ids)})
        self.keep_row(index, sample)

    def keep_row(self, index: int, sample) -> None:
        """The sample's dataset row (ids and mask), written with the shard's others by `shard_done`."""
        self._rows.append(orjson.dumps({"index": index, "id": sample.sample_id, "input_ids": sample.input_ids,
                                        "loss_mask": sample.loss_mask, "seq_len": len(sample.input_ids)}))

    def shard_done(self, info, first: int, end: int) -> None:
        with self.out.atomic_writer(f"rows/{info.shard_id}.jsonl") as fh:
            for row in self._rows:
                fh.write(row + b"\n")
        self._rows = []

    def _all_rows(self):
        for shard in self.shards_in_order():
            with self.out.open(f"rows/{shard}.jsonl") as fh:
                for line in fh:
                    row = orjson.loads(line)
                    yield {k: row[k] for k in ("id", "input_ids", "loss_mask", "seq_len")}

    def finish(self, done: set[str], samples: int) -> None:
        import datasets

        super().finish(done, samples)
        datasets.disable_progress_bars()  # the exporter shows its own progress
        features = datasets.Features({"id": datasets.Value("string"),
                                      "input_ids": datasets.Sequence(datasets.Value("int64")),
                                      "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                      "seq_len": datasets.Value("int64")})
        cache = tempfile.mkdtemp(prefix="regen-speculators-")
        try:
            if samples:
                ds = datasets.Dataset.from_generator(self._all_rows, features=features, cache_dir=cache,
                                                     fingerprint=f"regen-speculators-{digest(done)}")
            else:  # nothing exported (yet): an empty dataset, as from_generator cannot build one
                ds = datasets.Dataset.from_dict({k: [] for k in features}, features=features)
            ds.set_format(type="torch", columns=["input_ids", "loss_mask", "seq_len"], output_all_columns=True)
            if self.out.is_local:
                ds.save_to_disk(self.out.path(""))
            else:  # an object store: the same credentials the output folder was opened with
                ds.save_to_disk(self.out.url, storage_options=getattr(self.out.fs, "storage_options", None))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
