"""The Celery app Flower runs on (`celery -A app.ops.flower flower`), so that Flower lists regen's queues.

Why its own app: Celery's default app lists only the `celery` queue, and the worker's app (the guarded
transport) gives a broker URL Flower cannot use. This is `create_app` on the same settings, with Flower's
queue list extended by regen's queues and every task queue the broker has recorded (its kombu binding sets),
so Flower needs no storage. The broker URL is regen's (`REGEN_BROKER_URL`); `rediss://` options become
`broker_use_ssl`. The whole story: docs/operating.md#flowers-own-celery-app.
"""

from __future__ import annotations

import logging
import ssl

from celery import Celery
from kombu import Queue
from kombu.transport.redis import Channel
from kombu.utils.url import parse_url

from app.base.celery_app import create_app, redis_client
from app.base.config import DEFAULT_CAPTURE_QUEUE, DEFAULT_QUEUE, Config, install, mask_text
from app.base.library_patches import FLOWER_QUEUES, check_versions, extend_flower_queue_listing

log = logging.getLogger("regen.flower")

REGEN_QUEUES = (DEFAULT_QUEUE, DEFAULT_CAPTURE_QUEUE)


def task_queue_names(url: str, timeout: float = 2.0) -> list[str]:
    """Every task queue the Redis broker at `url` has a binding for, sorted.

    kombu keeps a set `_kombu.binding.<exchange>` whose members are `routing_key SEP pattern SEP queue`; a
    Celery task queue is bound to an exchange of its own name. Celery's other bindings (the `celeryev` event
    queues, the `celery.pidbox` control queues) are bound to shared exchanges and are left out."""
    prefix = Channel.keyprefix_queue % ("",)
    client = redis_client(url, timeout)
    try:
        names = set()
        for key in client.scan_iter(match=prefix + "*", count=1000):
            exchange = key.decode("utf-8", "replace")[len(prefix):]
            for member in client.smembers(key):
                queue = member.decode("utf-8", "replace").split(Channel.sep)[-1]
                if queue == exchange:
                    names.add(queue)
        return sorted(names)
    finally:
        client.close()


def regen_queue_names(handler) -> list[str]:
    """regen's two queues and every task queue the broker has recorded; broker trouble leaves Flower's own list,
    logged once a request (password masked)."""
    names = set(REGEN_QUEUES)
    try:
        names |= set(task_queue_names(handler.capp.conf.broker_url))
    except Exception as exc:
        log.warning("regen: broker queues not read: %s", mask_text(f"{type(exc).__name__}: {exc}"))
    return sorted(names)


def tls_options(url: str) -> dict | None:
    """`broker_use_ssl` for a `rediss://` URL: its `ssl_*` query settings as kombu parses them, or kombu's own
    default without them (no certificate check; kombu warns). None for other URLs."""
    if not url.startswith("rediss://"):
        return None

    return parse_url(url).get("ssl") or {"ssl_cert_reqs": ssl.CERT_NONE}


def build_flower_app(settings: Config) -> Celery:
    """The app Flower runs on: regen's Celery configuration on `settings.broker`, regen's queues declared."""
    celery = create_app(settings.broker)
    celery.conf.task_queues = [Queue(name) for name in REGEN_QUEUES]
    use_ssl = tls_options(celery.conf.broker_url or "")
    if use_ssl is not None:
        celery.conf.broker_use_ssl = use_ssl
    extend_flower_queue_listing(regen_queue_names)
    for problem in check_versions([FLOWER_QUEUES]):
        log.warning("regen: %s", problem)
    return celery


def __getattr__(name: str) -> Celery:
    """`celery`: the app Celery's command line finds here (`celery -A app.ops.flower flower`), built on first
    access with this process's settings read from the environment."""
    if name != "celery":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    app = globals()["celery"] = build_flower_app(install(Config.from_env()))
    return app
