"""One clock for leases: the broker's Redis `TIME`, which every host of a fleet already reaches.

Why: a lease is written by one host and judged by another, and hosts' clocks drift; judged on the reader's
clock, live attempts would count as dead or dead ones never die. One `TIME` round trip gives this host's
offset from the shared clock for `REFRESH_S` seconds (storage mtimes are not one clock). Without a Redis
broker the local clock is the shared one. Why Redis and not storage: docs/faults.md#one-clock-for-leases.
"""

from __future__ import annotations

import logging
import threading
import time

from app.base.celery_app import redis_client
from app.base.config import current, mask_text

log = logging.getLogger("regen.clock")

REFRESH_S = 60.0  # how long one measured offset serves (clocks drift by milliseconds a minute, not seconds)
RETRY_S = 10.0  # after a failed measurement, how long the last offset serves before asking again
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


class SharedClock:
    """`now()`: this host's `time.time()` corrected by its measured offset from the broker's Redis `TIME`."""

    def __init__(self, url: str | None):
        self.url = url if url and url.startswith(_REDIS_SCHEMES) else None
        self._offset = 0.0
        self._measured = False
        self._due = 0.0
        self._lock = threading.Lock()

    def measure(self) -> float | None:
        """Ask Redis for its time now; return this host's offset from it in seconds (None: no answer)."""
        if self.url is None:
            return None

        try:
            client = redis_client(self.url, timeout=2.0)
            try:
                before = time.time()
                seconds, micros = client.time()
                after = time.time()
            finally:
                client.close()
        except Exception as exc:  # no broker: keep the last offset (or the local clock)
            log.debug("shared clock: no answer from the broker: %s", mask_text(str(exc)))
            return None
        return seconds + micros / 1e6 - (before + after) / 2

    def offset(self) -> float:
        """Seconds to add to this host's clock to read the shared one (0 where there is no shared one)."""
        if self.url is None:
            return 0.0
        with self._lock:
            if time.monotonic() >= self._due:
                measured = self.measure()
                if measured is not None:
                    self._offset, self._measured = measured, True
                self._due = time.monotonic() + (REFRESH_S if measured is not None else RETRY_S)
            return self._offset

    def now(self) -> float:
        return time.time() + self.offset()

    @property
    def shared(self) -> bool:
        """Whether the last reading came from the broker (False: the local clock stands in)."""
        return self._measured


_clocks: dict[str | None, SharedClock] = {}
_clocks_lock = threading.Lock()


def clock(url: str | None = None) -> SharedClock:
    """The process's clock for broker `url` (default: this process's broker setting), made once per URL."""
    url = current().broker.url if url is None else url
    with _clocks_lock:
        if url not in _clocks:
            _clocks[url] = SharedClock(url)
        return _clocks[url]


def shared_now(url: str | None = None) -> float:
    """Now on the fleet's shared clock, as POSIX seconds: what leases are written and judged with."""
    return clock(url).now()
