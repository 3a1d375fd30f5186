"""Keeping Python's full garbage collections short in the long-lived worker process.

The Celery process of a worker imports torch, transformers and Celery and holds the tokenizer (and, with the
engine in the same process, vLLM and the model): ~400,000 objects or more that live as long as the process.
CPython's oldest-generation collection walks all of them, and it runs whenever enough objects have been promoted
since the last one (a quarter of the long-lived heap: every few dozen shards of the tiny model, whose records and
results outlive a young collection while the shard runs). One such collection took ~200 ms of CPU, holding the
GIL, so every task slot, encoder and the delivery thread stopped for it; on the CPU those threads run at a low
priority (workers.engine.scheduling), and one collection stopped them for 1.25 s of wall time: no shard was started
or handed to the engine meanwhile, and the engine stood idle 215 ms between two shards (bench/bench_fleet.py,
a worker without the freeze beside one with it, 12 rounds: 215 ms against at most 28 ms; in earlier runs 226 and
238 ms, once in every few hundred gaps). Frozen, a full collection there takes ~1-2 ms.

`gc.freeze()` moves every object alive at that moment into a permanent generation that collections skip, after a
collection has removed the start-up garbage. vLLM does the same in its engine core (`freeze_gc_heap` at the end
of `EngineCore.__init__`), which covers the engine host's process (workers.engine.process; a collection there
right after start-up found nothing left to walk) and a GPU engine core's, but not the process that drives the
engine. Objects created later (records, results, shard buffers) are still collected as before.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze what is left; returns how many objects are now frozen.

    Called once the process's long-lived state exists: engine built and self-tested, consumer started."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
