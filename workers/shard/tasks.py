"""The Celery tasks a worker runs, and the rules that make at-least-once delivery safe.

Order inside `generate_shard` (and `capture_shard`), and why:
0. Arguments that cannot be a shard (wrong names or types, ids that could escape the storage root) -> recorded
   in the dead-message list (app/dead_messages.py) and acked; nothing else is touched.
1. The engine already died (another slot saw it) -> the shard is re-published, the process exits for a restart.
2. Another delivery of the same shard already runs in this process -> this one starts no attempt
   (workers/process/inflight.py: a different message is acked, the running one covers the shard; the same message,
   restored by the visibility timeout, is deferred with Celery's retry).
3. The guards, in order (workers/shard/task_guards.py, each testable alone): skip done, skip dead, drop when paused
   (ack, no requeue: `regen resume-run` re-sends), require the run (not on storage -> a few retries with backoff,
   then recorded in the dead-message list and acked), count the attempt (dead-letter past `max_attempts`
   failures of its own or `max_crashes` processes that died holding it), check the manifest (another model or
   layers -> the error recorded on the attempt, rejected with requeue).
4. Generate, write outputs under attempt-specific names, create the completion marker exclusively; a generated
   shard's records feed the run's stub window (pause on stubs).
5. A failure is settled on storage (`settle_failure`): an engine that died -> re-publish the shard, then exit the
   process *without* acking; the supervisor restarts the worker (a new engine), and Redis' copy of the message
   is a harmless duplicate. A PermanentError -> dead-lettered at once. Other failures (storage errors, bugs) ->
   retried with Celery's retry machinery (exponential backoff); the attempt count on storage, not Celery's
   retry count, decides the dead letter.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time

from celery import Task

from app import dead_messages
from app.celery_app import CAPTURE_TASK, GENERATE_TASK
from app.errors import InvalidId, InvalidTask
from app.ledger import CAPTURE, GENERATE, stage_key
from app.storage import RunStore, Storage
from workers.process.context import WorkerContext
from workers.process.inflight import InFlight
from workers.shard.shard_output import hidden_file_stream, publish_shard
from workers.shard.task_guards import Delivery, Worker, pause_on_stubs, run_guards, settle_failure

log = logging.getLogger("regen.tasks")
RETRYABLE = (OSError, TimeoutError)
DEFER_SECONDS = 30  # a copy of a shard this process runs (same message) is looked at again this much later


def missing_run_retries() -> int:
    """Retries (5, 10, 20 ... s apart) of a task whose run is not on storage (`REGEN_MISSING_RUN_RETRIES`,
    default 5, about 2.5 minutes in all; app/settings.py): long enough for a late NFS mount, not forever."""
    from app.settings import current

    return current().missing_run_retries


def _backoff(retries: int) -> int:
    """5, 10, 20 ... 300 s: long enough for an NFS server or a full disk to be fixed between attempts."""
    return min(300, 5 * 2**retries)


def _store(ctx: WorkerContext, storage_url: str, run_id: str) -> RunStore:
    return RunStore(Storage(ctx.config.storage or storage_url), run_id)


_dying = threading.Lock()


def _exit_for_restart(task: Task, kwargs: dict, reason: str) -> None:
    """Re-publish the shard so it is not stuck until the visibility timeout, then die without acking.

    Every task slot sees the dead engine; each re-publishes its own shard first, and the process exits once
    no other slot is still re-publishing (or after 10 s).
    """
    queue = (task.request.delivery_info or {}).get("routing_key") or "regen"
    try:
        task.app.send_task(task.name, kwargs=kwargs, queue=queue)
    finally:
        log.error("%s; exiting so the supervisor restarts this worker", reason)
        _inflight.release_one()
        _inflight.wait_empty(10)
        with _dying:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(75)


class _Running:
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


_inflight = _Running()
_claims = InFlight()


def holds_no_shard() -> bool:
    """Whether this process runs no shard now (workers/process/dead_holder_watch.py checks only then)."""
    return not _claims.held()


def _delivery_tag(task: Task) -> str | None:
    return (getattr(task.request, "properties", None) or {}).get("delivery_tag")


def _set_aside(task: Task, reason: str, kwargs: dict) -> str:
    """Record a task that cannot be run in the dead-message list; the message is acked (the caller returns)."""
    import orjson

    queue = (task.request.delivery_info or {}).get("routing_key")
    shown = {k: (f"<{len(v)} samples>" if k == "samples" and isinstance(v, list) else v) for k, v in kwargs.items()}
    dead_messages.record(task.app.conf.broker_url, queue, f"{task.name}: {reason}",
                         orjson.dumps(shown, default=repr), task=task.name, task_id=task.request.id)
    return "invalid"


def _run_attempt(task: Task, stage: str, kwargs: dict, work) -> str:
    """The steps of the module docstring around `work(ctx, delivery) -> result`, for both stages."""
    run_id, storage, shard_id = kwargs["run_id"], kwargs["storage"], kwargs["shard_id"]
    key = stage_key(shard_id, stage)
    _inflight.add()
    claim = None
    try:
        ctx = WorkerContext.get()
        dead = ctx.engine.dead
        if dead:  # another slot saw the engine die and this worker is on its way out: no attempt of this shard
            # here, which would only fail and count against it (a free slot takes a re-published shard at once)
            _exit_for_restart(task, kwargs, f"{dead}; {shard_id} not started")
        store = _store(ctx, storage, run_id)
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
            return stopped
        try:
            return work(ctx, delivery)
        except Exception as exc:
            then = settle_failure(delivery, exc)
            if then == "restart":
                _exit_for_restart(task, kwargs, str(exc))
            if then == "dead":
                return "dead"
            raise task.retry(exc=exc, countdown=_backoff(task.request.retries)) from exc
    except InvalidId as exc:
        return _set_aside(task, str(exc), kwargs)
    except InvalidTask as exc:
        if task.request.retries < missing_run_retries():
            log.warning("%s; retrying in %ds", exc, _backoff(task.request.retries))
            raise task.retry(exc=exc, countdown=_backoff(task.request.retries)) from None
        return _set_aside(task, f"{exc} after {task.request.retries} retries", kwargs)
    except RETRYABLE as exc:  # storage trouble before the attempt began
        raise task.retry(exc=exc, countdown=_backoff(task.request.retries)) from exc
    finally:
        if claim is not None:
            _claims.release(claim)
        _inflight.release_one()


def visibility_timeout(app) -> float:
    """The broker's visibility timeout: a killed attempt's shard is redelivered no sooner."""
    from app.config import DEFAULT_VISIBILITY_TIMEOUT

    options = app.conf.broker_transport_options or {}
    return float(options.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT))


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
        import inspect

        try:
            bound = inspect.signature(self.run).bind(*args, **kwargs)
        except TypeError as exc:
            return _set_aside(self, f"arguments do not fit: {exc}", kwargs)
        problem = _argument_problem(bound.arguments)
        if problem:
            return _set_aside(self, problem, kwargs)
        return super().__call__(*args, **kwargs)


def register(celery) -> None:
    """Register the tasks on `celery` (only worker processes import this module)."""

    @celery.task(name=GENERATE_TASK, bind=True, acks_late=True, max_retries=None, base=GuardedTask)
    def generate_shard(self, run_id: str, storage: str, shard_id: str, samples: list[dict]):
        task_started = time.time()

        def work(ctx, delivery):
            from workers.shard.generate import generate_records as run_generation

            store, manifest, attempt = delivery.store, delivery.manifest, delivery.attempt
            inline = manifest["settings"]["capture_mode"] == "inline"
            with hidden_file_stream(store, shard_id, attempt) if inline else contextlib.nullcontext() as stream:
                records, summary = run_generation(ctx, manifest, run_id, shard_id, samples, stream)
            summary["task_started"] = round(task_started, 4)
            t_pub = time.time()
            level = int(manifest["settings"].get("compression_level", 3))
            won = publish_shard(store, shard_id, attempt, records, stream.written if inline else None, summary,
                                level=level, stale_after=visibility_timeout(self.app))
            log.info("%s/%s timings: begin %.1f ms, engine-end->publish %.1f ms, publish %.1f ms", run_id,
                     shard_id, (summary["engine_started"] - task_started) * 1000,
                     (t_pub - summary["engine_finished"]) * 1000, (time.time() - t_pub) * 1000)
            if manifest["settings"]["capture_mode"] == "staged" and won:
                self.app.send_task(CAPTURE_TASK, kwargs={"run_id": run_id, "storage": storage, "shard_id": shard_id},
                                   queue=manifest["settings"].get("capture_queue", "regen.capture"))
            pause_on_stubs(delivery, records)
            return "done" if won else "duplicate"

        kwargs = {"run_id": run_id, "storage": storage, "shard_id": shard_id, "samples": samples}
        return _run_attempt(self, GENERATE, kwargs, work)

    @celery.task(name=CAPTURE_TASK, bind=True, acks_late=True, max_retries=None, base=GuardedTask)
    def capture_shard(self, run_id: str, storage: str, shard_id: str):
        def work(ctx, delivery):
            from workers.shard.capture_stage import capture_records as run_capture

            won = run_capture(ctx, delivery.store, delivery.manifest, shard_id, delivery.attempt)
            return "done" if won else "duplicate"

        return _run_attempt(self, CAPTURE, {"run_id": run_id, "storage": storage, "shard_id": shard_id}, work)
