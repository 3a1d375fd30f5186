"""Messages a worker could not use, kept in Redis beside the queues: undecodable bytes, invalid tasks.

Why Redis and not storage: such a message names no run. Why not drop it silently: whoever wrote it must be
found, and `regen status` / `regen metrics` show the count. Keys `regen.dead-messages` (a capped list) and
`regen.dead-messages.count`; recording never raises. Keys and fields: docs/faults.md#the-dead-message-list.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket

import orjson

from app.base.celery_app import redis_client
from app.base.config import mask_text

LIST_KEY = "regen.dead-messages"
COUNT_KEY = "regen.dead-messages.count"
KEEP = 1000
HEXDUMP_BYTES = 64

log = logging.getLogger("regen.dead_messages")


def hexdump(raw: bytes, limit: int = HEXDUMP_BYTES) -> str:
    """The first `limit` bytes as hex pairs, with the total size when there is more."""
    head = raw[:limit].hex(" ")
    return head if len(raw) <= limit else f"{head} ... ({len(raw):,} bytes)"


def _is_redis(url: str | None) -> bool:
    return bool(url) and url.startswith(("redis://", "rediss://", "unix://"))


def record(broker_url: str | None, queue: str | None, reason: str, raw: bytes | str = b"", **extra) -> None:
    """Log the message (its queue, reason and a short hexdump) and keep it in the Redis list; never raises."""
    data = raw.encode("utf-8", "replace") if isinstance(raw, str) else bytes(raw or b"")
    entry = {"at": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"), "queue": queue,
             "reason": mask_text(reason)[:500], "size": len(data), "hexdump": hexdump(data),
             "worker": f"{socket.gethostname()}:{os.getpid()}", **extra}
    log.error("rejected a message from queue %s: %s; first bytes: %s", queue, entry["reason"], entry["hexdump"])
    if not _is_redis(broker_url):
        return
    try:
        client = redis_client(broker_url)
        with client.pipeline(transaction=True) as pipe:
            pipe.lpush(LIST_KEY, orjson.dumps(entry, default=str))
            pipe.ltrim(LIST_KEY, 0, KEEP - 1)
            pipe.incr(COUNT_KEY)
            pipe.execute()
        client.close()
    except Exception as exc:  # the log line above is the record then
        log.warning("could not keep the rejected message in Redis: %s", mask_text(f"{type(exc).__name__}: {exc}"))


def count(broker_url: str) -> int | None:
    """Messages ever recorded; None when the broker is not Redis or does not answer."""
    if not _is_redis(broker_url):
        return None
    try:
        client = redis_client(broker_url)
        value = client.get(COUNT_KEY)
        client.close()
    except Exception:
        return None
    return int(value or 0)


def recent(broker_url: str, n: int = 10) -> list[dict]:
    """The newest `n` entries (empty when the broker is not Redis or does not answer)."""
    if not _is_redis(broker_url):
        return []
    try:
        client = redis_client(broker_url)
        items = client.lrange(LIST_KEY, 0, n - 1)
        client.close()
    except Exception:
        return []
    return [orjson.loads(i) for i in items]
