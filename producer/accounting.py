"""What the producer did with every input row, and the files that record it.

Why: a silently dropped row is indistinguishable from one never there, so every row read is exactly one of
enqueued, duplicate, rejected (with a named reason) or left out, and `check_identity` asserts the sum at the
end of every produce (a mismatch is a producer bug). Files: `{run}/rejects.jsonl` and `{run}/produce.json`.
Details: docs/faults.md#every-input-row-accounted-for.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections import Counter
from dataclasses import dataclass, field

import orjson

from app.base.documents import ProduceSummary
from app.base.storage import RunStore
from producer.normalise import REJECT_REASONS


@dataclass
class Accounting:
    read: int = 0
    enqueued: int = 0  # unique samples placed in a shard (sent now, or in a shard already done)
    duplicates: int = 0
    rejected_by_reason: Counter = field(default_factory=Counter)
    shards: int = 0
    shards_sent: int = 0
    shards_skipped_done: int = 0
    shards_skipped_dead: int = 0  # dead-lettered: not sent (a worker would skip them); `regen retry-dead` sends them
    shards_not_selected: int = 0  # outside `only_shards` (retry-dead sends only the shards it revived)
    samples_sent: int = 0
    input_bytes: int = 0
    left_out_by_file: Counter = field(default_factory=Counter)  # rows `--take` did not draw, per input
    take_rows: dict = field(default_factory=dict)  # rows of each input a `--take` names
    mode_counts: dict = field(default_factory=dict)  # producer.thinking_modes.ModeCounts: samples, per mode, per rule

    @property
    def rejected(self) -> int:
        return sum(self.rejected_by_reason.values())

    @property
    def left_out(self) -> int:
        return sum(self.left_out_by_file.values())

    def check_identity(self, samples_per_prompt: int | None = None) -> None:
        if self.read != self.enqueued + self.duplicates + self.rejected + self.left_out:
            raise AssertionError(
                f"producer accounting bug: read {self.read} != enqueued {self.enqueued} + duplicates "
                f"{self.duplicates} + rejected {self.rejected} + left out {self.left_out}"
            )
        if samples_per_prompt is not None and self.mode_counts.get("samples") != self.enqueued * samples_per_prompt:
            raise AssertionError(f"producer accounting bug: {self.mode_counts.get('samples')} samples sharded != "
                                 f"{self.enqueued} prompts x {samples_per_prompt}")

    def to_dict(self) -> dict:
        return {
            "read": self.read,
            "enqueued": self.enqueued,
            "duplicates": self.duplicates,
            "rejected": self.rejected,
            "rejected_by_reason": {r: self.rejected_by_reason[r] for r in REJECT_REASONS if self.rejected_by_reason[r]},
            "shards": self.shards,
            "shards_sent": self.shards_sent,
            "shards_skipped_done": self.shards_skipped_done,
            "shards_skipped_dead": self.shards_skipped_dead,
            "shards_not_selected": self.shards_not_selected,
            "samples_sent": self.samples_sent,
            "left_out": self.left_out,
            **({"take": {p: {"rows": n, "taken": n - self.left_out_by_file[p], "left_out": self.left_out_by_file[p]}
                         for p, n in self.take_rows.items()}} if self.take_rows else {}),
            **self.mode_counts,
        }


class RejectLog:
    """Counts rejects and, when given a store, streams them to `{run}/rejects.jsonl`."""

    def __init__(self, accounting: Accounting, store: RunStore | None = None):
        self.accounting = accounting
        self.store = store
        self._stack = contextlib.ExitStack()
        self._fh = None

    def __enter__(self) -> RejectLog:
        if self.store is not None:
            self._fh = self._stack.enter_context(self.store.storage.atomic_writer(self.store.rejects_path))
        return self

    def __exit__(self, *exc) -> bool:
        return self._stack.__exit__(*exc)

    def add(self, file: str, line: int, reason: str, detail: str = "") -> None:
        self.accounting.rejected_by_reason[reason] += 1
        if self._fh is not None:
            row = {"file": file, "line": line, "reason": reason, "detail": detail}
            self._fh.write(orjson.dumps(row) + b"\n")


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def read_produce_state(store: RunStore) -> ProduceSummary | None:
    try:
        return ProduceSummary.parse(store.storage.read_bytes(store.produce_path), store.produce_path)
    except FileNotFoundError:
        return None


def write_produce_state(store: RunStore, *, producer_settings: dict, accounting: Accounting | None, complete: bool,
                        queue: str, started: str | None = None) -> None:
    state = ProduceSummary.new(store.run_id, complete, started or _now(), _now() if complete else None, queue,
                               producer_settings, accounting.to_dict() if accounting else None)
    store.storage.write_json(store.produce_path, state)

