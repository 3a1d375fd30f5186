"""One rule of a shard's delivery is one small class with the same three hooks, as dramatiq's middleware is.

What flows through them is one `Delivery`, as one Document flows through datatrove's steps: `before(d)` in order
before the work (a result string ends the delivery), `after(d, done)` after it, `on_failure(d, exc, failure)`
until one answers with a `Verdict`. The retry policy comes last and answers every other failure. The hooks in
full: docs/workers.md#the-policy-interface-workersshardpolicypy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from app.base import ledger
from app.base.errors import Failure
from app.base.storage import RunStore
from workers.process.inflight import Claim, InFlight


@dataclass(frozen=True)
class Worker:
    """What the guards need to know of the worker process (workers.process.context.WorkerContext holds it all)."""

    name: str
    model_fingerprint: str
    model_path: str
    capture_layers: list[int]  # the engine's (vLLM ids); empty when it captures nothing
    max_attempts: int = 5
    max_crashes: int = 10
    engine: dict | None = None  # what attempt records say about the engine
    thinking_close: str | None = None  # the engine's reasoning config's close text (app.base.thinking); None: none
    stop_loops: bool = False  # the engine runs the loop stop (workers.engine.loop_stop)

    @classmethod
    def of(cls, ctx) -> Worker:
        options = ctx.engine.options
        return cls(ctx.worker_name, ctx.model.fingerprint, ctx.model.path,
                   list(options.capture_layers or []), ctx.config.max_attempts, ctx.config.max_crashes,
                   ctx.engine_record, options.thinking_close, options.stop_loops)


@dataclass
class Delivery:
    """One delivery of one shard at one stage, as the guards see and fill it."""

    store: RunStore
    shard: str
    stage: str  # ledger.GENERATE or ledger.CAPTURE
    worker: Worker
    stale_after: float  # the broker's visibility timeout: the lease of attempt records written without one
    claims: InFlight  # the shards this process runs now
    claim: Claim | None = None  # set by ClaimShard (workers.shard.delivery)
    manifests: dict = field(default_factory=dict)  # the process's cache of run manifests
    windows: dict = field(default_factory=dict)  # the process's stub windows, by run
    # Set by the policies, in order: the work sees both set.
    manifest: dict | None = None  # set by RequireRun
    attempt: str | None = None  # set by CountAttempt
    retries: int = 0  # Celery's retries of this task so far
    engine_dead: str | None = None  # why the engine died, where another slot saw it die before this delivery
    working: bool = False  # the work began: a failure from here on is the attempt's own
    tag: str | None = None  # the message's delivery tag (which copy of the shard's message this is)

    @property
    def key(self) -> str:
        return ledger.stage_key(self.shard, self.stage)

    @property
    def run_id(self) -> str:
        return self.store.run_id


class Action(StrEnum):
    """What the delivery does with a failure."""

    RESTART = "restart"  # re-publish the shard, exit the process without acking (a fresh engine)
    DEAD = "dead"  # dead-lettered: acked with the result "dead"
    RETRY = "retry"  # Celery's retry with backoff
    SET_ASIDE = "set-aside"  # recorded in the dead-message list, acked with the result "invalid"
    DEFER = "defer"  # this very message came back while it runs here: looked at again later, not acked
    RAISE = "raise"  # Celery records the task's failure (Celery's own Retry and Reject pass through so)


@dataclass(frozen=True)
class Verdict:
    """A policy's answer to a failure: the action and what it says (the reason logged or recorded)."""

    action: Action
    reason: str = ""
    chained: bool = True  # a retry's traceback names the failure (False: a run not on storage yet, expected)


@dataclass
class Done:
    """What a stage's work produced: the task's result and what the `after` hooks look at."""

    result: str  # "done", or "duplicate" when another attempt's marker won
    records: list[dict] | None = None  # generation's records (the stub window's), None for a capture
    checks: list[tuple[str, dict]] = field(default_factory=list)  # (sample id, capture check) of checked samples


class Policy:
    """The hooks, each doing nothing: a policy overrides the ones it needs."""

    def before(self, d: Delivery) -> str | None:
        return None

    def after(self, d: Delivery, done: Done) -> None:
        return None

    def on_failure(self, d: Delivery, exc: Exception, failure: Failure) -> Verdict | None:
        return None
