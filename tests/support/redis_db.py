"""The tests' Redis: one URL scheme, one db per suite, and the fixtures that hand out emptied dbs.

`REGEN_TEST_REDIS` (default the local server) plus a db per suite: 3 end-to-end, 5 producer, 7 operations,
9 hybrid, 10 `regen run`, 12 speculative (MTP) runs, 13 the dead-host runs, 14 `regen pilot`, 15 never connected.
Two suites never flush each other's keys; pointing `REGEN_TEST_REDIS` at another server
(`redis://127.0.0.1:6380`) moves every suite at once, which lets two checkouts run their tests side by side.
Missing Redis *fails* under CI (env CI set) and skips on a laptop, so
CI can never pass by skipping.
"""

from __future__ import annotations

import os

import pytest

DEFAULT_SERVER = "redis://127.0.0.1:6379"


def redis_url(db: int) -> str:
    """The URL of db `db` on the tests' Redis server."""
    return f"{os.environ.get('REGEN_TEST_REDIS', DEFAULT_SERVER).rstrip('/')}/{db}"


E2E_BROKER = redis_url(3)
PRODUCER_REDIS = redis_url(5)
OPS_BROKER = redis_url(7)
HYBRID_BROKER = redis_url(9)
PILOT_BROKER = redis_url(14)  # `regen pilot`'s runs and the run made with its settings


def redis_or_fail(url: str):
    """A client of `url` that answers a ping; fails the test under CI when none does, skips elsewhere."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.exceptions.ConnectionError:
        if os.environ.get("CI"):
            pytest.fail(f"Redis is not reachable at {url}; CI must provide it (.ci/run starts redis-server)")
        pytest.skip(f"Redis is not reachable at {url}")
    return client


def flushed_redis(url: str):
    """A client of the db at `url`, emptied: a session's worker starts on a queue holding nothing of earlier runs."""
    client = redis_or_fail(url)
    client.flushdb()
    return client


@pytest.fixture(scope="session")
def e2e_redis():
    """The end-to-end suite's db, emptied once for the session's worker."""
    return flushed_redis(E2E_BROKER)


@pytest.fixture(scope="session")
def hybrid_redis():
    """The hybrid worker's db: it never takes the dense worker's shards, nor they its."""
    return flushed_redis(HYBRID_BROKER)


def _flushed_around_the_test(url: str):
    client = flushed_redis(url)
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def producer_redis():
    """The producer suite's db, flushed before and after each test."""
    yield from _flushed_around_the_test(PRODUCER_REDIS)


@pytest.fixture
def redis7():
    """The operations suite's db (7), flushed before and after each test."""
    yield from _flushed_around_the_test(OPS_BROKER)
