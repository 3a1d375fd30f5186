"""The CPU engine's own process (workers/engine/process.py): how its failures reach the worker.

A healthy engine host, a SIGKILLed one and a worker SIGKILLed around one are covered with the session's real
worker (tests/workers/test_worker_e2e.py, tests/workers/test_faults.py); here, what the worker sees when the child cannot build
its engine, and the wording of a child's death.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal

import pytest

from app.base.errors import EngineDead
from tests.support.workers import process_gone
from workers.engine.options import EngineOptions
from workers.engine.process import PROCESS_NAME, EngineProcess, exit_status


def test_a_dead_engine_process_is_named_by_its_signal_or_exit_code():
    assert exit_status(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_status(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert exit_status(1) == "exit code 1"
    assert exit_status(None) == "still running"


@pytest.mark.vllm
def test_an_engine_that_cannot_be_built_fails_the_worker_start_with_the_childs_error(tiny_qwen3, tmp_path):
    # The tokenizer loads (in the worker process) but the weights are gone, so vLLM fails in the child: its
    # error, not a hang or a bare EOF, must reach the worker, and the child must be gone afterwards.
    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_qwen3, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(Exception) as caught:  # noqa: PT011 - vLLM's own error type, whichever it is
        EngineProcess(EngineOptions(model=str(broken), capture_layers=None, max_model_len=512,
                                    scratch_dir=str(tmp_path / "scratch")))
    assert not isinstance(caught.value, EngineDead), caught.value  # the build error itself, not "the process exited"
    assert "Cannot find any model weights" in str(caught.value), caught.value  # vLLM's loader, in the child
    assert _engine_hosts() == []  # stopped and reaped, not left behind


def _engine_hosts() -> list[int]:
    """This test process's children that are engine hosts and have not exited."""
    pids = []
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{os.getpid()}/task/{task}/children") as fh:
            pids += [int(p) for p in fh.read().split()]
    named = []
    for pid in pids:
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/comm") as fh:
            if fh.read().strip() == PROCESS_NAME and not process_gone(pid):
                named.append(pid)
    return named
