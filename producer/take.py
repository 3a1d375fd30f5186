"""`--take GLOB=N` / `--take GLOB=FRACTION`: a seeded share of an input's rows, so one run draws the mix a user
asks for ("all of the tool-calling set, half of ShareGPT") from the files as they are.

Why a count pass first: "half of ShareGPT" means half of its rows, exactly, and the same half on every produce
of the run. Each matched file's records are counted once (the reader's own records: blank lines are not rows),
then `N` of them (or `round(FRACTION x rows)`) are drawn without replacement from a generator seeded with the
run seed and the file's sha256, so the draw depends on the file's bytes and the seed, not on where the file
lives or in which order the inputs were given. Rows not drawn are `left out`: never parsed, never a reject
or a duplicate, counted per file, and `read = enqueued + duplicates + rejected + left out` holds. A count above
the file's rows takes every row, and the producer's summary's counts say so (`rows`, `taken`). Files no `--take` names
are read whole. The selection is one byte per row of a taken file.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
from dataclasses import dataclass

import numpy as np

from app.base.errors import ConfigError
from producer.readers import InputReader


@dataclass(frozen=True)
class TakeRule:
    glob: str
    count: int | None = None
    fraction: float | None = None

    def to_manifest(self) -> dict:
        return {"glob": self.glob, "count": self.count} if self.count is not None else {"glob": self.glob,
                                                                                        "fraction": self.fraction}

    def wanted(self, rows: int) -> int:
        return min(rows, self.count) if self.count is not None else round(self.fraction * rows)


def parse_take(item: str) -> TakeRule:
    """`GLOB=N` (a whole number of rows) or `GLOB=FRACTION` (a share in (0, 1], written with a decimal point)."""
    glob, sep, value = item.rpartition("=")
    if not sep or not glob or not value:
        raise ConfigError(f"--take {item!r}: expected GLOB=N or GLOB=FRACTION (e.g. 'sharegpt*.jsonl=0.5')")
    try:
        if "." in value or "e" in value.lower():
            fraction = float(value)
            if not 0 < fraction <= 1:
                raise ValueError
            return TakeRule(glob, fraction=fraction)
        count = int(value)
        if count < 0:
            raise ValueError
        return TakeRule(glob, count=count)
    except ValueError:
        raise ConfigError(f"--take {item!r}: {value!r} is neither a row count (0 or more) nor a fraction in (0, 1]"
                          ) from None


def rules_from_manifest(entries: list[dict] | None) -> list[TakeRule]:
    return [TakeRule(e["glob"], e.get("count"), e.get("fraction")) for e in entries or []]


def _matches(rule: TakeRule, path: str) -> bool:
    rel = os.path.relpath(path)
    return any(fnmatch.fnmatchcase(p, rule.glob) for p in (path, rel, os.path.basename(path)))


def match_rules(rules: list[TakeRule], paths: list[str]) -> dict[str, TakeRule]:
    """Each input a rule names -> its rule. A rule that names no input, or an input two rules name, is refused."""
    out: dict[str, TakeRule] = {}
    for rule in rules:
        hits = [p for p in paths if _matches(rule, p)]
        if not hits:
            raise ConfigError(f"--take {rule.glob}: matches none of the inputs")
        for path in hits:
            if path in out:
                raise ConfigError(f"--take: {path} is matched by both {out[path].glob!r} and {rule.glob!r}")
            out[path] = rule
    return out


@dataclass
class Selection:
    """Which records of one input are taken (`keep[k]` for its k-th record, 0-based)."""

    rows: int
    keep: bytearray

    @property
    def taken(self) -> int:
        return sum(self.keep)


def count_records(path: str) -> int:
    return sum(1 for _ in InputReader(path))


def select(path: str, sha256: str, rule: TakeRule, run_seed: int) -> Selection:
    rows = count_records(path)
    n = rule.wanted(rows)
    key = int.from_bytes(hashlib.blake2b(f"take:{run_seed}:{sha256}".encode(), digest_size=8).digest(), "little")
    chosen = np.random.default_rng(key).choice(rows, size=n, replace=False) if n else np.empty(0, dtype=np.int64)
    keep = np.zeros(rows, dtype=np.uint8)
    keep[chosen] = 1
    return Selection(rows, bytearray(keep.tobytes()))


def selections(rules: list[TakeRule], inputs: list[dict], run_seed: int) -> dict[str, Selection]:
    """The selection of every input a rule names (`inputs`: the manifest's entries, with their sha256)."""
    if not rules:
        return {}
    matched = match_rules(rules, [i["path"] for i in inputs])
    return {i["path"]: select(i["path"], i["sha256"], matched[i["path"]], run_seed)
            for i in inputs if i["path"] in matched}
