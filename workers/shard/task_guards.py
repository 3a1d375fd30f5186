"""The checks a shard's delivery passes before its work, as plain steps in the order they run.

`run_guards` is the sequence: the first step with an answer ends the delivery there (`SKIPPED`, or Celery's
`Reject`); the work runs only when every step passed. Each step reads and writes the shard ledger (app.ledger)
and knows Celery only through `Reject`, so each runs on a plain `Delivery` in the tests.

    skip_done         its completion marker exists (a redelivery, a re-run, a duplicate publish) -> SKIPPED;
                      what dead duplicates left on the finished shard is swept on the way
    skip_dead         it was dead-lettered (`regen retry-dead` re-sends it) -> SKIPPED
    drop_when_paused  the run is paused -> Reject(requeue=False); `regen resume-run` re-sends every shard
                      without a marker, so nothing is lost and paused shards do not bounce through Redis
    require_run       sets `Delivery.manifest`, read once per process; a run not on storage -> InvalidTask
    count_attempt     sets `Delivery.attempt`: recorded; past the retry policy's limits
                      (retry_policy.exhausted), dead-letter it -> SKIPPED
    check_manifest    another model, other layers, settings its engine cannot run -> the error recorded on the
                      attempt, Reject(requeue=True)

Around the work, `pause_on_stubs` follows a generated shard's records; what a failure does next is
`retry_policy.settle_failure`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from celery.exceptions import Reject

from app import ledger
from app.errors import InvalidTask, ManifestMismatch
from app.manifest import RunSettings
from app.modes import record_mode, run_modes
from app.quality import StubWindow, is_stub
from app.speculative import ignored_with_capture
from app.storage import RunStore
from workers.engine.limits import unsupported
from workers.process.inflight import Claim, InFlight
from workers.shard.retry_policy import exhausted

log = logging.getLogger("regen.tasks")


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
    device: str = "cuda"  # "cpu" or "cuda": what workers.engine.limits judges
    thinking_close: str | None = None  # the engine's reasoning config's close text (app.thinking); None: none
    stop_loops: bool = False  # the engine runs the loop stop (workers.engine.loop_stop)

    @classmethod
    def of(cls, ctx) -> Worker:
        options = ctx.engine.options
        return cls(ctx.worker_name, ctx.model.fingerprint, ctx.model.path,
                   list(options.capture_layers or []), ctx.config.max_attempts, ctx.config.max_crashes,
                   ctx.engine_record, ctx.config.device, options.thinking_close, options.stop_loops)


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
    # Set by the steps, in order: the work sees both set (run_guards returned None).
    manifest: dict | None = None  # set by require_run
    attempt: str | None = None  # set by count_attempt

    @property
    def key(self) -> str:
        return ledger.stage_key(self.shard, self.stage)

    @property
    def run_id(self) -> str:
        return self.store.run_id



SKIPPED = "skipped"  # a step's answer that ends the delivery, acked; it is the task's result


def skip_done(d: Delivery) -> str | None:
    if ledger.is_finished(d.store, d.key):
        log.info("%s/%s: already done, skipping", d.run_id, d.shard)
        # A copy of a finished shard comes back when its holder died (the broker's visibility timeout, or the
        # dead-holder re-send): what that holder left half-written was not there to sweep when the shard was
        # published, and nothing else returns to a finished shard. One listing of the shard's own folders.
        try:
            swept = ledger.sweep_temporaries(d.store, d.key, d.stale_after)
        except OSError as exc:
            log.warning("%s/%s: could not sweep dead attempts' temporaries: %s", d.run_id, d.shard, exc)
        else:
            if swept:
                log.info("%s/%s: removed %d temporaries dead attempts left", d.run_id, d.shard, swept)
        return SKIPPED
    return None


def skip_dead(d: Delivery) -> str | None:
    if ledger.is_dead(d.store, d.key):
        log.info("%s/%s: dead-lettered, skipping (regen retry-dead %s re-sends it)", d.run_id, d.shard, d.run_id)
        return SKIPPED
    return None


def drop_when_paused(d: Delivery) -> None:
    pause = ledger.pause_state(d.store)
    if pause:
        log.warning("%s paused (%s): dropping %s; resume-run re-sends it", d.run_id, pause.reason, d.shard)
        raise Reject("run paused", requeue=False)


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


def count_attempt(d: Delivery) -> str | None:
    """Record this attempt (its lease renewed from now on); dead-letter the shard when its earlier attempts
    used up either limit. A stage that got finished meanwhile (a duplicate published it) is never dead-lettered
    (app.ledger.is_finished: the one answer to "is this stage finished")."""
    d.attempt = ledger.new_attempt_id()
    engine = {"engine": d.worker.engine} if d.worker.engine is not None else {}
    counted = ledger.record_attempt(d.store, d.key, d.attempt, d.worker.name, stale_after=d.stale_after, **engine,
                                    stage=d.stage)
    d.claims.started(d.claim, d.store, d.attempt)
    reason = exhausted(counted, d.worker.max_attempts, d.worker.max_crashes)
    if reason is None or ledger.is_finished(d.store, d.key):
        return None
    ledger.record_attempt_end(d.store, d.key, d.attempt, f"not run, dead-lettered: {reason}")
    ledger.dead_letter(d.store, d.key, f"{reason}: {counted.records - 1} attempts without success")
    log.error("%s/%s dead-lettered: %s", d.run_id, d.shard, reason)
    return SKIPPED


def check_manifest(d: Delivery) -> None:
    """The shard is this worker's: the run's model and, where this stage captures, its layers. A refusal is
    recorded on the attempt, so it needs one."""
    manifest, attempt = d.manifest, d.attempt
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
    if d.stage == ledger.GENERATE:
        problems += generation_features_missing(settings, d.worker)
    if problems:
        exc = ManifestMismatch(f"run {manifest['run_id']}: worker {d.worker.name} refuses shard: "
                               + "; ".join(problems))
        ledger.record_attempt_error(d.store, d.key, attempt, str(exc))
        log.error("%s", exc)
        raise Reject(str(exc), requeue=True)


def generation_features_missing(settings: dict, worker: Worker) -> list[str]:
    """What a run's thinking budget or loop stop needs of the engine that generates its shards and this one lacks:
    a reasoning config with the run's close text, the loop stop (engines get them from the run: `--run`)."""
    out = []
    s = RunSettings.view(settings)
    budget, close = s.thinking_budget, s.thinking_close
    if budget is not None and worker.thinking_close != close:
        out.append(f"the run closes thinking at {budget} tokens with {close!r}, and this engine "
                   + (f"closes with {worker.thinking_close!r}" if worker.thinking_close is not None
                      else "has no reasoning config (a capture engine, or started without --run)"))
    if s.stop_loops and not worker.stop_loops:
        out.append("the run stops loops, and this engine has no loop stop (a capture engine, or started without "
                   "--run)")
    return out


def run_guards(d: Delivery) -> str | None:
    """The steps in order (see the module docstring); the first answer ends the delivery, None lets the work
    run with `d.manifest` and `d.attempt` set."""
    for step in (skip_done, skip_dead):
        ended = step(d)
        if ended is not None:
            return ended
    drop_when_paused(d)
    require_run(d)
    ended = count_attempt(d)
    if ended is not None:
        return ended
    check_manifest(d)
    return None


def pause_on_stubs(d: Delivery, records: list[dict]) -> None:
    """Feed the run's stub window of each sample's mode (a mixed run has one per mode: non-thinking answers are
    short by nature and must not hide, or dilute, thinking stubs); pause the run when a mode's recent
    stub-or-empty rate crosses the threshold."""
    settings = d.manifest["settings"]
    q = settings.get("quality", {})
    threshold = float(q.get("pause_stub_rate", 0.2))
    mixed = len(run_modes(settings)) > 1
    for mode in sorted({record_mode(r, settings) for r in records if r.get("status") == "ok"}):
        key = (d.run_id, mode) if mixed else d.run_id
        window = d.windows.setdefault(key, StubWindow(int(q.get("pause_window", 256))))
        for r in records:
            if r.get("status") == "ok" and record_mode(r, settings) == mode:
                window.add(is_stub(r["flags"]))
        pausing = threshold < 1.0 and window.should_pause(threshold, int(q.get("pause_min_samples", 32)))
        if pausing and not ledger.pause_state(d.store):
            of = f" {mode.replace('_', '-')}" if mixed else ""
            reason = (f"stub-or-empty rate {window.rate:.0%} over the last {len(window.values)}{of} samples on "
                      f"{d.worker.name} crossed the threshold {threshold:.0%}")
            ledger.pause_run(d.store, reason, rate=window.rate, window=len(window.values), by=d.worker.name)
            log.error("run %s paused: %s", d.run_id, reason)


def pause_on_capture_check(d: Delivery, checks: list[tuple[str, dict]]) -> None:
    """Pause the run when a sample's capture check failed (workers.shard.capture_check): its states differ from
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
