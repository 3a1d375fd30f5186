"""A message the worker cannot decode or take apart is set aside once, never fatal to the worker.

Why: kombu decodes a message's envelope inside the consumer's event loop, where an exception ends the worker
and its engine must be rebuilt, so anyone who can write to the queue could keep a fleet reloading. This
subclass of kombu's Redis transport checks every popped envelope and records a bad one in the dead-message
list (app.base.dead_messages) instead of delivering it; `Consumer` does the same for bodies Celery cannot use. How,
and the kombu patch it rests on: docs/faults.md#the-message-guard-in-detail.
"""

from __future__ import annotations

import base64
import binascii
import logging

import orjson
from celery.worker.consumer import Consumer as CeleryConsumer
from kombu.transport import redis as kombu_redis

from app.base import dead_messages
from app.base.library_patches import (
    KOMBU_ENVELOPE_LOADS,
    Undecodable,
    check_versions,
    install_tolerant_envelope_loads,
    tolerant_envelope_loads,
)

log = logging.getLogger("regen.message_guard")
BROKER_URL: str | None = None  # where the dead-message list lives (`install` sets it)


def envelope_problem(message) -> str | None:
    """Why kombu could not build a message from this envelope, or None when it can."""
    if isinstance(message, Undecodable):
        return f"not a JSON envelope: {type(message.error).__name__}: {message.error}"
    if not isinstance(message, dict):
        return f"envelope is a JSON {type(message).__name__}, not an object"
    properties = message.get("properties")
    if not isinstance(properties, dict) or "delivery_tag" not in properties:
        return "envelope has no properties.delivery_tag"
    body = message.get("body")
    encoding = properties.get("body_encoding")
    if body and encoding == "base64":
        if not isinstance(body, str | bytes):
            return f"base64 body is a JSON {type(body).__name__}"
        try:
            base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError) as exc:
            return f"body is not valid base64: {exc}"
    elif encoding not in (None, "base64", "utf-8"):
        return f"unknown body_encoding {encoding!r}"
    return None


def _raw_bytes(message) -> bytes:
    if isinstance(message, Undecodable):
        raw = message.raw
        return raw.encode("utf-8", "replace") if isinstance(raw, str) else bytes(raw)
    try:
        return orjson.dumps(message, default=str)
    except TypeError:
        return repr(message).encode()


class Channel(kombu_redis.Channel):
    def _brpop_read(self, **options):
        with tolerant_envelope_loads():
            return super()._brpop_read(**options)

    def _get(self, queue):
        with tolerant_envelope_loads():
            return super()._get(queue)


class Transport(kombu_redis.Transport):
    Channel = Channel

    def _deliver(self, message, queue):
        problem = envelope_problem(message)
        if problem is not None:
            dead_messages.record(BROKER_URL, queue, problem, _raw_bytes(message))
            return
        with tolerant_envelope_loads(False):  # the delivery itself (Celery's consumer) sees kombu's own loads
            super()._deliver(message, queue)


def _queue(message) -> str | None:
    return (getattr(message, "delivery_info", None) or {}).get("routing_key")


def _message_bytes(message) -> bytes:
    body = getattr(message, "body", b"")
    return body if isinstance(body, bytes) else str(body).encode("utf-8", "replace")


class Consumer(CeleryConsumer):
    """Celery's consumer, with every message it cannot use recorded (app.base.dead_messages) and acked."""

    def _set_aside(self, message, reason: str) -> None:
        dead_messages.record(BROKER_URL or self.app.conf.broker_url, _queue(message), reason, _message_bytes(message),
                             task=(message.headers or {}).get("task") if isinstance(message.headers, dict) else None)

    def create_task_handler(self, promise=None):
        handler = super().create_task_handler() if promise is None else super().create_task_handler(promise)
        keep_raising = tuple(self.connection_errors or ()) + tuple(self.channel_errors or ())

        def on_task_received(message):
            try:
                return handler(message)
            except keep_raising:
                raise
            except Exception as exc:  # a body Celery's strategy could not unpack into a task request
                self._set_aside(message, f"not a task message: {type(exc).__name__}: {exc}")
                message.ack()

        return on_task_received

    def on_decode_error(self, message, exc):
        self._set_aside(message, f"body does not decode: {type(exc).__name__}: {exc}")
        message.ack()

    def on_unknown_message(self, body, message):
        self._set_aside(message, "not a task message (no task name)")
        return super().on_unknown_message(body, message)

    def on_unknown_task(self, body, message, exc):
        self._set_aside(message, f"unknown task {exc}")
        return super().on_unknown_task(body, message, exc)

    def on_invalid_task(self, body, message, exc):
        self._set_aside(message, f"invalid task: {exc}")
        return super().on_invalid_task(body, message, exc)


def install(celery) -> bool:
    """Guard `celery`'s worker: the consumer above always; the transport above when the broker is plain Redis
    (True then).

    `rediss://` keeps kombu's own transport: kombu derives its TLS settings from the URL scheme's name, which a
    transport given by class path does not have, so a message that is not JSON there still stops the worker."""
    global BROKER_URL
    url = celery.conf.broker_url or ""
    BROKER_URL = url
    celery.conf.worker_consumer = f"{__name__}:Consumer"
    if not url.startswith(("redis://", "unix://")):
        return False
    for problem in check_versions([KOMBU_ENVELOPE_LOADS]):
        log.warning("%s", problem)
    install_tolerant_envelope_loads()
    celery.conf.broker_transport = f"{__name__}:Transport"
    return True
