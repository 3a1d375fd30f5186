"""Build small but real runs on tmp storage for the data-command tests: the same files a producer and workers write.

Records are built like workers/shard/generate.py builds them (flags from app.base.quality, summary from
workers.shard.generate.shard_summary), states are encoded with app.base.hidden_file.encode_sample and shards are written by
workers.shard.shard_output.publish_shard; run.json and produce.json are written with the producer's own code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from app.base.hidden_file import encode_sample, float32_to_bf16
from app.base.ids import shard_id
from app.base.manifest import QualitySettings, RunSettings, Sampling, StatesStorage, open_or_create
from app.base.quality import is_stub, sample_flags
from app.base.records import loss_mask, rejected_record
from app.base.states_codec import promised_bound
from app.base.storage import RunStore, Storage
from producer.accounting import Accounting, write_produce_state
from workers.shard.generate import shard_summary
from workers.shard.shard_output import hidden_file_stream, publish_marker, publish_shard

LAYERS = [1, 2, 4]
HIDDEN = 16
THINK_END, EOS = 7, 2  # token ids standing for `</think>` and `<|im_end|>` in the synthetic vocabulary


@dataclass
class Spec:
    run_id: str = "synth"
    shards: int = 3
    shard_size: int = 4
    capture: str = "inline"  # inline | staged | off
    stub_fraction: float = 0.0
    zero_samples: set = field(default_factory=set)  # global indices whose states are all zero
    worker_rejects: set = field(default_factory=set)  # global indices the worker rejects (prompt_too_long)
    duplicates: int = 2
    producer_rejects: int = 1
    sources: tuple = ("a.jsonl", "b.jsonl")
    seed: int = 0
    states_dtype: str = "bf16"  # a lossy codec (app/base/states_codec.py) stores and records states as that
    layers: tuple = tuple(LAYERS)  # vLLM ids the run says it captured (the states have one slot per id)
    marks: dict = field(default_factory=dict)  # global index -> fields set on its ok record (`flags` are added)


@dataclass
class Built:
    storage: Storage
    store: RunStore
    spec: Spec
    records: list[dict]  # every record written, in order
    states: dict[str, np.ndarray]  # sample_id -> uint16 [T-1, L, H]


def _sample(i: int, spec: Spec, rng: np.random.Generator) -> tuple[dict, np.ndarray | None]:
    n_prompt = int(rng.integers(5, 12))
    stub = int((i + 1) * spec.stub_fraction) > int(i * spec.stub_fraction)  # evenly spread, exact rate
    if stub:
        reasoning, answer = "", "OK."
        out = [THINK_END, 40, EOS]
        n_answer = 1
    else:
        n_reason, n_answer = int(rng.integers(6, 20)), int(rng.integers(10, 20))
        out = list(rng.integers(20, 90, n_reason)) + [THINK_END] + list(rng.integers(20, 90, n_answer)) + [EOS]
        out = [int(t) for t in out]
        reasoning, answer = f"thinking {i} " * 3, f"answer {i} " * 4
    prompt = [int(t) for t in rng.integers(10, 90, n_prompt)]
    finish = "length" if i % 11 == 10 else "stop"
    flags = sample_flags(thinking=True, reasoning=reasoning, think_closed=True, answer=answer, answer_tokens=n_answer,
                         finish_reason=finish, output_ids=out, quality=QualitySettings())
    source = spec.sources[i % len(spec.sources)]
    rec = {
        "sample_id": f"{i:016x}", "source": {"file": source, "line": i + 1, "source_id": None},
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Question {i}?"}],
        "tools": None, "seed": 1000 + i, "status": "ok", "input_ids": prompt + out,
        "loss_mask": loss_mask(n_prompt, len(out)), "num_prompt_tokens": n_prompt, "num_output_tokens": len(out),
        "num_answer_tokens": n_answer, "text": f"{reasoning}</think>{answer}", "reasoning": reasoning,
        "answer": answer, "finish_reason": finish, "stop_reason": None, "seconds": 0.1, "flags": flags,
        "hidden": None, "worker": "w0", "device": "cpu",
    }
    for key, value in spec.marks.get(i, {}).items():
        rec[key] = rec["flags"] + [f for f in value if f not in rec["flags"]] if key == "flags" else value
    if spec.capture == "off":
        return rec, None
    if i in spec.zero_samples:
        states = np.zeros((n_prompt + len(out) - 1, len(spec.layers), HIDDEN), dtype=np.uint16)
    else:
        states = float32_to_bf16(rng.standard_normal((n_prompt + len(out) - 1, len(spec.layers), HIDDEN),
                                                     dtype=np.float32))
    return rec, states


def build_run(root: Path, spec: Spec | None = None) -> Built:
    spec = spec or Spec()
    storage = Storage(str(root))
    store = RunStore(storage, spec.run_id)
    settings = RunSettings(
        model={"path": str(root / "no-model"), "num_layers": 4, "hidden_size": HIDDEN, "model_type": "qwen3",
               "fingerprint": "synthetic"},
        sampling=Sampling.defaults(True, 64), thinking=True, capture_mode=spec.capture,
        layers=None if spec.capture == "off" else {
            "spec": "vllm:" + ",".join(map(str, spec.layers)), "num_layers": 4, "vllm_ids": list(spec.layers),
            "dflash_ids": [v - 1 for v in spec.layers]},
        shard_size=spec.shard_size, max_prompt_tokens=4096, regenerate="last", inputs=[],
        states=StatesStorage(spec.states_dtype, promised_bound(spec.states_dtype, HIDDEN)),
    )
    open_or_create(store, settings)
    rng = np.random.default_rng(spec.seed)
    all_records, all_states = [], {}
    ctx = SimpleNamespace(worker_name="w0", config=SimpleNamespace(device_class="cpu"), engine_mode_key="synthetic")
    for s in range(spec.shards):
        sid = shard_id(s)
        records, encoded = [], []
        for k in range(spec.shard_size):
            i = s * spec.shard_size + k
            rec, states = _sample(i, spec, rng)
            rec = {"run_id": spec.run_id, "shard_id": sid, "index": k, **rec}
            if i in spec.worker_rejects:
                rec = rejected_record({key: rec[key] for key in ("run_id", "shard_id", "sample_id", "index",
                                                                 "source", "messages", "tools")},
                                      "prompt_too_long", "synthetic")
            elif states is not None:
                tokens = np.asarray(rec["input_ids"][:-1], dtype=np.int64)
                if spec.capture == "inline":
                    rec["hidden"] = {"index": len(encoded), "n_tokens": len(tokens), "layers": list(spec.layers)}
                encoded.append(encode_sample(rec["sample_id"], tokens, states, list(spec.layers),
                                             stored=spec.states_dtype))
                all_states[rec["sample_id"]] = states
            records.append(rec)
        summary = shard_summary(records, 1.0 + s, ctx)
        summary["worker"] = f"w{s % 2}"
        publish_shard(store, sid, f"att{s:04d}", records, encoded if spec.capture == "inline" else None, summary)
        if spec.capture == "staged":
            _write_capture(store, sid, encoded)
        all_records += records
    acc = Accounting(read=spec.shards * spec.shard_size + spec.duplicates + spec.producer_rejects,
                     enqueued=spec.shards * spec.shard_size, duplicates=spec.duplicates, shards=spec.shards)
    if spec.producer_rejects:
        acc.rejected_by_reason["malformed_json"] = spec.producer_rejects
    acc.check_identity()
    write_produce_state(store, producer_settings={}, accounting=acc, complete=True, queue="regen")
    return Built(storage, store, spec, all_records, all_states)


def _write_capture(store: RunStore, shard: str, encoded: list) -> None:
    """What workers/shard/capture_stage.py writes, through the same functions: a hidden file under a `c` attempt
    (hidden_file_stream) and the captured/ marker naming it with its sha256 (publish_marker)."""
    with hidden_file_stream(store, shard, "capt0c") as stream:
        for e in encoded:
            stream.append(e)
    body = {"shard_id": shard, "attempt": "capt0", "hidden": stream.written.info(),
            "index": {e.sample_id: n for n, e in enumerate(encoded)}, "problems": {}, "worker": "w0"}
    assert publish_marker(store, store.captured_path(shard), body, [stream.written.path], shard)


def ok_records(built: Built) -> list[dict]:
    return [r for r in built.records if r["status"] == "ok"]


def stub_count(built: Built) -> int:
    return sum(1 for r in ok_records(built) if is_stub(r["flags"]))
