"""The guards and the pauses of a shard's delivery, each one policy (workers.shard.policy), in the order they run.

Guards (`before`): SkipDone, SkipDead, DropWhenPaused, RequireRun, CountAttempt, CheckManifest; the first with an
answer ends the delivery. Pauses (`after`): PauseOnStubs and PauseOnCaptureCheck read what the work produced.
Each knows Celery only through `Reject`, so each runs on a plain `Delivery` in the tests. What each does: docs/workers.md#the-guards-and-the-pauses-workersshardtask_guardspy.
"""

from __future__ import annotations

import logging

from celery.exceptions import Reject

from app.base import ledger
from app.base.errors import InvalidTask, ManifestMismatch
from app.base.manifest import RunSettings
from app.base.quality import StubWindow, is_stub
from app.base.speculative import ignored_with_capture
from app.base.thinking_modes import record_mode, run_modes
from workers.shard.policy import Delivery, Done, Policy, Worker
from workers.shard.retry_policy import exhausted

log = logging.getLogger("regen.tasks")


SKIPPED = "skipped"  # a step's answer that ends the delivery, acked; it is the task's result


class SkipDone(Policy):
    """A finished stage is not run again."""

    def before(self, d: Delivery) -> str | None:
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


class SkipDead(Policy):
    """A dead-lettered stage is not run."""

    def before(self, d: Delivery) -> str | None:
        if ledger.is_dead(d.store, d.key):
            log.info("%s/%s: dead-lettered, skipping (regen retry-dead %s re-sends it)", d.run_id, d.shard, d.run_id)
            return SKIPPED
        return None


class DropWhenPaused(Policy):
    """A paused run's shards are dropped, not requeued."""

    def before(self, d: Delivery) -> None:
        pause = ledger.pause_state(d.store)
        if pause:
            log.warning("%s paused (%s): dropping %s; resume-run re-sends it", d.run_id, pause.reason, d.shard)
            raise Reject("run paused", requeue=False)


class RequireRun(Policy):
    """The run is on storage."""

    def before(self, d: Delivery) -> None:
        """The run's manifest, read once per process (it never changes); before any attempt is recorded, so a run
        that is not on storage (yet: a late NFS mount) is retried by the task without counting against its shards."""
        cache_key = f"{d.store.storage.url}|{d.run_id}"
        if cache_key not in d.manifests:
            try:
                d.manifests[cache_key] = d.store.storage.read_json(d.store.manifest_path)
            except FileNotFoundError:
                raise InvalidTask(f"run {d.run_id} is not on storage {d.store.storage.url} (no run.json)") from None
        d.manifest = d.manifests[cache_key]


class CountAttempt(Policy):
    """The attempt recorded, within the limits."""

    def before(self, d: Delivery) -> str | None:
        """Record this attempt (its lease renewed from now on); dead-letter the shard when its earlier attempts
        used up either limit. A stage that got finished meanwhile (a duplicate published it) is never dead-lettered
        (app.base.ledger.is_finished: the one answer to "is this stage finished")."""
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


class CheckManifest(Policy):
    """The run is this worker's to run."""

    def before(self, d: Delivery) -> None:
        """The shard is this worker's: the run's model and, where this stage captures, its layers. A refusal is
        recorded on the attempt, so it needs one."""
        manifest, attempt = d.manifest, d.attempt
        settings = RunSettings.view(manifest["settings"])
        problems = []
        fingerprint = settings.model.get("fingerprint")
        if fingerprint != d.worker.model_fingerprint:
            problems.append(f"model fingerprint {fingerprint} != loaded {d.worker.model_fingerprint} "
                            f"({d.worker.model_path})")
        needs_capture = settings.capture_inline if d.stage == ledger.GENERATE else True
        if needs_capture:
            want = settings.vllm_layer_ids
            if want != d.worker.capture_layers:
                problems.append(f"capture layers (vLLM ids) {want} != engine's {d.worker.capture_layers}")
        sampling = settings.sampling_dict()
        if d.stage == ledger.GENERATE and (ignored := ignored_with_capture(sampling, settings.capture_mode)):
            problems.append(ignored)
        if d.stage == ledger.GENERATE:
            problems += generation_features_missing(settings, d.worker)
        if problems:
            exc = ManifestMismatch(f"run {manifest['run_id']}: worker {d.worker.name} refuses shard: "
                                   + "; ".join(problems))
            ledger.record_attempt_error(d.store, d.key, attempt, str(exc))
            log.error("%s", exc)
            raise Reject(str(exc), requeue=True)


def generation_features_missing(settings: RunSettings | dict, worker: Worker) -> list[str]:
    """What a run's thinking budget or loop stop needs of the engine that generates its shards and this one lacks:
    a reasoning config with the run's close text, the loop stop (engines get them from the run: `--run`)."""
    out = []
    settings = RunSettings.view(settings)
    budget, close = settings.thinking_budget, settings.thinking_close
    if budget is not None and worker.thinking_close != close:
        out.append(f"the run closes thinking at {budget} tokens with {close!r}, and this engine "
                   + (f"closes with {worker.thinking_close!r}" if worker.thinking_close is not None
                      else "has no reasoning config (a capture engine, or started without --run)"))
    if settings.stop_loops and not worker.stop_loops:
        out.append("the run stops loops, and this engine has no loop stop (a capture engine, or started without "
                   "--run)")
    return out


class PauseOnStubs(Policy):
    """Too many stubs of late pause the run."""

    def after(self, d: Delivery, done: Done) -> None:
        """Feed the stub windows with a generated shard's records (a capture's `done` has none)."""
        if done.records is not None:
            pause_on_stubs(d, done.records)


def pause_on_stubs(d: Delivery, records: list[dict]) -> None:
    """Feed the run's stub window of each sample's mode (a mixed run has one per mode: non-thinking answers are
    short by nature and must not hide, or dilute, thinking stubs); pause the run when a mode's recent
    stub-or-empty rate crosses the threshold."""
    settings = RunSettings.view(d.manifest["settings"])
    q = settings.quality  # the run's thresholds, with app.base.manifest.QualitySettings' defaults for older runs
    threshold = float(q.pause_stub_rate)
    mixed = len(run_modes(settings)) > 1
    for mode in sorted({record_mode(r, settings) for r in records if r.get("status") == "ok"}):
        key = (d.run_id, mode) if mixed else d.run_id
        window = d.windows.setdefault(key, StubWindow(int(q.pause_window)))
        for r in records:
            if r.get("status") == "ok" and record_mode(r, settings) == mode:
                window.add(is_stub(r["flags"]))
        pausing = threshold < 1.0 and window.should_pause(threshold, int(q.pause_min_samples))
        if pausing and not ledger.pause_state(d.store):
            of = f" {mode.replace('_', '-')}" if mixed else ""
            reason = (f"stub-or-empty rate {window.rate:.0%} over the last {len(window.values)}{of} samples on "
                      f"{d.worker.name} crossed the threshold {threshold:.0%}")
            ledger.pause_run(d.store, reason, rate=window.rate, window=len(window.values), by=d.worker.name)
            log.error("run %s paused: %s", d.run_id, reason)


class PauseOnCaptureCheck(Policy):
    """A failed capture check pauses the run."""

    def after(self, d: Delivery, done: Done) -> None:
        pause_on_capture_check(d, done.checks)


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


GUARDS = (SkipDone(), SkipDead(), DropWhenPaused(), RequireRun(), CountAttempt(), CheckManifest())
PAUSES = (PauseOnStubs(), PauseOnCaptureCheck())


def run_guards(d: Delivery, guards=GUARDS) -> str | None:
    """The guards' `before` in order: the first answer ends the delivery, None lets the work run with `d.manifest`
    and `d.attempt` set (a delivery's own loop is workers.shard.delivery.run_delivery's; this one is the tests')."""
    for guard in guards:
        ended = guard.before(d)
        if ended is not None:
            return ended
    return None
