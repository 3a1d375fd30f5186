"""The guards a shard's delivery passes before and after its work, in order; each one small and testable alone.

In the spirit of dramatiq's middleware: the delivery (workers/shard/delivery.py) runs `BEFORE` in order, and the
first guard that has an answer ends the delivery there (`Ends.SKIPPED`, or Celery's `Reject`); the work runs
only when every guard passed. Around the work, `pause_on_stubs` follows a generated shard's records and
`settle_failure` decides what a failed attempt leaves on storage and what the task does next. Every guard reads
and writes the shard ledger (app/ledger.py); none knows Celery beyond `Reject`, so each runs on a plain
`Delivery`.

Each guard states its contract in code (`@guard`): what it may end the delivery with (`ends`), which of the
delivery's facts it fills when it passes (`gives`: the run's manifest, the attempt's id) and which it needs an
earlier guard to have filled (`needs`). `in_order` refuses a list of guards where one needs a fact no guard
before it gives, so `BEFORE` cannot be reordered wrongly (it fails at import), and a guard asks for a fact with
`Delivery.given`, which fails loudly instead of reading a None.

    skip_done         its completion marker exists (a redelivery, a re-run, a duplicate publish) -> "skipped"
    skip_dead         it was dead-lettered (`regen retry-dead` re-sends it) -> "skipped"
    drop_when_paused  the run is paused -> Reject(requeue=False); `regen resume-run` re-sends every shard
                      without a marker, so nothing is lost and paused shards do not bounce through Redis
    require_run       gives the run's manifest, read once per process; a run not on storage -> InvalidTask
    count_attempt     gives the attempt: recorded; at `max_attempts` failures of its own or `max_crashes`
                      processes that died holding it, dead-letter it -> "skipped"
    check_manifest    needs the manifest and the attempt: another model, other layers -> the error recorded on
                      the attempt, Reject(requeue=True)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from celery.exceptions import Reject

from app import ledger
from app.errors import EngineLost, Failure, InvalidTask, ManifestMismatch, classify
from app.quality import StubWindow, is_stub
from app.speculative import ignored_with_capture
from app.storage import RunStore
from workers.engine.limits import unsupported
from workers.process.inflight import Claim, InFlight

log = logging.getLogger("regen.tasks")


@dataclass(frozen=True)
class Worker:
    """What the guards need to know of the worker process (workers/process/context.WorkerContext holds it all)."""

    name: str
    model_fingerprint: str
    model_path: str
    capture_layers: list[int]  # the engine's (vLLM ids); empty when it captures nothing
    max_attempts: int = 5
    max_crashes: int = 10
    engine: dict | None = None  # what attempt records say about the engine
    device: str = "cuda"  # "cpu" or "cuda": what workers/engine/limits.py judges

    @classmethod
    def of(cls, ctx) -> Worker:
        return cls(ctx.worker_name, ctx.model.fingerprint, ctx.model.path,
                   list(ctx.engine.options.capture_layers or []), ctx.config.max_attempts, ctx.config.max_crashes,
                   ctx.engine_record, ctx.config.device)


@dataclass
class Delivery:
    """One delivery of one shard at one stage, as the guards see and fill it."""

    store: RunStore
    shard: str
    stage: str  # ledger.GENERATE or ledger.CAPTURE
    worker: Worker
    stale_after: float  # the broker's visibility timeout: the lease of attempt records written without one
    claims: InFlight
    claim: Claim
    manifests: dict = field(default_factory=dict)  # the process's cache of run manifests
    windows: dict = field(default_factory=dict)  # the process's stub windows, by run
    # The facts guards give (FACTS): None until the guard that gives it passed; read them with `given`.
    manifest: dict | None = None  # given by require_run
    attempt: str | None = None  # given by count_attempt

    @property
    def key(self) -> str:
        return ledger.stage_key(self.shard, self.stage)

    @property
    def run_id(self) -> str:
        return self.store.run_id

    def given(self, fact: str):
        """The fact an earlier guard gave (`"manifest"`, `"attempt"`); GuardOrderError when none has yet."""
        value = getattr(self, fact) if fact in FACTS else None
        if value is None:
            raise GuardOrderError(f"{self.run_id}/{self.key}: the delivery's {fact} is needed before a guard gave "
                                  f"it ({FACTS.get(fact, 'no guard gives it')})")
        return value


FACTS = {"manifest": "require_run gives it", "attempt": "count_attempt gives it"}


class GuardOrderError(RuntimeError):
    """A guard (or the work) needs a fact of the delivery that no guard before it gives: a bug in the order."""


class Ends(StrEnum):
    """A guard's answer that ends the delivery, acked; it is the task's result."""

    SKIPPED = "skipped"


@dataclass(frozen=True)
class Contract:
    """What a guard may end a delivery with, and the delivery's facts it needs and gives (see the module)."""

    ends: tuple = ()  # Ends values it returns, exceptions it raises (Celery's Reject, InvalidTask)
    needs: frozenset[str] = frozenset()
    gives: frozenset[str] = frozenset()


Guard = Callable[[Delivery], "Ends | None"]


def guard(*, ends: tuple = (), needs: tuple[str, ...] = (), gives: tuple[str, ...] = ()):
    """Declare a guard's contract on it (`fn.contract`)."""
    unknown = (set(needs) | set(gives)) - set(FACTS)
    if unknown:
        raise ValueError(f"unknown delivery facts {sorted(unknown)}: one of {sorted(FACTS)}")

    def declare(fn: Guard) -> Guard:
        fn.contract = Contract(tuple(ends), frozenset(needs), frozenset(gives))
        return fn

    return declare


def in_order(*guards: Guard) -> tuple[Guard, ...]:
    """`guards` as a tuple, refused when one needs a fact that no guard before it gives."""
    given: set[str] = set()
    for g in guards:
        missing = g.contract.needs - given
        if missing:
            raise GuardOrderError(f"{g.__name__} needs the delivery's {', '.join(sorted(missing))}, which no guard "
                                  f"before it gives ({'; '.join(FACTS[f] for f in sorted(missing))})")
        given |= g.contract.gives
    return tuple(guards)


@guard(ends=(Ends.SKIPPED,))
def skip_done(d: Delivery) -> Ends | None:
    if ledger.is_finished(d.store, d.key):
        log.info("%s/%s: already done, skipping", d.run_id, d.shard)
        return Ends.SKIPPED
    return None


@guard(ends=(Ends.SKIPPED,))
def skip_dead(d: Delivery) -> Ends | None:
    if ledger.is_dead(d.store, d.key):
        log.info("%s/%s: dead-lettered, skipping (regen retry-dead %s re-sends it)", d.run_id, d.shard, d.run_id)
        return Ends.SKIPPED
    return None


@guard(ends=(Reject,))
def drop_when_paused(d: Delivery) -> None:
    pause = ledger.pause_state(d.store)
    if pause:
        log.warning("%s paused (%s): dropping %s; resume-run re-sends it", d.run_id, pause.get("reason"), d.shard)
        raise Reject("run paused", requeue=False)


@guard(ends=(InvalidTask,), gives=("manifest",))
def require_run(d: Delivery) -> None:
    """The run's manifest, read once per process (it never changes); before any attempt is recorded, so a run
    that is not on storage (yet: a late NFS mount) is retried by the task without counting against its shards."""
    cache_key = f"{d.store.storage.url}|{d.run_id}"
    if cache_key not in d.manifests:
        try:
            d.manifests[cache_key] = d.store.storage.read_json(d.store.manifest_path)
        except FileNotFoundError:
            raise InvalidTask(f"run {d.run_id} is not on storage {d.store.storage.url} (no run.json)") from None
    d.manifest = d.manifests[cache_key]


@guard(ends=(Ends.SKIPPED,), gives=("attempt",))
def count_attempt(d: Delivery) -> Ends | None:
    """Record this attempt (its lease renewed from now on); dead-letter the shard when its earlier attempts
    used up either limit. A stage that got finished meanwhile (a duplicate published it) is never dead-lettered
    (app/ledger.is_finished: the one answer to "is this stage finished")."""
    d.attempt = ledger.new_attempt_id()
    engine = {"engine": d.worker.engine} if d.worker.engine is not None else {}
    counted = ledger.record_attempt(d.store, d.key, d.attempt, d.worker.name, stale_after=d.stale_after, **engine,
                                    stage=d.stage)
    d.claims.started(d.claim, d.store, d.attempt)
    limits = d.worker.max_attempts, d.worker.max_crashes
    if counted.failures < limits[0] and counted.crashes < limits[1]:
        return None
    if ledger.is_finished(d.store, d.key):
        return None
    reason = (f"{counted.failures} attempts failed (limit {limits[0]})" if counted.failures >= limits[0] else
              f"{counted.crashes} worker processes died holding it (limit {limits[1]})")
    ledger.record_attempt_end(d.store, d.key, d.attempt, f"not run, dead-lettered: {reason}")
    ledger.dead_letter(d.store, d.key, f"{reason}: {counted.records - 1} attempts without success")
    log.error("%s/%s dead-lettered: %s", d.run_id, d.shard, reason)
    return Ends.SKIPPED


@guard(ends=(Reject,), needs=("manifest", "attempt"))
def check_manifest(d: Delivery) -> None:
    """The shard is this worker's: the run's model and, where this stage captures, its layers. A refusal is
    recorded on the attempt, so it needs one."""
    manifest, attempt = d.given("manifest"), d.given("attempt")
    settings = manifest["settings"]
    problems = []
    if settings["model"]["fingerprint"] != d.worker.model_fingerprint:
        problems.append(f"model fingerprint {settings['model']['fingerprint']} != loaded {d.worker.model_fingerprint} "
                        f"({d.worker.model_path})")
    needs_capture = settings["capture_mode"] == "inline" if d.stage == ledger.GENERATE else True
    if needs_capture:
        want = settings["layers"]["vllm_ids"]
        if want != d.worker.capture_layers:
            problems.append(f"capture layers (vLLM ids) {want} != engine's {d.worker.capture_layers}")
    # settings its engine is known to crash on (a worker started without --run learns the run only here)
    why = unsupported(d.worker.device, settings["sampling"], needs_capture and bool(d.worker.capture_layers))
    if why:
        problems.append(why)
    if d.stage == ledger.GENERATE and (ignored := ignored_with_capture(settings["sampling"], settings["capture_mode"])):
        problems.append(ignored)
    if problems:
        exc = ManifestMismatch(f"run {manifest['run_id']}: worker {d.worker.name} refuses shard: "
                               + "; ".join(problems))
        ledger.record_attempt_error(d.store, d.key, attempt, str(exc))
        log.error("%s", exc)
        raise Reject(str(exc), requeue=True)


BEFORE: tuple[Guard, ...] = in_order(skip_done, skip_dead, drop_when_paused, require_run, count_attempt,
                                     check_manifest)


def run_guards(d: Delivery, guards: tuple[Guard, ...] = BEFORE) -> Ends | None:
    """Run `guards` (checked by `in_order`) in order; the first answer ends the delivery, None lets the work run."""
    for g in in_order(*guards):
        result = g(d)
        if result is not None:
            return result
    return None


def pause_on_stubs(d: Delivery, records: list[dict]) -> None:
    """Feed the run's stub window; pause the run when the recent stub-or-empty rate crosses its threshold."""
    q = d.given("manifest")["settings"].get("quality", {})
    window = d.windows.setdefault(d.run_id, StubWindow(int(q.get("pause_window", 256))))
    for r in records:
        if r.get("status") == "ok":
            window.add(is_stub(r["flags"]))
    threshold = float(q.get("pause_stub_rate", 0.2))
    pausing = threshold < 1.0 and window.should_pause(threshold, int(q.get("pause_min_samples", 32)))
    if pausing and not ledger.pause_state(d.store):
        reason = (f"stub-or-empty rate {window.rate:.0%} over the last {len(window.values)} samples on "
                  f"{d.worker.name} crossed the threshold {threshold:.0%}")
        ledger.pause_run(d.store, reason, rate=window.rate, window=len(window.values), by=d.worker.name)
        log.error("run %s paused: %s", d.run_id, reason)


def pause_on_capture_check(d: Delivery, checks: list[tuple[str, dict]]) -> None:
    """Pause the run when a sample's capture check failed (workers/shard/capture_check.py): its states differ from
    a re-capture of the same ids on this worker's engine. The reason names the worker, its engine mode and the
    sample's worst layer, token and error; `regen resume-run` lifts it once the engine is understood."""
    failed = [(sample, check) for sample, check in checks if not check.get("ok")]
    if not failed or ledger.pause_state(d.store):
        return
    sample, check = failed[0]
    mode = (d.worker.engine or {}).get("mode_key", "unknown")
    reason = (f"capture check failed on worker {d.worker.name} (engine mode: {mode}): {len(failed)} of "
              f"{len(checks)} re-captured samples of {d.shard} differ from their stored states; {sample}: "
              f"{check.get('problem')}")
    ledger.pause_run(d.store, reason, check="capture", by=d.worker.name, engine_mode=mode, shard=d.shard,
                     sample_id=sample, layer=check.get("layer"), token=check.get("token"), error=check.get("error"),
                     bound=check.get("bound"))
    log.error("run %s paused: %s", d.run_id, reason)


def settle_failure(d: Delivery, exc: Exception) -> str:
    """Record why the attempt failed; return what the task does next, as app/errors.classify decides by class:
    - "restart": the engine died. EngineLost (its process vanished under a signal) counts as a crash, any other
      engine death as the shard's failure; the task re-publishes the shard and exits for a fresh engine.
    - "dead": a PermanentError (an InvalidId among them) repeats on every attempt: dead-lettered at once.
    - "retry": anything else, storage trouble or a bug; Celery retries with backoff, the attempt count
      dead-letters it."""
    attempt = d.given("attempt")
    failure = classify(exc)
    if failure is Failure.RESTART:
        kind = "crash" if isinstance(exc, EngineLost) else "error"
        ledger.record_attempt_error(d.store, d.key, attempt, str(exc), kind=kind)
        return "restart"
    if failure in (Failure.DEAD_LETTER, Failure.SET_ASIDE):
        ledger.record_attempt_error(d.store, d.key, attempt, str(exc))
        ledger.dead_letter(d.store, d.key, str(exc))
        return "dead"
    ledger.record_attempt_error(d.store, d.key, attempt, f"{type(exc).__name__}: {exc}")
    return "retry"
