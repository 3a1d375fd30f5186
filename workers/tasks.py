"""The Celery tasks a worker runs, and the rules that make at-least-once delivery safe.

Order inside `generate_shard`, and why:
1. Completion marker exists -> return at once (redelivery, a re-run, or a duplicate publish).
2. Dead-lettered -> return (the shard failed too often; `regen status` shows why).
3. Run paused -> drop the message (ack, no requeue); `regen resume-run` re-sends every shard without a
   marker, so nothing is lost and paused shards do not bounce through Redis.
4. Manifest mismatch (other model, layers or capture mode) -> refused, the error recorded as an attempt.
5. Record this attempt on storage; past `max_attempts` the shard is dead-lettered with every error.
6. Generate, write outputs under attempt-specific names, create the completion marker exclusively.
7. An engine that died: re-publish the shard, then exit the process *without* acking; the supervisor
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

from app.celery_app import CAPTURE_TASK, GENERATE_TASK
from app.errors import EngineDead, ManifestMismatch, PermanentError
from app.storage import RunStore, Storage
from workers.context import WorkerContext
from workers.quality import StubWindow, is_stub
from workers.shard_output import (
    dead_letter,
    hidden_file_stream,
    new_attempt_id,
    publish_shard,
    record_attempt,
    record_attempt_error,
)

log = logging.getLogger("regen.tasks")
RETRYABLE = (OSError, TimeoutError)


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


class _InFlight:
    """Counts running tasks, so a dying process can let the other slot re-publish its shard first."""

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


_inflight = _InFlight()


def _begin(task: Task, stage: str, run_id: str, storage: str, shard_id: str):
    """Steps 1-5 above; returns (ctx, store, manifest, attempt) or None when there is nothing to do."""
    ctx = WorkerContext.get()
    store = _store(ctx, storage, run_id)
    key = shard_id if stage == "generate" else f"{shard_id}.capture"
    done = store.is_done(shard_id) if stage == "generate" else store.storage.exists(store.captured_path(shard_id))
    if done:
        log.info("%s/%s: already done, skipping", run_id, shard_id)
        return None
    if store.storage.exists(store.dead_path(key)):
        log.info("%s/%s: dead-lettered, skipping", run_id, shard_id)
        return None
    pause = store.pause_state()
    if pause:
        log.warning("%s paused (%s): dropping %s; resume-run re-sends it", run_id, pause.get("reason"), shard_id)
        raise Reject("run paused", requeue=False)
    manifest = _manifest(ctx, store)
    attempt = new_attempt_id()
    n = record_attempt(store, key, attempt, ctx.worker_name, stale_after=_visibility_timeout(task.app), stage=stage)
    if n > ctx.config.max_attempts and not (stage == "generate" and store.is_done(shard_id)):
        dead_letter(store, key, f"{n - 1} attempts without success")
        log.error("%s/%s dead-lettered after %d attempts", run_id, shard_id, n - 1)
        return None
    try:
        check_manifest(ctx, manifest, stage)
    except ManifestMismatch as exc:
        record_attempt_error(store, key, attempt, str(exc))
        log.error("%s", exc)
        raise Reject(str(exc), requeue=True) from None
    return ctx, store, manifest, attempt


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


def _run_attempt(task: Task, stage: str, kwargs: dict, work) -> str:
    """Steps 1-7 of the module docstring around `work(ctx, store, manifest, attempt) -> result`, for both stages."""
    run_id, storage, shard_id = kwargs["run_id"], kwargs["storage"], kwargs["shard_id"]
    key = shard_id if stage == "generate" else f"{shard_id}.capture"
    _inflight.add()
    try:
        dead = WorkerContext.get().engine.dead
        if dead:  # another slot saw the engine die and this worker is on its way out: no attempt of this shard
            # here, which would only fail and count against it (a free slot takes a re-published shard at once)
            _exit_for_restart(task, kwargs, f"{dead}; {shard_id} not started")
        begun = _begin(task, stage, run_id, storage, shard_id)
        if begun is None:
            return "skipped"
        ctx, store, manifest, attempt = begun
        try:
            return work(ctx, store, manifest, attempt)
        except EngineDead as exc:
            record_attempt_error(store, key, attempt, str(exc))
            _exit_for_restart(task, kwargs, str(exc))
        except PermanentError as exc:
            record_attempt_error(store, key, attempt, str(exc))
            dead_letter(store, key, str(exc))
            return "dead"
        except Exception as exc:  # storage trouble or a bug: retried; the attempt count dead-letters it
            record_attempt_error(store, key, attempt, f"{type(exc).__name__}: {exc}")
            raise task.retry(exc=exc, countdown=_backoff(task.request.retries)) from exc
    except RETRYABLE as exc:  # storage trouble before the attempt began
        raise task.retry(exc=exc, countdown=_backoff(task.request.retries)) from exc
    finally:
        _inflight.release_one()


def _visibility_timeout(app) -> float:
    """The broker's visibility timeout: a killed attempt's shard is redelivered no sooner."""
    from app.config import DEFAULT_VISIBILITY_TIMEOUT

    options = app.conf.broker_transport_options or {}
    return float(options.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT))


def register(celery) -> None:
    """Register the tasks on `celery` (only worker processes import this module)."""

    @celery.task(name=GENERATE_TASK, bind=True, acks_late=True, max_retries=None)
    def generate_shard(self, run_id: str, storage: str, shard_id: str, samples: list[dict]):
        task_started = time.time()

        def work(ctx, store, manifest, attempt):
            from workers.generate import generate_shard as run_generation

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

    @celery.task(name=CAPTURE_TASK, bind=True, acks_late=True, max_retries=None)
    def capture_shard(self, run_id: str, storage: str, shard_id: str):
        def work(ctx, store, manifest, attempt):
            from workers.capture_stage import capture_shard as run_capture

            return "done" if run_capture(ctx, store, manifest, shard_id, attempt) else "duplicate"

        return _run_attempt(self, "capture", {"run_id": run_id, "storage": storage, "shard_id": shard_id}, work)
