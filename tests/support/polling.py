"""Waiting on a condition with a deadline: tests never sleep a fixed time."""

from __future__ import annotations

import time

import pytest


def wait_for(predicate, timeout: float, what: str, interval: float = 0.25):
    """Poll `predicate` until it returns a truthy value or `timeout` passes (then fail, naming `what`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
