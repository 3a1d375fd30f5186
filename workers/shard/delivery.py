"""One delivery of a shard, around its work: the rules that make at-least-once delivery safe.

The tasks (workers.shard.tasks) hand their work to `run_delivery`, which runs these steps in order:
0. Arguments that cannot be a shard (wrong names or types, ids that could escape the storage root) -> recorded
   in the dead-message list (app.dead_messages) and acked; nothing else is touched.
1. The engine already died (another slot saw it) -> the shard is re-published, the process exits for a restart.
2. Another delivery of the same shard already runs in this process -> this one starts no attempt
   (workers.process.inflight: a different message is acked, the running one covers the shard; the same
   message, restored by the visibility timeout, is deferred with Celery's retry).
3. The guards, in order (task_guards.run_guards, each step testable alone): skip done, skip dead, drop when
   paused (ack, no requeue: `regen resume-run` re-sends), require the run (not on storage -> a few retries with
   backoff, then recorded in the dead-message list and acked), count the attempt (dead-letter past
   `max_attempts` failures of its own or `max_crashes` processes that died holding it), check the manifest
   (another model or layers -> the error recorded on the attempt, rejected with requeue).
4. The work: generate or capture, write outputs under attempt-specific names, create the completion marker
   exclusively.
5. A failure is settled by the retry policy (workers.shard.retry_policy: the failure's class, the backoff, the
   limits, in one module): inside the attempt, `settle_failure` records it on storage, then an engine that died -> re-publish the shard and exit the
   process *without* acking (the supervisor restarts the worker with a new engine; Redis' copy of the message
   is a harmless duplicate); a PermanentError -> dead-lettered at once; anything else (storage errors, bugs) ->
   retried with Celery's retry machinery (exponential backoff), the attempt count on storage, not Celery's
   retry count, deciding the dead letter. Before an attempt exists: an InvalidId -> set aside; a run not on
   storage -> a few retries, then set aside; a transient error (OSError, TimeoutError, RetryableError) ->
   retried; anything else -> Celery records the task's failure (nothing would bound its retries).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable

import orjson
from celery import Task

from app import dead_messages
from app.errors import Failure, classify
from app.ledger import stage_key
from app.settings import DEFAULT_VISIBILITY_TIMEOUT
from app.storage import RunStore, Storage
from workers.process.context import WorkerContext
from workers.process.inflight import InFlight
from workers.shard.retry_policy import Action, backoff, before_attempt, settle_failure
from workers.shard.task_guards import Delivery, Worker, run_guards

log = logging.getLogger("regen.tasks")
DEFER_SECONDS = 30  # a copy of a shard this process runs (same message) is looked at again this much later

Work = Callable[[WorkerContext, Delivery], str]  # a stage's work on a delivery that passed its guards -> result


def visibility_timeout(app) -> float:
    """The broker's visibility timeout: a killed attempt's shard is redelivered no sooner."""
    options = app.conf.broker_transport_options or {}
    return float(options.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT))


class Running:
    """Counts running tasks, so a dying process can let the other slots re-publish their shards first."""

    def __init__(self):
        self.cond = threading.Condition()
        self.count = 0

    def add(self) -> None:
        with self.cond:
            self.count += 1

    def release_one(self) -> None:
        with self.cond:
            self.count = max(0, self.count - 1)
            self.cond.notify_all()

    def wait_empty(self, timeout: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.count == 0, timeout=timeout)


_running = Running()
_claims = InFlight()
_dying = threading.Lock()


def holds_no_shard() -> bool:
    """Whether this process runs no shard now."""
    return not _claims.held()


def shards_held() -> int:
    """How many shards this process runs now (workers.process.dead_holder_watch checks while it has a free
    task slot)."""
    return _claims.held()


def exit_for_restart(task: Task, kwargs: dict, reason: str) -> None:
    """Re-publish the shard so it is not stuck until the visibility timeout, then die without acking.

    Every task slot sees the dead engine; each re-publishes its own shard first, and the process exits once
    no other slot is still re-publishing (or after 10 s).
    """
    queue = (task.request.delivery_info or {}).get("routing_key") or "regen"
    try:
        task.app.send_task(task.name, kwargs=kwargs, queue=queue)
    finally:
        log.error("%s; exiting so the supervisor restarts this worker", reason)
        _running.release_one()
        _running.wait_empty(10)
        with _dying:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(75)


def set_aside(task: Task, reason: str, kwargs: dict) -> str:
    """Record a task that cannot be run in the dead-message list; the message is acked (the caller returns)."""
    queue = (task.request.delivery_info or {}).get("routing_key")
    shown = {k: (f"<{len(v)} samples>" if k == "samples" and isinstance(v, list) else v) for k, v in kwargs.items()}
    dead_messages.record(task.app.conf.broker_url, queue, f"{task.name}: {reason}",
                         orjson.dumps(shown, default=repr), task=task.name, task_id=task.request.id)
    return "invalid"


def _delivery_tag(task: Task) -> str | None:
    return (getattr(task.request, "properties", None) or {}).get("delivery_tag")


def run_delivery(task: Task, stage: str, kwargs: dict, work: Work) -> str:
    """The steps of the module docstring around `work(ctx, delivery) -> result`, for both stages."""
    run_id, storage, shard_id = kwargs["run_id"], kwargs["storage"], kwargs["shard_id"]
    key = stage_key(shard_id, stage)
    _running.add()
    claim = None
    try:
        ctx = WorkerContext.get()
        dead = ctx.engine.dead
        if dead:  # another slot saw the engine die and this worker is on its way out: no attempt of this shard
            # here, which would only fail and count against it (a free slot takes a re-published shard at once)
            exit_for_restart(task, kwargs, f"{dead}; {shard_id} not started")
        store = RunStore(Storage(ctx.config.storage or storage), run_id)
        tag = _delivery_tag(task)
        claim, holder = _claims.claim((store.storage.url, run_id, key), tag)
        if claim is None:
            if tag is not None and holder.tag == tag:  # this very message, restored while it runs: not acked
                log.info("%s/%s: its message came back while it runs here; deferred %ds", run_id, key, DEFER_SECONDS)
                raise task.retry(countdown=DEFER_SECONDS)
            log.info("%s/%s: another copy of it runs in this process; this copy is dropped", run_id, key)
            return "held"
        delivery = Delivery(store, shard_id, stage, Worker.of(ctx), visibility_timeout(task.app), _claims, claim,
                            ctx.manifests, ctx.windows)
        stopped = run_guards(delivery)
        if stopped is not None:
            return str(stopped)
        try:
            return work(ctx, delivery)
        except Exception as exc:
            then = settle_failure(delivery, exc)
            if then is Action.RESTART:
                exit_for_restart(task, kwargs, str(exc))
            if then is Action.DEAD:
                return "dead"
            raise task.retry(exc=exc, countdown=backoff(task.request.retries)) from exc
    except Exception as exc:  # before the attempt began (the attempt's own failures were settled above)
        then = before_attempt(exc, task.request.retries)
        if then is Action.SET_ASIDE:
            retried = task.request.retries
            return set_aside(task, f"{exc} after {retried} retries" if classify(exc) is Failure.RETRY_A_FEW
                             else str(exc), kwargs)
        if then is Action.RETRY:
            if classify(exc) is Failure.RETRY_A_FEW:
                log.warning("%s; retrying in %ds", exc, backoff(task.request.retries))
                raise task.retry(exc=exc, countdown=backoff(task.request.retries)) from None
            raise task.retry(exc=exc, countdown=backoff(task.request.retries)) from exc  # storage trouble
        raise  # Celery's own Retry and Reject, and what nothing would bound: Celery records the failure
    finally:
        if claim is not None:
            _claims.release(claim)
        _running.release_one()


def _argument_problem(arguments: dict) -> str | None:
    for name in ("run_id", "storage", "shard_id"):
        if not isinstance(arguments.get(name), str) or not arguments[name]:
            return f"{name} must be a non-empty string, not {type(arguments.get(name)).__name__}"
    samples = arguments.get("samples", [])
    if not isinstance(samples, list) or not all(isinstance(x, dict) for x in samples):
        return "samples must be a list of objects"
    return None


class GuardedTask(Task):
    """A task whose message's arguments are checked before it runs: a message that cannot be this task's call
    (unknown or missing arguments, wrong types) is recorded in the dead-message list and acked, instead of
    failing in Celery's tracer without a trace anyone reads."""

    def __call__(self, *args, **kwargs):
        try:
            bound = inspect.signature(self.run).bind(*args, **kwargs)
        except TypeError as exc:
            return set_aside(self, f"arguments do not fit: {exc}", kwargs)
        problem = _argument_problem(bound.arguments)
        if problem:
            return set_aside(self, problem, kwargs)
        return super().__call__(*args, **kwargs)
