"""The retry policy, the last of a delivery's policies (workers.shard.policy): what a failure does next, from
its one classification (`app.base.errors.classify`), with the backoff between Celery retries and the limits that
dead-letter a shard, in one place as dramatiq's `Retries` middleware keeps its own.

The attempt records on storage, not Celery's retry count, decide the dead letter, so a shard redelivered to
another host counts its earlier attempts. Each failure and its verdict: docs/workers.md#the-retry-policy-workersshardretry_policypy.
"""

from __future__ import annotations

import logging
from typing import Protocol

from app.base import ledger
from app.base.config import current
from app.base.errors import EngineLost, Failure, classify
from app.base.storage import RunStore
from workers.shard.policy import Action, Delivery, Policy, Verdict

log = logging.getLogger("regen.tasks")

MAX_BACKOFF_S = 300


class Attempt(Protocol):
    """A delivery whose attempt began (workers.shard.policy.Delivery after its guards)."""

    store: RunStore
    key: str
    attempt: str | None


def backoff(retries: int) -> int:
    """5, 10, 20 ... 300 s: long enough for an NFS server or a full disk to be fixed between attempts."""
    return min(MAX_BACKOFF_S, 5 * 2**retries)


def missing_run_retries() -> int:
    """Retries (5, 10, 20 ... s apart) of a task whose run is not on storage (`REGEN_MISSING_RUN_RETRIES`,
    default 5, about 2.5 minutes in all): long enough for a late NFS mount, not forever."""
    return current().missing_run_retries


def exhausted(counted: ledger.AttemptCount, max_attempts: int, max_crashes: int) -> str | None:
    """Why a shard whose earlier attempts count `counted` is dead-lettered now, or None while it may run: at
    `max_attempts` failures of its own, or `max_crashes` processes that died holding it."""
    if counted.failures >= max_attempts:
        return f"{counted.failures} attempts failed (limit {max_attempts})"
    if counted.crashes >= max_crashes:
        return f"{counted.crashes} worker processes died holding it (limit {max_crashes})"
    return None


def settle_failure(d: Attempt, exc: Exception, failure: Failure | None = None) -> Action:
    """Record why the delivery's attempt failed; return what the task does next (see the module docstring).
    `failure`: the failure's class where the caller has it (`classify(exc)`)."""
    failure = failure or classify(exc)
    if failure is Failure.RESTART:
        kind = "crash" if isinstance(exc, EngineLost) else "error"
        ledger.record_attempt_error(d.store, d.key, d.attempt, str(exc), kind=kind)
        return Action.RESTART
    if failure in (Failure.DEAD_LETTER, Failure.SET_ASIDE):
        ledger.record_attempt_error(d.store, d.key, d.attempt, str(exc))
        ledger.dead_letter(d.store, d.key, str(exc))
        return Action.DEAD
    ledger.record_attempt_error(d.store, d.key, d.attempt, f"{type(exc).__name__}: {exc}")
    return Action.RETRY


def before_work(failure: Failure, retries: int) -> Action:
    """What a failure before the work began does, after `retries` Celery retries of the task."""
    if failure is Failure.SET_ASIDE:
        return Action.SET_ASIDE
    if failure is Failure.RETRY_A_FEW:
        return Action.RETRY if retries < missing_run_retries() else Action.SET_ASIDE
    if failure is Failure.RETRY:
        return Action.RETRY
    return Action.RAISE


class RetryPolicy(Policy):
    """Answers every failure the policies before it left (see the module docstring)."""

    def on_failure(self, d: Delivery, exc: Exception, failure: Failure) -> Verdict:
        if d.working:  # the attempt's own failure: recorded on it
            return Verdict(settle_failure(d, exc, failure), str(exc))
        action = before_work(failure, d.retries)
        if failure is not Failure.RETRY_A_FEW:
            return Verdict(action, str(exc))
        if action is Action.SET_ASIDE:
            return Verdict(action, f"{exc} after {d.retries} retries")
        log.warning("%s; retrying in %ds", exc, backoff(d.retries))
        return Verdict(action, str(exc), chained=False)
