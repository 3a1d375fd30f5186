"""What checking one shard finds, and the check of one sample's states: shared by `regen verify`'s full pass
(app/data/verify.py) and its sampled one (app/data/verify_sampled.py), so neither imports the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from app.data.run_reader import RunReader
from app.hidden_file import CorruptHiddenFile, HiddenFileReader
from app.states_bound import promise, sample_problem


@dataclass
class Problem:
    kind: str
    shard: str | None
    sample: str | None
    detail: str
    severity: str = "error"


@dataclass
class ShardResult:
    shard: str
    state: str  # done | dead | missing
    records: int = 0
    conversations: int = 0  # the producer's samples: a multi-turn conversation's turns are several records
    ok: int = 0
    rejected: int = 0
    problems: list[Problem] = field(default_factory=list)
    good_samples: list[str] = field(default_factory=list)  # ok samples whose states passed: reference pool
    stale_rows: object = field(default=None, repr=False)  # app.quality.StaleRows across the shard's samples
    worker: str | None = None  # the worker that published it (sampled verify spreads its reads over workers)

    def add(self, kind: str, detail: str, sample: str | None = None, severity: str = "error") -> None:
        self.problems.append(Problem(kind, self.shard, sample, detail, severity))


def check_states(res: ShardResult, rec: dict, hreader: HiddenFileReader, pos: int, reader: RunReader,
                  hidden_size: int | None) -> bool:
    """Decode sample `pos` of the hidden file and check it against its record and the run (ids, layers,
    width, finite and plausible values, a lossy sample's recorded error); problems go to `res`. True: clean."""
    from app.quality import STATE_PROBLEMS, StaleRows, implausible_states, layer_detail, states_problem

    sid = rec["sample_id"]
    try:
        tokens, states = hreader.read(pos)
    except CorruptHiddenFile as exc:
        res.add("hidden_corrupt", str(exc), sid)
        return False
    good = True
    want = rec["input_ids"][:-1]
    if tokens.shape[0] != len(want) or not np.array_equal(tokens, np.asarray(want, dtype=np.int64)):
        res.add("token_mismatch", f"hidden file token_ids ({tokens.shape[0]}) != record input_ids[:-1] "
                f"({len(want)})", sid)
        good = False
    entry = hreader.entries[pos]
    if reader.layers is not None and list(entry["layers"]) != list(reader.layers):
        res.add("layers", f"states for layers {entry['layers']}, run captures {reader.layers}", sid)
        good = False
    if hidden_size and states.shape[2] != hidden_size:
        res.add("states_shape", f"hidden size {states.shape[2]} != model's {hidden_size}", sid)
        good = False
    problem = states_problem(states)
    if problem:  # per layer, with its kind on a hybrid (linear / full attention)
        kinds = (reader.settings.get("layers") or {}).get("kinds")
        res.add(problem, layer_detail(states, list(entry["layers"]), kinds) or STATE_PROBLEMS[problem], sid)
        good = False
    else:
        res.stale_rows = res.stale_rows or StaleRows()
        problem = implausible_states(tokens, states, res.stale_rows)
        if problem:
            res.add(problem, STATE_PROBLEMS[problem], sid)
            good = False
    broken = sample_problem(entry, promise(reader.settings))  # a lossy sample's recorded error vs the bound
    if broken:
        res.add(*broken, sample=sid)
        good = False
    return good
