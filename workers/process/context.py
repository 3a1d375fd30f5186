"""What one worker process holds for its whole life: the engine, the model's identity and its settings.

Built once per process (never per task) from `REGEN_WORKER_CONFIG`, a JSON object the supervisor (`regen worker`)
puts in the child's environment together with `CUDA_VISIBLE_DEVICES` (app.base.process_env), and which the
child's config carries (app.base.config).
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.base.config import Config
from app.base.config import current as current_settings
from app.base.errors import ConfigError
from app.base.manifest import software_versions
from app.base.model_info import ModelInfo, read_model_info
from app.base.quality import StubWindow
from app.base.speculative import describe_engine_config
from workers.engine.engine_mode import mode_key, read_mode
from workers.engine.factory import build_engine
from workers.engine.fault_hook import capture_faults
from workers.engine.llm_arguments import held_speculative
from workers.engine.options import EngineOptions
from workers.engine.recapture import EngineChecks
from workers.engine.scheduling import ENV as SIDE_THREADS_ENV
from workers.engine.scheduling import POLICY_NAMES, lower_priority, name_thread, side_threads_policy
from workers.engine.self_test import run_start_test

if TYPE_CHECKING:
    from workers.engine.interface import Engine

log = logging.getLogger("regen.worker")


@dataclass
class WorkerConfig:
    model: str
    device: str = "cpu"
    device_class: str = "cpu"
    capture_layers: list[int] | None = None
    storage: str | None = None  # overrides the storage URL in messages (hosts may mount NFS elsewhere)
    hostname: str = field(default_factory=socket.gethostname)
    max_attempts: int = 5  # failed attempts (the shard's own errors) before a dead letter
    max_crashes: int = 10  # processes that died holding the shard before a dead letter (app.base.ledger)
    engine: dict = field(default_factory=dict)
    task_slots: int = 3  # Celery thread-pool slots (workers.process.devices.task_slots_for)
    encode_threads: int = 2  # threads checking and compressing hidden states (workers.process.devices.encode_threads_for)
    self_test: bool = True
    # The sampling the engine self-test generates with (workers.engine.self_test): the run's, when the worker
    # was started with --run; None: the default thinking-mode sampling.
    self_test_sampling: dict | None = None
    # Benchmarks and tests only: an engine standing in for a GPU (workers.doubles.stand_in), its spec text.
    stand_in: str | None = None

    @classmethod
    def from_settings(cls, settings: Config) -> WorkerConfig:
        """The config `regen worker` handed this child process (`REGEN_WORKER_CONFIG`)."""
        if not settings.worker_config:
            raise ConfigError("REGEN_WORKER_CONFIG is not set: start workers with `regen worker`")
        return cls(**json.loads(settings.worker_config))

    def to_env(self) -> str:
        return json.dumps(self.__dict__)


SHM = "/dev/shm"
SCRATCH_SAMPLES = 4  # full-length samples' capture files the scratch place must hold at once


def scratch_root(need_bytes: int = 0) -> str:
    """Where the capture connector's per-request files go: `REGEN_SCRATCH`, else /dev/shm (RAM), else the temp dir.

    They live for one engine step or two; on a disk-backed /tmp writing them cost a CPU engine ~7% of its time.
    `need_bytes` is the room the worker needs there (`capture_room`). A container's /dev/shm is often 64 MB
    (Docker's and Kubernetes' default) while one real sample's states take hundreds of MB: vLLM's write would
    fail mid-shard and take the engine down with it, shard after shard. So the default place falls back to the
    temp dir, with a warning, when /dev/shm has less free room than that, and a `REGEN_SCRATCH` without the room
    is refused at start-up with the figures.
    """
    explicit = current_settings().scratch
    if explicit:
        os.makedirs(explicit, exist_ok=True)
    candidates = [explicit] if explicit else [p for p in (SHM, tempfile.gettempdir()) if os.path.isdir(p)]
    free = {path: free_bytes(path) for path in candidates}
    for path in candidates:
        if free[path] >= need_bytes:
            if path != candidates[0]:
                log.warning("%s has %s free, less than the %s this worker's capture files may need; they go to %s "
                            "(slower; give the container more shared memory, or set REGEN_SCRATCH)",
                            candidates[0], _mb(free[candidates[0]]), _mb(need_bytes), path)
            return path
    where = f"REGEN_SCRATCH={explicit}" if explicit else " and ".join(candidates)
    raise ConfigError(f"capture scratch: {where} has {_mb(max(free.values()))} free; this worker needs "
                      f"{_mb(need_bytes)} ({SCRATCH_SAMPLES} samples of max_model_len tokens at every capture layer)")


def capture_room(max_model_len: int, layers: int, hidden_size: int, dtype: str) -> int:
    """Bytes of scratch room for SCRATCH_SAMPLES full-length samples' capture files."""
    itemsize = 4 if dtype in ("float32", "float") else 2
    return SCRATCH_SAMPLES * max_model_len * layers * hidden_size * itemsize


def free_bytes(path: str) -> int:
    return shutil.disk_usage(path).free


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


class WorkerContext:
    """The process-wide singleton the tasks use."""

    current: WorkerContext | None = None
    _building = threading.Lock()

    @classmethod
    def get(cls) -> WorkerContext:
        """The process's context; a worker started as plain `celery worker` (not `regen worker`) builds its
        engine on the first task."""
        if cls.current is None:
            with cls._building:
                if cls.current is None:
                    cls.current = WorkerContext(WorkerConfig.from_settings(current_settings()))
        return cls.current

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.model: ModelInfo = read_model_info(config.model)
        options = EngineOptions(
            model=config.model,
            device="cpu" if config.device == "cpu" else "cuda",
            capture_layers=tuple(config.capture_layers) if config.capture_layers else None,
            **config.engine,
        )
        need = 0
        if options.capture_layers:
            need = capture_room(options.max_model_len, len(options.capture_layers), self.model.hidden_size,
                                options.dtype)
        options.scratch_dir = os.path.join(scratch_root(need), f"regen-capture-{os.getpid()}")
        _remove_stale_scratch(os.path.dirname(options.scratch_dir))
        self.engine: Engine = build_engine(options, config.stand_in)  # the stand-in: benchmarks and tests only

        atexit.register(self.close)
        self.tokenizer = self.engine.tokenizer
        # Task slots render prompts at once; HF fast tokenizers are not safe to share across threads.
        self.tokenizer_lock = threading.Lock()
        side_policy = side_threads_policy(config.device)
        self.encode_pool = ThreadPoolExecutor(max_workers=config.encode_threads, thread_name_prefix="regen-encode",
                                              initializer=_encoder_thread_start, initargs=(side_policy,))
        self.windows: dict[str, StubWindow] = {}
        self.manifests: dict[str, dict] = {}
        self.closed = False

        # Read from the built engine, not from the options: what attempt records and the checks' messages name.
        self.engine_mode = read_mode(self.engine)
        self.engine_mode_key = mode_key(self.engine_mode)
        log.info("engine mode: %s (%s)", self.engine_mode_key, self.engine_mode)
        self.capture_checks = EngineChecks()  # the capture check's counts (workers.engine.recapture)

        self.faults_for_tests = capture_faults()  # None but in the tests; it says so in the log at once
        if config.self_test:
            seconds = run_start_test(self.engine, config.self_test_sampling, self.engine_mode)
            log.info("engine self-test passed in %.2fs with %s", seconds,
                     f"the run's sampling {config.self_test_sampling}" if config.self_test_sampling is not None
                     else "the default thinking-mode sampling")

        # Read from the built engine, not from the options: attempt records say what the engine ran with.
        self.speculative_config = self.engine.call(held_speculative)
        log.info("speculative config as the engine holds it: %s", self.speculative_config)
        log.info("task slots: %d; hidden-state encoder threads: %d", config.task_slots, config.encode_threads)
        if side_policy:
            # After the engine thread and its OpenMP team exist: threads started from here on inherit this.
            delivery = self.engine.delivery_thread_id
            if lower_priority(policy=side_policy) and (delivery is None or lower_priority(delivery, side_policy)):
                log.info("side threads run under %s, so they yield the engine's cores "
                         "(%s=idle|batch|normal chooses)", POLICY_NAMES[side_policy], SIDE_THREADS_ENV)

    @property
    def worker_name(self) -> str:
        return self.config.hostname

    @functools.cached_property
    def engine_record(self) -> dict:
        """What attempt records say about this worker's engine (app.base.ledger.record_attempt)."""
        # `speculative`: the run setting ("mtp:2") this engine generated with, None without; `speculative_config`:
        # the engine's own (a capture engine's is vLLM's extract_hidden_states), both as the engine reports them.
        return {"vllm": None if self.config.stand_in else software_versions()["vllm"],
                **({"stand_in": self.config.stand_in} if self.config.stand_in else {}), "vllm_args": list(self.config.engine.get("vllm_args") or []),
                "speculative": describe_engine_config(self.speculative_config),
                "speculative_config": self.speculative_config,
                "mode": self.engine_mode, "mode_key": self.engine_mode_key,
                # the run's thinking budget close text and loop stop, where this engine has them (app.base.thinking,
                # app.base.loops)
                **({"thinking_close": self.engine.options.thinking_close}
                   if self.engine.options.thinking_close is not None else {}),
                **({"stop_loops": True} if self.engine.options.stop_loops else {}),
                **({"fault_injection_for_tests": self.faults_for_tests.path} if self.faults_for_tests else {})}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.encode_pool.shutdown(wait=True)
        self.engine.shutdown()
        shutil.rmtree(self.engine.options.scratch_dir, ignore_errors=True)


def _encoder_thread_start(policy: str | None) -> None:
    name_thread("regen-encode")
    if policy:
        lower_priority(policy=policy)


def _remove_stale_scratch(parent: str) -> None:
    """Remove capture scratch folders left by worker processes that no longer exist (SIGKILL, OOM)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith("regen-capture-"):
            continue
        pid = name.rsplit("-", 1)[-1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
