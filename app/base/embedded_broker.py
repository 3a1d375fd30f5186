"""A broker for one machine when no Redis answers: a private `redis-server`, or kombu's filesystem transport.

`regen run` should work on a fresh machine. A private redis-server (started here, on a free loopback port,
no persistence, `noeviction`, stopped on exit) keeps Redis' real delivery semantics. Where no redis-server
binary exists, kombu's `filesystem://` transport runs tasks too, but it is at-most-once (a crash loses the
in-flight shard until a reconcile re-sends it, docs/measured-facts.md) and polls a folder: fine for one machine only.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time

from app.base.config import DEFAULT_BROKER_URL


def reachable(url: str, timeout: float = 1.0) -> bool:
    if not url.startswith(("redis://", "rediss://")):
        return True
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout).ping()
        return True
    except (redis.exceptions.RedisError, OSError):
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def broker_for_run(url: str | None, workdir: str):
    """Yield (broker URL, description). Use `url` if given or if the default Redis answers, else embed one."""
    if url:
        yield url, "configured broker"
        return
    if reachable(DEFAULT_BROKER_URL):
        yield DEFAULT_BROKER_URL, "local Redis"
        return
    binary = shutil.which("redis-server")
    if binary:
        port = _free_port()
        folder = tempfile.mkdtemp(prefix="regen-redis-", dir=workdir)
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--maxmemory-policy", "noeviction", "--dir", folder],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        embedded = f"redis://127.0.0.1:{port}/0"
        try:
            deadline = time.monotonic() + 10
            while not reachable(embedded, 0.2):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the private redis-server did not start")
                time.sleep(0.05)
            yield embedded, f"private redis-server on port {port}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            shutil.rmtree(folder, ignore_errors=True)
        return
    folder = tempfile.mkdtemp(prefix="regen-broker-", dir=workdir)
    yield f"filesystem://{folder}", "kombu filesystem transport (at-most-once; single machine)"
