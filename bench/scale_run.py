"""Lay down a completed run of the real job's shape through the project's own writers (for bench/bench_scale.py).

The job: 914K thinking-mode samples of a 64-layer, 5120-wide target, 64 samples a shard (14,282 shards). Every
shard gets what a worker leaves: its attempt record (app/ledger.record_attempt), its records file and
completion marker (workers/shard_output.publish_shard, with workers.generate.shard_summary's counts), and
the records are built as workers/generate.py builds them (flags from app.base.quality.sample_flags, masks from
app.base.records.loss_mask). run.json and produce.json come from the producer's own code.

States at the target's width for every sample would be ~140 TB, so the run is a *staged* capture run
(`capture_mode: staged`) whose capture stage has finished `states_shards` of its shards: those get a hidden
file at width 5120 with the DFlash layers and the final one (vLLM ids 2,17,32,47,62,64), written through the
worker's own `encode_into` and `hidden_file_stream`, and a `captured/` marker as workers/capture_stage.py
writes it. The other shards are a capture still in progress, which every reader handles (exports skip them
until captured, verify reports them). The state-bearing shards are the first ones, so every fraction of the
run (`derive`) holds them.

Lengths: prompts log-normal around 120 tokens (12-3,000), outputs log-normal around 2,300 tokens up to the
8,192 cap (~4.5% of samples stop at the cap, unterminated), 2% stub answers: ~3,000 tokens a sample, ~2.8
billion for the job, near the job's 2.7 billion. Text fields are slices of a fixed pseudo-random word list
(4 characters a token), so records have a real sample's size in bytes.

Writing is split over processes by shard; each shard's content depends on its number only, so the run is the
same whatever the split.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import orjson

from app.base.hidden_file import float32_to_bf16
from app.base.ids import shard_id
from app.base.ledger import record_attempt
from app.base.manifest import QualitySettings, RunSettings, Sampling, StatesStorage, open_or_create
from app.base.quality import sample_flags
from app.base.records import loss_mask
from app.base.states_codec import promised_bound
from app.base.storage import RunStore, Storage
from producer.accounting import Accounting, write_produce_state
from workers.doubles.stand_in import thinking_output
from workers.shard.generate import shard_summary
from workers.shard.shard_output import hidden_file_stream, publish_shard
from workers.shard.states import encode_into

JOB_SAMPLES = 914_000
SHARD_SIZE = 64
NUM_LAYERS, HIDDEN = 64, 5120
LAYERS = [2, 17, 32, 47, 62, 64]  # --layers dflash on a 64-layer target, plus the final layer (EAGLE-3, speculators)
MAX_TOKENS = 8192
THINK_END, EOS, VOCAB = 151668, 151645, 151643  # Qwen3's `</think>`, `<|im_end|>`, and ids below the specials
RUN_ID = "job"
WORKERS = 8  # names the records and markers spread over (verify --sample spreads its reads over them)
STAMP = "bench_scale.json"


@dataclass(frozen=True)
class Shape:
    samples: int
    states_shards: int
    seed: int = 0
    hidden: int = HIDDEN  # the harness's own test lays down narrow states

    @property
    def shards(self) -> int:
        return math.ceil(self.samples / SHARD_SIZE)

    def shard_samples(self, s: int) -> int:
        return min(SHARD_SIZE, self.samples - s * SHARD_SIZE)


# -- the target checkpoint's stand-in: what an export reads of it (config.json, the final norm) ------------
def write_model(folder: Path, hidden: int = HIDDEN) -> None:
    """config.json of a 64-layer, 5120-wide Qwen3 and its final norm's weight (specforge-eagle3 applies it)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": NUM_LAYERS,
        "hidden_size": hidden, "rms_norm_eps": 1e-6, "vocab_size": 151936}))
    weight = (1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    save_file({"model.norm.weight": weight}, str(folder / "model.safetensors"))


def settings(model_dir: Path, shape: Shape) -> RunSettings:
    from app.base.model_info import read_model_info

    info = read_model_info(str(model_dir))
    return RunSettings(
        model={"path": str(model_dir), "num_layers": NUM_LAYERS, "hidden_size": shape.hidden, "model_type": "qwen3",
               "fingerprint": info.fingerprint},
        sampling=Sampling.defaults(True, MAX_TOKENS), thinking=True, capture_mode="staged",
        layers={"spec": "vllm:" + ",".join(map(str, LAYERS)), "num_layers": NUM_LAYERS, "vllm_ids": LAYERS,
                "dflash_ids": [v - 1 for v in LAYERS]},
        shard_size=SHARD_SIZE, max_prompt_tokens=4096, regenerate="last", inputs=[],
        states=StatesStorage("bf16", promised_bound("bf16", shape.hidden)),
    )


def write_run_files(store: RunStore, run_settings: RunSettings, samples: int) -> None:
    """run.json and a finished producer's produce.json for `samples` samples."""
    open_or_create(store, run_settings)
    acc = Accounting(read=samples, enqueued=samples, duplicates=0, shards=math.ceil(samples / SHARD_SIZE))
    acc.check_identity()
    write_produce_state(store, producer_settings={}, accounting=acc, complete=True, queue="regen")


# -- records ---------------------------------------------------------------------------------------------
_CORPUS: str | None = None


def corpus() -> str:
    """A fixed 4 MB pseudo-random word list that text fields are sliced from (4 characters a token)."""
    global _CORPUS
    if _CORPUS is None:
        rng = np.random.default_rng(12345)
        letters = np.frombuffer(b"etaoinshrdlucmfwypvbgkjqxz", dtype=np.uint8)
        chars = letters[np.minimum(rng.geometric(0.12, 4 << 20) - 1, len(letters) - 1)]
        chars[rng.random(len(chars)) < 0.2] = ord(" ")
        _CORPUS = chars.tobytes().decode()
    return _CORPUS


def _text(rng: np.random.Generator, n_tokens: int) -> str:
    text = corpus()
    n = min(len(text) - 1, 4 * n_tokens)
    start = int(rng.integers(0, len(text) - n))
    return text[start:start + n]


def lengths(rng: np.random.Generator) -> tuple[int, int, str]:
    """(prompt tokens, output tokens, kind): kind is `stop`, `stub` or `cap` (cut at max_tokens). The output's
    shape is the stand-in engine's (workers/doubles/stand_in.thinking_output), so the fleet harness
    (bench/bench_fleet_scale.py) generates what this run lays down."""
    n_prompt = int(np.clip(rng.lognormal(np.log(120), 0.9), 12, 3000))
    n_out, kind = thinking_output(rng, MAX_TOKENS)
    return n_prompt, n_out, kind


def record(run_id: str, shard: str, k: int, i: int, rng: np.random.Generator, quality: QualitySettings) -> dict:
    """Sample `i` (the k-th of its shard) as a worker writes it."""
    n_prompt, n_out, kind = lengths(rng)
    prompt = rng.integers(0, VOCAB, n_prompt).tolist()
    if kind == "cap":  # thinking never ended: all reasoning, no answer
        out = rng.integers(0, VOCAB, n_out).tolist()
        n_answer, reasoning, answer, closed, finish = 0, _text(rng, n_out), "", False, "length"
    else:
        n_answer = int(rng.integers(1, 3)) if kind == "stub" else max(1, int(n_out * rng.uniform(0.1, 0.3)))
        n_reason = max(0, n_out - n_answer - 2)
        out = (rng.integers(0, VOCAB, n_reason).tolist() + [THINK_END] + rng.integers(0, VOCAB, n_answer).tolist()
               + [EOS])
        n_out = len(out)
        reasoning, answer, closed, finish = _text(rng, n_reason), _text(rng, n_answer), True, "stop"
    flags = sample_flags(thinking=True, reasoning=reasoning, think_closed=closed, answer=answer,
                         answer_tokens=n_answer, finish_reason=finish, output_ids=out, quality=quality)
    return {
        "run_id": run_id, "shard_id": shard, "index": k,
        "sample_id": f"{i:016x}", "source": {"file": f"data/part-{i % 16:02d}.jsonl.zst", "line": i // 16 + 1,
                                             "source_id": None},
        "messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": _text(rng, n_prompt - 20)}],
        "tools": None, "seed": 1000 + i, "status": "ok", "input_ids": prompt + out,
        "loss_mask": loss_mask(n_prompt, len(out)), "num_prompt_tokens": n_prompt, "num_output_tokens": len(out),
        "num_answer_tokens": n_answer, "text": f"{reasoning}</think>{answer}" if closed else reasoning,
        "reasoning": reasoning, "answer": answer, "finish_reason": finish, "stop_reason": None,
        "seconds": round(float(rng.uniform(20, 200)), 3), "flags": flags, "hidden": None,
        "worker": f"gpu-host-{i // SHARD_SIZE % WORKERS}", "device": "h200",
    }


# -- states ----------------------------------------------------------------------------------------------
_POOL_ROWS = 1024


def _state_pool(hidden: int) -> np.ndarray:
    """bf16 rows [rows, layers, hidden] that samples' states are cut from (drawing 5120-wide states afresh
    for every token would cost more than everything else here); per-channel scales as in real activations."""
    rng = np.random.default_rng(7)
    scale = np.exp(rng.standard_normal((1, len(LAYERS), hidden), dtype=np.float32))
    return float32_to_bf16(rng.standard_normal((_POOL_ROWS, len(LAYERS), hidden), dtype=np.float32) * scale)


def states_for(pool: np.ndarray, n_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """A sample's states: pool rows from a random offset, each pass over the pool with its own random flip of
    every channel's low mantissa bits, so no row repeats within or across samples (verify flags a row seen
    before for another token)."""
    at = np.arange(n_tokens) + int(rng.integers(0, _POOL_ROWS))
    states = pool[at % _POOL_ROWS]
    laps = at // _POOL_ROWS
    masks = rng.integers(0, 128, (int(laps[-1]) + 1, pool.shape[2]), dtype=np.uint16)
    states ^= masks[laps][:, None, :]
    return states


# -- shards ----------------------------------------------------------------------------------------------
def write_shard(store: RunStore, shape: Shape, s: int, pool: np.ndarray | None) -> tuple[int, int]:
    """Shard `s`: attempt record, records, marker (and, for a state shard, its capture); (samples, tokens)."""
    rng = np.random.default_rng([shape.seed, s])
    sid = shard_id(s)
    worker = f"gpu-host-{s % WORKERS}"
    attempt = f"{s:012x}"
    quality = QualitySettings()
    records = [record(store.run_id, sid, k, s * SHARD_SIZE + k, rng, quality) for k in range(shape.shard_samples(s))]
    record_attempt(store, sid, attempt, worker)
    ctx = SimpleNamespace(worker_name=worker, config=SimpleNamespace(device_class="h200"), engine_mode_key="scale-run")
    summary = shard_summary(records, float(sum(r["seconds"] for r in records)) / 8, ctx)
    publish_shard(store, sid, attempt, records, None, summary)
    if pool is not None:
        write_capture(store, sid, attempt, records, pool, rng)
    return len(records), sum(len(r["input_ids"]) for r in records)


def write_capture(store: RunStore, sid: str, attempt: str, records: list[dict], pool: np.ndarray,
                  rng: np.random.Generator) -> None:
    """What workers/capture_stage.py leaves: the states file under the `c` attempt and the captured/ marker."""
    import datetime as dt

    index, problems = {}, {}
    with hidden_file_stream(store, sid, f"{attempt}c") as stream:
        for rec in records:
            ids = rec["input_ids"][:-1]
            states = states_for(pool, len(ids), rng)
            issues, position, _ = encode_into(stream, rec["sample_id"], ids, np.asarray(ids, dtype=np.int64),
                                              states, LAYERS, 3, True)
            if issues:
                problems[rec["sample_id"]] = issues
            index[rec["sample_id"]] = position
    body = {"shard_id": sid, "attempt": attempt, "hidden": {"path": stream.written.path,
                                                           "bytes": stream.written.bytes},
            "index": index, "problems": problems, "worker": f"gpu-host-{int(sid.rsplit('-', 1)[-1]) % WORKERS}",
            "finished": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")}
    store.storage.create_exclusive(store.captured_path(sid), orjson.dumps(body))


def _write_range(root: str, shape: Shape, lo: int, hi: int) -> tuple[int, int]:
    store = RunStore(Storage(root), RUN_ID)
    pool = _state_pool(shape.hidden) if lo < shape.states_shards else None
    samples = tokens = 0
    for s in range(lo, hi):
        n, t = write_shard(store, shape, s, pool if s < shape.states_shards else None)
        samples, tokens = samples + n, tokens + t
    return samples, tokens


def lay_down(root: Path, shape: Shape, model_dir: Path, jobs: int) -> dict:
    """Write the whole run under `root` with `jobs` processes; what was written."""
    store = RunStore(Storage(str(root)), RUN_ID)
    write_run_files(store, settings(model_dir, shape), shape.samples)
    chunks = [(s, s + 1) for s in range(shape.states_shards)]  # one state shard per task: they are the heavy ones
    step = 32
    chunks += [(lo, min(lo + step, shape.shards)) for lo in range(shape.states_shards, shape.shards, step)]
    samples = tokens = 0
    with ProcessPoolExecutor(max(1, jobs)) as pool:
        for n, t in pool.map(_write_range, [str(root)] * len(chunks), [shape] * len(chunks),
                             [c[0] for c in chunks], [c[1] for c in chunks]):
            samples, tokens = samples + n, tokens + t
    return {"samples": samples, "tokens": tokens, "shape": asdict(shape)}


def derive(full: Path, part: Path, shape: Shape, model_dir: Path, shards: int) -> None:
    """A run of the first `shards` shards of the run under `full`, under `part` (same run id): its own run.json
    and produce.json, and hard links to the shards' files, markers and attempt records (no data copied)."""
    src, dst = full / RUN_ID, part / RUN_ID
    samples = sum(shape.shard_samples(s) for s in range(shards))
    write_run_files(RunStore(Storage(str(part)), RUN_ID), settings(model_dir, shape), samples)
    for s in range(shards):
        sid = shard_id(s)
        for folder in (f"shards/{sid}", f"attempts/{sid}"):
            (dst / folder).mkdir(parents=True, exist_ok=True)
            for name in os.listdir(src / folder):
                os.link(src / folder / name, dst / folder / name)
        for folder in ("done", "captured"):
            if (src / folder / f"{sid}.json").exists():
                (dst / folder).mkdir(parents=True, exist_ok=True)
                os.link(src / folder / f"{sid}.json", dst / folder / f"{sid}.json")
