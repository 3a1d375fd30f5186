"""`regen export`: a run's ok records as files other tools read, one output file per shard, resumable.

Why per shard: a 914K-sample export takes hours; each shard's output is written atomically and then a
`done/{shard}.json` marker in the output folder, so a rerun (after a crash, or while the run is still
generating) does exactly the shards not yet exported. `export.json` pins the run, format and filters: a rerun
with other settings is refused instead of mixing two selections in one folder.

Formats:
- `sharegpt`, `specforge-jsonl`  one row per conversation with every turn the model saw (app/data/export_text.py).
- `parquet`      `data/{shard}.parquet`, one row per record, one fixed schema for every shard.
- `specforge-dflash`, `specforge-eagle3`, `speculators`: hidden states laid out as each trainer's own reader
                 loads them (app/data/export_trainers.py and the modules it names).
- `specforge-online`, `speculators-online`: ids and loss masks only, for trainers that run the target
                 themselves; every run, `--capture off` included (app/data/export_online.py).

Text formats (`sharegpt`, `specforge-jsonl`, `parquet`) leave out samples whose thinking never ended unless
`include_unterminated` (app/data/export_text.py says why); every left-out sample is counted by reason.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from app.data import export_text
from app.data.export_trainers import ONLINE_FORMATS, TRAINER_FORMATS
from app.data.run_reader import RunReader, ShardInfo
from app.errors import RegenError
from app.storage import Storage

FORMATS = ("sharegpt", "parquet", "specforge-jsonl", *TRAINER_FORMATS, *ONLINE_FORMATS)
TEXT_FORMATS = ("sharegpt", "parquet", "specforge-jsonl")
EXPORT_FORMAT = "regen.export/1"


@dataclass(frozen=True)
class ExportOptions:
    fmt: str
    exclude_flags: tuple[str, ...] = ()
    min_response_tokens: int = 0
    include_unterminated: bool = False
    layers: str | None = None  # hidden-state formats: which captured layers (default: what the format takes)
    model: str | None = None  # specforge-eagle3: the target checkpoint (default: the run's model path)

    def to_dict(self) -> dict:
        return {"format": self.fmt, "exclude_flags": list(self.exclude_flags),
                "min_response_tokens": self.min_response_tokens, "include_unterminated": self.include_unterminated,
                "layers": self.layers}


def filter_reason(rec: dict, opts: ExportOptions) -> str | None:
    """Why a record is left out (None: exported). Only `status: ok` records are ever exported."""
    if rec.get("status") != "ok":
        return f"status:{rec.get('status')}"
    flags = set(rec.get("flags") or ())
    for f in opts.exclude_flags:
        if f in flags:
            return f"flag:{f}"
    if rec["num_output_tokens"] < opts.min_response_tokens:
        return "min_response_tokens"
    if opts.fmt in TEXT_FORMATS:
        return export_text.unterminated_reason(rec, opts.include_unterminated)
    return None


# -- row builders -------------------------------------------------------------------------------------------


def _parquet_schema():
    import pyarrow as pa

    return pa.schema([
        ("sample_id", pa.string()), ("conversation_id", pa.string()), ("turn", pa.int32()),
        ("run_id", pa.string()), ("shard_id", pa.string()),
        ("source_file", pa.string()), ("source_line", pa.int64()),
        ("messages", pa.string()), ("tools", pa.string()),
        ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
        ("num_prompt_tokens", pa.int32()), ("num_output_tokens", pa.int32()), ("num_answer_tokens", pa.int32()),
        ("text", pa.string()), ("reasoning", pa.string()), ("answer", pa.string()),
        ("finish_reason", pa.string()), ("flags", pa.list_(pa.string())), ("seed", pa.int64()),
    ])


def _parquet_row(rec: dict) -> dict:
    src = rec.get("source") or {}
    return {
        "sample_id": rec["sample_id"], "conversation_id": rec.get("conversation_id") or rec["sample_id"],
        "turn": rec.get("turn", 0), "run_id": rec.get("run_id"), "shard_id": rec.get("shard_id"),
        "source_file": src.get("file"), "source_line": src.get("line"),
        "messages": json.dumps(rec.get("messages"), ensure_ascii=False),
        "tools": json.dumps(rec["tools"], ensure_ascii=False) if rec.get("tools") else None,
        **{k: rec.get(k) for k in ("input_ids", "loss_mask", "num_prompt_tokens", "num_output_tokens",
                                   "num_answer_tokens", "text", "reasoning", "answer", "finish_reason",
                                   "seed")},
        "flags": list(rec.get("flags") or []),
    }


# -- the exporter -----------------------------------------------------------------------------------------
class Exporter:
    """Exports a run's done shards into `out`, skipping shards whose export marker exists."""

    def __init__(self, reader: RunReader, out: str, opts: ExportOptions):
        if opts.fmt not in FORMATS:
            raise RegenError(f"unknown export format {opts.fmt!r} (one of {', '.join(FORMATS)})")
        if opts.fmt in TRAINER_FORMATS and reader.capture_mode == "off":
            raise RegenError(f"run {reader.run_id!r} captured no hidden states: the {opts.fmt} format needs them")
        if opts.fmt == "specforge-jsonl" and opts.include_unterminated:
            raise RegenError("--include-unterminated: SpecForge's rows need a non-empty answer on every assistant "
                             "turn; use --format sharegpt or parquet to keep unterminated samples")
        self.reader, self.opts, self.out = reader, opts, Storage(out)
        self.trainer = None
        if opts.fmt in TRAINER_FORMATS or opts.fmt in ONLINE_FORMATS:
            from app.data.export_trainers import formats

            cls = formats()[opts.fmt]
            extra = {"model_path": opts.model} if opts.fmt == "specforge-eagle3" else {}
            self.trainer = cls(reader, self.out, opts.layers, **extra)
        self._pin()

    def _pin(self) -> None:
        want = {"format": EXPORT_FORMAT, "run_id": self.reader.run_id, "storage": self.reader.storage.url,
                **self.opts.to_dict(), **({"trainer": self.trainer.meta()} if self.trainer else {})}
        if self.out.exists("export.json"):
            have = self.out.read_json("export.json")
            differ = [k for k in want if k != "storage" and have.get(k) != want[k]]
            if differ:
                raise RegenError(f"{self.out.url} holds an export with other {', '.join(differ)}; use another --out")
        else:
            self.out.write_json("export.json", want)

    def pending(self) -> tuple[list[ShardInfo], list[str]]:
        """(done shards still to export, shards already exported)."""
        exported = {n[: -len(".json")] for n in self.out.listdir("done") if n.endswith(".json")}
        infos = list(self.reader.shards())
        if self.reader.capture_mode == "staged" and self.trainer and self.trainer.needs_states:
            infos = [i for i in infos if i.captured is not None]  # capture not finished: a later rerun does it
        return [i for i in infos if i.shard_id not in exported], sorted(exported)

    def export_shard(self, info: ShardInfo) -> dict:
        if self.trainer:
            counts: Counter = Counter()
            done = self.trainer.export_shard(info, self._kept(info, counts), counts)
            self.out.write_json(f"done/{info.shard_id}.json", done)
            return done
        if self.opts.fmt in export_text.FORMATS:  # one row per conversation
            rows, counts = export_text.conversation_rows(self.opts.fmt, self.reader.records(info),
                                                         lambda rec: filter_reason(rec, self.opts),
                                                         self.reader.settings)
        else:
            counts = Counter()
            rows = [_parquet_row(rec) for rec in self._kept(info, counts)]
        data_rel = f"data/{info.shard_id}.{'parquet' if self.opts.fmt == 'parquet' else 'jsonl'}"
        if rows:  # no empty files: JSON readers (datasets) fail on them
            self._write_data(data_rel, rows)
        done = {"shard_id": info.shard_id, "exported": len(rows), "filtered": dict(counts),
                "file": data_rel if rows else None}
        self.out.write_json(f"done/{info.shard_id}.json", done)
        return done

    def _kept(self, info: ShardInfo, counts: Counter):
        for rec in self.reader.records(info):
            reason = filter_reason(rec, self.opts)
            if reason:
                counts[reason] += 1
            else:
                yield rec

    def _write_data(self, data_rel: str, rows: list[dict]) -> None:
        with self.out.atomic_writer(data_rel) as fh:
            if self.opts.fmt == "parquet":
                import pyarrow as pa
                import pyarrow.parquet as pq

                buf = io.BytesIO()
                pq.write_table(pa.Table.from_pylist(rows, schema=_parquet_schema()), buf)
                fh.write(buf.getvalue())
            else:
                for row in rows:
                    fh.write(orjson.dumps(row) + b"\n")

    def run(self, on_shard: Callable[[str], None] | None = None) -> dict:
        todo, skipped = self.pending()
        if self.trainer:
            self.trainer.begin()
        for info in todo:
            self.export_shard(info)
            if on_shard:
                on_shard(info.shard_id)
        if self.trainer:
            self.trainer.finish()
        self.reader.close()
        totals = {**self.totals(), "shards_exported_now": len(todo), "shards_skipped": len(skipped)}
        if self.opts.fmt == "specforge-jsonl":
            export_text.join_shard_files(self.out, [n for n in self.out.listdir("done") if n.endswith(".json")])
            totals["file"] = export_text.SPECFORGE_FILE
        elif self.trainer and self.trainer.file:
            totals["file"] = self.trainer.file
        return totals

    def totals(self) -> dict:
        """Counts over every shard exported into `out` so far (this call's and earlier ones')."""
        exported, filtered, shards = 0, Counter(), 0
        for name in self.out.listdir("done"):
            if name.endswith(".json"):
                d = self.out.read_json(f"done/{name}")
                shards += 1
                exported += d["exported"]
                filtered.update(d["filtered"])
        return {"shards": shards, "exported": exported, "filtered": dict(sorted(filtered.items()))}
