"""Which devices a host has, what class each is, the engine presets for that class, and how many GPUs one
engine needs (tensor parallelism) for a model that does not fit one.

Detection uses `nvidia-smi` (no CUDA initialisation in the supervisor, so each child pins its own GPU with
CUDA_VISIBLE_DEVICES before anything touches CUDA). Every preset value can be overridden on the command line.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from dataclasses import dataclass

from app.base.errors import ConfigError
from app.base.model_info import read_text_config


@dataclass(frozen=True)
class Device:
    index: str  # "cpu" or the GPU index as nvidia-smi numbers it
    name: str
    device_class: str  # cpu, sm_90, sm_100, sm_120, sm_other
    memory_mib: int = 0  # total device memory as nvidia-smi reports it (0: unknown)


# max_num_seqs, gpu_memory_utilization, enforce_eager, in_process engine core, host_process: the in-process
# engine in a child process of the worker (workers.engine.process); GPU engines already run in vLLM's own
# engine-core process
PRESETS: dict[str, dict] = {
    "cpu": {"max_num_seqs": 64, "gpu_memory_utilization": 0.1, "enforce_eager": True, "in_process": True,
            "host_process": True},
    "sm_90": {"max_num_seqs": 256, "gpu_memory_utilization": 0.90, "enforce_eager": False, "in_process": False},
    "sm_100": {"max_num_seqs": 512, "gpu_memory_utilization": 0.92, "enforce_eager": False, "in_process": False},
    "sm_120": {"max_num_seqs": 128, "gpu_memory_utilization": 0.90, "enforce_eager": False, "in_process": False},
    "sm_other": {"max_num_seqs": 128, "gpu_memory_utilization": 0.88, "enforce_eager": False, "in_process": False},
    # benchmarks and tests only: the engine standing in for a GPU (workers.doubles.stand_in), a B200's batch
    "stand-in": {"max_num_seqs": 512, "gpu_memory_utilization": 0.92, "enforce_eager": True, "in_process": True},
}


def classify(compute_cap: str) -> str:
    major = compute_cap.split(".")[0].strip()
    return {"9": "sm_90", "10": "sm_100", "12": "sm_120"}.get(major, "sm_other")


def detect_gpus() -> list[Device]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,compute_cap,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    devices = []
    for line in out.strip().splitlines():
        # the name may contain commas; index first, compute capability and memory last
        idx, rest = line.split(",", 1)
        name, cap, memory = (p.strip() for p in rest.rsplit(",", 2))
        devices.append(Device(idx.strip(), name, classify(cap), int(memory) if memory.isdigit() else 0))
    return devices


def select_gpus(gpus: str | None, use: str = "--cpu to run on the CPU") -> list[Device]:
    """The GPUs `--gpus` names (comma-separated indices; all when None), in that order; a ConfigError naming an
    index nvidia-smi does not see, or saying there is none."""
    found = detect_gpus()
    if gpus:
        wanted = [g.strip() for g in gpus.split(",") if g.strip()]
        by_index = {d.index: d for d in found}
        missing = [g for g in wanted if g not in by_index]
        if missing:
            raise ConfigError(f"--gpus {gpus}: no such GPU {', '.join(missing)} (nvidia-smi sees "
                              f"{', '.join(by_index) or 'none'})")
        found = [by_index[g] for g in wanted]
    if not found:
        raise ConfigError(f"no GPU found (nvidia-smi); use {use}")
    return found


def preset_for(device_class: str, overrides: dict) -> dict:
    values = dict(PRESETS.get(device_class, PRESETS["sm_other"]))
    values.update({k: v for k, v in overrides.items() if v is not None})
    return values


CPU_SPARE_SLOTS = 4  # on top of task_slots_for's: see its docstring


def task_slots_for(max_num_seqs: int, shard_size: int, device_class: str = "") -> int:
    """Celery task slots one worker runs: enough shards to fill the engine's batch, one more queued behind them,
    and one more being written; a CPU worker gets four more.

    Why: the queued shard keeps the batch full while a finished one is written and acked, and a CPU worker's side
    threads get only a thin share of the cores, so its next shards need spare slots to start and render meanwhile
    (measurements: docs/performance.md, 2026-11-30).
    """
    return -(-max_num_seqs // max(1, shard_size)) + 2 + (CPU_SPARE_SLOTS if device_class == "cpu" else 0)


ENCODE_THREADS_MIN, ENCODE_THREADS_MAX = 2, 8
CORES_PER_ENGINE = 2  # a GPU engine's own processes: the engine core's busy loop, the worker's main threads


def encode_threads_for(device_class: str, workers_on_host: int, cpus: int | None = None) -> int:
    """Threads one worker uses to check and compress finished samples' hidden states (workers.shard.generate).

    A real model's sample is large ([4000 tokens, 5 layers, 5120] bf16 = 205 MB) and checking plus encoding it
    takes ~0.45 s of one core (~550 MB/s). A B200 finishing a few such samples a second needs several threads, or
    samples wait in RAM behind the encoder and shards finish late. GPU hosts have cores to spare: each worker
    gets its share of the host's cores less CORES_PER_ENGINE, between ENCODE_THREADS_MIN and ENCODE_THREADS_MAX
    (8 threads ~4 GB/s, more than an engine's capture rate). On the CPU the engine needs every core and the
    samples are small: ENCODE_THREADS_MIN.
    """
    if device_class == "cpu":
        return ENCODE_THREADS_MIN
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    share = cpus // max(1, workers_on_host) - CORES_PER_ENGINE
    return max(ENCODE_THREADS_MIN, min(ENCODE_THREADS_MAX, share))


# The share of an engine's memory budget (device memory x gpu_memory_utilization, per GPU) the weights may take.
# The rest is KV cache and activations: a thinking-mode run keeps max_num_seqs sequences of up to max_model_len
# tokens in flight, and an engine whose weights leave it a sliver of KV cache runs a handful of sequences at a
# time (or refuses to start). With the presets' utilisations, 0.6 keeps a 27B bf16 model (~50 GiB) on one H200,
# B200 or RTX PRO 6000, and puts a 70B bf16 model (~131 GiB) on 2 H200s or 2 B200s, or 4 RTX PRO 6000s.
WEIGHT_SHARE = 0.6
TP_SIZES = (1, 2, 4, 8)
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")


def weights_bytes(model_path: str) -> int:
    """Bytes of the checkpoint's weight files (safetensors preferred; .bin/.pt for older checkpoints)."""
    for pattern in _WEIGHT_PATTERNS:
        files = [f for f in glob.glob(os.path.join(model_path, pattern)) if not f.endswith("training_args.bin")]
        if files:
            return sum(os.path.getsize(f) for f in files)
    return 0


def head_counts(model_path: str) -> dict[str, int]:
    """Every head count tensor parallelism splits, from the language model's config (`text_config` in a
    multimodal wrapper): attention heads and, on a hybrid, the Gated DeltaNet layers' key and value heads."""
    text = read_text_config(model_path)
    names = {"num_attention_heads": "attention heads", "linear_num_key_heads": "linear-attention key heads",
             "linear_num_value_heads": "linear-attention value heads"}
    return {words: int(text[n]) for n, words in names.items() if text.get(n)}


@dataclass(frozen=True)
class TensorParallelChoice:
    size: int
    weights_bytes: int
    budget_bytes: int  # one GPU's engine budget (memory x gpu_memory_utilization)

    def describe(self) -> str:
        gib = 1 << 30
        return (f"tensor parallel {self.size}: weights {self.weights_bytes / gib:.1f} GiB, "
                f"{self.weights_bytes / self.size / gib:.1f} GiB per GPU of a {self.budget_bytes / gib:.1f} GiB budget")


def choose_tensor_parallel(model_path: str, devices: list[Device], memory_utilization: float) -> TensorParallelChoice:
    """The smallest tensor-parallel size (1, 2, 4, 8) whose per-GPU share of the weights stays within
    WEIGHT_SHARE of one GPU's budget, that divides the GPUs given and the model's attention heads.

    Unknown memory (nvidia-smi said nothing) or no weight files: 1, as before; `--tensor-parallel-size` decides.
    """
    weights = weights_bytes(model_path)
    memory = min((d.memory_mib for d in devices), default=0) << 20
    budget = int(memory * memory_utilization)
    if not weights or not budget:
        return TensorParallelChoice(1, weights, budget)
    heads = head_counts(model_path)
    for tp in TP_SIZES:
        if tp > len(devices) or len(devices) % tp or any(n % tp for n in heads.values()):
            continue
        if weights / tp <= WEIGHT_SHARE * budget:
            return TensorParallelChoice(tp, weights, budget)
    gib = 1 << 30
    raise ConfigError(
        f"{model_path}: weights {weights / gib:.1f} GiB do not fit {len(devices)} GPU(s) of "
        f"{memory / gib:.0f} GiB at gpu_memory_utilization {memory_utilization} (weights may take "
        f"{WEIGHT_SHARE:.0%} of each GPU's budget, with a tensor-parallel size dividing the GPU count"
        f"{' and the ' + ', '.join(f'{v} {k}' for k, v in heads.items()) if heads else ''}); give "
        "--tensor-parallel-size to override"
    )
