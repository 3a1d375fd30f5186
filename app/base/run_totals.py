"""A run's totals, added up once from its completion markers: what `regen run`'s summary, `regen status`, the
Prometheus gauges and the pilot's measurement all report.

Why one tally: each of those used to walk the markers and add the same keys on its own, so a key added to the
marker (`records` for multi-turn runs, `rejected` by reason) reached some reports and not others. A marker's
counts are the shard's, read as app.base.documents.DoneMarker defines them.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from app.base.documents import DoneMarker


def parse_time(value: str | None) -> float | None:
    """ISO-8601 (as the workers write it) -> POSIX seconds; None stays None."""
    if not value:
        return None
    return dt.datetime.fromisoformat(value).timestamp()


@dataclass
class RunTotals:
    shards: int = 0
    samples: int = 0
    records: int = 0
    ok: int = 0
    stubs: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    generation_seconds: float = 0.0
    rejected_by_reason: Counter = field(default_factory=Counter)
    flags: Counter = field(default_factory=Counter)
    first_start: float | None = None  # earliest generation start (a marker's finish less its generation seconds)
    first_finished: float | None = None
    last_finished: float | None = None

    @classmethod
    def of(cls, markers: Iterable[dict]) -> RunTotals:
        t = cls()
        for m in markers:
            t.add(m)
        return t

    def add(self, marker: dict) -> None:
        """Count one completion marker (its counts read as app.base.documents.DoneMarker reads them)."""
        m = marker if isinstance(marker, DoneMarker) else DoneMarker(marker)
        self.shards += 1
        self.samples += m.samples
        self.records += m.records
        self.ok += m.ok
        self.stubs += m.stubs
        self.prompt_tokens += m.prompt_tokens
        self.generated_tokens += m.generated_tokens
        self.generation_seconds += m.generation_seconds
        self.rejected_by_reason.update(m.rejected)
        self.flags.update(m.flags)
        finished = parse_time(m.finished)
        if finished is not None:
            start = finished - m.generation_seconds
            if self.last_finished is None:
                self.first_finished = self.last_finished = finished
                self.first_start = start
            else:
                self.first_finished = min(self.first_finished, finished)
                self.last_finished = max(self.last_finished, finished)
                self.first_start = min(self.first_start, start)

    @property
    def rejected(self) -> int:
        return sum(self.rejected_by_reason.values())

    @property
    def wall_seconds(self) -> float | None:
        """From the earliest generation start to the last finish; None before any shard finished."""
        if self.last_finished is None or self.first_start is None:
            return None
        return self.last_finished - self.first_start

    @property
    def stub_rate(self) -> float | None:
        return round(self.stubs / self.ok, 6) if self.ok else None
