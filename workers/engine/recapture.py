"""A sample's states captured again on the engine that made them, and compared with what is stored.

The core of the capture check (workers.shard.capture_check says which samples and why) and of the engine's
self-test (workers.engine.self_test): the stored ids go through a prefill-only pass (max_tokens=1) in a batch
of their own, and each re-capture is judged against the stored states by app.base.states_compare.compare (the
re-capture is the reference, the stored states the candidate). An item marked `duplicate` is sent twice in the
batch: equal requests must give equal states.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import xxhash

from app.base.manifest import CaptureCheckSettings, RunSettings
from app.base.states_compare import compare
from workers.engine.request import GenRequest, GenResult

PREFILL_ONLY = {"temperature": 1.0, "max_tokens": 1, "seed": 0}


@dataclass
class Pending:
    """A sample to re-capture: its stored ids and the states the worker stores for them (`[T, L, H]` bf16 bits)."""

    position: int  # the caller's index of the sample (its record's)
    sample_id: str
    ids: list[int]
    stored: np.ndarray
    duplicate: bool = False  # also send it twice: equal requests must give equal states


@dataclass(frozen=True)
class CheckOutcome:
    """One sample's verdict: the comparison's figures, and which test spoke (`recapture` or `duplicate`)."""

    position: int
    sample_id: str
    ok: bool
    check: str
    line: str
    layer: int | None
    token: int | None
    error: float
    bound: float

    def as_record(self) -> dict:
        """What the record carries (`capture_check`)."""
        return {"ok": self.ok, "check": self.check, "problem": None if self.ok else self.line,
                "layer": self.layer, "token": self.token, "error": _finite(self.error), "bound": self.bound}


def recheck(engine, items: list[Pending], layers: list[int]) -> list[CheckOutcome]:
    """Re-capture `items` in one prefill-only batch on `engine` and compare each with what is stored (see the
    module); one outcome per item, in order. Blocks until the batch is done (other task slots' batches share
    the engine meanwhile)."""
    if not items:
        return []
    requests = []
    for k, item in enumerate(items):
        requests.append(GenRequest(f"check-{k}", list(item.ids), dict(PREFILL_ONLY), capture=True,
                                   include_output_tokens=False))
        if item.duplicate:
            requests.append(GenRequest(f"check-{k}-again", list(item.ids), dict(PREFILL_ONLY), capture=True,
                                       include_output_tokens=False))
    got: dict[str, GenResult] = {}
    engine.run(requests, lambda res: got.__setitem__(res.request_id, res))
    return [_judge(item, got.get(f"check-{k}"), got.get(f"check-{k}-again"), layers)
            for k, item in enumerate(items)]


def _judge(item: Pending, again: GenResult | None, twice: GenResult | None, layers: list[int]) -> CheckOutcome:
    def outcome(ok: bool, check: str, line: str, layer=None, token=None, error=float("inf"), bound=0.0):
        return CheckOutcome(item.position, item.sample_id, ok, check, line, layer, token, error, bound)

    want = np.asarray(item.ids, dtype=np.int64)
    if again is None or again.captured_states is None:
        return outcome(False, "recapture", "the re-capture returned no states")
    n = len(want)
    got_ids = np.asarray(again.captured_token_ids)[:n]
    if got_ids.shape != want.shape or not np.array_equal(got_ids, want):
        return outcome(False, "recapture", f"the re-capture covers other ids ({len(again.captured_token_ids)} "
                                           f"for {n} stored)")
    fresh = again.captured_states[:n]
    verdict = compare(fresh, item.stored, layers)
    if verdict.ok and twice is not None and twice.captured_states is not None:
        same = compare(fresh, twice.captured_states[:n], layers)
        if not same.ok:
            return outcome(False, "duplicate", f"two equal requests in one batch differ: {same.line()}", same.layer,
                           same.token, same.error, same.bound)
    return outcome(verdict.ok, "recapture", verdict.line(), verdict.layer, verdict.token, verdict.error,
                   verdict.bound)


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


# The check's policy and one engine's counts: the engine's own, so a worker process holds them beside it. The
# defaults are the run setting's (app.base.manifest.CaptureCheckSettings), defined there once.
DEFAULT_EVERY = CaptureCheckSettings.every
DEFAULT_FIRST = CaptureCheckSettings.first


@dataclass(frozen=True)
class CheckPolicy:
    """Which samples are re-captured: one in `every` by sample id (0: none by id), and each engine's first `first`."""

    every: int = DEFAULT_EVERY
    first: int = DEFAULT_FIRST

    @classmethod
    def of(cls, settings: dict) -> CheckPolicy:
        """The run's policy from its manifest settings (runs made before the setting existed get the default)."""
        check = RunSettings.view(settings).capture_check
        return cls(int(check.every), int(check.first))

    def by_id(self, sample_id: str) -> bool:
        return self.every > 0 and xxhash.xxh64_intdigest(sample_id.encode()) % self.every == 0


class EngineChecks:
    """What one engine has checked so far (one per worker process, whose engine it is): its first samples are
    always checked; the counts say how much of the engine's time the checks took."""

    def __init__(self):
        self._lock = threading.Lock()
        self.firsts = 0
        self.checked = 0
        self.failed = 0
        self.seconds = 0.0

    def wants(self, sample_id: str, policy: CheckPolicy) -> tuple[bool, bool]:
        """(check this sample, it is one of the engine's first)."""
        with self._lock:
            if self.firsts < policy.first:
                self.firsts += 1
                return True, True
        return policy.by_id(sample_id), False

    def count(self, outcomes: list[CheckOutcome], seconds: float) -> None:
        with self._lock:
            self.checked += len(outcomes)
            self.failed += sum(not o.ok for o in outcomes)
            self.seconds += seconds
