"""Which worker threads yield to the engine: the choice from device and environment, and the real syscall."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from app.base.errors import ConfigError
from workers.engine.scheduling import (
    BATCH,
    BATCH_NICE,
    ENV,
    IDLE,
    lower_priority,
    name_thread,
    side_threads_policy,
)


def test_side_threads_yield_on_the_cpu_only_unless_told(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert side_threads_policy("cpu") == BATCH
    assert side_threads_policy("cuda") is None  # busy engine-core processes there could starve low-priority threads
    monkeypatch.setenv(ENV, "normal")
    assert side_threads_policy("cpu") is None
    monkeypatch.setenv(ENV, " IDLE ")
    assert side_threads_policy("cuda") == IDLE
    monkeypatch.setenv(ENV, "batch")
    assert side_threads_policy("cuda") == BATCH
    monkeypatch.setenv(ENV, "low")
    with pytest.raises(ConfigError, match="REGEN_SIDE_THREADS='low'"):
        side_threads_policy("cpu")


@pytest.mark.parametrize(("policy", "linux_policy", "nice"), [(IDLE, os.SCHED_IDLE, 0),
                                                              (BATCH, os.SCHED_BATCH, BATCH_NICE)])
def test_a_thread_moved_to_a_side_policy_has_it_and_its_new_threads_inherit_it(policy, linux_policy, nice):
    seen: dict[str, object] = {}

    def child():
        seen["child"] = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    def side():
        name_thread("regen-test-side")
        seen["name"] = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
        seen["moved"] = lower_priority(policy=policy)
        seen["self"] = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        t = threading.Thread(target=child)
        t.start()
        t.join()

    t = threading.Thread(target=side)
    t.start()
    t.join()
    assert seen == {"name": "regen-test-side", "moved": True, "self": (linux_policy, nice),
                    "child": (linux_policy, nice)}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # only that thread moved, not the test process
