"""Hidden-state exports that a trainer's own reader loads as they are: the part every such format shares.

A format subclass says which layers it needs and how one sample is written; this base streams the run's shards
through it: samples numbered over the whole export from the plan (app.data.export_plan), per-shard frequencies
for `token_freq.pt`, `samples.jsonl` naming each number, samples with nothing to learn from left out and
counted, and each shard claimed (app.data.export_claims). The token-only formats are subclasses without
states. Details: docs/formats.md#what-every-hidden-state-export-shares.
"""

from __future__ import annotations

import io
from collections import Counter

import orjson

from app.base.errors import RegenError
from app.base.records import prompt_id
from app.base.storage import Storage
from app.base.thinking_modes import record_thinking
from app.data import export_formats
from app.data.export_states import (
    ExportLayers,
    Sample,
    choose_layers,
    covered_sample,
    supervised_counts,
    supervision_problem,
)
from app.data.read_ahead import read_ahead
from app.data.run_reader import RunReader, ShardInfo


class StateExport:
    """Base of the hidden-state formats; subclasses set the class fields and `write_sample`."""

    name = ""
    needs_states = True  # False: a token-only format, which reads no states and writes none
    consecutive_supervision = False

    @property
    def needs_final(self) -> bool:
        """The format writes the final layer (app.data.export_formats, the one list of what each needs)."""
        return export_formats.get(self.name).final_layer

    @property
    def aux_count(self) -> int | None:
        return export_formats.get(self.name).aux_layers

    def __init__(self, reader: RunReader, out: Storage, layers_spec: str | None):
        self.reader, self.out = reader, out
        model = reader.run_settings.model
        self.model = model
        self.layers: ExportLayers | None = None
        if self.needs_states:
            self.layers = choose_layers(self.name, reader.run_id, reader.layers, int(model.get("num_layers") or 0),
                                        layers_spec, self.needs_final, self.aux_count)

    def meta(self) -> dict:
        """What goes into export.json: the layers and where they are in each sample's tensors."""
        return {"layers": self.layers.to_meta(), "one_state_per_id": "input_ids[:n], n = stored states "
                "(input_ids[:-1]: the last id, usually the end-of-turn token, has no state and is not exported)"}

    def count_shard(self, info: ShardInfo, kept, filtered: Counter) -> int:
        """How many of the shard's kept records `export_shard` writes (the rest counted in `filtered`), from the
        hidden file's index alone: the states' token count decides which ids and mask positions are exported.
        A token-only format exports every id and the whole mask, so the record alone decides."""
        if not self.needs_states:
            n = 0
            for rec in kept:
                problem = supervision_problem(rec["loss_mask"], self.consecutive_supervision)
                if problem:
                    filtered[problem] += 1
                else:
                    n += 1
            return n
        reader = self.reader.hidden_reader(info)
        n = 0
        for rec in kept:
            pos = None if reader is None else reader.by_id.get(rec["sample_id"])
            if pos is None:
                raise RegenError(f"shard {info.shard_id} sample {rec['sample_id']}: no hidden states")
            tokens = int(reader.entries[pos]["n_tokens"])
            if tokens not in (len(rec["input_ids"]) - 1, len(rec["input_ids"])):
                raise RegenError(f"shard {info.shard_id} sample {rec['sample_id']}: stored states are for {tokens} "
                                 f"tokens, the record has {len(rec['input_ids'])} ids; run `regen verify` on the run")
            problem = supervision_problem(rec["loss_mask"][:tokens], self.consecutive_supervision)
            if problem:
                filtered[problem] += 1
            else:
                n += 1
        return n

    def remove_from(self, end: int) -> None:
        """Remove sample files numbered `end` or more (left by a killed attempt; subclasses know their names)."""

    # -- per shard ----------------------------------------------------------------------------------------
    def export_shard(self, info: ShardInfo, kept, filtered: Counter, first: int) -> dict:
        """Write the shard's kept records (`kept` yields them) numbered from `first`; return the done-marker body.

        The next sample is read and decoded (`samples`) in a thread while this one is written (app/data/
        read_ahead.py); the writes stay in this thread, in order, so the files and numbers are as before."""
        index = first
        freq: Counter = Counter()
        named = []
        for sample in read_ahead(self.samples(info, kept, filtered)):
            self.write_sample(index, sample)
            freq.update(supervised_counts(sample))
            named.append({"index": index, "sample_id": sample.sample_id, "prompt_id": sample.prompt_id,
                          "thinking": sample.thinking})
            index += 1
        self.shard_done(info, first, index)
        self.out.write_json(f"freq/{info.shard_id}.json", {str(k): v for k, v in sorted(freq.items())})
        self.out.write_json(f"samples/{info.shard_id}.json", named)
        return {"shard_id": info.shard_id, "exported": index - first, "first_index": first,
                "filtered": dict(filtered), "file": None}

    def samples(self, info: ShardInfo, kept, filtered: Counter):
        """The kept records as the format writes them, less those with nothing to learn from (counted in
        `filtered`); `filtered` is only touched here, so in the read-ahead thread alone."""
        settings = self.reader.settings
        for rec in kept:
            sample = self.sample(info, rec)
            sample.prompt_id, sample.thinking = prompt_id(rec), record_thinking(rec, settings)
            problem = supervision_problem(sample.loss_mask, self.consecutive_supervision)
            if problem:
                filtered[problem] += 1
                continue
            yield self.prepare(sample)

    def prepare(self, sample: Sample) -> Sample:
        """The CPU work a format does on a decoded sample before writing it (default: none). It runs in the
        read-ahead thread, beside the previous sample's write, so `write_sample` is left with the writing."""
        return sample

    def sample(self, info: ShardInfo, rec: dict) -> Sample:
        """The record as the format writes it: here the ids its stored states cover, with the layers it writes
        (`ExportLayers.read_slots`: auxiliary ones, then the final one)."""
        got = self.reader.states(info, rec, self.layers.read_slots)
        if got is None:
            raise RegenError(f"shard {info.shard_id} sample {rec['sample_id']}: no hidden states")
        return covered_sample(rec, *got, where=f"shard {info.shard_id}")

    def write_sample(self, index: int, sample) -> None:
        raise NotImplementedError

    def shard_done(self, info: ShardInfo, first: int, end: int) -> None:
        """Hook after a shard's samples are written (speculators keeps the shard's rows for its dataset)."""

    # -- assembling the export ----------------------------------------------------------------------------
    def shards_in_order(self) -> list[str]:
        """The exported shards that hold samples, in the order of their samples' numbers."""
        starts = []
        for name in self.out.listdir("done"):
            if name.endswith(".json"):
                d = self.out.read_json(f"done/{name}")
                if d["exported"]:
                    starts.append((int(d["first_index"]), d["shard_id"]))
        return [shard for _, shard in sorted(starts)]

    def finish(self, done: set[str], samples: int) -> None:
        """Write the files made from every exported shard (`done`; `samples` in all), after the last shard."""
        import torch

        total: Counter = Counter()
        for shard in sorted(done):
            total.update({int(k): int(v) for k, v in self.out.read_json(f"freq/{shard}.json").items()})
        buf = io.BytesIO()
        torch.save(dict(sorted(total.items())), buf)
        self.out.write_bytes("token_freq.pt", buf.getvalue())
        shards = self.shards_in_order()
        if all(self.out.exists(f"samples/{shard}.json") for shard in shards):  # not for an export begun before
            with self.out.atomic_writer("samples.jsonl") as fh:
                for shard in shards:
                    for row in self.out.read_json(f"samples/{shard}.json"):
                        fh.write(orjson.dumps(row) + b"\n")
