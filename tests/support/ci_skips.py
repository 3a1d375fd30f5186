"""Under CI (the `CI` variable set, as `.ci/run` sets it) a skipped test fails.

A few tests skip on a laptop that lacks a part (Redis, vLLM, openssl, a TLS-built redis-server, root for a tmpfs
mount; the README lists them). CI installs or starts every one of them, so a skip there means a part went
missing, and CI must never pass by not running a test.
"""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, where every test must run: {reason}"
