"""Sampled verify: every shard's accounting, records and hidden-file index, and the states of a few samples.

Why: a 914K-sample run of a 27B target holds ~60-130 TB of hidden states; decoding all of them is a day or
more. What can be wrong with a shard is mostly visible without its states: a marker naming a missing or
wrong-sized file, records whose masks or token counts are off, a hidden file whose index lacks a sample, holds
the wrong number of tokens, layers or hidden size, or holds samples no record names. Those are checked for every
shard (`check_index_entry` in place of decoding). The states themselves (non-zero, finite, per-part CRCs, the
token ids equal to the record's) are decoded for the chosen samples: picked in turn from each worker, and within
a worker from shard after shard, so a bad GPU or a bad stretch of the run is reached early; a fixed seed makes
the choice repeatable. Not read: the other samples' state bytes, and the hidden files' sha256 (which needs every
byte); the report says so with the counts.
"""

from __future__ import annotations

import math
import random

from app.base.hidden_file import HiddenFileReader
from app.data.verify_checks import check_states


def check_index_entry(res, rec: dict, entry: dict, reader, hidden_size: int | None) -> bool:
    """What a hidden file's index says about one ok record's sample, without reading its states."""
    sid = rec["sample_id"]
    good = True
    want = len(rec["input_ids"]) - 1
    if int(entry.get("n_tokens", -1)) != want:
        res.add("token_mismatch", f"hidden file index holds {entry.get('n_tokens')} tokens, record input_ids[:-1] "
                f"has {want}", sid)
        good = False
    if reader.layers is not None and list(entry.get("layers") or []) != list(reader.layers):
        res.add("layers", f"states for layers {entry.get('layers')}, run captures {reader.layers}", sid)
        good = False
    if hidden_size and entry.get("hidden") is not None and int(entry["hidden"]) != hidden_size:
        res.add("states_shape", f"hidden size {entry['hidden']} != model's {hidden_size}", sid)
        good = False
    return good


def choose(results, sample: float, seed: int = 0) -> list[tuple[object, str]]:
    """(shard result, sample id) pairs: `sample` of them (or that fraction of the good samples), in turn from
    each worker and, within a worker, from shard after shard."""
    rng = random.Random(seed)
    by_worker: dict[str, list] = {}
    total = 0
    for res in sorted(results, key=lambda r: r.shard):
        if res.good_samples:
            by_worker.setdefault(res.worker or "unknown", []).append((res, rng.sample(res.good_samples,
                                                                                     len(res.good_samples))))
            total += len(res.good_samples)
    want = int(sample) if sample >= 1 else math.ceil(sample * total)
    for shards in by_worker.values():
        rng.shuffle(shards)
    chosen: list[tuple[object, str]] = []
    turn = 0
    # Each worker's shards that still have unchosen samples, in order; a shard leaves its list once emptied
    # (rebuilding the list for every pick made a 1% sample of the job's 14K shards O(picks x shards): 13 s).
    live = list(by_worker.values())
    while len(chosen) < min(want, total):
        for shards in live:
            if not shards:
                continue
            at = turn % len(shards)
            res, sids = shards[at]
            chosen.append((res, sids.pop()))
            if not sids:
                del shards[at]
            if len(chosen) >= want:
                break
        turn += 1
    return chosen


def decode_sample(reader, results, sample: float) -> dict:
    """Decode and check the chosen samples' states (problems go to their shard's result); what was read."""
    hidden_size = reader.run_settings.hidden_size
    chosen = choose(results, sample)
    by_shard: dict[str, tuple[object, list[str]]] = {}
    for res, sid in chosen:
        by_shard.setdefault(res.shard, (res, []))[1].append(sid)
    decoded, workers = 0, {}
    for shard, (res, sids) in sorted(by_shard.items()):
        info = reader.shard(shard)
        want = set(sids)
        records = {r["sample_id"]: r for r in reader.records(info) if r.get("sample_id") in want}
        path = reader.hidden_path(info)
        if path is None:
            continue
        with reader.storage.open(path) as fh:
            hreader = HiddenFileReader(fh)
            for pos, sid in sorted((hreader.by_id[s], s) for s in sids if s in hreader.by_id and s in records):
                check_states(res, records[sid], hreader, pos, reader, hidden_size)
                decoded += 1
                workers[res.worker or "unknown"] = workers.get(res.worker or "unknown", 0) + 1
    good = sum(len(r.good_samples) for r in results)
    return {"asked": sample, "states_decoded": decoded, "of_samples": good, "shards_read": len(by_shard),
            "of_shards": len(results), "by_worker": dict(sorted(workers.items())),
            "checked_everywhere": "markers, file sizes, records (ids, masks, counts), hidden-file indexes, accounting",
            "not_read": f"states of {good - decoded:,} samples; hidden files' sha256 (needs every byte)"}

