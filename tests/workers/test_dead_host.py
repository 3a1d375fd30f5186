"""A worker host dies (power cut: its whole PID namespace SIGKILLed) with shards held, the broker's visibility
timeout at its default (4 h): the other host re-sends them within a few lease lengths and finishes the run.

The two workers' identities differ as two hosts' do: the dying one runs in its own UTS and PID namespaces
(`unshare`, as root) with its own host name, so the survivor can judge its attempts only by their leases. Leases
are short here (`REGEN_HEARTBEAT_S=1`: 4 s); everything else is the default, the visibility timeout included.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest
from click.testing import CliRunner

from app.base.ledger import attempt_errors
from app.base.storage import RunStore, Storage
from app.cli import main
from tests.support.faults import report
from tests.support.polling import wait_for
from tests.support.redis_db import flushed_redis, redis_url
from tests.support.runs import produce, prompts_file, wait_run_done
from tests.support.workers import E2E_LAYERS, WorkerProcess, worker_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BROKER = redis_url(13)  # its own db (12 is the MTP runs'): the session workers' 20 s visibility timeout must not restore anything
HEARTBEAT_S = 1.0
DEAD_HOST = "regen-host-a"
UNSHARE = ("unshare", "--uts", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c",
           f'hostname {DEAD_HOST} && exec "$@"', "sh")


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run([*UNSHARE, "true"], capture_output=True).returncode == 0


def _env() -> dict:
    env = worker_env(BROKER)
    for name in ("REGEN_VISIBILITY_TIMEOUT", "REGEN_UNACKED_RESTORE_INTERVAL"):
        env.pop(name, None)  # the defaults: 4 h before Redis gives a held message back
    env["REGEN_HEARTBEAT_S"] = str(HEARTBEAT_S)
    return env


def _worker(tiny_qwen3, name: str, log_dir, prefix=()) -> WorkerProcess:
    return WorkerProcess(["--cpu", "--model", str(tiny_qwen3), "--layers", E2E_LAYERS, "--max-model-len", "4096",
                          "--max-num-seqs", "16", "--name", name], log_dir / f"{name}.log", _env(), prefix)


def test_a_dead_hosts_shards_come_back_within_a_few_leases(tiny_qwen3, tmp_path):
    if not _can_unshare():
        pytest.skip("unshare --uts --pid needs root (or user namespaces) on this machine")
    redis = flushed_redis(BROKER)
    storage = tmp_path / "storage"
    dying = _worker(tiny_qwen3, "dying", tmp_path, UNSHARE)
    survivor = _worker(tiny_qwen3, "survivor", tmp_path)
    try:
        dying.wait_ready()
        # the survivor is ready too before anything is produced, so the dying host takes only its share
        survivor.wait_ready()
        inputs = prompts_file(tmp_path, n_synthetic=48, with_formats=False)
        state = produce(storage, "dead-host", [inputs], tiny_qwen3, "--max-tokens", "96", broker=BROKER)
        store = RunStore(Storage(str(storage)), "dead-host")

        def held_by_dying(renewed: bool = False) -> set[str] | None:
            """Unfinished shards with an attempt of the dying host's (`renewed`: whose lease it renewed)."""
            held = {s for s in store.storage.listdir(store.rel("attempts")) if not store.is_done(s)
                    and any(a.get("host") == DEAD_HOST and (not renewed or a["heartbeat"] > a["started"])
                            for a in attempt_errors(store, s))}
            return held or None

        held = wait_for(lambda: held_by_dying(renewed=True), 240, "the dying host to hold shards", interval=0.05)
        os.killpg(dying.proc.pid, signal.SIGKILL)  # the power cut: supervisor, worker, engine, all at once
        killed_at = time.monotonic()
        dying.proc.wait()
        held = {s for s in held_by_dying() or held if not store.is_done(s)}
        assert held and redis.hlen("unacked") >= len(held)  # its messages stay unacked for 4 h

        wait_run_done(storage, "dead-host", timeout=300)
        took = time.monotonic() - killed_at
        print(f"[dead-host] shards held by the dead host: {sorted(held)}; run done {took:.0f} s after the kill")
        assert "re-sent" in survivor.text()
        for shard in held:  # finished by the survivor, not waited out
            assert store.done_marker(shard)["worker"].startswith("survivor@"), shard
        report(storage, "dead-host", state["counts"]["enqueued"])
        verify = CliRunner().invoke(main, ["verify", "dead-host", "--storage", str(storage)])
        assert verify.exit_code == 0, verify.output

        status = CliRunner().invoke(main, ["status", "dead-host", "--storage", str(storage), "--broker", BROKER,
                                           "--json", "--inspect-timeout", "2"])
        assert status.exit_code == 0, status.output
        workers = {w["name"]: w for w in json.loads(status.stdout)["workers"]}
        dead = workers[f"dying@{DEAD_HOST}"]
        assert dead["state"] == "dead" and dead["current_shard"] is None and dead["online"] is False, dead
        assert dead["heartbeat_age_s"] >= 4 * HEARTBEAT_S
        alive = next(w for n, w in workers.items() if n.startswith("survivor@"))
        assert alive["state"] != "dead" and alive["online"] is True
    finally:
        survivor.stop()
        if dying.proc.poll() is None:
            os.killpg(dying.proc.pid, signal.SIGKILL)
            dying.proc.wait()
        dying.log.close()
