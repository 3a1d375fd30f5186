"""A fault soak, run on demand: many kill/restart cycles and one broker loss over a long run of shards.

    python scripts/soak_faults.py [--shards 200] [--shard-size 4] [--workers 2] [--kill-every 8 20]
                                  [--max-tokens 48] [--seed 0] [--timeout 3600] [--keep DIR]

What it does, all with real parts: a private `redis-server` on a free port, a tiny random Qwen3 built offline,
`--workers` real `regen worker --cpu` supervisors (visibility timeout 20 s, unacked sweep every 5 s), and one
`regen produce` of `--shards` shards. Every `--kill-every` seconds (uniform in the range) one of: a worker
process SIGKILLed (its engine process dies with it), its engine process alone SIGKILLed, or a SIGTERM (warm
shutdown); the supervisors restart them. Once, when about a third of the shards are done, the broker is killed
and restarted empty, and `regen reconcile` re-sends what has no marker. The faults go on until every shard is
done or `--timeout` passes.

It ends with the figures (shards, samples expected / written / duplicated / lost, dead-lettered shards, faults of
each kind, attempts per shard, temporaries left, `regen verify`'s verdict) as one JSON line, and exits 0 only
with 0 lost, 0 duplicated, 0 dead-lettered, no temporary left and verify passing. Not part of the test suite: at
the default size it takes tens of minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port: int) -> subprocess.Popen:
    import redis

    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if client.ping():
                return proc
        except redis.exceptions.ConnectionError:
            time.sleep(0.1)
    raise RuntimeError(f"redis-server on port {port} did not start")


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def engine_of(worker_pid: int) -> int | None:
    from workers.engine.process import PROCESS_NAME

    for pid in children(worker_pid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == PROCESS_NAME:
                return pid
        except FileNotFoundError:
            continue
    return None


def cli(*args: str, env: dict) -> str:
    result = subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=REPO, env=env, capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise RuntimeError(f"regen {' '.join(args[:2])} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=200)
    ap.add_argument("--shard-size", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kill-every", type=float, nargs=2, default=(8.0, 20.0), metavar=("MIN", "MAX"))
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--keep", default=None, help="Work folder to keep (default: a temporary one, removed)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = Path(args.keep or tempfile.mkdtemp(prefix="regen-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    storage, run_id = work / "storage", "soak"
    port = free_port()
    broker = f"redis://127.0.0.1:{port}/0"
    env = {**os.environ, "REGEN_BROKER_URL": broker, "REGEN_VISIBILITY_TIMEOUT": "20",
           "REGEN_UNACKED_RESTORE_INTERVAL": "5", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "REGEN_STATE_DIR": str(work / "state"),
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    redis_proc = start_redis(port)
    supervisors: list[subprocess.Popen] = []
    faults: Counter = Counter()
    started = time.monotonic()
    try:
        from workers.tiny_model import build_tiny_qwen3

        model = build_tiny_qwen3(str(work / "tiny-qwen3"))
        for k in range(args.workers):
            log = open(work / f"worker{k}.log", "wb")  # noqa: SIM115
            supervisors.append(subprocess.Popen(
                [sys.executable, "-m", "app.cli", "worker", "--cpu", "--model", model, "--layers", "vllm:1,2,4",
                 "--max-model-len", "4096", "--max-num-seqs", "16", "--name", f"soak{k}"],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        prompts = work / "prompts.jsonl"
        n = args.shards * args.shard_size
        prompts.write_text("".join(json.dumps({"question": f"Soak {i}: what is {i} plus {i * 7}?"}) + "\n"
                                   for i in range(n)))
        cli("produce", str(prompts), "--run", run_id, "--storage", str(storage), "--model", model, "--broker", broker,
            "--max-tokens", str(args.max_tokens), "--shard-size", str(args.shard_size),
            "--layers", "vllm:1,2,4", env=env)
        from app.base.storage import RunStore, Storage

        store = RunStore(Storage(str(storage)), run_id)
        broker_lost = False
        next_fault = time.monotonic() + rng.uniform(*args.kill_every)
        while len(store.done_shards()) < args.shards and time.monotonic() - started < args.timeout:
            time.sleep(0.5)
            if not broker_lost and len(store.done_shards()) >= args.shards // 3:
                redis_proc.kill()
                redis_proc.wait()
                redis_proc = start_redis(port)  # same address, nothing kept
                cli("reconcile", run_id, "--storage", str(storage), "--broker", broker, env=env)
                broker_lost = True
                faults["broker_lost_and_reconciled"] += 1
            if time.monotonic() < next_fault:
                continue
            next_fault = time.monotonic() + rng.uniform(*args.kill_every)
            sup = rng.choice(supervisors)
            kids = children(sup.pid)
            if not kids:
                faults["skipped_no_worker"] += 1
                continue
            kind = rng.choice(["worker_sigkill", "engine_sigkill", "worker_sigterm"])
            engine = engine_of(kids[0])
            try:
                if kind == "engine_sigkill" and engine:
                    os.kill(engine, signal.SIGKILL)
                elif kind == "worker_sigterm":
                    os.kill(kids[0], signal.SIGTERM)
                else:
                    kind = "worker_sigkill"
                    os.kill(kids[0], signal.SIGKILL)
                faults[kind] += 1
            except ProcessLookupError:
                faults["skipped_gone"] += 1
        elapsed = time.monotonic() - started
        return report(store, storage, run_id, args, faults, elapsed)
    finally:
        for sup in supervisors:
            if sup.poll() is None:
                sup.send_signal(signal.SIGTERM)
        for sup in supervisors:
            try:
                sup.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(sup.pid, signal.SIGKILL)
        redis_proc.kill()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def report(store, storage: Path, run_id: str, args, faults: Counter, elapsed: float) -> int:
    from app.base.jsonl_zst import loads_jsonl_zst
    from app.base.ledger import attempt_errors
    from app.data.run_reader import RunReader
    from app.data.verify import verify_run

    ids: Counter = Counter()
    for shard in store.done_shards():
        marker = store.done_marker(shard)
        for r in loads_jsonl_zst(store.storage.read_bytes(marker["files"]["records"]["path"])):
            ids[r["sample_id"]] += 1
    expected = args.shards * args.shard_size
    deadline = time.monotonic() + 60  # a losing copy may still be removing its files
    while time.monotonic() < deadline and list((storage / run_id).rglob(".*.tmp-*")):
        time.sleep(1)
    temporaries = sorted(str(p.relative_to(storage / run_id)) for p in (storage / run_id).rglob(".*.tmp-*"))
    attempts = [len(attempt_errors(store, s)) for s in store.done_shards() | store.dead_shards()]
    verify = verify_run(RunReader(str(storage), run_id))
    figures = {
        "shards": args.shards, "shards_done": len(store.done_shards()), "dead_lettered": len(store.dead_shards()),
        "samples_expected": expected, "samples_written": sum(ids.values()),
        "duplicated": sum(n - 1 for n in ids.values()), "lost": expected - len(ids),
        "faults": dict(faults), "worker_restarts": sum(p.read_text(errors="replace").count(" exited with ")
                                                        for p in storage.parent.glob("worker*.log")),
        "shards_interrupted": sum(n > 1 for n in attempts), "attempts_per_shard_max": max(attempts, default=0),
        "attempts_total": sum(attempts), "temporaries_left": len(temporaries),
        "verify_ok": verify.ok(), "verify_headline": verify.headline(),
        "verify_errors": [f"{p.kind} {p.shard}: {p.detail}" for p in verify.errors()][:5],
        "elapsed_s": round(elapsed, 1),
    }
    print(json.dumps(figures))
    good = (figures["lost"], figures["duplicated"], figures["dead_lettered"], figures["temporaries_left"]) == (0, 0, 0, 0)
    return 0 if good and verify.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
