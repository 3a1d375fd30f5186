"""Which worker threads yield to the engine: the choice from device and environment, and the real syscall."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from app.errors import ConfigError
from workers.scheduling import ENV, make_idle, name_thread, side_threads_idle


def test_side_threads_are_idle_on_the_cpu_only_unless_told(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert side_threads_idle("cpu") is True
    assert side_threads_idle("cuda") is False  # busy engine-core processes there could starve idle threads
    monkeypatch.setenv(ENV, "normal")
    assert side_threads_idle("cpu") is False
    monkeypatch.setenv(ENV, " IDLE ")
    assert side_threads_idle("cuda") is True
    monkeypatch.setenv(ENV, "low")
    with pytest.raises(ConfigError, match="REGEN_SIDE_THREADS='low'"):
        side_threads_idle("cpu")


def test_a_thread_moved_to_sched_idle_is_idle_and_its_new_threads_inherit_it():
    seen: dict[str, object] = {}

    def child():
        seen["child"] = os.sched_getscheduler(0)

    def side():
        name_thread("regen-test-side")
        seen["name"] = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
        seen["moved"] = make_idle()
        seen["self"] = os.sched_getscheduler(0)
        t = threading.Thread(target=child)
        t.start()
        t.join()

    t = threading.Thread(target=side)
    t.start()
    t.join()
    assert seen == {"name": "regen-test-side", "moved": True, "self": os.SCHED_IDLE, "child": os.SCHED_IDLE}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # only that thread moved, not the test process
