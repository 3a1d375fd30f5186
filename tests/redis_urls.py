"""One scheme for the tests' Redis URLs: `REGEN_TEST_REDIS` (default the local server) plus a db per suite.

Each suite keeps its own db (3 end-to-end, 5 producer, 7 operations, 15 never connected), so two suites never
flush each other's keys; pointing `REGEN_TEST_REDIS` at another server (`redis://127.0.0.1:6380`) moves every
suite at once, which lets two checkouts run their tests side by side.
"""

from __future__ import annotations

import os

DEFAULT_SERVER = "redis://127.0.0.1:6379"


def redis_url(db: int) -> str:
    """The URL of db `db` on the tests' Redis server."""
    return f"{os.environ.get('REGEN_TEST_REDIS', DEFAULT_SERVER).rstrip('/')}/{db}"
