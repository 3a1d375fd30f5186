"""Flower, started with compose.yaml's command, lists regen's queues with their real backlog and the workers on
them: the backlog is put on Redis by the real producer (`produce`, `send_captures`), Flower is a real
`celery flower` subprocess, the worker a real `celery worker` (tests/support/celery_app.py)."""

from __future__ import annotations

import base64
import json
import os
import shlex
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from app.base.celery_app import create_app
from app.base.config import DEFAULT_CAPTURE_QUEUE, DEFAULT_QUEUE, BrokerConfig
from app.base.manifest import load
from app.base.storage import RunStore, Storage
from producer.produce import produce, send_captures
from producer.run_setup import ProduceOptions
from tests.support.celery_app import CeleryTestWorker
from tests.support.paths import REPO
from tests.support.polling import wait_for
from tests.support.ports import free_port
from tests.support.private_redis import tls_redis
from tests.support.producer import sharegpt_row, write_jsonl
from tests.support.redis_db import OPS_BROKER

LOGIN = ("regen", "flower-test-password")
PASSWORD = "br0ker-Pa55"  # the broker's (requirepass), never to be shown
OTHER_QUEUE = "team-b.regen"  # a run produced with `--queue team-b.regen`
IDLE_QUEUE = "flower-idle"  # what the test worker consumes: nothing is ever sent there


def compose_flower_argv(port: int) -> list[str]:
    """compose.yaml's Flower command, on `port` of 127.0.0.1 and this interpreter's `celery`."""
    command = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["flower"]["command"]
    if command[:2] == ["sh", "-c"]:  # the login check, then `exec celery ...` (tests/test_compose.py runs the check)
        command = shlex.split(command[2].rsplit("exec ", 1)[1])
    assert command[0] == "celery"
    args = [a for a in command[1:] if not a.startswith("--port")]
    return [sys.executable, "-m", "celery", *args, f"--port={port}", "--address=127.0.0.1"]


class Flower:
    """`celery ... flower` in a subprocess, its output in `log_path`; a context manager."""

    def __init__(self, log_path: Path, broker: str):
        self.port = free_port()
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "FLOWER_"))}
        env.update(REGEN_BROKER_URL=broker, FLOWER_BASIC_AUTH=":".join(LOGIN),
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(compose_flower_argv(self.port), cwd=REPO, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def get(self, path: str) -> bytes | None:
        """The body of GET `path` with the login, or None while Flower does not answer yet."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}")
        request.add_header("Authorization", "Basic " + base64.b64encode(":".join(LOGIN).encode()).decode())
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return resp.read()
        except (ConnectionError, urllib.error.URLError) as exc:
            if isinstance(exc, urllib.error.HTTPError):
                raise AssertionError(f"GET {path}: {exc.code} {exc.read()[:300]!r}\n{self.text()[-2000:]}") from None
            return None

    def get_json(self, path: str):
        body = self.get(path)
        return None if body is None else json.loads(body)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60) -> None:
        wait_for(lambda: self.proc.poll() is not None or self.get("/healthcheck") == b"OK", timeout,
                 f"Flower to answer (log {self.log_path})")
        assert self.proc.poll() is None, f"Flower exited:\n{self.text()[-3000:]}"

    def __enter__(self) -> Flower:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def make_backlog(folder: Path, broker: str, model: Path) -> dict[str, int]:
    """Three runs' shards waiting in Redis as the producer leaves them: {queue: messages}."""
    import redis

    storage = str(folder / "store")

    def produce_run(run_id: str, rows: int, **kw):
        inputs = write_jsonl(folder / f"{run_id}.jsonl", [sharegpt_row(i, run_id) for i in range(rows)])
        result = produce(ProduceOptions(inputs=[str(inputs)], run_id=run_id, storage=storage, model=str(model),
                                        broker=broker, shard_size=2, **kw))
        assert result.status == "produced"
        return result

    produce_run("r-main", 10)  # 5 shards on `regen`
    produce_run("r-other", 6, queue=OTHER_QUEUE)  # 3 shards on the run's own queue
    staged = produce_run("r-staged", 4, capture="staged")  # 2 more on `regen`; their captures on `regen.capture`
    store = RunStore(Storage(storage), "r-staged")
    app = create_app(BrokerConfig(url=broker))
    try:
        sent = send_captures(store, app, staged.storage_url, load(store)["settings"], ["shard-000000", "shard-000001"])
    finally:
        app.close()
    assert sent == 2
    expected = {DEFAULT_QUEUE: 7, OTHER_QUEUE: 3, DEFAULT_CAPTURE_QUEUE: 2}
    client = redis.Redis.from_url(broker)
    assert {q: client.llen(q) for q in expected} == expected  # what Flower must show, read from Redis itself
    client.close()
    return expected


@pytest.fixture
def backlog(tmp_path, redis7, tiny_config_model) -> dict[str, int]:
    return make_backlog(tmp_path, OPS_BROKER, tiny_config_model)


def queue_lengths(flower: Flower) -> dict[str, int]:
    return {q["name"]: q["messages"] for q in flower.get_json("/api/queues/length")["active_queues"]}


def test_flower_lists_every_queue_with_its_backlog_and_the_worker_on_them(tmp_path, backlog):
    with Flower(tmp_path / "flower.log", OPS_BROKER) as flower:
        flower.wait_ready()
        assert queue_lengths(flower) == backlog  # no worker yet: regen's queues and the run's own, nothing else
        page = flower.get("/broker").decode()
        for queue in backlog:
            assert f"<td>{queue}</td>" in page

        with CeleryTestWorker(tmp_path / "worker.log", IDLE_QUEUE, "idle@flower-test") as worker:
            worker.wait_ready()
            workers = wait_for(lambda: (flower.get_json("/api/workers?refresh=1") or {}).get("idle@flower-test"),
                               30, "Flower to list the worker")
            assert [q["name"] for q in workers["active_queues"]] == [IDLE_QUEUE]
            # Flower alone would now list the worker's queue only; the backlog stays listed beside it
            assert queue_lengths(flower) == {**backlog, IDLE_QUEUE: 0}
            assert "idle@flower-test" in flower.get("/workers").decode()
    assert "not supported" not in flower.text()


def test_flower_over_tls_with_a_password_lists_the_queues_and_shows_the_password_nowhere(tmp_path, tiny_config_model):
    """The broker URL as the docs give it for other hosts (`rediss://:PASSWORD@...?ssl_cert_reqs=required&
    ssl_ca_certs=...`): Flower reads the queues over TLS, and neither its pages, its API (the workers' `conf`
    included), its log nor the worker's log carries the password."""
    server, url = tls_redis(tmp_path, PASSWORD)
    try:
        backlog = make_backlog(tmp_path, url, tiny_config_model)
        with CeleryTestWorker(tmp_path / "worker.log", IDLE_QUEUE, "tls@flower-test", broker=url) as worker, \
                Flower(tmp_path / "flower.log", url) as flower:
            flower.wait_ready()
            seen = wait_for(lambda: worker.proc.poll() is not None or (flower.get_json("/api/workers?refresh=1")
                                                                       or {}).get("tls@flower-test"),
                            60, "Flower to list the worker on the TLS broker")
            assert worker.proc.poll() is None, worker.text()[-3000:]
            assert [q["name"] for q in seen["active_queues"]] == [IDLE_QUEUE]
            assert queue_lengths(flower) == {**backlog, IDLE_QUEUE: 0}
            bodies = {path: flower.get(path).decode() for path in
                      ("/api/workers?refresh=1", "/api/queues/length", "/broker", "/workers", "/worker/tls@flower-test")}
            assert "tls@flower-test" in bodies["/worker/tls@flower-test"]
            assert "rediss://" in bodies["/broker"]
        for where, text in {**bodies, "Flower's log": flower.text(), "the worker's log": worker.text()}.items():
            assert PASSWORD not in text, where
    finally:
        server.stop()
