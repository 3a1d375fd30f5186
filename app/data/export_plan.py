"""An export's plan in its output folder: which shards each round of exporting takes, and every sample's number.

Why on storage: hidden-state exports number samples over the whole export, so several processes and hosts
writing shards at once must know each shard's first number before they start. `batches/{k}.json` (created
exclusively) lists a round's shards and its first number; `counts/{shard}.json` how many samples each keeps. A
shard's `done/{shard}.json` still says it is exported. Details: docs/formats.md#the-export-plan.
"""

from __future__ import annotations

import hashlib

import orjson

from app.base.storage import Storage

BATCHES = "batches"
ASSEMBLED = "assembled.json"  # the set of exported shards the cross-shard files were last made from


def _json_bytes(obj) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_INDENT_2) + b"\n"


def done_shards(out: Storage) -> set[str]:
    return {n[: -len(".json")] for n in out.listdir("done") if n.endswith(".json")}


def batches(out: Storage) -> list[dict]:
    return [out.read_json(f"{BATCHES}/{n}") for n in out.listdir(BATCHES) if n.endswith(".json")]


def next_index(out: Storage) -> int:
    """The number the next sample gets: one past the last sample any done shard holds."""
    end = 0
    for name in out.listdir("done"):
        if name.endswith(".json"):
            d = out.read_json(f"done/{name}")
            end = max(end, int(d.get("first_index", 0)) + int(d["exported"]))
    return end


def open_batch(out: Storage, candidates: list[str]) -> dict | None:
    """The batch to work on: the last one while it is incomplete, else a new one of the `candidates` (done shards
    of the run, in id order) that no batch holds and no done marker names; None when there is nothing to do."""
    planned = batches(out)
    done = done_shards(out)
    if planned and any(s not in done for s in planned[-1]["shards"]):
        return planned[-1]
    held = {s for b in planned for s in b["shards"]}
    new = [s for s in candidates if s not in held and s not in done]
    if not new:
        return None
    body = {"batch": len(planned), "first_index": next_index(out), "shards": new}
    rel = f"{BATCHES}/{len(planned):06d}.json"
    if not out.create_exclusive(rel, _json_bytes(body)):
        body = out.read_json(rel)  # another exporter planned it first: its batch is the one
    return body


def complete(out: Storage) -> bool:
    """Every planned shard is exported."""
    done = done_shards(out)
    return all(s in done for b in batches(out) for s in b["shards"])


def write_count(out: Storage, shard: str, exported: int, filtered: dict) -> dict:
    body = {"shard_id": shard, "exported": exported, "filtered": filtered}
    out.write_bytes(f"counts/{shard}.json", _json_bytes(body))
    return body


def read_count(out: Storage, shard: str) -> dict | None:
    try:
        return out.read_json(f"counts/{shard}.json")
    except FileNotFoundError:
        return None


def first_indices(out: Storage, batch: dict) -> dict[str, int]:
    """Each shard's first sample number, for the shards whose predecessors in the batch are all counted."""
    firsts, index = {}, int(batch["first_index"])
    for shard in batch["shards"]:
        firsts[shard] = index
        count = read_count(out, shard)
        if count is None:
            break
        index += int(count["exported"])
    return firsts


def digest(shards: set[str]) -> str:
    """Names the set of exported shards an assembly was made from."""
    return hashlib.sha256("\n".join(sorted(shards)).encode()).hexdigest()[:16]


def assembled(out: Storage) -> str | None:
    try:
        return out.read_json(ASSEMBLED).get("digest")
    except FileNotFoundError:
        return None


def mark_assembled(out: Storage, shards: set[str], samples: int | None) -> None:
    out.write_bytes(ASSEMBLED, _json_bytes({"digest": digest(shards), "shards": len(shards),
                                                   "samples": samples}))
