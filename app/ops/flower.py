"""The Celery app Flower runs on (`celery -A app.ops.flower flower`), so that Flower lists regen's queues.

Why Flower needs its own app module:

- Plain `celery flower` (the broker from `CELERY_BROKER_URL`) has Celery's default app, whose default queue is
  `celery`: its Broker page and `/api/queues/length` listed one queue, `celery`, with 0 messages, while
  shards waited in `regen`.
- `celery -A workers.celery_worker flower` answered "'redis' broker is not supported": the worker's app runs on
  the guarded transport (workers.process.message_guard, `broker_transport` given as a class path), and kombu's
  `Connection.as_uri()` then starts the URL with that class path instead of `redis://`; Flower picks its broker
  client by that URL's scheme (flower/utils/broker.py, `Broker`) and finds none. Flower does not consume tasks,
  so it needs neither the guard nor the worker's tasks and signals: this app is `create_app` on the same
  settings (app.celery_app), plus the queues below.
- Flower 2.2 lists the queues the workers it knows consume (their `active_queues`) or, while it knows none, the
  app's default queue and `task_queues` (`BaseHandler.get_active_queue_names`). A backlog on a queue no live
  worker consumes (`regen.capture` before a staged worker starts, a run produced with `--queue team-b`) would
  not be listed. Flower has no option for more queues; its `--broker-api` is RabbitMQ's management API and is
  used only on an `amqp` broker.

So `build_flower_app` extends Flower's list (app.library_patches.extend_flower_queue_listing) with regen's two queues and every task queue the broker itself
has recorded (`task_queue_names`): kombu's Redis transport adds a binding to the set `_kombu.binding.<exchange>`
each time a queue is declared, by a producer that publishes to it or by a worker that consumes it, and Celery
binds each task queue to an exchange of its own name. Reading the broker rather than the runs' manifests on
storage keeps Flower storage-free (its container mounts none) and sees a queue the moment a producer has
published to it. A queue stays listed (at 0) until its binding set is deleted (`redis-cli DEL
_kombu.binding.NAME`).

The broker URL comes from regen's settings (`REGEN_BROKER_URL`, app.settings); Celery lets
`CELERY_BROKER_URL` win where it is set. A `rediss://` URL's `ssl_*` query settings become `broker_use_ssl`,
which Flower's Redis client needs for TLS.
"""

from __future__ import annotations

import logging
import ssl

from celery import Celery
from kombu import Queue
from kombu.transport.redis import Channel
from kombu.utils.url import parse_url

from app.celery_app import create_app, redis_client
from app.library_patches import FLOWER_QUEUES, check_versions, extend_flower_queue_listing
from app.settings import DEFAULT_CAPTURE_QUEUE, DEFAULT_QUEUE, Settings, install, mask_text

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


def build_flower_app(settings: Settings) -> Celery:
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
    app = globals()["celery"] = build_flower_app(install(Settings.from_env()))
    return app
