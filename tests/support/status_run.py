"""A synthetic run on storage, built with the workers' own writers (no engine): for status and metrics tests.

`build_status_run` writes run.json and produce.json the way the producer does, publishes some shards with
`publish_shard` (records + hidden file + completion marker), records failed attempts, dead-letters one shard,
leaves one shard running, and pauses the run. It returns the numbers a correct status must report.
"""

from __future__ import annotations

import datetime as dt

import numpy as np

from app.base.hidden_file import encode_sample
from app.base.ledger import dead_letter, record_attempt, record_attempt_error
from app.base.storage import RunStore, Storage
from workers.shard.shard_output import publish_shard

STATUS_QUEUE = "regen-status-test"
DONE = {  # shard -> (worker, samples, stubs, prompt tokens per sample, generated tokens per sample, seconds)
    "shard-000000": ("gpu0@hostA", 4, 1, 10, 50, 2.0),
    "shard-000001": ("gpu0@hostA", 4, 0, 12, 40, 1.5),
    "shard-000002": ("gpu1@hostA", 3, 2, 8, 30, 3.0),
}
FAILED = "shard-000003"
DEAD = "shard-000004"
RUNNING = "shard-000005"
TOTAL_SHARDS = 8
PAUSE_REASON = "stub-or-empty rate 25% over the last 11 samples on gpu1@hostA crossed the threshold 20%"


def _record(sid: str, prompt: int, generated: int, stub: bool) -> dict:
    ids = list(range(prompt + generated))
    return {"sample_id": sid, "status": "ok", "input_ids": ids, "loss_mask": [0] * prompt + [1] * generated,
            "num_prompt_tokens": prompt, "num_output_tokens": generated, "finish_reason": "stop",
            "flags": ["stub"] if stub else []}


def _hidden(sid: str, n_tokens: int):
    rng = np.random.default_rng(n_tokens)
    states = rng.integers(0, 2**16, size=(n_tokens, 2, 8), dtype=np.uint16)
    return encode_sample(sid, np.arange(n_tokens, dtype=np.int32), states, [2, 3])


def publish_synthetic(store: RunStore, shard: str, worker: str, n: int, stubs: int, prompt: int, generated: int,
                      seconds: float, attempt: str = "a0") -> dict:
    record_attempt(store, shard, attempt, worker, stage="generate")
    records = [_record(f"{shard}-s{i}", prompt, generated, i < stubs) for i in range(n)]
    hidden = [_hidden(r["sample_id"], prompt + generated - 1) for r in records]
    summary = {"samples": n, "ok": n, "rejected": {}, "flags": {"stub": stubs} if stubs else {}, "stubs": stubs,
               "prompt_tokens": n * prompt, "generated_tokens": n * generated, "generation_seconds": seconds,
               "worker": worker, "device": "rtx-pro-6000"}
    assert publish_shard(store, shard, attempt, records, hidden, summary)
    return summary


def build_status_run(root: str, run_id: str = "r1") -> dict:
    storage = Storage(root)
    store = RunStore(storage, run_id)
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    storage.write_json(store.manifest_path, {
        "format": "regen.run/1", "run_id": run_id, "created": now,
        "settings": {"capture_mode": "inline", "model": {"path": "/m"}},
        "counts": {"read": 40, "enqueued": 30, "duplicates": 2, "rejected": 8, "shards": TOTAL_SHARDS},
    })
    storage.write_json(store.produce_path, {"run_id": run_id, "complete": True, "started": now, "finished": now,
                                            "queue": STATUS_QUEUE, "producer_settings": {}, "counts": {"shards": TOTAL_SHARDS}})
    summaries = {s: publish_synthetic(store, s, *spec) for s, spec in DONE.items()}
    record_attempt(store, FAILED, "f1", "gpu1@hostA", stage="generate")
    record_attempt_error(store, FAILED, "f1", "OSError: disk full on redis://:hunter2@broker:6379/0")
    for i in range(2):
        record_attempt(store, DEAD, f"d{i}", "gpu0@hostA", stage="generate")
        record_attempt_error(store, DEAD, f"d{i}", "PermanentError: prompt too long")
    dead_letter(store, DEAD, "PermanentError: prompt too long")
    record_attempt(store, RUNNING, "r1", "gpu1@hostA", stage="generate")
    storage.write_json(store.pause_path, {"reason": PAUSE_REASON, "rate": 0.25, "window": 11, "by": "gpu1@hostA"})
    return {"store": store, "summaries": summaries}
