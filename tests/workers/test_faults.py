"""Fault injection with real processes: nothing lost, nothing duplicated.

Each scenario prints `expected / written / duplicated / lost` samples. Time is bounded by deadlines on
conditions (no bare sleeps); Redis' re-delivery wait is shortened through the worker's environment
(visibility timeout 20 s, unacked sweep every 5 s; see tests/support/workers.py).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from app.base import dead_messages
from app.base.ledger import attempt_errors, new_attempt_id, pause_state
from app.base.storage import RunStore, Storage
from app.cli import main
from tests.support.faults import (
    assert_redone_elsewhere,
    in_flight_shard,
    in_flight_shards,
    prompts_beyond_the_slots,
    report,
    temporaries,
)
from tests.support.polling import wait_for
from tests.support.ports import free_port
from tests.support.redis_db import E2E_BROKER
from tests.support.runs import produce, prompts_file, run_records, wait_run_done, wait_run_done_after_kills
from tests.support.workers import E2E_LAYERS, WorkerProcess, engine_host_pid, process_gone, worker_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_sigkill_mid_shard_loses_and_duplicates_nothing(cpu_worker, e2e_storage, tiny_qwen3, tmp_path):
    # First the worker is killed (its engine process must die with it), then the engine process alone (the
    # worker must see its engine die, re-publish its shards and exit for a restart, as with a CUDA error).
    # The second kill needs shards the first did not reach. Two samples per prompt, each exactly once: the
    # samples of a prompt are in different shards (one pass of shards per sample index), so a kill cuts some
    # prompts' samples short and not others.
    inputs = prompts_beyond_the_slots(cpu_worker, tmp_path)
    state = produce(e2e_storage, "sigkill", [inputs], tiny_qwen3, "--max-tokens", "48", "--samples-per-prompt", "2")
    store = RunStore(Storage(str(e2e_storage)), "sigkill")
    starts_before = cpu_worker.text().count("engine self-test passed")
    killed: dict[str, set[str]] = {}
    holders: dict[str, int] = {}  # the worker process whose attempts each kill cut short
    for kills, victim in enumerate(["worker", "engine"], start=1):
        earlier = set().union(*killed.values())
        wait_for(lambda e=earlier: in_flight_shard(store, besides=e), 240, "a shard in flight", interval=0.05)
        child = cpu_worker.child_pids()
        assert child, "the supervisor has no worker child"
        engine = engine_host_pid(child[0])
        os.kill(child[0] if victim == "worker" else engine, signal.SIGKILL)
        killed[victim] = in_flight_shards(store) - earlier
        holders[victim] = child[0]
        wait_for(lambda pid=engine: process_gone(pid), 30, f"engine process {engine} to end after the {victim} was killed")
        # The supervisor brings a fresh worker up; it finds the killed shards unfinished and redoes them.
        cpu_worker.wait_ready(count=starts_before + kills)
    wait_run_done_after_kills(e2e_storage, "sigkill")
    for victim, shards in killed.items():  # the killed attempt, then one in the fresh worker that finished
        assert_redone_elsewhere(store, shards, holders[victim])
    # What killed attempts left half-written (hidden-state files, attempt records, markers) went when their shards
    # were completed: nothing temporary is left anywhere under the run (a losing copy may still be tidying up).
    wait_for(lambda: not temporaries(e2e_storage / "sigkill"), 60, "no temporary file under the completed run")
    # The worker whose engine process died recorded why on the shards it was running, then exited for a restart.
    errors = [a.get("error", "") for shard in killed["engine"] for a in attempt_errors(store, shard)]
    assert any("the engine process exited (killed by SIGKILL)" in e for e in errors), (killed, errors)
    report(e2e_storage, "sigkill", state["counts"]["samples"])
    per_prompt: dict[str, list[dict]] = {}
    for rec in run_records(e2e_storage, "sigkill"):
        per_prompt.setdefault(rec["prompt_id"], []).append(rec)
    assert len(per_prompt) == state["counts"]["enqueued"] and state["counts"]["samples"] == 2 * len(per_prompt)
    for recs in per_prompt.values():  # (prompt, index) exactly once, each sample its own seed
        assert sorted(r["sample_index"] for r in recs) == [0, 1] and len({r["seed"] for r in recs}) == 2
    assert not store.dead_shards()


def test_sigterm_mid_shard_finishes_it_and_does_not_redo_it(cpu_worker, e2e_storage, tiny_qwen3, tmp_path):
    inputs = prompts_beyond_the_slots(cpu_worker, tmp_path)  # 4 shards of 4 were once done between two polls
    state = produce(e2e_storage, "sigterm", [inputs], tiny_qwen3, "--max-tokens", "48")
    store = RunStore(Storage(str(e2e_storage)), "sigterm")
    restarts_before = cpu_worker.text().count("engine self-test passed")
    shard = wait_for(lambda: in_flight_shard(store), 240, "a shard in flight", interval=0.05)
    child = cpu_worker.child_pids()[0]
    os.kill(child, signal.SIGTERM)  # Celery warm shutdown of the worker process
    wait_for(lambda: store.is_done(shard), 120, f"{shard} to finish after SIGTERM")
    assert "exited with 0" in wait_for(lambda: "exited with 0" in cpu_worker.text() and cpu_worker.text(), 120,
                                       "the warm-shut-down worker to exit cleanly")
    cpu_worker.wait_ready(count=restarts_before + 1)
    wait_run_done(e2e_storage, "sigterm", timeout=300)
    assert len(store.storage.listdir(store.attempts_dir(shard))) == 1  # finished once, never redone
    report(e2e_storage, "sigterm", state["counts"]["enqueued"])


@pytest.fixture(scope="module")
def stub_worker(e2e_redis, tmp_path_factory):
    """A second real worker process, on its own queue, serving a broken checkpoint that only says stop."""
    from workers.tiny_model import build_tiny_qwen3

    model = Path(build_tiny_qwen3(str(tmp_path_factory.mktemp("stub-qwen3")), stub=True))
    worker = WorkerProcess(["--cpu", "--model", str(model), "--layers", E2E_LAYERS, "--queue", "regen-stub",
                            "--max-model-len", "4096", "--name", "stub"],
                           tmp_path_factory.mktemp("stub-logs") / "worker.log", worker_env())
    try:
        worker.wait_ready()
        yield worker, model
    finally:
        worker.stop()


def test_a_run_of_stubs_is_paused_after_its_first_shards(stub_worker, e2e_storage, e2e_redis, tmp_path):
    _, model = stub_worker
    inputs = prompts_file(tmp_path, n_synthetic=40, with_formats=False)
    produce(e2e_storage, "stubs", [inputs], model, "--queue", "regen-stub", "--pause-min-samples", "8",
            "--pause-window", "16")
    store = RunStore(Storage(str(e2e_storage)), "stubs")
    pause = wait_for(lambda: pause_state(store), 180, "the run to be paused")
    assert "stub-or-empty rate 100%" in pause["reason"]
    wait_for(lambda: e2e_redis.llen("regen-stub") == 0, 60, "the paused run's queue to drain")
    # Shards the worker had begun before the pause still finish (the worker overlaps several); wait for them, or
    # one finishing between the count below and resume-run turns "sent" into "skipped".
    wait_for(lambda: in_flight_shard(store) is None, 120, "the shards begun before the pause to finish")
    done = store.done_shards()
    assert 2 <= len(done) < 10  # caught after the first shards, not after the last
    for r in run_records(e2e_storage, "stubs"):
        assert r["num_output_tokens"] == 1 and "empty_answer" in r["flags"]
    # resume-run clears the pause and re-sends exactly the shards without a marker.
    missing = 10 - len(store.done_shards())
    result = CliRunner().invoke(main, ["resume-run", "stubs", "--storage", str(e2e_storage), "--broker", E2E_BROKER,
                                       "--queue", "regen-stub"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "pause cleared" in result.output
    counts = store.storage.read_json(store.produce_path)["counts"]
    assert counts["shards_sent"] == missing and counts["shards_skipped_done"] == 10 - missing
    # The checkpoint is still broken, so the worker pauses the run again on the first re-sent shard.
    assert wait_for(lambda: pause_state(store), 120, "the run to pause again")


def test_a_shard_the_engine_cannot_run_is_refused_dead_lettered_and_the_rest_completes(cpu_worker, e2e_storage,
                                                                                        tiny_qwen3, tmp_path):
    # A run this worker cannot serve (its shards ask for other capture layers than the engine's, as when a run is
    # sent to a fleet started for another): a worker started without --run learns the run from its shards and
    # refuses each delivery with the reason (workers.shard.task_guards.CheckManifest); each refusal counts as a
    # failed attempt, so after --max-attempts (3 for the test worker) the shard is dead-lettered with every
    # attempt's reason.
    inputs = prompts_file(tmp_path, n_synthetic=2, with_formats=False)
    produce(e2e_storage, "poison", [inputs], tiny_qwen3, "--layers", "vllm:1,2", "--shard-size", "2")
    store = RunStore(Storage(str(e2e_storage)), "poison")
    restarts_before = cpu_worker.text().count("engine self-test passed")
    dead = wait_for(lambda: store.dead_shards(), 420, "the refused shard to be dead-lettered")
    assert dead == {"shard-000000"}
    letter = store.storage.read_json(store.dead_path("shard-000000"))
    errors = [a.get("error", "") for a in letter["attempts"]]
    # The letter is written by the delivery that found the attempts used up; a copy of the shard still running
    # beside it (re-published message and Redis' re-delivered original) may record its error just after.
    assert sum("refuses shard" in e and "capture layers (vLLM ids) [1, 2] != engine's" in e for e in errors) >= 2, errors
    assert "attempts without success" in letter["reason"]
    assert not store.done_shards()
    # Nothing crashed: the engine that refused the shard is the one that serves the next run.
    assert cpu_worker.text().count("engine self-test passed") == restarts_before
    (tmp_path / "healthy").mkdir()
    healthy = prompts_file(tmp_path / "healthy", n_synthetic=4, with_formats=False)
    state = produce(e2e_storage, "after-poison", [healthy], tiny_qwen3)
    wait_run_done(e2e_storage, "after-poison", timeout=180)
    report(e2e_storage, "after-poison", state["counts"]["enqueued"])


def _start_redis(port: int):
    import shutil
    import subprocess

    import redis

    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    wait_for(lambda: _pings(client), 10, f"redis-server on port {port}")
    return proc


def _pings(client) -> bool:
    import redis

    try:
        return bool(client.ping())
    except redis.exceptions.ConnectionError:
        return False


def test_a_redis_restart_that_keeps_nothing_is_recovered_by_resume(tiny_qwen3, e2e_storage, tmp_path):
    """Redis dies mid-run and comes back empty: workers reconnect, `produce --resume` re-sends what is missing."""
    port = free_port()
    broker = f"redis://127.0.0.1:{port}/0"
    redis_proc = _start_redis(port)
    worker = WorkerProcess(["--cpu", "--model", str(tiny_qwen3), "--layers", E2E_LAYERS, "--max-model-len", "4096",
                            "--name", "restart"], tmp_path / "worker.log", worker_env(broker))
    try:
        worker.wait_ready()
        inputs = prompts_file(tmp_path, n_synthetic=32, with_formats=False)
        state = produce(e2e_storage, "redis-restart", [inputs], tiny_qwen3, "--max-tokens", "48", broker=broker)
        store = RunStore(Storage(str(e2e_storage)), "redis-restart")
        wait_for(lambda: store.done_shards(), 180, "the first finished shard")
        redis_proc.kill()
        redis_proc.wait()
        redis_proc = _start_redis(port)  # same address, nothing kept
        result = CliRunner().invoke(main, ["produce", "--resume", "redis-restart", "--storage", str(e2e_storage),
                                           "--broker", broker], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        wait_run_done(e2e_storage, "redis-restart", timeout=300)
        report(e2e_storage, "redis-restart", state["counts"]["enqueued"])
        # The thread pool cannot cancel running tasks; the worker no longer asks it to on a connection loss.
        assert "kill_job" not in worker.text()
    finally:
        worker.stop()
        redis_proc.kill()
        redis_proc.wait()


def _status_json(storage: Path, run_id: str) -> dict:
    import json

    result = CliRunner().invoke(main, ["status", run_id, "--storage", str(storage), "--broker", E2E_BROKER, "--json",
                                       "--inspect-timeout", "0"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_a_storage_fault_is_retried_never_half_visible_and_shown_in_status(cpu_worker, tiny_qwen3, tmp_path):
    """The shard's output folder cannot be created (a file blocks its path): every write fails with an OSError.
    The attempt's error is recorded, Celery retries with backoff, nothing partial appears; once the fault is
    cleared the retry publishes the shard."""
    storage = tmp_path / "storage"
    inputs = prompts_file(tmp_path, n_synthetic=4, with_formats=False)
    blocker = storage / "storage-fault" / "shards" / "shard-000000"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a folder")
    state = produce(storage, "storage-fault", [inputs], tiny_qwen3)
    store = RunStore(Storage(str(storage)), "storage-fault")

    def failed_attempt():
        # attempt_errors skips the `.name.tmp-*` file of a write in progress, which could be renamed away between
        # listing and reading it (a likely cause of this test's one unexplained failure).
        return next((body for body in attempt_errors(store, "shard-000000") if body.get("error")), None)

    failure = wait_for(failed_attempt, 120, "a failed attempt on the blocked shard")
    assert "Error" in failure["error"]
    assert not store.is_done("shard-000000")
    status = _status_json(storage, "storage-fault")
    assert "Error" in json.dumps(status), status
    blocker.unlink()  # the operator fixes the storage; the retry finishes the shard
    wait_run_done(storage, "storage-fault", timeout=180)
    report(storage, "storage-fault", state["counts"]["enqueued"])


def test_disk_full_leaves_no_partial_shard_and_the_retry_completes(cpu_worker, tiny_qwen3, tmp_path):
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root in a mount namespace)")
    try:
        inputs = prompts_file(tmp_path, n_synthetic=4, with_formats=False)
        state = produce(mount, "disk-full", [inputs], tiny_qwen3, "--max-tokens", "64")
        store = RunStore(Storage(str(mount)), "disk-full")

        def failed():
            return next((body for body in attempt_errors(store, "shard-000000")
                         if "No space left" in body.get("error", "")), None)

        wait_for(failed, 120, "an attempt to fail with ENOSPC")
        assert not store.is_done("shard-000000")
        leftovers = store.storage.listdir(store.rel("shards", "shard-000000"))
        assert not [n for n in leftovers if not n.startswith(".")], leftovers  # nothing half-written is visible
        subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], check=True)
        wait_run_done(mount, "disk-full", timeout=180)
        report(mount, "disk-full", state["counts"]["enqueued"])
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_host_added_mid_run_shares_the_work_and_duplicates_collapse(cpu_worker, e2e_storage, tiny_qwen3,
                                                                       tmp_path):
    """A second worker joins during a run (adding a host is one command), and every shard is also published
    twice (as Redis re-delivery or a second produce would), so the two workers run copies of the same shards
    at once: each shard still has exactly one output."""
    inputs = prompts_file(tmp_path, n_synthetic=200, with_formats=False)
    state = produce(e2e_storage, "two-hosts", [inputs], tiny_qwen3, "--max-tokens", "64")
    store = RunStore(Storage(str(e2e_storage)), "two-hosts")
    wait_for(lambda: store.done_shards() or None, 120, "the first worker to finish a shard")  # the run is under way
    # Hold the run while the new host loads its engine (a fast first worker could otherwise finish alone): a
    # paused run's messages are dropped, and resume-run re-sends every shard without a marker.
    store.storage.write_json(store.pause_path, {"reason": "test: waiting for the second host"})
    second = WorkerProcess(["--cpu", "--model", str(tiny_qwen3), "--layers", E2E_LAYERS, "--max-model-len", "4096",
                            "--name", "second"], tmp_path / "second.log", worker_env())
    try:
        second.wait_ready()
        assert len(store.done_shards()) < state["counts"]["shards"] - 4, "the run ended before the second host came"
        for command in ("resume-run", "reconcile"):  # every remaining shard is published twice
            resent = CliRunner().invoke(main, [command, "two-hosts", "--storage", str(e2e_storage), "--broker",
                                               E2E_BROKER], catch_exceptions=False)
            assert resent.exit_code == 0, resent.output
        wait_run_done(e2e_storage, "two-hosts", timeout=300)
        workers = {store.done_marker(s)["worker"].split("@")[0] for s in store.done_shards()}
        assert workers == {"e2e", "second"}, workers
        ids = report(e2e_storage, "two-hosts", state["counts"]["enqueued"])
        assert len(ids) == state["counts"]["enqueued"]

        def leftovers():
            return [n for s in store.done_shards() for n in store.storage.listdir(store.rel("shards", s))
                    if not n.startswith(store.done_marker(s)["attempt"])]

        # Copies that lost the race delete their files (one may still be finishing when the last marker lands).
        wait_for(lambda: not leftovers(), 120, "losing copies to remove their files")
    finally:
        second.stop()


# Run last: each of these restarts the session worker, and the supervisor's backoff grows with every restart,
# which the poison test above (three restarts against a deadline) must not inherit.
def _cli(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_copies_of_one_shard_held_by_one_worker_and_one_sigkill_give_one_output(cpu_worker, e2e_storage,
                                                                                 tiny_qwen3, tmp_path):
    # The fault run's reproduction: one shard, `produce` plus five `reconcile`s, so one worker is handed six copies
    # of it; one SIGKILL. Before, all six started (six attempt records, one pid) and the kill dead-lettered the
    # shard. Now one copy runs, the others are dropped, and the kill counts once.
    from app.base.celery_app import create_app
    from app.base.config import BrokerConfig

    inputs = prompts_file(tmp_path, n_synthetic=8, with_formats=False)
    drops_before = cpu_worker.text().count("another copy of it runs in this process")
    starts_before = cpu_worker.text().count("engine self-test passed")
    # The worker stops consuming while the six copies are queued (Celery's remote control), then takes them all
    # at once: the copies meet the first while it runs, however fast the machine is. The shard is long (8 x 1,000
    # tokens) because the worker's Celery thread runs at SCHED_BATCH nice 19 (workers.engine.scheduling): on a
    # loaded box it was seen to take the last copies 40 s late, after a 400-token shard had finished.
    control = create_app(BrokerConfig(url=E2E_BROKER)).control
    name = next(n for reply in control.ping(timeout=5) for n in reply if n.startswith("e2e@"))
    assert control.cancel_consumer("regen", destination=[name], reply=True, timeout=10)
    try:
        state = produce(e2e_storage, "copies", [inputs], tiny_qwen3, "--max-tokens", "1000", "--shard-size", "8")
        for _ in range(5):
            _cli("reconcile", "copies", "--storage", str(e2e_storage), "--broker", E2E_BROKER)
    finally:
        assert control.add_consumer("regen", destination=[name], reply=True, timeout=10)
    store = RunStore(Storage(str(e2e_storage)), "copies")
    wait_for(lambda: cpu_worker.text().count("another copy of it runs in this process") - drops_before >= 5, 240,
             "the worker to drop the five extra copies", interval=0.05)
    assert len(store.storage.listdir(store.attempts_dir("shard-000000"))) == 1  # one attempt, not six
    assert not store.is_done("shard-000000"), "the shard finished before the kill; make it longer"
    child = cpu_worker.child_pids()[0]
    os.kill(child, signal.SIGKILL)
    cpu_worker.wait_ready(count=starts_before + 1)
    # Redis restores the killed delivery's message after the visibility timeout; the shard then completes.
    wait_run_done(e2e_storage, "copies", timeout=600)
    assert not store.dead_shards()
    report(e2e_storage, "copies", state["counts"]["enqueued"])
    assert len(run_records(e2e_storage, "copies")) == 8  # exactly one output
    attempts = attempt_errors(store, "shard-000000")
    assert len(attempts) == 2 and len({a["pid"] for a in attempts}) == 2
    wait_for(lambda: not temporaries(e2e_storage / "copies"), 60, "no temporary file under the completed run")


def test_a_dead_lettered_shard_completes_after_retry_dead_and_its_old_errors_are_kept(cpu_worker, e2e_storage,
                                                                                      tiny_qwen3, tmp_path):
    inputs = prompts_file(tmp_path, n_synthetic=8, with_formats=False)
    store = RunStore(Storage(str(e2e_storage)), "revive")
    # The shard failed for good before (say an engine bug since fixed): its attempts and dead letter are on storage.
    old = new_attempt_id()
    store.storage.write_json(f"{store.attempts_dir('shard-000000')}/{old}.json",
                             {"attempt": old, "worker": "gpu0@old", "error": "EngineDead: a bug since fixed",
                              "error_kind": "error", "started": "2026-01-01T00:00:00+00:00"})
    store.storage.write_json(store.dead_path("shard-000000"),
                             {"shard_id": "shard-000000", "reason": "3 attempts failed (limit 3)",
                              "attempts": attempt_errors(store, "shard-000000")})
    state = produce(e2e_storage, "revive", [inputs], tiny_qwen3)
    wait_for(lambda: store.is_done("shard-000001"), 120, "the healthy shard")
    assert not store.is_done("shard-000000")
    # reconcile does not send it (the worker would only skip it) and says how to bring it back.
    out = _cli("reconcile", "revive", "--storage", str(e2e_storage), "--broker", E2E_BROKER)
    assert "regen retry-dead revive" in out
    assert store.storage.read_json(store.produce_path)["counts"]["shards_skipped_dead"] == 1
    status = _status_json(e2e_storage, "revive")
    assert status["shards"]["dead"] == 1 and status["retry_dead"] == "regen retry-dead revive"
    out = _cli("retry-dead", "revive", "--storage", str(e2e_storage), "--broker", E2E_BROKER)
    assert "re-sent 1 shard" in out
    wait_run_done(e2e_storage, "revive", timeout=120)
    report(e2e_storage, "revive", state["counts"]["enqueued"])
    assert not store.dead_shards()
    archived = list((e2e_storage / "revive" / "archive" / "shard-000000").iterdir())
    assert len(archived) == 1
    letter = json.loads((archived[0] / "dead.json").read_text())
    assert letter["attempts"][0]["error"] == "EngineDead: a bug since fixed"
    assert json.loads((archived[0] / "attempts" / f"{old}.json").read_text())["error"] == "EngineDead: a bug since fixed"
    assert [a["attempt"] for a in attempt_errors(store, "shard-000000")] != [old]  # counting starts afresh


def test_messages_the_worker_cannot_use_are_set_aside_and_counted_and_it_keeps_running(cpu_worker, e2e_redis,
                                                                                       e2e_storage, tmp_path):
    import base64

    from app.base.celery_app import GENERATE_TASK, create_app
    from app.base.config import BrokerConfig

    child = cpu_worker.child_pids()[0]
    engine = engine_host_pid(child)
    before = dead_messages.count(E2E_BROKER) or 0
    e2e_redis.lpush("regen", b"\x00\x01 garbage \xff")  # not JSON at all
    envelope = {"body": "!!! not base64 !!!", "content-encoding": "utf-8", "content-type": "application/json",
                "headers": {"task": GENERATE_TASK, "id": "bad-base64"},
                "properties": {"delivery_tag": "bad-base64", "body_encoding": "base64",
                               "delivery_info": {"exchange": "", "routing_key": "regen"}}}
    e2e_redis.lpush("regen", json.dumps(envelope))
    not_a_task = {**envelope, "body": base64.b64encode(b'{"a": 1}').decode(),
                  "properties": {**envelope["properties"], "delivery_tag": "not-a-task"}}
    e2e_redis.lpush("regen", json.dumps(not_a_task))
    app = create_app(BrokerConfig(url=E2E_BROKER))
    app.send_task(GENERATE_TASK, kwargs={"run_id": "no-such-run", "storage": str(e2e_storage),
                                         "shard_id": "shard-000000", "samples": []}, queue="regen")
    app.send_task(GENERATE_TASK, kwargs={"run_id": 5, "storage": str(e2e_storage), "shard_id": "shard-000000",
                                         "samples": "nope"}, queue="regen")
    app.send_task(GENERATE_TASK, kwargs={"run": "x"}, queue="regen")  # arguments of another task
    wait_for(lambda: (dead_messages.count(E2E_BROKER) or 0) - before >= 6, 60, "six messages set aside")
    reasons = " | ".join(e["reason"] for e in dead_messages.recent(E2E_BROKER, 6))
    for expected in ("not a JSON envelope", "not valid base64", "not a task message", "run no-such-run is not on",
                     "run_id must be a non-empty string", "arguments do not fit"):
        assert expected in reasons, reasons
    assert all(e["queue"] == "regen" and e["hexdump"] for e in dead_messages.recent(E2E_BROKER, 6))
    # The same worker process and the same engine process: nothing restarted.
    assert cpu_worker.child_pids() == [child] and engine_host_pid(child) == engine
    # Counted where operators look: `regen status` (the overview's broker line) and `regen metrics`.
    result = CliRunner().invoke(main, ["status", "--storage", str(e2e_storage), "--broker", E2E_BROKER, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["broker"]["dead_messages"] >= before + 6
    from app.ops.metrics import RegenCollector

    families = {f.name: f for f in RegenCollector(str(e2e_storage), E2E_BROKER).collect()}
    assert families["regen_dead_messages"].samples[0].value >= before + 6


def test_an_idle_worker_notices_its_engine_died_within_seconds(cpu_worker):
    import time

    starts_before = cpu_worker.text().count("engine self-test passed")
    child = cpu_worker.child_pids()[0]
    engine = engine_host_pid(child)
    killed = time.monotonic()
    os.kill(engine, signal.SIGKILL)
    wait_for(lambda: process_gone(child), 15, "the idle worker to exit after its engine died")
    print(f"idle worker exited {time.monotonic() - killed:.1f}s after its engine was killed")
    cpu_worker.wait_ready(count=starts_before + 1)
