"""`regen status`: numbers from storage markers, queue length from Redis, live workers from Celery."""

from __future__ import annotations

import datetime as dt
import json

from click.testing import CliRunner

from app.cli import main
from tests.support.polling import wait_for
from tests.support.redis_db import OPS_BROKER
from tests.support.status_run import (
    DEAD,
    DONE,
    FAILED,
    PAUSE_REASON,
    RUNNING,
    STATUS_QUEUE,
    TOTAL_SHARDS,
    build_status_run,
)

BROKER = OPS_BROKER


def _status(*args: str) -> dict:
    result = CliRunner().invoke(main, ["status", *args, "--broker", BROKER, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_status_json_matches_what_storage_and_redis_hold(tmp_path, redis7):
    built = build_status_run(str(tmp_path))
    redis7.lpush(STATUS_QUEUE, b"m1", b"m2")  # two messages waiting (contents do not matter to LLEN)
    s = _status("r1", "--storage", str(tmp_path), "--inspect-timeout", "0")

    markers = [built["store"].done_marker(sh) for sh in DONE]
    assert s["shards"] == {"total": TOTAL_SHARDS, "done": 3, "queued": 2, "running": 1, "failed": 1, "stale": 0,
                           "dead": 1, "remaining": TOTAL_SHARDS - 4, "waiting": TOTAL_SHARDS - 4 - 2}
    assert s["samples"]["done"] == sum(m["samples"] for m in markers) == 11
    assert s["samples"]["ok"] == 11 and s["samples"]["stubs"] == 3
    assert s["stub_rate"] == round(3 / 11, 6)
    assert s["tokens"] == {"prompt": sum(m["prompt_tokens"] for m in markers),
                           "generated": sum(m["generated_tokens"] for m in markers),
                           "generation_seconds": 6.5}
    by_worker = {w["name"]: w for w in s["workers"]}
    assert by_worker["gpu0@hostA"]["generated_tokens"] == 4 * 50 + 4 * 40
    assert by_worker["gpu0@hostA"]["tokens_per_s"] == round(360 / 3.5, 3)
    assert by_worker["gpu1@hostA"]["tokens_per_s"] == round(90 / 3.0, 3)
    assert s["rates"]["engine_tokens_per_s"] == round(360 / 3.5, 3) + round(90 / 3.0, 3)
    # Wall window: earliest (finished - generation_seconds) to the last finished.
    finished = {sh: m["finished"] for sh, m in zip(DONE, markers, strict=True)}
    from app.ops.status import parse_time

    start = min(parse_time(finished[sh]) - DONE[sh][5] for sh in DONE)
    wall = max(parse_time(f) for f in finished.values()) - start
    assert s["rates"]["wall_seconds"] == round(wall, 3)
    assert s["rates"]["wall_tokens_per_s"] == round(450 / wall, 3)
    assert s["eta_seconds"] == round((TOTAL_SHARDS - 4) / (3 / wall), 1)
    assert s["paused"]["reason"] == PAUSE_REASON
    assert [f["shard"] for f in s["failed"]] == [FAILED]
    assert "hunter2" not in json.dumps(s) and "redis://:***@broker" in s["failed"][0]["last_error"]
    assert s["dead"] == [{"shard": DEAD, "reason": "PermanentError: prompt too long"}]
    assert by_worker["gpu1@hostA"]["current_shard"] == RUNNING and by_worker["gpu1@hostA"]["source"] == "storage"
    assert by_worker["gpu0@hostA"]["current_shard"] is None
    assert s["workers"][0]["online"] is None  # not asked
    assert s["broker"]["url"] == BROKER and s["broker"]["error"] is None


def test_an_old_attempt_without_marker_or_error_counts_as_stale(tmp_path, redis7):
    from app.base.ledger import record_attempt

    built = build_status_run(str(tmp_path))
    # written by this (live) process, so it names another host: a record of this host's would be judged by its pid
    record_attempt(built["store"], "shard-000006", "old", "gpu0@hostA", started="2020-01-01T00:00:00+00:00",
                   host="another-host")
    s = _status("r1", "--storage", str(tmp_path), "--inspect-timeout", "0")
    assert s["shards"]["stale"] == 1 and s["shards"]["running"] == 1 and s["shards"]["waiting"] == 1


def test_without_a_run_status_lists_every_run_one_line_each(tmp_path, redis7):
    build_status_run(str(tmp_path), "r1")
    build_status_run(str(tmp_path), "r2")
    (tmp_path / "not-a-run").mkdir()
    s = _status("--storage", str(tmp_path))
    assert [r["run"] for r in s["runs"]] == ["r1", "r2"]
    assert s["runs"][0]["done"] == 3 and s["runs"][0]["paused"] == PAUSE_REASON
    plain = CliRunner().invoke(main, ["status", "--storage", str(tmp_path), "--broker", BROKER])
    assert plain.exit_code == 0 and "r1" in plain.output and "r2" in plain.output


def test_status_masks_the_broker_password_and_survives_an_unreachable_broker(tmp_path):
    build_status_run(str(tmp_path))
    url = "redis://:hunter2@127.0.0.1:1/0"  # nothing listens on port 1
    for extra in (["--json"], []):
        result = CliRunner().invoke(main, ["status", "r1", "--storage", str(tmp_path), "--broker", url, *extra])
        assert result.exit_code == 0, result.output
        assert "hunter2" not in result.output and "redis://:***@127.0.0.1:1/0" in result.output
    s = json.loads(CliRunner().invoke(main, ["status", "r1", "--storage", str(tmp_path), "--broker", url,
                                             "--json"]).stdout)
    assert s["broker"]["error"] and s["shards"]["done"] == 3 and s["shards"]["queued"] is None


def test_unknown_or_invalid_run_is_one_line_and_exit_2(tmp_path):
    for run in ("nope", "../etc", "/abs"):
        result = CliRunner().invoke(main, ["status", run, "--storage", str(tmp_path), "--broker", BROKER])
        assert result.exit_code == 2, result.output
        assert result.output.count("\n") == 1 and result.output.startswith("regen: error:")


def test_a_live_worker_reports_the_shard_it_runs(tmp_path, redis7):
    """A threads-pool worker answers inspect mid-task; status shows its current shard from the broker."""
    from tests.support.celery_app import CeleryTestWorker, app

    build_status_run(str(tmp_path))
    release = tmp_path / "release"
    with CeleryTestWorker(tmp_path / "worker.log", STATUS_QUEUE + "-live", "gpu7@testhost", pool="threads") as worker:
        worker.wait_ready()
        app.send_task("regen_test.hold", kwargs={"run_id": "r1", "storage": str(tmp_path),
                                                 "shard_id": "shard-000007", "release": str(release)},
                      queue=STATUS_QUEUE + "-live")

        def live():
            s = _status("r1", "--storage", str(tmp_path), "--inspect-timeout", "1")
            w = {w["name"]: w for w in s["workers"]}.get("gpu7@testhost")
            return s if w and w["current_shard"] == "shard-000007" else None

        s = wait_for(live, 30, "status to show the live worker's shard")
        release.write_text("go")
        w = {w["name"]: w for w in s["workers"]}
        assert w["gpu7@testhost"]["online"] is True and w["gpu7@testhost"]["source"] == "broker"
        assert w["gpu0@hostA"]["online"] is False  # known from storage, silent on the broker


def test_status_names_the_shards_the_broker_lost_and_the_command_that_re_sends_them(tmp_path, redis7):
    from app.base import ledger

    built = build_status_run(str(tmp_path))
    args = ("r1", "--storage", str(tmp_path), "--inspect-timeout", "0")
    assert _status(*args)["lost_from_broker"] is None  # paused: its shards are held back on purpose
    ledger.clear_pause(built["store"])
    # Nothing in Redis, and storage has 2 shards never attempted and 1 failed whose retry is not coming: lost.
    lost = _status(*args)["lost_from_broker"]
    assert lost == {"shards": TOTAL_SHARDS - 4 - 2 + 1, "reconcile": "regen reconcile r1"}
    text = " ".join(CliRunner().invoke(main, ["status", *args, "--broker", BROKER]).output.split())  # unwrapped
    assert "3 shards are neither queued nor running (lost from the broker): regen reconcile r1" in text
    redis7.lpush(STATUS_QUEUE, b"m1")  # a message waits: it may be one of them, so nothing is called lost
    assert _status(*args)["lost_from_broker"] is None
    redis7.delete(STATUS_QUEUE)
    redis7.hset("unacked", "tag", b"{}")  # one unacked anywhere: the same
    assert _status(*args)["lost_from_broker"] is None


def test_a_dead_host_holds_no_shard_shows_dead_and_its_shards_are_named(tmp_path, redis7):
    """The field report: 63 s after host A died (its lease 12 s) status listed A and B both on one shard. Each
    attempt is judged by its own liveness: B runs it, A is dead with its last heartbeat's age and no shard."""
    import datetime as dt

    from app.base.ledger import record_attempt

    built = build_status_run(str(tmp_path))
    ago = (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=63)).isoformat()
    for shard in ("shard-000006", "shard-000007"):  # host A held both when it died
        record_attempt(built["store"], shard, f"a{shard[-1]}" * 6, "cpu@hostA", host="hostA", started=ago,
                       heartbeat=ago, lease_s=12)
    record_attempt(built["store"], "shard-000006", "b" * 12, "cpu@hostB", host="hostB", lease_s=12)  # B took one
    s = _status("r1", "--storage", str(tmp_path), "--inspect-timeout", "0")
    workers = {w["name"]: w for w in s["workers"]}
    a, b = workers["cpu@hostA"], workers["cpu@hostB"]
    assert a["state"] == "dead" and a["current_shard"] is None and 60 <= a["heartbeat_age_s"] < 120, a
    assert b["state"] == "running" and b["current_shard"] == "shard-000006", b
    assert [(h["shard"], h["host"], h["worker"]) for h in s["held_by_dead"]] == [("shard-000007", "hostA",
                                                                                  "cpu@hostA")]
    assert s["shards"]["running"] == 2 and s["shards"]["stale"] == 1  # RUNNING's, B's; A's other shard
    table = CliRunner().invoke(main, ["status", "r1", "--storage", str(tmp_path), "--broker", BROKER,
                                      "--inspect-timeout", "0"], terminal_width=200)
    assert "held by a dead worker: shard-000007 (cpu@hostA on host hostA" in table.output, table.output


def test_a_warm_rescan_lists_only_the_open_keys_attempts_and_sees_what_changed(tmp_path, monkeypatch):
    """A --watch or a scrape must not list every attempt folder of the run on each pass (O(run) listings a scrape,
    ~1.4M at a thousand GPUs): after the first scan, settled keys' attempts come from the scanner's memory."""
    from app.base.storage_counts import read_all
    from app.ops.status import RunScanner, summarise
    from tests.support.status_run import publish_synthetic

    built = build_status_run(str(tmp_path))
    store, counts = built["store"], tmp_path / "counts"
    monkeypatch.setenv("REGEN_STORAGE_COUNTS", str(counts))
    scanner = RunScanner(store)
    first = scanner.scan()
    cold = read_all(str(counts))
    open_keys = {k for k in first.attempts if k not in first.done and k not in first.dead}
    assert open_keys == {FAILED, RUNNING}
    assert cold["list:attempts"] == 1  # one walk of attempts/

    second = scanner.scan()
    warm = read_all(str(counts)) - cold
    assert warm["list:attempts"] == 1 + len(open_keys)  # attempts/ and the two open keys' folders
    assert warm["read:done"] == 0 and warm["read:dead"] == 0
    assert second.attempts == first.attempts and second.done == first.done and second.dead == first.dead

    # the running shard finishes: the next warm scan sees its marker and then keeps its attempts
    publish_synthetic(store, RUNNING, "gpu1@hostA", 2, 0, 5, 20, 1.0, attempt="a9")
    third = scanner.scan()
    fresh = RunScanner(store).scan()
    assert third.done.keys() == fresh.done.keys() and RUNNING in third.done
    assert third.attempts == fresh.attempts and len(third.attempts[RUNNING]) == 2
    before = read_all(str(counts))
    scanner.scan()
    assert (read_all(str(counts)) - before)["list:attempts"] == 1 + 1  # only the failed key is still open
    now = dt.datetime.now(dt.UTC).timestamp()
    assert summarise(scanner.scan(), now) == summarise(RunScanner(store).scan(), now)
