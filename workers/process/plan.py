"""A worker host's plan: which worker processes to start (one per GPU or tensor-parallel group, or one on the
CPU), each with its WorkerConfig, and the settings a run's manifest gives them. Pure planning: nothing starts here."""

from __future__ import annotations

import logging
import socket

from app.base import manifest as manifest_mod
from app.base.config import DEFAULT_CAPTURE_QUEUE, DEFAULT_QUEUE, DEFAULT_SHARD_SIZE
from app.base.errors import ConfigError
from app.base.layers import ascending_problem
from app.base.manifest import RunSettings
from app.base.model_info import read_text_config
from app.base.speculative import ignored_with_capture
from app.base.storage import RunStore, Storage
from workers.engine.factory import stand_in_devices
from workers.process.context import WorkerConfig
from workers.process.devices import (
    choose_tensor_parallel,
    encode_threads_for,
    preset_for,
    select_gpus,
    task_slots_for,
)

log = logging.getLogger("regen.worker")


def worker_configs(*, cpu: bool, gpus: str | None, model: str | None, layers: list[int] | None, storage: str | None,
                   name: str | None, max_attempts: int, engine_overrides: dict, max_crashes: int = 10,
                   tensor_parallel_size: int | None = None, shard_size: int = DEFAULT_SHARD_SIZE,
                   task_slots: int | None = None, encode_threads: int | None = None, stand_in: str | None = None):
    """One (WorkerConfig, CUDA_VISIBLE_DEVICES) per child process.

    `tensor_parallel_size` None: the smallest size that fits the model's weights (devices.choose_tensor_parallel).
    `task_slots` None: from the engine's max_num_seqs and the shard size (devices.task_slots_for).
    `encode_threads` None: from the device and the host's cores per worker (devices.encode_threads_for).
    `stand_in` (benchmarks and tests only): a stand-in engine's spec (workers.doubles.stand_in); its
    `devices` worker processes each hold one engine standing in for a GPU, and no GPU is looked for.
    """
    host = socket.gethostname()
    if stand_in:
        devices, tp = [(str(k), None, "stand-in") for k in range(stand_in_devices(stand_in))], 1
    elif cpu:
        devices, tp = [("cpu", None, "cpu")], 1
    else:
        found = select_gpus(gpus)
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
        prefix = (f"{name or 'stand-in'}{label}" if stand_in
                  else name or ("cpu" if visible is None else f"gpu{label}"))
        configs.append((WorkerConfig(model=model, device="cuda" if visible is not None else
                                     "stand-in" if stand_in else "cpu", stand_in=stand_in,
                                     device_class=device_class, capture_layers=layers, storage=storage,
                                     hostname=f"{prefix}@{host}", max_attempts=max_attempts, engine=engine,
                                     task_slots=task_slots or task_slots_for(engine["max_num_seqs"], shard_size, device_class),
                                     encode_threads=encode_threads or encode_threads_for(device_class, len(devices))),
                        visible))
    return configs


def settings_from_run(storage: str, run_id: str, queues: str) -> tuple[str, list[int] | None, int, int]:
    """Model path, capture layers this worker's engine needs, a max_model_len and the shard size from a run
    manifest."""
    m = manifest_mod.load(RunStore(Storage(storage), run_id))["settings"]
    qs = {q.strip() for q in queues.split(",")}
    mode = m["capture_mode"]
    needs_capture = (mode == "inline" and qs - {DEFAULT_CAPTURE_QUEUE}) or (mode == "staged"
                                                                           and DEFAULT_CAPTURE_QUEUE in qs)
    layers = m["layers"]["vllm_ids"] if needs_capture and m.get("layers") else None
    if layers and (why := ascending_problem(layers)):
        raise ConfigError(f"run {run_id}: {why}")
    wanted = int(m["max_prompt_tokens"]) + int(m["sampling"]["max_tokens"])
    max_len = min(wanted, _model_max_len(m["model"]["path"]) or wanted)
    return m["model"]["path"], layers, max_len, int(m["shard_size"])


def run_queues(storage: str, run_id: str) -> str:
    """The queues a worker of `run_id` consumes when none are given: the queue the run was produced to
    (produce.json), and for a staged run the capture queue too, so one worker drains both passes."""
    store = RunStore(Storage(storage), run_id)
    settings = RunSettings.view(manifest_mod.load(store).settings)
    state = store.storage.read_json(store.produce_path) if store.storage.exists(store.produce_path) else {}
    queues = [state.get("queue") or DEFAULT_QUEUE]
    if settings.staged:
        queues.append(settings.capture_queue)
    return ",".join(queues)


def check_max_model_len(model: str, max_model_len: int | None) -> None:
    """Refuse a context longer than the model's (vLLM would refuse it at every engine start)."""
    context = _model_max_len(model)
    if max_model_len and context and max_model_len > context:
        raise ConfigError(f"--max-model-len {max_model_len:,} is longer than the model's context, {context:,} "
                          f"tokens (max_position_embeddings in {model}/config.json)")


def run_speculative(storage: str, run_id: str, capture_layers: list[int] | None, queues: str) -> str | None:
    """The run's speculative generation ("mtp:K") for a worker whose engine captures `capture_layers`: the
    manifest's setting for a generation-only engine, None for a capture engine (capture is itself vLLM's
    speculative method; app.base.speculative). A capture engine that also consumes a generation queue (a worker
    on both staged queues) says so in the log, since the shards it generates run without it."""
    setting = _settings(storage, run_id).speculative
    if setting and capture_layers:
        if {q.strip() for q in queues.split(",")} - {DEFAULT_CAPTURE_QUEUE}:
            log.warning("run %s generates with --speculative %s on generation engines only; this worker's "
                        "engine captures, so what it generates runs without it (start generation workers with "
                        "--queue %s)", run_id, setting, DEFAULT_QUEUE)
        return None
    return setting


def run_generation_features(storage: str, run_id: str, capture_layers: list[int] | None) -> dict:
    """The engine settings a run's thinking budget and loop stop need (`thinking_close`, `stop_loops`), for an
    engine that generates without capturing; none for a capture engine, where vLLM honours neither (app.base.thinking;
    its shards' guard refuses the run's generate shards on it)."""
    settings = _settings(storage, run_id)
    if capture_layers:
        return {}
    return {"thinking_close": settings.thinking_close, "stop_loops": bool(settings.stop_loops) or None}


def needs_plain_generation(storage: str, run_id: str) -> bool:
    """Whether the run's generation needs an engine without a speculative config: a thinking budget or the loop
    stop (app.base.thinking, app.base.loops)."""
    settings = _settings(storage, run_id)
    return settings.thinking_budget is not None or bool(settings.stop_loops)


def staged_split(capture_mode: str, speculative: str | None, plain_generation: bool = False) -> bool:
    """Whether `regen run` starts generation and capture workers apart: a staged run with speculative generation,
    a thinking budget or the loop stop (a worker on both queues holds a capture engine, which cannot run them)."""
    return capture_mode == "staged" and (bool(speculative) or plain_generation)


def speculative_staged_configs(generate: list[tuple], capture: list[tuple], cpu: bool) -> list[tuple]:
    """`regen run`'s workers for a staged run with speculative generation, each entry with its own queues:
    on the CPU a generation worker and a capture worker beside it; on GPUs every device group generates except
    the last, which captures (the prefill-only capture pass is the smaller share of the work)."""
    gen = [(config, visible, DEFAULT_QUEUE) for config, visible in generate]
    cap = [(config, visible, DEFAULT_CAPTURE_QUEUE) for config, visible in capture]
    if cpu:
        return gen + cap
    if len(gen) < 2:
        raise ConfigError("--capture staged with --speculative, --thinking-budget or --stop-loops needs two GPU "
                          "groups here (one generates, one captures); or start `regen worker --queue regen` and `--queue regen.capture` "
                          "workers yourself")
    return gen[:-1] + cap[-1:]


def refuse_unrunnable(storage: str, run_id: str) -> None:
    """A ConfigError (one line) when the planned workers cannot run the run's settings, before any engine
    starts: sampling a capturing generation would ignore (app.base.speculative)."""
    settings = _settings(storage, run_id)
    sampling = settings.sampling_dict()
    if why := ignored_with_capture(sampling, settings.capture_mode):  # every generating engine captures
        raise ConfigError(f"workers refuse run {run_id}: {why}")


def test_with_run_sampling(configs, storage: str, run_id: str) -> None:
    """Every worker's engine start test generates with the run's own sampling (its manifest's), as the shards
    will: `regen worker --run`, `regen run` and the pilot's runs (and compose's workers, which are `regen worker
    --run`) start their workers so, after refusing a setting an engine is known to crash on."""
    refuse_unrunnable(storage, run_id)
    sampling = run_sampling(storage, run_id)
    for config, *_ in configs:
        config.self_test_sampling = sampling


def _settings(storage: str, run_id: str) -> RunSettings:
    return RunSettings.view(manifest_mod.load(RunStore(Storage(storage), run_id)).settings)


def run_sampling(storage: str, run_id: str) -> dict:
    """The run's sampling (its manifest's): what a worker started with --run tests its engine with at start."""
    return _settings(storage, run_id).sampling_dict()


def manifest_engine_args(storage: str, run_id: str) -> dict:
    """The vLLM arguments a run's manifest gives every worker (`regen produce --vllm-arg`)."""
    return dict(_settings(storage, run_id).engine_args or {})


def _model_max_len(path: str) -> int | None:
    """The model's own context limit (vLLM refuses a larger max_model_len)."""
    value = read_text_config(path).get("max_position_embeddings")
    return int(value) if value else None
