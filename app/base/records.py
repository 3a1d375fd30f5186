"""The per-sample record a worker writes into `{attempt}.records.jsonl.zst` (one JSON object per line), as a type.

`RECORD_FIELDS` is the schema: each field's types, whether every record of its status carries it, and what a
record written before the field existed implies. Records are written in one place (`encode_records`, which
refuses a field the schema does not know) and read in one place (`Record.from_dict`, through `read_records` /
`iter_records`), so a field's name and default cannot drift between the worker and its readers. The fields'
meaning, and the multi-turn layout (one record per regenerated turn, `{conversation_id}-t{turn}`), are in
docs/formats.md#record-fields.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import orjson
import zstandard

from app.base.documents import Document, MalformedDocument
from app.base.manifest import COMPRESSION_LEVEL

_NUM = (int, float)
_NONE = type(None)


@dataclass(frozen=True)
class RecordField:
    """One field of a record: its JSON types, which records carry it (`ok`, `rejected`, `both`, or `some`: only
    where it applies), and for fields added after the first runs, what an older record without it implies."""

    types: tuple[type, ...]
    carried_by: str
    older_default: object = None
    added_later: bool = False


def _f(*types: type, by: str = "both", later: bool = False, default: object = None) -> RecordField:
    return RecordField(types, by, default, later)


# The record schema. `carried_by` "some": only records it applies to (multi-turn, capture checks, tests).
RECORD_FIELDS: dict[str, RecordField] = {
    # where the sample lives (index: the input sample's place in the shard)
    "run_id": _f(str), "shard_id": _f(str), "sample_id": _f(str), "index": _f(int),
    # the prompt it answers and which of its samples it is (sample k of prompt P: `P-s{k}`, sample 0: P)
    "prompt_id": _f(str, later=True), "sample_index": _f(int, later=True, default=0),
    # its mode (app.base.thinking_modes); older records are in the run's mode (`record_thinking`)
    "thinking": _f(bool, later=True), "mode_rule": _f(str, by="some"),
    # multi-turn runs (`--regenerate all`): the producer's sample id and which regenerated turn
    "conversation_id": _f(str, by="some"), "turn": _f(int, by="some"),
    "source": _f(dict, _NONE), "messages": _f(list), "tools": _f(list, _NONE),
    "worker": _f(str), "device": _f(str, _NONE),
    "status": _f(str), "reject_reason": _f(str, by="rejected"), "reject_detail": _f(str, by="rejected"),
    "seed": _f(int, by="ok"), "sampling": _f(dict, by="ok", later=True),
    # prompt ids + generated ids exactly as the engine returned them; the mask 0 over the prompt, 1 over the output
    "input_ids": _f(list, by="ok"), "loss_mask": _f(list, by="ok"),
    "num_prompt_tokens": _f(int, by="ok"), "num_output_tokens": _f(int, by="ok"),
    "num_answer_tokens": _f(int, by="ok"),
    "text": _f(str, by="ok"), "reasoning": _f(str, _NONE, by="ok"), "answer": _f(str, by="ok"),
    "finish_reason": _f(str, _NONE, by="ok"), "stop_reason": _f(str, int, _NONE, by="ok"),
    "seconds": _f(*_NUM, by="ok"), "flags": _f(list, by="ok"),
    "hidden": _f(dict, _NONE, by="ok"),  # {index, n_tokens, layers} in the shard's hidden file
    "capture_check": _f(dict, by="some"), "capture_repaired": _f(dict, by="some"),
    # the thinking budget closed the reasoning; ended early for repeating (only written when true); the
    # [first, end) spans of input_ids the engine forced, which the loss mask leaves out (app.base.thinking)
    "budget_closed": _f(bool, by="some", later=True, default=False),
    "loop_stopped": _f(bool, by="some", later=True, default=False),
    "forced": _f(list, by="some", later=True),
    # a fault the tests' capture-fault injector put into this sample's states (never in production)
    "fault_injected_for_tests": _f(str, dict, by="some"),
}
_TYPES = {name: f.types if len(f.types) > 1 else f.types[0] for name, f in RECORD_FIELDS.items()}
# What a reader cannot do without; every other field is checked for its type where present (a tool that wrote
# records by hand, or a field a reader can default, is read).
_REQUIRED = {"ok": ("sample_id", "status", "input_ids", "loss_mask", "num_prompt_tokens", "num_output_tokens"),
             "rejected": ("sample_id", "status", "reject_reason")}


class Record(Document):
    """One record, as read: its JSON object, with the keys of `RECORD_FIELDS` typed and the defaults older
    records imply."""

    TYPES: ClassVar = _TYPES

    @classmethod
    def check(cls, body: dict, where: str) -> None:
        status = body.get("status")
        if status not in _REQUIRED:
            raise MalformedDocument(f"{where}: status {status!r}, not 'ok' or 'rejected'")
        missing = [k for k in _REQUIRED[status] if k not in body]
        if missing:
            raise MalformedDocument(f"{where}: {status} record without {', '.join(missing)}")

    @property
    def ok(self) -> bool:
        return self["status"] == "ok"

    @property
    def sample_id(self) -> str:
        return self["sample_id"]

    @property
    def sample_index(self) -> int:
        return int(self.get("sample_index", 0))

    @property
    def budget_closed(self) -> bool:
        return bool(self.get("budget_closed", False))

    @property
    def loop_stopped(self) -> bool:
        return bool(self.get("loop_stopped", False))


def encode_records(records: Iterable[dict], level: int = COMPRESSION_LEVEL) -> bytes:
    """A shard's records file (zstd JSON Lines): the one place records are written. A key outside the schema or
    of the wrong type is a bug in the writer, refused here rather than found by a reader."""
    rows = []
    for i, rec in enumerate(records):
        unknown = [k for k in rec if k not in RECORD_FIELDS]
        if unknown:
            raise ValueError(f"record {i}: fields outside app.base.records.RECORD_FIELDS: {', '.join(unknown)}")
        for key, value in rec.items():
            if not isinstance(value, RECORD_FIELDS[key].types):
                raise ValueError(f"record {i}: {key!r} is {type(value).__name__}, not as app.base.records.RECORD_FIELDS says")
        rows.append(orjson.dumps(rec, option=orjson.OPT_SERIALIZE_NUMPY))
    raw = b"".join(row + b"\n" for row in rows)
    return zstandard.ZstdCompressor(level=level, write_checksum=True).compress(raw)


def read_records(data: bytes, where: str) -> list[Record]:
    """Every record of a records file held in memory (`where`, its path, names a malformed one)."""
    raw = zstandard.ZstdDecompressor().decompress(data) if data else b""
    return [Record.from_dict(orjson.loads(line), f"{where} line {n}")
            for n, line in enumerate(raw.splitlines(), 1) if line]


def iter_records(fh: io.BufferedIOBase, where: str) -> Iterator[Record]:
    """A records file's records streamed from an open binary file, without holding it in memory."""
    reader = zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True)
    for n, line in enumerate(io.BufferedReader(reader, buffer_size=1 << 20), 1):
        if line.strip():
            yield Record.from_dict(orjson.loads(line), f"{where} line {n}")


def loss_mask(num_prompt: int, num_output: int) -> list[int]:
    return [0] * num_prompt + [1] * num_output


def rejected_record(base: dict, reason: str, detail: str) -> dict:
    return {**base, "status": "rejected", "reject_reason": reason, "reject_detail": detail}


def turn_sample_id(conversation: str, turn: int) -> str:
    return f"{conversation}-t{turn}"


def prompt_id(rec: dict) -> str:
    """The prompt a record answers (records made before several samples per prompt existed: their sample's)."""
    return rec.get("prompt_id") or conversation_id(rec)


def conversation_id(rec: dict) -> str:
    """The producer's sample id this record belongs to (its own id outside multi-turn runs)."""
    return rec.get("conversation_id") or rec["sample_id"]
