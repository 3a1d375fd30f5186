"""One exception tree for the whole project.

`RegenError` and its children carry a one-line, user-facing message; the CLI prints it and exits non-zero
without a traceback. Retryable failures (storage hiccups, a broker that went away) are kept apart from
permanent ones (bad input, a shard that does not belong to the loaded model) so the worker can decide between
Celery's retry machinery and dead-lettering.
"""


class RegenError(Exception):
    """Base of every error regen raises on purpose; its message is shown to the user as one line."""


class ConfigError(RegenError):
    """A setting, flag or environment value is invalid."""


class InputError(RegenError):
    """An input file cannot be read at all (missing, unreadable, unknown format)."""


class ManifestMismatch(RegenError):
    """A run is reopened, or a shard is served, with settings that differ from the run manifest."""


class InvalidId(RegenError):
    """A run or shard id that could escape the storage root or is otherwise malformed."""


class RetryableError(RegenError):
    """A transient failure: the task may be retried (storage I/O, broker connection)."""


class PermanentError(RegenError):
    """A failure that will repeat on every attempt: the shard is dead-lettered at once."""


class EngineDead(RegenError):
    """The inference engine died; the worker process must exit without acking so the shard is redelivered."""


class EngineLost(EngineDead):
    """The engine's process vanished (a signal, the OOM killer) without an error of its own: a crash of the
    machine around a shard, counted as such (app/ledger.record_attempt), not as the shard's failure."""


class InvalidTask(RegenError):
    """A task message whose arguments cannot be a shard of a run (wrong names or types, a run that is not on
    storage): recorded in the dead-message list, never retried forever."""
