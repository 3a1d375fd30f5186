"""Samples and capture checks counted per engine mode, from the shards' markers: what `regen stats` and
`regen verify` print, so two hosts' (an sm_120 and an sm_100) or two vLLM versions' samples of one run are
compared on the run's own data.

A worker writes its engine's mode label (workers.engine.engine_mode.mode_key: device, vLLM version, model runner,
scheduling, chunked prefill and its budget, CUDA graphs, tensor parallel size) and its capture check's counts
into each marker it publishes: the completion marker of a generated shard, and for staged runs the capture
marker, whose engine made the stored states. A shard's states are counted under the engine that captured them;
a shard published before modes were recorded counts under "unknown".
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

UNKNOWN = "unknown"


@dataclass
class ModeCount:
    shards: int = 0
    samples: int = 0
    checked: int = 0  # samples re-captured by the capture check
    failed: int = 0  # of which differed from their stored states
    worst_reference: float | None = None  # verify --reference: the largest error of a sample against transformers

    def as_dict(self) -> dict:
        out = {"shards": self.shards, "samples": self.samples, "checked": self.checked, "failed": self.failed}
        if self.worst_reference is not None:
            out["worst_reference_error"] = self.worst_reference
        return out


def check_failure(shard: str, marker: dict, captured: dict | None) -> tuple[str | None, str] | None:
    """(sample, one line) when the shard's capture check found a sample whose stored states differ from a
    re-capture on the engine that made them; None when every re-check agreed (or none was made)."""
    source = captured if captured is not None else marker
    check = source.get("capture_check") or {}
    if not check.get("failed"):
        return None
    first = check.get("first_failure") or {}
    if not first and check.get("samples"):  # a capture marker lists every re-checked sample
        first = next(({"sample_id": s, **c} for s, c in check["samples"].items() if not c.get("ok")), {})
    return first.get("sample_id"), (f"{check['failed']} of {check.get('checked')} re-captured samples differ from "
                                    f"their stored states on engine {source.get('engine_mode') or UNKNOWN}: "
                                    f"{first.get('problem')}")


def shard_mode(marker: dict, captured: dict | None) -> tuple[str, int, int]:
    """(mode label, samples re-checked, failed) of a shard from its markers: the capture marker's where there is
    one (a staged run's states were made there), else the completion marker's."""
    source = captured if captured is not None else marker
    check = source.get("capture_check") or {}
    return str(source.get("engine_mode") or UNKNOWN), int(check.get("checked", 0)), int(check.get("failed", 0))


class ModeCounts:
    """The counts per mode label, in first-seen order."""

    def __init__(self):
        self.modes: dict[str, ModeCount] = {}

    def add(self, mode: str, samples: int, checked: int, failed: int) -> None:
        count = self.modes.setdefault(mode, ModeCount())
        count.shards += 1
        count.samples += samples
        count.checked += checked
        count.failed += failed

    def add_reference(self, mode: str, error: float) -> None:
        count = self.modes.setdefault(mode, ModeCount())
        count.worst_reference = error if count.worst_reference is None else max(count.worst_reference, error)

    @property
    def failed(self) -> int:
        return sum(c.failed for c in self.modes.values())

    def as_dict(self) -> dict:
        return {mode: count.as_dict() for mode, count in self.modes.items()}

    def rows(self) -> list[list[str]]:
        """Table rows: mode, shards, samples, re-checked, failed (, worst reference error where measured)."""
        out = []
        for mode, c in self.modes.items():
            row = [mode, str(c.shards), str(c.samples), str(c.checked), str(c.failed)]
            if any(m.worst_reference is not None for m in self.modes.values()):
                row.append("-" if c.worst_reference is None else f"{c.worst_reference:.3g}")
            out.append(row)
        return out

    def header(self) -> list[str]:
        cols = ["engine mode", "shards", "samples", "re-checked", "check failed"]
        if any(m.worst_reference is not None for m in self.modes.values()):
            cols.append("worst reference error")
        return cols

    def lines(self) -> list[str]:
        """One line per mode, for plain-text output."""
        return [f"  {r[0]}: " + ", ".join(f"{h} {v}" for h, v in zip(self.header()[1:], r[1:], strict=True))
                for r in self.rows()]


def modes_table(counts: ModeCounts, title: str):
    """`counts` as the rich table `regen stats` and `regen verify` print."""
    table = Table(title=title)
    for col in counts.header():
        table.add_column(col, justify="left" if col == "engine mode" else "right")
    for row in counts.rows():
        table.add_row(*row)
    return table
