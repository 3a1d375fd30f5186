"""`regen run` on a machine where no Redis answers: a private redis-server, else kombu's filesystem transport."""

from __future__ import annotations

from pathlib import Path

import redis

import app.base.embedded_broker as eb
from tests.support.ports import free_port


def _unused_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


def test_a_given_broker_is_used_as_is(tmp_path):
    with eb.broker_for_run("redis://:secret@example:6379/0", str(tmp_path)) as (url, how):
        assert url == "redis://:secret@example:6379/0" and how == "configured broker"


def test_without_redis_a_private_redis_server_is_started_and_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(eb, "DEFAULT_BROKER_URL", _unused_url())
    with eb.broker_for_run(None, str(tmp_path)) as (url, how):
        assert "private redis-server" in how
        client = redis.Redis.from_url(url)
        assert client.ping()
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    assert not eb.reachable(url, 0.2)  # stopped with the run
    assert not list(tmp_path.glob("regen-redis-*"))


def test_without_redis_server_the_filesystem_transport_is_used(tmp_path, monkeypatch):
    monkeypatch.setattr(eb, "DEFAULT_BROKER_URL", _unused_url())
    monkeypatch.setattr(eb.shutil, "which", lambda name: None)
    with eb.broker_for_run(None, str(tmp_path)) as (url, how):
        assert url.startswith("filesystem://") and "at-most-once" in how
        from app.base.celery_app import create_app
        from app.base.config import BrokerConfig

        app = create_app(BrokerConfig(url=url))
        app.send_task("regen.generate_shard", kwargs={"run_id": "r"}, queue="regen")
        folder = url[len("filesystem://"):]
        assert any(p.suffix == ".msg" for p in Path(folder).iterdir())
