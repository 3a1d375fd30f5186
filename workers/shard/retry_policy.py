"""What a failed delivery does next, in one place: the failure's class mapped to an action, the backoff
between Celery retries, and the limits that dead-letter a shard.

In the spirit of dramatiq's `Retries` middleware, which keeps its whole policy (which exceptions retry, the
backoff, the retry limit) together: here the class of a failure decides (`app.errors.classify`, most specific
class first), and this module turns that answer into what the delivery does and what storage records. Celery's
own retry count bounds nothing but a run that is not on storage yet: the attempt records on storage (failures
of the shard's own, processes that died holding it) decide the dead letter, so a shard redelivered to another
host counts its earlier attempts there too.

After the attempt began (`settle_failure`, which records the failure on the attempt):
    engine died (EngineDead)       -> RESTART: re-publish the shard, exit for a fresh engine (EngineLost, its
                                      process vanished under a signal, counts as a crash, not as a failure)
    PermanentError, InvalidId      -> DEAD: dead-lettered at once (it repeats on every attempt)
    anything else                  -> RETRY with `backoff`; `max_attempts` failures dead-letter it
Before an attempt exists (`before_attempt`): an InvalidId -> SET_ASIDE (the dead-message list, acked); a run
not on storage -> RETRY up to `missing_run_retries()` times, then SET_ASIDE; a transient error (OSError,
TimeoutError, RetryableError) -> RETRY; anything else -> RAISE (Celery records the task's failure: nothing would
bound its retries).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol

from app import ledger
from app.errors import EngineLost, Failure, classify
from app.settings import current
from app.storage import RunStore

MAX_BACKOFF_S = 300


class Attempt(Protocol):
    """A delivery whose attempt began (task_guards.Delivery after its steps)."""

    store: RunStore
    key: str
    attempt: str | None


class Action(StrEnum):
    """What the delivery does with a failure."""

    RESTART = "restart"
    DEAD = "dead"
    RETRY = "retry"
    SET_ASIDE = "set-aside"
    RAISE = "raise"


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


def settle_failure(d: Attempt, exc: Exception) -> Action:
    """Record why the delivery's attempt failed; return what the task does next (see the module docstring)."""
    failure = classify(exc)
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


def before_attempt(exc: Exception, retries: int) -> Action:
    """What a failure before the delivery's attempt began does, after `retries` Celery retries of the task."""
    failure = classify(exc)
    if failure is Failure.SET_ASIDE:
        return Action.SET_ASIDE
    if failure is Failure.RETRY_A_FEW:
        return Action.RETRY if retries < missing_run_retries() else Action.SET_ASIDE
    if failure is Failure.RETRY:
        return Action.RETRY
    return Action.RAISE
