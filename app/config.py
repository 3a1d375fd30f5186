"""The broker's settings and the defaults producer, workers and Flower share (the environment is read in
app/settings.py).

The broker URL may carry a password (`redis://:secret@host:6379/0`) or use TLS (`rediss://`); it is passed
through untouched, and every place that prints it uses `mask_url` so the password never reaches a log line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_QUEUE = "regen"
DEFAULT_CAPTURE_QUEUE = "regen.capture"
# Samples per shard (one Celery message): `regen produce --shard-size`; workers size their task slots by it.
DEFAULT_SHARD_SIZE = 64
# Redis re-delivers an unacked message after this many seconds *even if it is still running* (docs/measured-facts.md), so it
# must exceed the longest shard. Four hours covers a 64-sample shard of long thinking traces on one GPU.
DEFAULT_VISIBILITY_TIMEOUT = 4 * 3600

_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z0-9+.-]+://)(?P<user>[^:@/]*):(?P<password>[^@/]+)@", re.I)


def mask_url(url: str) -> str:
    """Return `url` with any password replaced by `***` (user names are kept, they help debugging)."""
    return _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:***@", url)


def mask_text(text: str) -> str:
    """Mask every URL password inside a free-form text (an exception message, a log line)."""
    return mask_url(text)


@dataclass(frozen=True)
class BrokerSettings:
    """Everything Celery needs to reach the broker; one instance is shared by producer, workers and Flower."""

    url: str = DEFAULT_BROKER_URL
    visibility_timeout: int = DEFAULT_VISIBILITY_TIMEOUT
    # Seconds between calls of kombu's unacked sweep (None: kombu's 10); kombu 5.7.0 scans on every 10th call
    # only, and then restores every message older than the visibility timeout (docs/configuration.md).
    unacked_restore_interval: int | None = None

    @classmethod
    def from_env(cls, url: str | None = None, visibility_timeout: int | None = None) -> BrokerSettings:
        """This process's broker settings (app/settings.py: `REGEN_BROKER_URL` and the timeouts), with a URL or
        timeout given on a command line winning."""
        from app.settings import current

        return current().broker_for(url, visibility_timeout)

    @property
    def masked_url(self) -> str:
        return mask_url(self.url)

    def __repr__(self) -> str:
        """Masked: these settings ride on the Celery app's configuration (`conf.regen_settings`), which every
        worker hands out as text to `celery inspect conf` and Flower's worker pages."""
        return (f"BrokerSettings(url={self.masked_url!r}, visibility_timeout={self.visibility_timeout}, "
                f"unacked_restore_interval={self.unacked_restore_interval})")
