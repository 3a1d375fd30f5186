"""Real `regen worker --cpu` processes, shared by the session because vLLM takes seconds to start even on
the tiny models.

- `cpu_worker`: one supervisor with its Celery worker child on the tiny dense Qwen3 (Redis db 3). Its engine
  captures vLLM layers 1 to 4 (the `eagle3` preset on the 4-layer model: three auxiliary layers and the last
  one, before the final norm, which every trainer format can be exported from), so every run the tests produce
  uses those layers.
- `hybrid_worker`: the same on the text-only Qwen3.5 hybrid (Redis db 9), started with an operator's vLLM
  setting the tests check reaches the engine.
Redelivery is shortened through the workers' environment (visibility timeout 20 s, unacked sweep every 5 s).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.engines import vllm_or_fail
from tests.support.paths import REPO
from tests.support.polling import wait_for
from tests.support.redis_db import E2E_BROKER, HYBRID_BROKER

E2E_LAYERS = "vllm:1,2,3,4"
VISIBILITY_TIMEOUT = 20
# vLLM ids 1 and 2 are linear-attention layers' outputs, 4 the full-attention layer's (the last, before the norm)
HYBRID_LAYERS = "vllm:1,2,4"
HYBRID_KINDS = ["linear_attention", "linear_attention", "full_attention"]
# An operator's engine setting the hybrid worker starts with: the tests check that it reaches the engine.
OPERATOR_ARG = "max_num_batched_tokens=6144"


class WorkerProcess:
    """A `regen worker` supervisor subprocess and its log; `prefix` runs it under another command (`unshare`)."""

    def __init__(self, args: list[str], log_path: Path, env: dict, prefix: tuple[str, ...] = ()):
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "app.cli", "worker", *args], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def wait_ready(self, count: int = 1, timeout: float = 600) -> None:
        wait_for(lambda: self.text().count("engine self-test passed") >= count or self._dead(), timeout,
                 f"worker start-up (log {self.log_path})")
        if self._dead():
            pytest.fail(f"worker exited early:\n{self.text()[-3000:]}")

    def _dead(self) -> bool:
        return self.proc.poll() is not None

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def worker_env(broker: str = E2E_BROKER) -> dict:
    env = dict(os.environ)
    env.update({
        "REGEN_BROKER_URL": broker,
        "REGEN_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT),
        "REGEN_UNACKED_RESTORE_INTERVAL": "5",
        "REGEN_MISSING_RUN_RETRIES": "1",  # a task for a run not on storage is set aside after one retry (5 s)
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    })
    return env


@contextlib.contextmanager
def session_worker(model: Path, layers: str, name: str, log_dir: Path, env: dict, extra: tuple[str, ...] = ()):
    """A started `regen worker --cpu` on `model` consuming the generate and staged-capture queues, stopped after."""
    vllm_or_fail()
    worker = WorkerProcess(
        ["--cpu", "--model", str(model), "--layers", layers, "--queue", "regen,regen.capture",
         "--max-model-len", "4096", "--max-num-seqs", "16", "--name", name, "--max-attempts", "3", *extra],
        log_dir / "supervisor.log", env,
    )
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()


def engine_host_pid(worker_pid: int) -> int:
    """The CPU worker's engine process (workers/engine/process.py): the worker's child of that name."""
    from workers.engine.process import PROCESS_NAME

    for pid in subprocess.run(["pgrep", "-P", str(worker_pid)], capture_output=True, text=True).stdout.split():
        with contextlib.suppress(FileNotFoundError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == PROCESS_NAME:
                return int(pid)
    raise AssertionError(f"worker {worker_pid} has no engine process")


def process_gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie waiting for its parent counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.fixture(scope="session")
def e2e_storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("storage")


@pytest.fixture(scope="session")
def capture_faults_file(tmp_path_factory) -> Path:
    """The `cpu_worker`'s fault-injection file (workers/doubles/capture_faults_for_tests.py): a test writes
    `{run id: fault}` into it before producing that run; runs it does not list are captured as they are."""
    return tmp_path_factory.mktemp("capture-faults") / "faults.json"


@pytest.fixture(scope="session")
def cpu_worker(tiny_qwen3, e2e_redis, tmp_path_factory, capture_faults_file):
    """One real CPU worker for the session, consuming the generate and the staged-capture queues."""
    # REGEN_BENCH_TASKS: the fleet bench's in-worker baseline is tested on this worker too;
    # REGEN_FAULT_INJECTION_FOR_TESTS: the capture check's fault cases run on it too, one run per fault.
    env = {**worker_env(), "REGEN_BENCH_TASKS": "1", "REGEN_FAULT_INJECTION_FOR_TESTS": str(capture_faults_file)}
    with session_worker(tiny_qwen3, E2E_LAYERS, "e2e", tmp_path_factory.mktemp("worker-logs"), env) as worker:
        yield worker


@pytest.fixture(scope="session")
def hybrid_worker(tiny_hybrid, hybrid_redis, tmp_path_factory):
    """One real CPU worker on the text-only hybrid for the session: generate and staged-capture queues."""
    with session_worker(tiny_hybrid, HYBRID_LAYERS, "hybrid", tmp_path_factory.mktemp("hybrid-worker-logs"),
                        worker_env(HYBRID_BROKER), ("--vllm-arg", OPERATOR_ARG)) as worker:
        yield worker
