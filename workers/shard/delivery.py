"""One delivery of a shard: its work between an ordered list of policies, the rules that make at-least-once
delivery safe (workers.shard.policy: each policy one class with the hooks before, after and on_failure).

`run_delivery` walks `POLICIES` (EngineAlive, ClaimShard, the guards, the work, the pauses, RetryPolicy) and
carries out the verdict on a failure (`carry_out`): restart, dead-letter, set aside, retry or raise. Arguments
that cannot be a shard never get here (`GuardedTask`). Each policy and each verdict: docs/workers.md#one-delivery-of-a-shard-policy-by-policy-workerssharddeliverypy.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
from celery import Task

from app.base import dead_messages
from app.base.config import DEFAULT_VISIBILITY_TIMEOUT
from app.base.errors import Failure, RegenError, classify
from app.base.storage import RunStore, Storage
from workers.process.context import WorkerContext
from workers.process.inflight import InFlight
from workers.shard.policy import Action, Delivery, Done, Policy, Verdict, Worker
from workers.shard.retry_policy import RetryPolicy, backoff
from workers.shard.task_guards import GUARDS, PAUSES

log = logging.getLogger("regen.tasks")
DEFER_SECONDS = 30  # a copy of a shard this process runs (same message) is looked at again this much later

Work = Callable[[WorkerContext, Delivery], Done]  # a stage's work on a delivery that passed its guards


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


@dataclass
class ProcessShards:
    """What this process's deliveries share: the tasks running, the shards claimed, and the one way out."""

    running: Running = field(default_factory=Running)
    claims: InFlight = field(default_factory=InFlight)
    dying: threading.Lock = field(default_factory=threading.Lock)


HERE = ProcessShards()  # one per worker process: its task slots are threads
RESTART_EXIT = 75  # the exit status of a process leaving for a fresh engine (the supervisor restarts it)


def holds_no_shard() -> bool:
    """Whether this process runs no shard now."""
    return not HERE.claims.held()


def shards_held() -> int:
    """How many shards this process runs now (workers.process.dead_holder_watch checks while it has a free
    task slot)."""
    return HERE.claims.held()


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
        HERE.running.release_one()
        HERE.running.wait_empty(10)
        with HERE.dying:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(RESTART_EXIT)


class EngineAlive(Policy):
    """No attempt on an engine another slot saw die: it would only fail and count against the shard (a free slot
    takes the re-published shard at once)."""

    def before(self, d: Delivery) -> None:
        if d.engine_dead:
            raise _EngineAlreadyDead(f"{d.engine_dead}; {d.shard} not started")

    def on_failure(self, d: Delivery, exc: Exception, failure: Failure) -> Verdict | None:
        return Verdict(Action.RESTART, str(exc)) if isinstance(exc, _EngineAlreadyDead) else None


class _EngineAlreadyDead(RegenError):
    pass


class ClaimShard(Policy):
    """One delivery of a shard at a time in this process (workers.process.inflight)."""

    def before(self, d: Delivery) -> str | None:
        d.claim, holder = d.claims.claim((d.store.storage.url, d.run_id, d.key), d.tag)
        if d.claim is not None:
            return None
        if d.tag is not None and holder.tag == d.tag:  # this very message, restored while it runs: not acked
            log.info("%s/%s: its message came back while it runs here; deferred %ds", d.run_id, d.key, DEFER_SECONDS)
            raise _RunningHere()
        log.info("%s/%s: another copy of it runs in this process; this copy is dropped", d.run_id, d.key)
        return "held"

    def on_failure(self, d: Delivery, exc: Exception, failure: Failure) -> Verdict | None:
        return Verdict(Action.DEFER) if isinstance(exc, _RunningHere) else None


class _RunningHere(RegenError):
    pass


POLICIES = (EngineAlive(), ClaimShard(), *GUARDS, *PAUSES, RetryPolicy())


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
    """`work(ctx, delivery) -> Done` between the policies' hooks, for both stages (the module docstring)."""
    HERE.running.add()
    d = None
    try:
        ctx = WorkerContext.get()
        d = Delivery(RunStore(Storage(ctx.config.storage or kwargs["storage"]), kwargs["run_id"]), kwargs["shard_id"],
                     stage, Worker.of(ctx), visibility_timeout(task.app), HERE.claims, None, ctx.manifests,
                     ctx.windows, retries=task.request.retries, engine_dead=ctx.engine.dead, tag=_delivery_tag(task))
        for policy in POLICIES:
            ended = policy.before(d)
            if ended is not None:
                return ended
        d.working = True
        done = work(ctx, d)
        for policy in POLICIES:
            policy.after(d, done)
        return done.result
    except Exception as exc:
        if d is None:  # the worker's context or the run's storage could not be built: judged without them
            d = Delivery(None, kwargs["shard_id"], stage, None, 0, HERE.claims, retries=task.request.retries)
        failure = classify(exc)
        verdict = next(v for policy in POLICIES if (v := policy.on_failure(d, exc, failure)) is not None)
        return carry_out(task, kwargs, exc, verdict)
    finally:
        if d is not None and d.claim is not None:
            HERE.claims.release(d.claim)
        HERE.running.release_one()


def carry_out(task: Task, kwargs: dict, exc: Exception, verdict: Verdict) -> str:
    """Do what the verdict on a failure says: return the task's result (acked), or raise Celery's retry, or exit."""
    if verdict.action is Action.RESTART:
        exit_for_restart(task, kwargs, verdict.reason)
    if verdict.action is Action.DEAD:
        return "dead"
    if verdict.action is Action.SET_ASIDE:
        return set_aside(task, verdict.reason, kwargs)
    if verdict.action is Action.DEFER:
        raise task.retry(countdown=DEFER_SECONDS)
    if verdict.action is Action.RETRY:
        raise task.retry(exc=exc, countdown=backoff(task.request.retries)) from (exc if verdict.chained else None)
    raise exc  # Celery's own Retry and Reject, and what nothing would bound: Celery records the failure


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
