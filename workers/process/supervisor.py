"""`regen worker`'s process supervisor: one child per device, restarted with backoff when it dies.

A child that exits (engine death mid-shard exits with 75 on purpose, an idle worker whose engine died leaves
with a warm shutdown, start-up failure exits with 70, a SIGKILL from the OOM killer) is restarted after 1, 2,
4 ... 60 s; the backoff resets once a child has run for 5 minutes.
SIGTERM / SIGINT to the supervisor forwards SIGTERM to every child (Celery's warm shutdown: the running shard
finishes and is acked) and waits for them.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from app.base.config import mask_url
from app.base.process_env import worker_child_env
from workers.process.context import WorkerConfig

log = logging.getLogger("regen.supervisor")


@dataclass
class Child:
    config: WorkerConfig
    env: dict
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    backoff: float = 1.0
    next_start: float = 0.0
    exits: list[int] = field(default_factory=list)


class Supervisor:
    def __init__(self, configs: list[tuple], broker_url: str, queues: str,
                 log_dir: str | None = None, max_backoff: float = 60.0, extra_env: dict | None = None):
        self.broker_url = broker_url
        self.queues = queues
        self.log_dir = log_dir
        self.max_backoff = max_backoff
        self.stopping = threading.Event()
        self.children: list[Child] = []
        for config, visible, *own_queues in configs:  # an entry may name its own queues (regen run's split)
            self.children.append(Child(config, worker_child_env(config.to_env(), visible, broker_url,
                                                                own_queues[0] if own_queues else queues,
                                                                extra_env, name=config.hostname)))

    def _start(self, child: Child) -> None:
        out = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{child.config.hostname.split('@')[0]}.log"), "ab")  # noqa: SIM115
        child.proc = subprocess.Popen([sys.executable, "-m", "workers.worker_main"], env=child.env,
                                      stdout=out or None, stderr=subprocess.STDOUT if out else None)
        child.started = time.monotonic()
        log.info("started %s (pid %d) on %s", child.config.hostname, child.proc.pid, mask_url(self.broker_url))

    def run(self, install_signals: bool = True) -> int:
        if install_signals:
            signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
            signal.signal(signal.SIGINT, lambda *_: self.stopping.set())
        for child in self.children:
            self._start(child)
        while not self.stopping.wait(0.5):
            now = time.monotonic()
            for child in self.children:
                if child.proc is None:
                    if now >= child.next_start:
                        self._start(child)
                    continue
                code = child.proc.poll()
                if code is None:
                    if now - child.started > 300:
                        child.backoff = 1.0
                    continue
                child.exits.append(code)
                child.restarts += 1
                child.proc = None
                child.next_start = now + child.backoff
                log.warning("%s exited with %s; restarting in %.0fs", child.config.hostname, code, child.backoff)
                child.backoff = min(self.max_backoff, child.backoff * 2)
        return self.shutdown()

    def shutdown(self, timeout: float | None = None) -> int:
        for child in self.children:
            if child.proc and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        codes = []
        for child in self.children:
            if child.proc:
                try:
                    codes.append(child.proc.wait(timeout=timeout))
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    codes.append(child.proc.wait())
        return 0 if all(c in (0, -signal.SIGTERM) for c in codes) else 1

    def stop(self) -> None:
        self.stopping.set()
