"""A skip fails under CI and stays a skip elsewhere (tests/support/ci_skips.py), checked on a real inner run."""

from __future__ import annotations

import pytest

from tests.support.paths import REPO

pytest_plugins = ["pytester"]

SKIPPING = """
import pytest

def test_needs_a_missing_part():
    pytest.skip("no openssl here")

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False
"""


@pytest.mark.parametrize(("ci", "outcomes"), [("true", {"failed": 1, "xfailed": 1}),
                                                (None, {"skipped": 1, "xfailed": 1})])
def test_a_skip_fails_only_under_ci(pytester, monkeypatch, ci, outcomes):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the inner run imports the plugin from this checkout
    pytester.makepyfile(SKIPPING)
    result = pytester.runpytest_subprocess("-p", "tests.support.ci_skips", "-p", "no:cacheprovider")
    result.assert_outcomes(**outcomes)
    if ci:
        result.stdout.fnmatch_lines(["*skipped under CI, where every test must run: *no openssl here*"])
