"""TEST ONLY: a fault injector in the capture path, so the tests can show that the capture check
(workers.shard.capture_check) catches each way a capture is known to go wrong.

Never on in production: it runs only where `REGEN_FAULT_INJECTION_FOR_TESTS` names a JSON file `{run id: fault}`,
logs every sample it corrupts, and marks its record `fault_injected_for_tests`. The faults (shift, swap, zero,
foreign, stale) and why the re-capture goes around it: docs/capture.md#the-capture-fault-injector-test-only-workersdoublescapture_faults_for_testspy.
"""

from __future__ import annotations

import functools
import logging
import os
import threading

import numpy as np
import orjson

from app.base.config import current

log = logging.getLogger("regen.faults_for_tests")

FAULTS = ("shift", "swap", "zero", "foreign", "stale")
STALE_ROWS = 16


class CaptureFaultsForTests:
    """The faults the file at `path` asks for, by run; the previous capture (for `foreign` and `stale`)."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._stamp: float | None = None
        self._faults: dict[str, str] = {}
        self._previous: np.ndarray | None = None
        log.error("FAULT INJECTION FOR TESTS is on (REGEN_FAULT_INJECTION_FOR_TESTS=%s): the runs it lists get "
                  "corrupted hidden states on purpose. Never set it outside the tests.", path)

    def fault_for(self, run_id: str) -> str | None:
        with self._lock:
            try:
                stamp = os.stat(self.path).st_mtime_ns
            except FileNotFoundError:
                self._stamp, self._faults = None, {}
                return None
            if stamp != self._stamp:
                with open(self.path, "rb") as fh:
                    faults = orjson.loads(fh.read() or b"{}")
                unknown = sorted(set(faults.values()) - set(FAULTS))
                if unknown:
                    raise ValueError(f"{self.path}: unknown faults {unknown} (known: {', '.join(FAULTS)})")
                self._stamp, self._faults = stamp, faults
            return self._faults.get(run_id)

    def corrupt(self, run_id: str, sample_id: str, states: np.ndarray) -> tuple[np.ndarray, str | None]:
        """(the states to store, the fault applied or None) for one captured sample `[T, L, H]`."""
        fault = self.fault_for(run_id)
        with self._lock:
            previous, self._previous = self._previous, states
        if fault is None:
            return states, None
        out = apply_fault(fault, states, previous)
        if out is None:
            log.error("fault injection for tests: %s cannot be applied to %s (%s rows, %s layers, no earlier "
                      "capture: %s); stored as captured", fault, sample_id, states.shape[0], states.shape[1],
                      previous is None)
            return states, None
        log.error("fault injection for tests: %s applied to %s of run %s", fault, sample_id, run_id)
        return out, fault


def apply_fault(fault: str, states: np.ndarray, previous: np.ndarray | None) -> np.ndarray | None:
    """`states` with `fault` applied (a new array), or None where it cannot be (too few rows or layers, or no
    earlier capture for `foreign`/`stale`)."""
    n_tokens, n_layers = states.shape[0], states.shape[1]
    out = np.array(states, copy=True)
    if fault == "shift":
        if n_tokens < 2:
            return None
        out[:-1] = states[1:]
    elif fault == "swap":
        if n_layers < 2:
            return None
        out[:, 0], out[:, 1] = states[:, 1], states[:, 0]
    elif fault == "zero":
        if n_tokens < 2:
            return None
        out[n_tokens // 4:max(n_tokens // 4 + 1, n_tokens // 2), 0] = 0
    elif fault in ("foreign", "stale"):
        if previous is None or previous.shape[1:] != states.shape[1:] or not len(previous):
            return None
        if fault == "foreign":
            out[:] = previous[np.arange(n_tokens) % len(previous)]
        else:
            start = n_tokens // 2
            rows = np.arange(start, min(n_tokens, start + STALE_ROWS))
            out[rows] = previous[rows % len(previous)]
    else:
        raise ValueError(f"unknown fault {fault!r} (known: {', '.join(FAULTS)})")
    return out


@functools.lru_cache(maxsize=1)
def _injector(path: str) -> CaptureFaultsForTests:
    return CaptureFaultsForTests(path)


def process_injector() -> CaptureFaultsForTests | None:
    """This process's injector, or None (everywhere but the tests: `REGEN_FAULT_INJECTION_FOR_TESTS` unset)."""
    path = current().fault_injection_for_tests
    return _injector(path) if path else None
