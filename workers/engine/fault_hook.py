"""The capture path's one hook for the test-only fault injector (workers.doubles.capture_faults_for_tests).

Generation, staged capture, the engine's self-test and the worker's start ask here; the injector is on only where
`REGEN_FAULT_INJECTION_FOR_TESTS` names a file (the tests' session worker), and this module is the one place the
product imports it (tests/test_layout.py holds the fence).
"""

from __future__ import annotations

from workers.doubles.capture_faults_for_tests import CaptureFaultsForTests, process_injector


def capture_faults() -> CaptureFaultsForTests | None:
    """This process's fault injector, or None (everywhere but the tests)."""
    return process_injector()
