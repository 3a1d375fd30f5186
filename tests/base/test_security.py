"""Security: pickle is never executed, Redis AUTH (and TLS) work with passwords masked, ids cannot escape storage.

Real processes throughout: a `celery worker` on a tiny test app built with the project's configuration, and
private `redis-server` processes with a password. Every wait has a deadline.
"""

from __future__ import annotations

import json
import pickle
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from app.base.config import mask_url
from app.cli import main
from tests.support.polling import wait_for
from tests.support.private_redis import PrivateRedis, tls_redis
from tests.support.producer import sharegpt_row, write_jsonl
from tests.support.redis_db import redis_or_fail, redis_url

BROKER = redis_url(7)
QUEUE = "regen-security-test"
PASSWORD = "s3cr3t-Pa55"


class _TouchOnUnpickle:
    """Unpickling this creates `path`: the proof that pickle content was deserialised."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_a_pickle_message_is_refused_logged_and_never_executed(tmp_path):
    from kombu import Connection

    from tests.support.celery_app import CeleryTestWorker, app

    client = redis_or_fail(BROKER)
    client.flushdb()
    evil = tmp_path / "unpickled"
    good = tmp_path / "json-task-ran"
    with CeleryTestWorker(tmp_path / "worker.log", QUEUE, "security@test", pool="solo") as worker:
        worker.wait_ready()
        body = pickle.dumps(((_TouchOnUnpickle(str(evil)),), {}, {"callbacks": None, "errbacks": None,
                                                                   "chain": None, "chord": None}))
        task_id = str(uuid.uuid4())
        headers = {"lang": "py", "task": "regen_test.touch", "id": task_id, "root_id": task_id, "parent_id": None,
                   "group": None, "argsrepr": "(...)", "kwargsrepr": "{}", "retries": 0, "eta": None}
        with Connection(BROKER) as conn:
            conn.Producer().publish(body, exchange="", routing_key=QUEUE, serializer=None, headers=headers,
                                    content_type="application/x-python-serialize", content_encoding="binary")
        # A JSON task sent after it: once it has run, the worker has already taken the pickle message (FIFO).
        app.send_task("regen_test.touch", args=[str(good)], queue=QUEUE)
        wait_for(good.exists, 30, "the JSON task after the pickle message to run")
        wait_for(lambda: "Refusing to deserialize untrusted content" in worker.text(), 10,
                 "the worker to log the refusal")
    assert not evil.exists(), "the pickle payload was deserialised"
    assert "application/x-python-serialize" in worker.text()
    assert client.llen(QUEUE) == 0  # refused and dropped, not left to loop
    client.flushdb()


# -- Redis AUTH and TLS ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def auth_redis(tmp_path_factory):
    server = PrivateRedis(tmp_path_factory.mktemp("redis-auth"), password=PASSWORD)
    url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
    server.wait(url)
    yield url
    server.stop()


@pytest.fixture(scope="module")
def config_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 4,
                                                    "hidden_size": 128}))
    return folder


def _produce(tmp_path: Path, model: Path, url: str, run: str = "sec") -> tuple:
    inputs = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i) for i in range(5)])
    storage = tmp_path / "storage"
    result = CliRunner().invoke(main, ["produce", str(inputs), "--run", run, "--model", str(model), "--storage",
                                       str(storage), "--broker", url, "--queue", QUEUE, "--shard-size", "2"])
    return result, storage


def test_produce_and_status_work_with_redis_auth_and_never_print_the_password(tmp_path, auth_redis, config_model):
    import redis

    result, storage = _produce(tmp_path, config_model, auth_redis)
    assert result.exit_code == 0, result.output
    assert PASSWORD not in result.output
    assert redis.Redis.from_url(auth_redis).llen(QUEUE) == 3
    status = CliRunner().invoke(main, ["status", "sec", "--storage", str(storage), "--broker", auth_redis,
                                       "--inspect-timeout", "0"])
    assert status.exit_code == 0, status.output
    assert PASSWORD not in status.output and mask_url(auth_redis) in status.output
    data = json.loads(CliRunner().invoke(main, ["status", "sec", "--storage", str(storage), "--broker", auth_redis,
                                                "--json", "--inspect-timeout", "0"]).stdout)
    assert data["shards"]["queued"] == 3 and data["broker"]["url"] == mask_url(auth_redis)


def test_the_broker_settings_a_celery_app_carries_print_no_password():
    """`conf.regen_settings` rides on every worker's configuration, which `celery inspect conf` and Flower's
    worker pages print (tests/ops/test_flower.py checks those end to end)."""
    from app.base.celery_app import create_app
    from app.base.config import BrokerConfig, Config

    url = f"rediss://user:{PASSWORD}@head:6379/0?ssl_cert_reqs=required"
    app = create_app(BrokerConfig(url=url))
    assert PASSWORD not in repr(app.conf.regen_settings) and PASSWORD not in str(app.conf.table(censored=True))
    assert "user:***@head" in repr(app.conf.regen_settings)
    assert PASSWORD not in repr(Config.from_env({"REGEN_BROKER_URL": url}))


def test_a_wrong_password_is_reported_without_showing_it(tmp_path, auth_redis):
    from tests.support.status_run import build_status_run

    build_status_run(str(tmp_path))
    wrong = auth_redis.replace(PASSWORD, "wrong-Pa55")
    result = CliRunner().invoke(main, ["status", "r1", "--storage", str(tmp_path), "--broker", wrong, "--json"])
    assert result.exit_code == 0, result.output
    assert "wrong-Pa55" not in result.output and PASSWORD not in result.output
    data = json.loads(result.stdout)
    assert data["broker"]["error"] and data["shards"]["done"] == 3


def test_rediss_tls_with_auth_works_for_produce_and_status(tmp_path, config_model):
    import redis

    server, url = tls_redis(tmp_path, PASSWORD)
    try:
        result, storage = _produce(tmp_path, config_model, url, run="tls")
        assert result.exit_code == 0, result.output
        assert PASSWORD not in result.output
        assert redis.Redis.from_url(url).llen(QUEUE) == 3
        status = CliRunner().invoke(main, ["status", "tls", "--storage", str(storage), "--broker", url, "--json",
                                           "--inspect-timeout", "0"])
        assert status.exit_code == 0 and PASSWORD not in status.output
        assert json.loads(status.stdout)["shards"]["queued"] == 3
    finally:
        server.stop()


# -- ids that would escape the storage root -----------------------------------------------------------------------

BAD_IDS = ["../escape", "/etc/passwd", "a/b", "..", "run\x00x", "ran\u00e9", " lead", "x" * 200]


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
@pytest.mark.parametrize("command", ["status", "resume-run", "reconcile", "metrics", "worker"])
def test_a_bad_run_id_is_refused_with_one_line_and_exit_2(tmp_path, command, bad):
    storage = str(tmp_path / "s")
    args = {"status": ["status", bad, "--storage", storage, "--broker", BROKER],
            "resume-run": ["resume-run", bad, "--storage", storage, "--broker", BROKER],
            "reconcile": ["reconcile", bad, "--storage", storage, "--broker", BROKER],
            "metrics": ["metrics", "--run", bad, "--storage", storage, "--broker", BROKER, "--port", "0"],
            "worker": ["worker", "--cpu", "--run", bad, "--storage", storage, "--broker", BROKER]}[command]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("regen: error: invalid run id"), result.output
    assert not any(p.name != "s" for p in tmp_path.iterdir())  # nothing written outside the root


def test_produce_refuses_a_bad_run_id(tmp_path, config_model):
    inputs = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(0)])
    for bad in ("../escape", "/abs", "a\x00b"):
        result = CliRunner().invoke(main, ["produce", str(inputs), "--run", bad, "--model", str(config_model),
                                           "--storage", str(tmp_path / "s"), "--broker", BROKER])
        assert result.exit_code == 2, result.output
        assert result.output.strip().startswith("regen: error: invalid run id") and result.output.count("\n") == 1


def test_storage_refuses_shard_ids_and_paths_that_escape(tmp_path):
    from app.base.errors import InvalidId, RegenError
    from app.base.storage import RunStore, Storage

    store = RunStore(Storage(str(tmp_path)), "r1")
    for bad in ("../x", "/x", "a/b", "x\x00", ".."):
        with pytest.raises(InvalidId):
            store.done_path(bad)
    with pytest.raises(RegenError):
        store.storage.path("r1/../../etc/passwd")
