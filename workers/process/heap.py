"""Keeping Python's full garbage collections short in the long-lived worker process.

The worker's Celery process holds a large start-up heap (torch, transformers, Celery, the tokenizer) that
every full collection walks with the GIL held, stopping every task slot and the delivery thread while the
engine runs dry. `gc.freeze()` after a collection moves it out of the collections' way, as vLLM does in its
engine core; objects created later are collected as before. Measurements:
docs/workers.md#the-heap-freeze-in-detail.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze what is left; returns how many objects are now frozen.

    Called once the process's long-lived state exists: engine built and self-tested, consumer started."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
