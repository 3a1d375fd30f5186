"""What one worker process holds for its whole life: the engine, the model's identity and its settings.

Built once in `worker_process_init` (never per task) from `REGEN_WORKER_CONFIG`, a JSON object the
supervisor (`regen worker`) puts in the child's environment together with `CUDA_VISIBLE_DEVICES`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from app.model_info import ModelInfo, read_model_info
from workers.quality import StubWindow
from workers.scheduling import ENV as SIDE_THREADS_ENV
from workers.scheduling import make_idle, name_thread, side_threads_idle

log = logging.getLogger("regen.worker")


@dataclass
class WorkerConfig:
    model: str
    device: str = "cpu"
    device_class: str = "cpu"
    capture_layers: list[int] | None = None
    storage: str | None = None  # overrides the storage URL in messages (hosts may mount NFS elsewhere)
    hostname: str = field(default_factory=socket.gethostname)
    max_attempts: int = 5
    engine: dict = field(default_factory=dict)
    task_slots: int = 3  # Celery thread-pool slots (workers/devices.task_slots_for)
    encode_threads: int = 2  # threads checking and compressing hidden states (workers/devices.encode_threads_for)
    self_test: bool = True

    @classmethod
    def from_env(cls) -> WorkerConfig:
        raw = os.environ.get("REGEN_WORKER_CONFIG")
        if not raw:
            from app.errors import ConfigError

            raise ConfigError("REGEN_WORKER_CONFIG is not set: start workers with `regen worker`")
        return cls(**json.loads(raw))

    def to_env(self) -> str:
        return json.dumps(self.__dict__)


def scratch_root() -> str:
    """Where the capture connector's per-request files go: `REGEN_SCRATCH`, else /dev/shm (RAM), else /tmp.
    They live for one engine step or two; on a disk-backed /tmp writing them cost a CPU engine ~7% of its time."""
    return os.environ.get("REGEN_SCRATCH", "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")


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
                    cls.current = WorkerContext(WorkerConfig.from_env())
        return cls.current

    def __init__(self, config: WorkerConfig):
        from workers.engine import Engine, EngineOptions

        self.config = config
        self.model: ModelInfo = read_model_info(config.model)
        options = EngineOptions(
            model=config.model,
            device="cpu" if config.device == "cpu" else "cuda",
            capture_layers=tuple(config.capture_layers) if config.capture_layers else None,
            scratch_dir=os.path.join(scratch_root(), f"regen-capture-{os.getpid()}"),
            **config.engine,
        )
        _remove_stale_scratch(os.path.dirname(options.scratch_dir))
        self.engine = Engine(options)
        import atexit

        atexit.register(self.close)
        self.tokenizer = self.engine.tokenizer
        # Task slots render prompts at once; HF fast tokenizers are not safe to share across threads.
        self.tokenizer_lock = threading.Lock()
        idle_side_threads = side_threads_idle(config.device)
        self.encode_pool = ThreadPoolExecutor(max_workers=config.encode_threads, thread_name_prefix="regen-encode",
                                              initializer=_encoder_thread_start, initargs=(idle_side_threads,))
        self.windows: dict[str, StubWindow] = {}
        self.manifests: dict[str, dict] = {}
        self.closed = False
        if config.self_test:
            seconds = self.engine.self_test()
            log.info("engine self-test passed in %.2fs", seconds)
        if idle_side_threads:
            # After the engine thread and its OpenMP team exist: threads started from here on inherit this.
            delivery = self.engine.delivery_thread_id
            if make_idle() and (delivery is None or make_idle(delivery)):
                log.info("side threads run under SCHED_IDLE, so they never stall the engine's cores "
                         "(%s=normal turns this off)", SIDE_THREADS_ENV)

    @property
    def worker_name(self) -> str:
        return self.config.hostname

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.encode_pool.shutdown(wait=True)
        self.engine.shutdown()
        shutil.rmtree(self.engine.options.scratch_dir, ignore_errors=True)


def _encoder_thread_start(idle: bool) -> None:
    name_thread("regen-encode")
    if idle:
        make_idle()


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
