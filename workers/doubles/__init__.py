"""Test and benchmark doubles: code that stands in for a part of the product, never used for data.

stand_in.py                  `StandInEngine`: an engine standing in for a GPU (`regen worker --stand-in-engine`)
capture_faults_for_tests.py  TEST ONLY: corrupts listed runs' captures on purpose (REGEN_FAULT_INJECTION_FOR_TESTS)
bench_task.py                the fleet bench's in-worker baseline task (REGEN_BENCH_TASKS=1)

Behind a fence, as dramatiq keeps its StubBroker apart from the brokers: the product reaches each through one plug
point only (tests/test_layout.py, PLUG_POINTS): the stand-in engine through workers.engine.factory, the fault
injector through workers.engine.fault_hook, the bench task through workers.celery_worker.
"""
