"""What a caller waits on while an engine works for it: a batch of requests (`BatchJob`) or a function to run
between steps (`ExclusiveCall`).

Both engines use them: the in-process engine's thread fills them in as it steps; the engine process's worker
side fills them in from the child's messages. Each ends by setting `finished`, with `error` set if it failed,
so a caller's wait and its error are the same whichever engine it holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from workers.engine.request import EngineSpan, GenRequest, GenResult


def one_by_one(on_done: Callable[[GenResult], None]) -> Callable[[list[GenResult]], None]:
    """A per-result callback as a `BatchJob`'s per-round one."""
    def on_results(results: list[GenResult]) -> None:
        for result in results:
            on_done(result)
    return on_results


class BatchJob:
    """One caller's batch inside the engine: counts results, carries the caller's error."""

    def __init__(self, requests: list[GenRequest], on_results: Callable[[list[GenResult]], None],
                 finish_on_last: bool = True):
        self.requests = requests
        self.on_results = on_results  # takes the results of one delivery round at once (`one_by_one` splits them)
        self.remaining = len(requests)
        # False in an engine process's worker process: the child's "done" message, which carries the engine's
        # span, comes after the last result and ends the batch.
        self.finish_on_last = finish_on_last
        self.started = time.monotonic()
        self.error: BaseException | None = None
        self.finished = threading.Event()
        # The engine's own view (wall clock, so an engine process's times compare with its worker's): when vLLM
        # took the batch's requests, and when its last one finished in the engine. The caller's view ends later,
        # once every result has been handed on, which on a busy CPU host can be well after the engine moved on.
        self.in_engine = len(requests)
        self.span: EngineSpan | None = None

    def deliver(self, result: GenResult) -> None:
        self.deliver_all([result])

    def deliver_all(self, results: list[GenResult]) -> None:
        """Hand on results of this job, in finishing order."""
        if self.error is None:
            try:
                self.on_results(results)
            except Exception as exc:  # the caller's bug fails the caller's batch, not the engine
                self.error = exc
        self.remaining -= len(results)
        if self.remaining <= 0 and self.finish_on_last:
            self.finished.set()

    def fail(self, error: BaseException) -> None:
        self.error = self.error or error
        self.finished.set()


class ExclusiveCall:
    """A function to run on the engine thread once nothing is in flight (`Engine.call`); an engine process's
    caller waits on one too, filled in from the child's answer."""

    def __init__(self, fn: Callable, args: tuple = ()):
        self.fn = fn
        self.args = args
        self.result = None
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def run(self, llm) -> None:
        try:
            self.result = self.fn(llm, *self.args)
        except Exception as exc:  # the caller's error; the engine goes on
            self.error = exc
        self.finished.set()

    def fail(self, error: BaseException) -> None:
        self.error = self.error or error
        self.finished.set()
