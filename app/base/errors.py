"""One exception tree for the whole project, and what a worker does with each kind of failure.

`RegenError` and its children carry a one-line, user-facing message that the CLI prints without a traceback;
`RetryableError` (a later attempt may pass) and `PermanentError` (repeats on every attempt) tell the worker
what to do. `classify(exc)` is the one place a failure's class decides that, for regen's errors and for the
ones that are not regen's (`OSError`/`TimeoutError` transient, anything else unexpected).
The tree and the rules: docs/faults.md#error-classes-and-what-a-worker-does-with-each.
"""

from __future__ import annotations

from enum import StrEnum


class RegenError(Exception):
    """Base of every error regen raises on purpose; its message is shown to the user as one line."""


class ConfigError(RegenError):
    """A setting, flag or environment value is invalid."""


class InputError(RegenError):
    """An input file cannot be read at all (missing, unreadable, unknown format)."""


class ManifestMismatch(RegenError):
    """A run is reopened, or a shard is served, with settings that differ from the run manifest."""


class RetryableError(RegenError):
    """A transient failure: the task may be retried (storage I/O, broker connection)."""


class PermanentError(RegenError):
    """A failure that will repeat on every attempt: a worker dead-letters the shard at once."""


class InvalidId(PermanentError):
    """A run or shard id (or a storage path component) that could escape the storage root or is otherwise
    malformed; a task message naming one cannot be a shard and is set aside."""


class EngineDead(RetryableError):
    """The inference engine died; the worker process must exit without acking so the shard is redelivered."""


class EngineLost(EngineDead):
    """The engine's process vanished (a signal, the OOM killer) without an error of its own: a crash of the
    machine around a shard, counted as such (app.base.ledger.record_attempt), not as the shard's failure."""


class InvalidTask(RetryableError):
    """A task message whose arguments cannot be a shard of a run (wrong names or types, a run that is not on
    storage): recorded in the dead-message list, never retried forever."""


class Failure(StrEnum):
    """What a worker does with a failed delivery, by the failure's class (`classify`)."""

    RESTART = "restart"  # the engine died: re-publish the shard, exit for a fresh engine
    SET_ASIDE = "set-aside"  # the message cannot name a shard: recorded in the dead-message list, acked
    DEAD_LETTER = "dead-letter"  # it repeats on every attempt: the shard is dead-lettered at once
    RETRY_A_FEW = "retry-a-few"  # the run is not on storage yet: a few retries, then set aside
    RETRY = "retry"  # transient: retried with backoff, the attempt count bounds it
    UNEXPECTED = "unexpected"  # a bug: retried within an attempt (bounded), Celery's failure before one


TRANSIENT = (RetryableError, OSError, TimeoutError)


def classify(exc: BaseException) -> Failure:
    """The one answer to "what does a worker do with this failure", from its class alone (most specific first)."""
    if isinstance(exc, EngineDead):
        return Failure.RESTART
    if isinstance(exc, InvalidId):
        return Failure.SET_ASIDE
    if isinstance(exc, PermanentError):
        return Failure.DEAD_LETTER
    if isinstance(exc, InvalidTask):
        return Failure.RETRY_A_FEW
    if isinstance(exc, TRANSIENT):
        return Failure.RETRY
    return Failure.UNEXPECTED
