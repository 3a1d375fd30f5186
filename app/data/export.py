"""`regen export`: a run's ok records as files other tools read, one output file per shard, resumable.

Why per shard: an export of the whole job takes hours; each shard's output is written atomically, then a done
marker, so a rerun does exactly the shards not yet exported. `export.json` pins the run, format and filters.
Fan-out (`processes`, `part`) gives the same bytes as one process: the plan numbers every sample first
(app.data.export_plan), each shard is claimed (app.data.export_claims), and `assemble` writes the whole-export
files. The formats are listed in app.data.export_formats. Details: docs/formats.md#how-regen-export-works.
"""

from __future__ import annotations

import io
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import orjson

from app.base.errors import RegenError
from app.base.records import prompt_id
from app.base.storage import Storage
from app.base.thinking_modes import record_thinking
from app.data import export_claims, export_formats, export_plan, export_text
from app.data.fanout import WHOLE, Part, process_pool
from app.data.run_reader import RunReader, ShardInfo

EXPORT_FORMAT = "regen.export/1"
PARQUET = "parquet"  # the one per-record text format, written here


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
    if export_formats.get(opts.fmt).kind == export_formats.TEXT:
        return export_text.unterminated_reason(rec, opts.include_unterminated)
    return None


# -- row builders -------------------------------------------------------------------------------------------


def _parquet_schema():
    import pyarrow as pa

    return pa.schema([
        ("sample_id", pa.string()), ("conversation_id", pa.string()), ("turn", pa.int32()),
        ("prompt_id", pa.string()), ("sample_index", pa.int32()), ("thinking", pa.bool_()),
        ("run_id", pa.string()), ("shard_id", pa.string()),
        ("source_file", pa.string()), ("source_line", pa.int64()),
        ("messages", pa.string()), ("tools", pa.string()),
        ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
        ("num_prompt_tokens", pa.int32()), ("num_output_tokens", pa.int32()), ("num_answer_tokens", pa.int32()),
        ("text", pa.string()), ("reasoning", pa.string()), ("answer", pa.string()),
        ("finish_reason", pa.string()), ("flags", pa.list_(pa.string())), ("seed", pa.int64()),
    ])


def _parquet_row(rec: dict, settings: dict) -> dict:
    src = rec.get("source") or {}
    return {
        "sample_id": rec["sample_id"], "conversation_id": rec.get("conversation_id") or rec["sample_id"],
        "turn": rec.get("turn", 0), "prompt_id": prompt_id(rec), "sample_index": rec.get("sample_index", 0),
        "thinking": record_thinking(rec, settings), "run_id": rec.get("run_id"), "shard_id": rec.get("shard_id"),
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
    """Exports a run's done shards into `out` as the plan (app.data.export_plan) numbers them, skipping shards
    whose done marker exists; `run(processes, part)` fans the shards out (module docstring)."""

    def __init__(self, reader: RunReader, out: str, opts: ExportOptions, pin: bool = True):
        self.format = spec = export_formats.get(opts.fmt)
        spec.require()  # its optional packages, before any work
        if spec.needs_states and reader.capture_mode == "off":
            raise RegenError(f"run {reader.run_id!r} captured no hidden states: the {opts.fmt} format needs them")
        if opts.include_unterminated and not spec.keeps_unterminated:  # specforge-jsonl
            raise RegenError("--include-unterminated: SpecForge's rows need a non-empty answer on every assistant "
                             "turn; use --format sharegpt or parquet to keep unterminated samples")
        self.reader, self.opts, self.out = reader, opts, Storage(out)
        self.out_url = out
        self.trainer = None
        if spec.writer:
            extra = {"model_path": opts.model} if spec.final_norm else {}
            self.trainer = spec.writer_class()(reader, self.out, opts.layers, **extra)
        if pin:
            self._pin()

    def _pin(self) -> None:
        want = {"format": EXPORT_FORMAT, "run_id": self.reader.run_id, "storage": self.reader.storage.url,
                **self.opts.to_dict(), **({"trainer": self.trainer.meta()} if self.trainer else {})}
        body = orjson.dumps(want, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY) + b"\n"
        if not self.out.create_exclusive("export.json", body):  # several exporters may start at once
            have = self.out.read_json("export.json")
            differ = [k for k in want if k != "storage" and have.get(k) != want[k]]
            if differ:
                raise RegenError(f"{self.out.url} holds an export with other {', '.join(differ)}; use another --out")

    def candidates(self) -> list[str]:
        """The run's done shards an export can take now, in id order."""
        infos = list(self.reader.shards())
        if self.reader.capture_mode == "staged" and self.trainer and self.trainer.needs_states:
            infos = [i for i in infos if i.captured is not None]  # capture not finished: a later rerun does it
        return [i.shard_id for i in infos]

    def pending(self) -> tuple[list[str], list[str]]:
        """(done shards still to export, shards already exported)."""
        exported = export_plan.done_shards(self.out)
        return [s for s in self.candidates() if s not in exported], sorted(exported)

    # -- one shard ------------------------------------------------------------------------------------------
    def count_shard(self, shard: str) -> dict:
        """The shard's count file (app.data.export_plan), written unless another exporter wrote it first."""
        have = export_plan.read_count(self.out, shard)
        if have is not None:
            return have
        info = self.reader.shard(shard)
        counts: Counter = Counter()
        n = self.trainer.count_shard(info, self._kept(info, counts), counts)
        return export_plan.write_count(self.out, shard, n, dict(counts))

    def export_claimed(self, shard: str, first: int | None) -> str:
        """Export one shard unless it is done or a live exporter holds its claim: `exported`, `done`, `claimed`."""
        if self.out.exists(f"done/{shard}.json"):
            return "done"
        claim = export_claims.take(self.out, shard)
        if claim is None:
            return "claimed"
        with claim.held():
            if self.out.exists(f"done/{shard}.json"):  # finished by the claim's last holder just now
                return "done"
            self.out.delete(export_plan.ASSEMBLED)  # what it names is out of date once this shard is written
            self.export_shard(self.reader.shard(shard), first)
        return "exported"

    def export_shard(self, info: ShardInfo, first: int | None = None) -> dict:
        if self.trainer:
            counts: Counter = Counter()
            done = self.trainer.export_shard(info, self._kept(info, counts), counts, first)
            planned = export_plan.read_count(self.out, info.shard_id)
            if planned is not None and planned["exported"] != done["exported"]:
                raise RegenError(f"shard {info.shard_id}: exported {done['exported']} samples, the plan counted "
                                 f"{planned['exported']}; run `regen verify` on the run")
            self.out.write_json(f"done/{info.shard_id}.json", done)
            return done
        if self.format.per_conversation:
            rows, counts = export_text.conversation_rows(self.opts.fmt, self.reader.records(info),
                                                         lambda rec: filter_reason(rec, self.opts),
                                                         self.reader.settings)
        else:
            counts = Counter()
            rows = [_parquet_row(rec, self.reader.settings) for rec in self._kept(info, counts)]
        data_rel = f"data/{info.shard_id}.{'parquet' if self.opts.fmt == PARQUET else 'jsonl'}"
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
            if self.opts.fmt == PARQUET:
                import pyarrow as pa
                import pyarrow.parquet as pq

                buf = io.BytesIO()
                pq.write_table(pa.Table.from_pylist(rows, schema=_parquet_schema()), buf)
                fh.write(buf.getvalue())
            else:
                for row in rows:
                    fh.write(orjson.dumps(row) + b"\n")

    # -- the whole export ---------------------------------------------------------------------------------
    def run(self, on_shard: Callable[[str], None] | None = None, processes: int = 1, part: Part = WHOLE,
            on_plan: Callable[[int], None] | None = None) -> dict:
        """Export this part's shards of every batch with `processes` worker processes, then assemble the export
        if every planned shard is exported (by this call or any other); `on_plan(n)`: n more shards to do."""
        started = time.time()
        exported_before = export_plan.done_shards(self.out)
        tally: Counter = Counter()
        with ShardPool(processes, (self.reader.storage.url, self.reader.run_id, self.out_url, self.opts),
                       self) as pool:
            while (batch := export_plan.open_batch(self.out, self.candidates())) is not None:
                done = export_plan.done_shards(self.out)
                mine = [s for k, s in enumerate(batch["shards"]) if part.owns(k) and s not in done]
                if on_plan:
                    on_plan(len(mine))
                firsts: dict[str, int] = {}
                if self.trainer and mine:
                    firsts = self._number(pool, batch, mine)
                for shard, state in zip(mine, pool.map(_export_task, [(s, firsts.get(s)) for s in mine]),
                                        strict=True):
                    tally[state] += 1
                    if on_shard:
                        on_shard(shard)
                if not export_plan.complete(self.out):
                    break  # shards of other parts, or claimed by other exporters, are still being written
        assembled = self.assemble(started) if export_plan.complete(self.out) else "waiting"
        self.reader.close()
        totals = {**self.totals(), "shards_exported_now": tally["exported"], "shards_skipped": len(exported_before),
                  "shards_claimed_elsewhere": tally["claimed"], "assembly": assembled, "part": str(part)}
        if self.format.file:
            totals["file"] = self.format.file
        return totals

    def _number(self, pool: ShardPool, batch: dict, mine: list[str]) -> dict[str, int]:
        """First sample numbers of `mine`: every shard before the last of them in the batch is counted first."""
        shards, own = batch["shards"], set(mine)
        last = max(k for k, s in enumerate(shards) if s in own)
        missing = [s for s in shards[: last + 1] if export_plan.read_count(self.out, s) is None]
        todo = [s for s in missing if s in own] + [s for s in missing if s not in own]  # its own shards first
        for _ in pool.map(_count_task, todo):
            pass
        firsts = export_plan.first_indices(self.out, batch)
        return {s: firsts[s] for s in mine}

    def assemble(self, started: float) -> str:
        """The files made from every exported shard (token_freq.pt, speculators' dataset, SpecForge's one JSONL),
        written by one exporter at a time, once per set of exported shards (`assembled.json` names the set; a
        shard written again removes it first): `assembled`, `assembled_before` or `claimed` (another exporter
        is assembling)."""
        done = export_plan.done_shards(self.out)
        if export_plan.assembled(self.out) == export_plan.digest(done):
            return "assembled_before"
        claim = export_claims.take(self.out, "assembly")
        if claim is None:
            return "claimed"
        with claim.held():
            if export_plan.assembled(self.out) == export_plan.digest(done):  # the last holder just did it
                return "assembled_before"
            samples = export_plan.next_index(self.out) if self.trainer else None
            if self.trainer:
                self.trainer.remove_from(samples)  # files past the last number: a pre-plan attempt's
                self.trainer.finish(done, samples)
            if self.format.per_conversation and self.format.file:  # specforge-jsonl's regenerated.jsonl
                export_text.join_shard_files(self.out, [f"{s}.json" for s in done])
            self._remove_temporaries(before=started)
            export_plan.mark_assembled(self.out, done, samples)
        return "assembled"

    def _remove_temporaries(self, before: float) -> None:
        """Temporaries (`.name.tmp-*`) that killed exporters left: every shard was exported since they were made,
        so no live writer owns one older than this call."""
        folders = ["", *(f for f in self.out.listdir("") if not f.startswith(".") and "." not in f)]
        for folder in folders:
            for name, mtime in self.out.temporaries(folder):
                if mtime < before:
                    self.out.remove_temporary(f"{folder}/{name}" if folder else name)

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


# -- worker processes -------------------------------------------------------------------------------------
_WORKER: Exporter | None = None  # this worker process's exporter (set by _init_worker)


def _init_worker(storage: str, run_id: str, out: str, opts: ExportOptions) -> None:
    global _WORKER
    _WORKER = Exporter(RunReader(storage, run_id), out, opts, pin=False)


def _count_task(shard: str) -> dict:
    return _WORKER.count_shard(shard)


def _export_task(task: tuple[str, int | None]) -> str:
    return _WORKER.export_claimed(*task)


class ShardPool:
    """Runs `_count_task` / `_export_task` in `processes` spawned workers (app.data.fanout), or here with
    the caller's own exporter when one process is asked for."""

    def __init__(self, processes: int, initargs: tuple, local: Exporter):
        self.processes, self.initargs, self.local = processes, initargs, local
        self.pool = None

    def __enter__(self) -> ShardPool:
        if self.processes > 1:
            self.pool = process_pool(self.processes, _init_worker, self.initargs)
        return self

    def map(self, fn, items: list) -> Iterator:
        """Results in item order, each as soon as it and those before it are done."""
        if self.pool is None:
            global _WORKER
            _WORKER = self.local
            return (fn(item) for item in items)
        return self.pool.map(fn, items)

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
