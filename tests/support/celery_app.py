"""A tiny Celery app built with the project's own configuration, for tests that need a real worker process.

It is not the vLLM worker: its tasks only touch files, so a worker starts in about a second. The broker URL
comes from `REGEN_TEST_CELERY_BROKER` (db 7 of the local Redis by default).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from app.base.celery_app import create_app
from app.base.config import BrokerConfig
from tests.support.paths import REPO
from tests.support.redis_db import OPS_BROKER

app = create_app(BrokerConfig(url=os.environ.get("REGEN_TEST_CELERY_BROKER", OPS_BROKER)))


@app.task(name="regen_test.touch")
def touch(path: str) -> str:
    """Create `path`: proof that a message was executed."""
    Path(path).write_text("ran")
    return path


@app.task(name="regen_test.hold")
def hold(run_id: str, storage: str, shard_id: str, release: str, timeout: float = 60.0) -> str:
    """Look busy with a shard (kwargs shaped like the real generate task) until `release` exists."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)
    return shard_id


class CeleryTestWorker:
    """`celery worker` for this app in a subprocess, its output in `log_path`; a context manager."""

    def __init__(self, log_path: Path, queue: str, hostname: str, pool: str = "solo", broker: str | None = None):
        import subprocess
        import sys

        repo = REPO
        env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if broker:
            env["REGEN_TEST_CELERY_BROKER"] = broker
        self.hostname = hostname
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115
        cmd = [sys.executable, "-m", "celery", "-A", "tests.support.celery_app:app", "worker", "--pool", pool,
               "--concurrency", "1", "-Q", queue, "-n", hostname, "--without-mingle", "--without-gossip",
               "--loglevel", "INFO"]
        self.proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the worker answers a ping (it is then consuming its queue)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.text()[-3000:]}")
            if app.control.ping(destination=[self.hostname], timeout=0.5):
                return
        raise TimeoutError(f"worker {self.hostname} did not answer a ping in {timeout:.0f}s:\n{self.text()[-3000:]}")

    def __enter__(self) -> CeleryTestWorker:
        return self

    def __exit__(self, *exc) -> None:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
