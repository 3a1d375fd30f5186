"""The Celery tasks a worker runs, and the rules that make at-least-once delivery safe.

Order inside `generate_shard`, and why:
0. Arguments that cannot be a shard (wrong names or types, ids that could escape the storage root) -> recorded
   in the dead-message list (app/dead_messages.py) and acked; nothing else is touched.
1. Another delivery of the same shard already runs in this process -> this one starts no attempt
   (workers/inflight.py: a different message is acked, the running one covers the shard; the same message,
   restored by the visibility timeout, is deferred with Celery's retry).
2. Completion marker exists -> return at once (redelivery, a re-run, or a duplicate publish).
3. Dead-lettered -> return (the shard failed too often; `regen status` shows why, `regen retry-dead` re-sends).
4. Run paused -> drop the message (ack, no requeue); `regen resume-run` re-sends every shard without a
   marker, so nothing is lost and paused shards do not bounce through Redis.
5. The run is not on storage -> a few retries with backoff (storage mounted late), then recorded in the
   dead-message list and acked, instead of retrying forever without an attempt record.
6. Manifest mismatch (other model, layers or capture mode) -> refused, the error recorded as an attempt.
7. Record this attempt on storage; at `max_attempts` failures of its own, or `max_crashes` processes that died
   holding it, the shard is dead-lettered with every attempt (workers/shard_output.record_attempt).
8. Generate, write outputs under attempt-specific names, create the completion marker exclusively.
9. An engine that died: re-publish the shard, then exit the process *without* acking; the supervisor
   restarts the worker (a new engine), and Redis' copy of the message is a harmless duplicate.
Other failures (storage errors, bugs) are recorded on the attempt and retried with Celery's retry machinery
(exponential backoff); the attempt count on storage, not Celery's retry count, decides the dead letter.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time

from celery import Task
from celery.exceptions import Reject

from app import dead_messages
from app.celery_app import CAPTURE_TASK, GENERATE_TASK
from app.errors import EngineDead, EngineLost, InvalidId, InvalidTask, ManifestMismatch, PermanentError
from app.quality import StubWindow, is_stub
from app.storage import RunStore, Storage
from workers.context import WorkerContext
from workers.inflight import Claim, InFlight
from workers.shard_output import (
    dead_letter,
    hidden_file_stream,
    new_attempt_id,
    publish_shard,
    record_attempt,
    record_attempt_end,
    record_attempt_error,
)

log = logging.getLogger("regen.tasks")
RETRYABLE = (OSError, TimeoutError)
DEFER_SECONDS = 30  # a copy of a shard this process runs (same message) is looked at again this much later


def missing_run_retries() -> int:
    """Retries (5, 10, 20 ... s apart) of a task whose run is not on storage (`REGEN_MISSING_RUN_RETRIES`,
    default 5, about 2.5 minutes in all): long enough for a late NFS mount, not forever."""
    try:
        return max(0, int(os.environ.get("REGEN_MISSING_RUN_RETRIES") or 5))
    except ValueError:
        return 5


def _backoff(retries: int) -> int:
    """5, 10, 20 ... 300 s: long enough for an NFS server or a full disk to be fixed between attempts."""
    return min(300, 5 * 2**retries)


def check_manifest(ctx: WorkerContext, manifest: dict, stage: str) -> None:
    settings = manifest["settings"]
    problems = []
    if settings["model"]["fingerprint"] != ctx.model.fingerprint:
        problems.append(f"model fingerprint {settings['model']['fingerprint']} != loaded {ctx.model.fingerprint} "
                        f"({ctx.model.path})")
    needs_capture = settings["capture_mode"] == "inline" if stage == "generate" else True
    if needs_capture:
        want = settings["layers"]["vllm_ids"]
        have = list(ctx.engine.options.capture_layers or [])
        if want != have:
            problems.append(f"capture layers (vLLM ids) {want} != engine's {have}")
    if problems:
        raise ManifestMismatch(f"run {manifest['run_id']}: worker {ctx.worker_name} refuses shard: "
                               + "; ".join(problems))


def _store(ctx: WorkerContext, storage_url: str, run_id: str) -> RunStore:
    return RunStore(Storage(ctx.config.storage or storage_url), run_id)


def _manifest(ctx: WorkerContext, store: RunStore) -> dict:
    key = f"{store.storage.url}|{store.run_id}"
    if key not in ctx.manifests:
        ctx.manifests[key] = store.storage.read_json(store.manifest_path)
    return ctx.manifests[key]


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


def _begin(task: Task, stage: str, ctx: WorkerContext, store: RunStore, shard_id: str, claim: Claim):
    """Steps 2-7 above; returns (manifest, attempt) or None when there is nothing to do."""
    run_id = store.run_id
    key = shard_id if stage == "generate" else f"{shard_id}.capture"
    done = store.is_done(shard_id) if stage == "generate" else store.storage.exists(store.captured_path(shard_id))
    if done:
        log.info("%s/%s: already done, skipping", run_id, shard_id)
        return None
    if store.storage.exists(store.dead_path(key)):
        log.info("%s/%s: dead-lettered, skipping (regen retry-dead %s re-sends it)", run_id, shard_id, run_id)
        return None
    pause = store.pause_state()
    if pause:
        log.warning("%s paused (%s): dropping %s; resume-run re-sends it", run_id, pause.get("reason"), shard_id)
        raise Reject("run paused", requeue=False)
    try:
        manifest = _manifest(ctx, store)
    except FileNotFoundError:
        raise InvalidTask(f"run {run_id} is not on storage {store.storage.url} (no run.json)") from None
    attempt = new_attempt_id()
    stale_after = _visibility_timeout(task.app)
    counted = record_attempt(store, key, attempt, ctx.worker_name, stale_after=stale_after, stage=stage)
    _claims.started(claim, store, attempt)
    limits = ctx.config.max_attempts, ctx.config.max_crashes
    if (counted.failures >= limits[0] or counted.crashes >= limits[1]) \
            and not (stage == "generate" and store.is_done(shard_id)):
        reason = (f"{counted.failures} attempts failed (limit {limits[0]})" if counted.failures >= limits[0] else
                  f"{counted.crashes} worker processes died holding it (limit {limits[1]})")
        with claim.lock:
            record_attempt_end(store, key, attempt, f"not run, dead-lettered: {reason}")
        dead_letter(store, key, f"{reason}: {counted.records - 1} attempts without success")
        log.error("%s/%s dead-lettered: %s", run_id, shard_id, reason)
        return None
    try:
        check_manifest(ctx, manifest, stage)
    except ManifestMismatch as exc:
        with claim.lock:
            record_attempt_error(store, key, attempt, str(exc))
        log.error("%s", exc)
        raise Reject(str(exc), requeue=True) from None
    return manifest, attempt


def _after_records(ctx: WorkerContext, store: RunStore, manifest: dict, records: list[dict]) -> None:
    """Feed the stub window; pause the run when the recent stub-or-empty rate crosses the threshold."""
    q = manifest["settings"].get("quality", {})
    window = ctx.windows.setdefault(store.run_id, StubWindow(int(q.get("pause_window", 256))))
    for r in records:
        if r.get("status") == "ok":
            window.add(is_stub(r["flags"]))
    threshold = float(q.get("pause_stub_rate", 0.2))
    pausing = threshold < 1.0 and window.should_pause(threshold, int(q.get("pause_min_samples", 32)))
    if pausing and not store.pause_state():
        reason = (f"stub-or-empty rate {window.rate:.0%} over the last {len(window.values)} samples on "
                  f"{ctx.worker_name} crossed the threshold {threshold:.0%}")
        store.storage.write_json(store.pause_path, {"reason": reason, "rate": window.rate,
                                                    "window": len(window.values), "by": ctx.worker_name})
        log.error("run %s paused: %s", store.run_id, reason)


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
    """The steps of the module docstring around `work(ctx, store, manifest, attempt) -> result`, for both stages."""
    run_id, storage, shard_id = kwargs["run_id"], kwargs["storage"], kwargs["shard_id"]
    key = shard_id if stage == "generate" else f"{shard_id}.capture"
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
        begun = _begin(task, stage, ctx, store, shard_id, claim)
        if begun is None:
            return "skipped"
        manifest, attempt = begun
        try:
            return work(ctx, store, manifest, attempt)
        except EngineDead as exc:
            with claim.lock:
                record_attempt_error(store, key, attempt, str(exc),
                                     kind="crash" if isinstance(exc, EngineLost) else "error")
            _exit_for_restart(task, kwargs, str(exc))
        except PermanentError as exc:
            with claim.lock:
                record_attempt_error(store, key, attempt, str(exc))
            dead_letter(store, key, str(exc))
            return "dead"
        except Exception as exc:  # storage trouble or a bug: retried; the attempt count dead-letters it
            with claim.lock:
                record_attempt_error(store, key, attempt, f"{type(exc).__name__}: {exc}")
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


def _visibility_timeout(app) -> float:
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

        def work(ctx, store, manifest, attempt):
            from workers.generate import generate_records as run_generation

            inline = manifest["settings"]["capture_mode"] == "inline"
            with hidden_file_stream(store, shard_id, attempt) if inline else contextlib.nullcontext() as stream:
                records, summary = run_generation(ctx, manifest, run_id, shard_id, samples, stream)
            summary["task_started"] = round(task_started, 4)
            t_pub = time.time()
            level = int(manifest["settings"].get("compression_level", 3))
            won = publish_shard(store, shard_id, attempt, records, stream.written if inline else None, summary,
                                level=level, stale_after=_visibility_timeout(self.app))
            log.info("%s/%s timings: begin %.1f ms, engine-end->publish %.1f ms, publish %.1f ms", run_id,
                     shard_id, (summary["engine_started"] - task_started) * 1000,
                     (t_pub - summary["engine_finished"]) * 1000, (time.time() - t_pub) * 1000)
            if manifest["settings"]["capture_mode"] == "staged" and won:
                self.app.send_task(CAPTURE_TASK, kwargs={"run_id": run_id, "storage": storage, "shard_id": shard_id},
                                   queue=manifest["settings"].get("capture_queue", "regen.capture"))
            _after_records(ctx, store, manifest, records)
            return "done" if won else "duplicate"

        kwargs = {"run_id": run_id, "storage": storage, "shard_id": shard_id, "samples": samples}
        return _run_attempt(self, "generate", kwargs, work)

    @celery.task(name=CAPTURE_TASK, bind=True, acks_late=True, max_retries=None, base=GuardedTask)
    def capture_shard(self, run_id: str, storage: str, shard_id: str):
        def work(ctx, store, manifest, attempt):
            from workers.capture_stage import capture_records as run_capture

            return "done" if run_capture(ctx, store, manifest, shard_id, attempt) else "duplicate"

        return _run_attempt(self, "capture", {"run_id": run_id, "storage": storage, "shard_id": shard_id}, work)
