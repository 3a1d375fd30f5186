"""What checking one shard finds, and the check of one sample's states: shared by `regen verify`'s full pass
(app.data.verify) and its sampled one (app.data.verify_sampled), so neither imports the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from app.base.hidden_file import CorruptHiddenFile, HiddenFileReader
from app.base.manifest import RunSettings
from app.base.quality import STATE_PROBLEMS, StaleRows, implausible_states, layer_detail, states_problem
from app.base.states_bound import promise, sample_problem
from app.base.states_compare import zero_rows_allowed
from app.base.thinking_modes import prompt_ends_in_mode, record_mode, record_thinking
from app.data.run_reader import RunReader


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
    stale_rows: object = field(default=None, repr=False)  # app.base.quality.StaleRows across the shard's samples
    worker: str | None = None  # the worker that published it (sampled verify spreads its reads over workers)

    def add(self, kind: str, detail: str, sample: str | None = None, severity: str = "error") -> None:
        self.problems.append(Problem(kind, self.shard, sample, detail, severity))


def check_mode(res: ShardResult, rec: dict, settings: dict) -> bool:
    """A mixed run's record against its mode: its prompt ids must end as the target's template ends that mode's
    generation prompt (the tails the producer measured, app.base.thinking_modes; Qwen3: a non-thinking prompt ends in the
    empty think block), and its reasoning must be what the mode allows (none without thinking). True: clean."""
    tails = RunSettings.view(settings).mode_prompt_tails
    if not tails:
        return True
    thinking, sid = record_thinking(rec, settings), rec.get("sample_id")
    if "thinking" not in rec:
        res.add("mode", "record of a mixed run names no mode", sid)
        return False
    n_prompt = int(rec.get("num_prompt_tokens") or 0)
    if not prompt_ends_in_mode(rec["input_ids"][:n_prompt], tails, thinking):
        res.add("mode", f"record says {record_mode(rec, settings)}, but its prompt ids do not end in that mode's "
                f"generation prompt ({tails[record_mode(rec, settings)]})", sid)
        return False
    if not thinking and rec.get("reasoning"):
        res.add("mode", "non-thinking record with reasoning", sid)
        return False
    return True


def check_states(res: ShardResult, rec: dict, hreader: HiddenFileReader, pos: int, reader: RunReader,
                  hidden_size: int | None) -> bool:
    """Decode sample `pos` of the hidden file and check it against its record and the run (ids, layers,
    width, finite and plausible values, a lossy sample's recorded error); problems go to `res`. True: clean."""
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
    zero_ok = zero_rows_allowed(tokens, reader.run_settings.zero_embedding_ids)
    problem = states_problem(states, zero_ok)
    if problem:  # per layer, with its kind on a hybrid (linear / full attention)
        kinds = reader.run_settings.layer_kinds
        res.add(problem, layer_detail(states, list(entry["layers"]), kinds, zero_ok) or STATE_PROBLEMS[problem], sid)
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
