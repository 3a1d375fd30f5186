"""What every engine a worker holds offers: `Engine`, implemented in this process (workers.engine.in_process)
and in a child process of its own (workers.engine.process).

The worker's code (workers.process.context, engine_watch.py, workers.doubles.bench_task; workers.shard.generate,
capture_stage.py) holds "an engine" and uses only this, so where the engine runs (a GPU worker's, beside vLLM's
own engine core; a CPU worker's, in a process that does nothing else) is decided once, when the worker builds it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from workers.engine.options import EngineOptions
from workers.engine.request import EngineSpan, GenRequest, GenResult


class Engine(Protocol):
    """One vLLM engine per worker process, shared by every task slot; a dead engine stays dead."""

    options: EngineOptions
    tokenizer: Any  # the model's Hugging Face tokenizer (vLLM's own, or one loaded beside the child process)

    @property
    def dead(self) -> str | None:
        """Why the engine died, or None while it runs (the watchdog, workers.process.engine_watch, polls it)."""
        ...

    @property
    def delivery_thread_id(self) -> int | None:
        """The native id of the thread that calls `on_done` (the worker lowers its priority:
        workers.engine.scheduling)."""
        ...

    def run(self, requests: list[GenRequest], on_done: Callable[[GenResult], None]) -> EngineSpan | None:
        """Generate every request (continuous batching) and call `on_done` as each one finishes.

        Blocks until the whole batch is done. Thread-safe: batches from several callers share the engine.
        `on_done` runs on the engine's delivery thread (one call at a time, in finishing order); keep it quick.
        Returns when the engine took the batch and when it finished its last request (None for no requests):
        the gaps between batches' spans are the engine's idle time. Raises `EngineDead` once the engine died.
        """
        ...

    def call(self, fn: Callable, *args) -> Any:
        """Run `fn(llm, *args)` on the engine thread, between steps, once no request is in the engine; return
        its result. `fn` and `args` must pickle (a module-level function): the engine may be in another process."""
        ...

    def self_test(self) -> float:
        """Generate a few tokens, so a broken engine never takes a shard; the seconds it took."""
        ...

    def shutdown(self) -> None:
        """Stop the engine (its threads, its process) and release vLLM."""
        ...
