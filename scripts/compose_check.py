#!/usr/bin/env python3
"""The compose check's scenario: compose.yaml's `cpu` profile run through a real container engine.

Started by scripts/compose_check.sh once the engine, compose v2 and the `regen:cpu` image exist; only the
standard library and the `docker` CLI are used on the host, so it runs on any machine with an engine. It brings up
a project of its own (`docker compose -p regen-check`, its own .env, storage folder and free ports on 127.0.0.1)
and checks, printing each step with its figures:

1. a run produced through `producer-cpu` and finished by two `worker-cpuN` containers; `regen verify` (in a
   container) passes; every input line is in exactly one record (lost 0, duplicated 0);
2. a second run produced while the workers are frozen (`docker compose pause`): Flower answers on its published
   port only with its login, and its API lists the run's queue with the backlog; the metrics endpoint exports
   the same queue length; every published port is bound to 127.0.0.1 and nothing answers on other addresses;
3. `docker kill` of one worker mid-shard: the run completes (time from the kill), nothing lost or duplicated,
   `regen status` shows the killed worker dead;
4. `docker compose restart redis` mid-run (AOF on): the queue is still there after the restart, the run completes;
5. `docker compose down` in the middle of a third run, then `up`: the run resumes from storage and completes,
   and the two finished runs stay finished (no attempt added, no marker rewritten, nothing queued).
The workers serve every run with their model and layers, so they start twice in all (each start builds a vLLM
engine, the slow part on a loaded machine).
At the end the project is removed with its volumes (`down -v`); `--keep` leaves it up for a look.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT = "regen-check"
WORK = Path(os.environ.get("REGEN_CHECK_DIR") or "/tmp/regen-compose-check")
ENV_FILE = WORK / "check.env"
STORAGE = WORK / "storage"
INPUTS = WORK / "inputs"
REPORT: list[str] = []
T0 = time.monotonic()


def step(text: str) -> None:
    line = f"[{time.monotonic() - T0:6.0f}s] {text}"
    print(line, flush=True)
    REPORT.append(line)


def fail(text: str) -> None:
    step(f"FAILED: {text}")
    raise SystemExit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Env:
    """The project's .env: secrets made here, free ports, this check's storage and inputs."""

    def __init__(self) -> None:
        self.values = {
            "REDIS_PASSWORD": secrets.token_hex(16), "FLOWER_USER": "regen", "FLOWER_PASSWORD": secrets.token_hex(12),
            "REDIS_IMAGE": os.environ.get("REDIS_IMAGE", "redis:7"), "REGEN_CPU_IMAGE": "regen:cpu",
            "REGEN_STORAGE_DIR": str(STORAGE), "REGEN_INPUT_DIR": str(INPUTS),
            "REDIS_PORT": str(free_port()), "FLOWER_PORT": str(free_port()), "METRICS_PORT": str(free_port()),
        }

    def set(self, **kw: str) -> None:
        self.values.update(kw)
        ENV_FILE.write_text("".join(f"{k}={v}\n" for k, v in self.values.items()))
        ENV_FILE.chmod(0o600)

    def __getitem__(self, key: str) -> str:
        return self.values[key]


ENV = Env()


def dc(*args: str, check: bool = True, timeout: float = 900, quiet: bool = False) -> subprocess.CompletedProcess:
    cmd = ["docker", "compose", "-p", PROJECT, "--env-file", str(ENV_FILE), "--profile", "cpu", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        fail(f"`docker compose {' '.join(args)}` exited {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}")
    if not quiet and proc.returncode == 0 and os.environ.get("REGEN_CHECK_VERBOSE"):
        print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
    return proc


def in_container(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """A command in a fresh container of the CPU image with the project's broker and storage (a `run` of
    producer-cpu's service, so its environment and volumes, without starting anything else)."""
    return dc("run", "--rm", "--no-deps", "-T", "producer-cpu", *argv, check=check)


def write_inputs(name: str, n: int) -> str:
    """n distinct single-turn prompts; returns the path the producer sees."""
    INPUTS.mkdir(parents=True, exist_ok=True)
    topics = ["message queues", "hidden states", "speculative decoding", "Redis persistence", "container engines",
              "exactly-once delivery", "zstd compression", "thinking-mode generation"]
    with open(INPUTS / f"{name}.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"{name} #{i}: explain {topics[i % len(topics)]} in {3 + i % 5} steps."})
                    + "\n")
    return f"/inputs/{name}.jsonl"


def done_count(run: str) -> int:
    folder = STORAGE / run / "done"
    return sum(1 for p in folder.glob("*.json")) if folder.is_dir() else 0


def shard_total(run: str) -> int:
    produce = STORAGE / run / "produce.json"
    return int(json.loads(produce.read_text())["counts"]["shards"])


def running_attempts(run: str, worker_prefix: str) -> list[str]:
    """Shards with an attempt file of this worker and no completion marker (what it holds right now)."""
    held = []
    for shard_dir in sorted((STORAGE / run / "attempts").glob("shard-*")):
        if (STORAGE / run / "done" / f"{shard_dir.name}.json").exists():
            continue
        for f in shard_dir.glob("*.json"):
            try:
                a = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if str(a.get("worker", "")).startswith(worker_prefix) and "error" not in a:
                held.append(shard_dir.name)
    return held


def wait_for(what: str, cond, timeout: float, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    fail(f"{what}: not reached in {timeout:.0f}s")


def wait_done(run: str, timeout: float) -> float:
    started = time.monotonic()
    total = shard_total(run)
    wait_for(f"run {run} complete ({total} shards)", lambda: done_count(run) >= total, timeout)
    return time.monotonic() - started


def producer_exit(run: str, timeout: float = 300) -> None:
    def exited():
        out = dc("ps", "-a", "--format", "json", "producer-cpu", quiet=True).stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip().startswith("{")]
        return rows and rows[0].get("State") == "exited" and rows[0]
    row = wait_for("producer-cpu exits", exited, timeout)
    if row.get("ExitCode") != 0:
        fail(f"producer-cpu exited {row.get('ExitCode')}: {dc('logs', 'producer-cpu').stdout[-1500:]}")


def status(run: str) -> dict:
    out = dc("exec", "-T", "metrics", "regen", "status", run, "--json", quiet=True).stdout
    return json.loads(out)


def verify(run: str) -> str:
    proc = in_container("regen", "verify", run, "--json", check=False)
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        fail(f"regen verify {run} printed no JSON (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-800:]}")
    if proc.returncode != 0:
        fail(f"regen verify {run} exited {proc.returncode}: {json.dumps(report)[:1500]}")
    acc = report.get("accounting", {})
    return (f"regen verify exit 0: read {acc.get('read')}, written {acc.get('written')}, duplicates in input "
            f"{acc.get('duplicates')}, rejected {acc.get('rejected_producer')}, identity holds {acc.get('identity_holds')}")


COUNT = """
import collections, json, sys
from app.data.run_reader import RunReader
reader = RunReader('/data/runs', sys.argv[1])
lines = collections.Counter(rec['source']['line'] for _, rec in reader.iter_records())
n = int(sys.argv[2])
print(json.dumps({'records': sum(lines.values()), 'lost': sum(1 for i in range(1, n + 1) if i not in lines),
                  'duplicated': sum(c - 1 for c in lines.values() if c > 1),
                  'foreign': sum(1 for k in lines if not 1 <= k <= n)}))
"""


def accounted(run: str, n: int) -> dict:
    """Every input line in exactly one record: counted from the stored records' provenance, not from markers."""
    out = in_container("python3", "-c", COUNT, run, str(n)).stdout
    counts = json.loads(out.strip().splitlines()[-1])
    if counts["records"] != n or counts["lost"] or counts["duplicated"] or counts["foreign"]:
        fail(f"run {run}: {n} input lines but {counts}")
    return counts


def http(url: str, auth: tuple[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return 0, str(e)


def redis_cli(*args: str) -> int:
    cmd = "redis-cli --no-auth-warning -a \"$REDIS_PASSWORD\" " + " ".join(args)
    return int(dc("exec", "-T", "redis", "sh", "-c", cmd, quiet=True).stdout.strip())


def llen(queue: str) -> int:
    return redis_cli("llen", queue)


def held_messages() -> tuple[int, int]:
    """(waiting in `regen`, fetched and not yet acked): a fetch moves a message from the first to the second, only
    an ack removes it, so their sum falls by one per finished shard and by nothing else."""
    return llen("regen"), redis_cli("hlen", "unacked")


def container(service: str) -> str:
    return dc("ps", "-q", service, quiet=True).stdout.strip()


def host_addresses() -> list[str]:
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    except OSError:
        out = []
    return [a for a in out if ":" not in a and not a.startswith("127.")]


def ready_marks() -> dict[str, int]:
    """How often each CPU worker has logged Celery's `ready.` (its log on storage, appended across restarts)."""
    out = {}
    for n in ("cpu0", "cpu1"):
        log = STORAGE / "logs" / f"{n}.log"
        out[n] = log.read_text(errors="replace").count(" ready.") if log.exists() else 0
    return out


def wait_workers_ready(before: dict[str, int], timeout: float) -> float:
    """Until every CPU worker has logged `ready.` once more than in `before` (its engine is built before it
    consumes: from then on it takes shards)."""
    started = time.monotonic()
    wait_for("workers ready", lambda: all(v > before[k] for k, v in ready_marks().items()), timeout, every=1)
    return time.monotonic() - started


def produce(run: str, path: str, args) -> None:
    """`regen produce` in the producer-cpu service's container with its settings (the .env keeps naming the first
    run: the workers, started with `--run check-a`, serve every run with its model and layers, unrestarted)."""
    dc("run", "--rm", "-T", "producer-cpu", "regen", "produce", path, "--run", run, "--model", "/opt/regen/tiny-qwen3",
       "--layers", "vllm:1,2,4", "--max-tokens", str(args.max_tokens), "--shard-size", str(args.shard_size),
       "--top-k", "0")


def snapshot(run: str) -> tuple[int, dict[str, int]]:
    """(attempt files, completion markers with their mtimes): what a re-run of a finished run would change."""
    attempts = sum(1 for _ in (STORAGE / run / "attempts").rglob("*.json"))
    return attempts, {p.name: p.stat().st_mtime_ns for p in (STORAGE / run / "done").glob("*.json")}


def check_run(run: str, n: int) -> None:
    step("   " + verify(run))
    counts = accounted(run, n)
    step(f"   input lines {n}: records {counts['records']}, lost {counts['lost']}, duplicated {counts['duplicated']}")


def scenario(args) -> None:
    ENV.set(REGEN_CPU_RUN="check-a", REGEN_CPU_INPUTS=write_inputs("check-a", args.samples_a),
            REGEN_CPU_MAX_TOKENS=str(args.max_tokens), REGEN_CPU_SHARD_SIZE=str(args.shard_size))
    STORAGE.mkdir(parents=True, exist_ok=True)
    dc("down", "-v", "--remove-orphans", check=False)
    step(f"project {PROJECT}: .env {ENV_FILE} (passwords made for this check), storage {STORAGE}, "
         f"ports 127.0.0.1:{ENV['REDIS_PORT']} (redis), {ENV['FLOWER_PORT']} (flower), {ENV['METRICS_PORT']} (metrics)")

    # 1. produce through the producer service, two CPU workers finish it, verify in a container
    t = time.monotonic()
    marks = ready_marks()
    dc("up", "-d")
    producer_exit("check-a")
    total = shard_total("check-a")
    step(f"1. `docker compose --profile cpu up -d`: producer-cpu produced check-a, {args.samples_a} samples in "
         f"{total} shards ({time.monotonic() - t:.0f}s to the producer's exit)")
    ready = wait_workers_ready(marks, args.timeout)
    step(f"   worker-cpu0 and worker-cpu1 ready (engines built) {ready:.0f}s later")
    took = wait_done("check-a", args.timeout)
    st = status("check-a")
    per_worker = {w["name"]: w["shards_done"] for w in st["workers"]}
    step(f"   check-a complete {took:.0f}s after the workers were ready: {st['samples']['done']} samples, "
         f"{st['shards']['done']}/{total} shards, by worker {per_worker}")
    if len([k for k in per_worker.values() if k]) < 2:
        fail(f"expected both workers to finish shards of check-a: {per_worker}")
    check_run("check-a", args.samples_a)

    # 2. a backlog (workers frozen): Flower (login, queue list), the metrics endpoint, the published ports
    dc("pause", "worker-cpu0", "worker-cpu1")
    produce("check-b", write_inputs("check-b", args.samples_b), args)
    total_b = shard_total("check-b")
    backlog = llen("regen")
    step(f"2. workers paused (`docker compose pause`); producer-cpu produced check-b: {args.samples_b} samples in "
         f"{total_b} shards; queue `regen` in Redis: {backlog}")
    fp, mp = ENV["FLOWER_PORT"], ENV["METRICS_PORT"]
    base = f"http://127.0.0.1:{fp}"
    wait_for("Flower answers", lambda: http(base + "/api/queues/length")[0] in (200, 401), 300, every=2)
    code_anon, _ = http(base + "/api/queues/length")
    code_bad, _ = http(base + "/api/queues/length", ("regen", "wrong-password"))
    code, body = http(base + "/api/queues/length", (ENV["FLOWER_USER"], ENV["FLOWER_PASSWORD"]))
    if code_anon != 401 or code_bad != 401 or code != 200:
        fail(f"Flower: without login {code_anon}, wrong password {code_bad}, with login {code} (want 401, 401, 200)")
    queues = {q["name"]: q["messages"] for q in json.loads(body).get("active_queues", [])}
    step(f"   Flower 127.0.0.1:{fp}/api/queues/length: without login HTTP {code_anon}, wrong password "
         f"HTTP {code_bad}, with login HTTP {code}: {json.dumps(queues, sort_keys=True)}")
    if queues.get("regen") != total_b:
        fail(f"Flower lists queue regen with {queues.get('regen')} messages, the backlog is {total_b}")
    code, text = http(f"http://127.0.0.1:{mp}/metrics")
    m = re.search(r'^regen_queue_length\{queue="regen"\} ([0-9.e+]+)$', text, re.M)
    step(f"   metrics 127.0.0.1:{mp}/metrics: HTTP {code}, {m.group(0) if m else 'no regen_queue_length'}")
    if code != 200 or not m or int(float(m.group(1))) != total_b:
        fail("the metrics endpoint does not export the backlog as regen_queue_length{queue=\"regen\"}")
    if args.screenshot:
        shot = subprocess.run([sys.executable, str(REPO / "scripts" / "flower_screenshot.py"), "--url",
                               base + "/broker", "--out", args.screenshot], cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "FLOWER_BASIC_AUTH": f"{ENV['FLOWER_USER']}:{ENV['FLOWER_PASSWORD']}"})
        step(f"   Flower's Broker page: {' '.join((shot.stdout or shot.stderr).strip().splitlines()[-1:])}")
    ports = dc("ps", "--format", "{{.Service}} {{.Ports}}", quiet=True).stdout.split("\n")
    published = sorted({p.strip() for line in ports for p in line.split(" ", 1)[-1].split(",") if "->" in p})
    if not published or any(not p.startswith("127.0.0.1:") for p in published):
        fail(f"published ports not all on 127.0.0.1: {published}")
    outside = {a: http(f"http://{a}:{fp}/")[0] for a in host_addresses()}
    shown = {a: ("refused" if c == 0 else c) for a, c in outside.items()} or "none"
    step(f"   published ports: {', '.join(published)}; Flower on the host's other addresses: {shown}")
    if any(c != 0 for c in outside.values()):
        fail(f"Flower answers on a non-loopback address: {outside}")

    # 3. docker kill of one worker mid-shard
    dc("unpause", "worker-cpu0", "worker-cpu1")
    held = wait_for("worker-cpu1 mid-shard",
                    lambda: done_count("check-b") >= 2 and running_attempts("check-b", "cpu1@"), args.timeout, every=0.2)
    subprocess.run(["docker", "kill", container("worker-cpu1")], check=True, capture_output=True)
    t_kill = time.monotonic()
    done_at_kill = done_count("check-b")
    step(f"3. workers unpaused; `docker kill` of worker-cpu1 while it held {', '.join(held)} "
         f"({done_at_kill}/{total_b} shards done)")

    # 4. docker compose restart redis mid-run
    half = max(done_at_kill + 1, total_b // 2)
    wait_for("check-b half done", lambda: done_count("check-b") >= half, args.timeout, every=0.5)
    (waiting0, unacked0), done0 = held_messages(), done_count("check-b")
    t = time.monotonic()
    dc("restart", "redis")
    wait_for("redis healthy", lambda: "healthy" in dc("ps", "--format", "{{.Status}}", "redis", quiet=True).stdout,
             120)
    (waiting1, unacked1), done1 = held_messages(), done_count("check-b")
    step(f"4. `docker compose restart redis` at {done0}/{total_b} shards done ({time.monotonic() - t:.0f}s to healthy): "
         f"before, {waiting0} waiting + {unacked0} fetched; after, {waiting1} + {unacked1} with {done1 - done0} "
         f"shards finished meanwhile")
    if waiting1 + unacked1 + (done1 - done0) < waiting0 + unacked0:
        fail("messages were lost in the Redis restart")
    wait_done("check-b", args.timeout)
    step(f"   check-b complete {time.monotonic() - t_kill:.0f}s after the kill (worker-cpu0 alone since)")
    st = wait_for("regen status shows worker-cpu1 dead",
                  lambda: (lambda s: s if any(w["name"].startswith("cpu1@") and w["state"] == "dead"
                                             for w in s["workers"]) else None)(status("check-b")), 300, every=3)
    states = {w["name"]: w["state"] for w in st["workers"]}
    step(f"   regen status check-b: shards {st['shards']['done']}/{total_b} done, dead-lettered "
         f"{len(st['dead'])}, workers {states}")
    check_run("check-b", args.samples_b)

    # 5. down mid-run, then up: the run resumes from storage; the finished runs stay finished
    produce("check-c", write_inputs("check-c", args.samples_c), args)
    total_c = shard_total("check-c")
    wait_for("check-c partly done", lambda: done_count("check-c") >= max(1, total_c // 4), args.timeout, every=0.5)
    finished = {run: snapshot(run) for run in ("check-a", "check-b")}
    t = time.monotonic()
    dc("stop")  # what `down` does first; the exit codes stay readable until the containers are removed
    rows = [json.loads(r) for r in dc("ps", "-a", "--format", "json", "worker-cpu0", quiet=True).stdout.splitlines()
            if r.strip().startswith("{")]
    exit_code = rows[0].get("ExitCode") if rows else None
    dc("down")
    at_down = done_count("check-c")
    how = "warm: its running shards finished" if exit_code == 0 else f"exit {exit_code}: killed at the grace period"
    step(f"5. check-c: {args.samples_c} samples in {total_c} shards on worker-cpu0; `docker compose down` at "
         f"{at_down}/{total_c} done ({time.monotonic() - t:.0f}s; worker-cpu0 {how}); every container gone, "
         f"the storage folder and the Redis volume kept")
    marks = ready_marks()
    dc("up", "-d")
    producer_exit("check-a")
    said = "already produced" in dc("logs", "producer-cpu", quiet=True).stdout
    wait_done("check-c", args.timeout)
    step(f"   `docker compose --profile cpu up -d`: producer-cpu says check-a is already produced ({said}); check-c "
         f"complete {time.monotonic() - t:.0f}s after the down, {total_c - at_down} shards done since")
    check_run("check-c", args.samples_c)
    wait_workers_ready(marks, args.timeout)
    time.sleep(5)
    again = {run: snapshot(run) for run in ("check-a", "check-b")}
    queue = llen("regen")
    for run in ("check-a", "check-b"):
        step(f"   finished {run} after the down and up: attempts {finished[run][0]} -> {again[run][0]}, "
             f"completion markers unchanged: {finished[run][1] == again[run][1]}")
    step(f"   queue `regen` {queue}; both workers up again (worker-cpu1 too, which `docker kill` had stopped)")
    if not said or queue or finished != again:
        fail("a finished run did not stay finished")
    check_run("check-a", args.samples_a)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples-a", type=int, default=48, help="prompts of the first run")
    parser.add_argument("--samples-b", type=int, default=96, help="prompts of the run with the kill and restart")
    parser.add_argument("--samples-c", type=int, default=64, help="prompts of the run taken down and up")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--shard-size", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds any one wait may take")
    parser.add_argument("--screenshot", default=None, help="also shoot Flower's Broker page to this PNG")
    parser.add_argument("--report", default=None, help="also write the steps to this file")
    parser.add_argument("--keep", action="store_true", help="leave the project up at the end")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    rc = 1
    try:
        scenario(args)
        step("compose check passed")
        rc = 0
    finally:
        if rc:
            for service in ("producer-cpu", "worker-cpu0", "worker-cpu1", "redis", "flower", "metrics"):
                tail = dc("logs", "--tail", "15", service, check=False, quiet=True)
                print(f"--- {service} ---\n{tail.stdout[-1500:]}{tail.stderr[-500:]}", file=sys.stderr)
        if not args.keep:
            dc("down", "-v", "--remove-orphans", check=False, quiet=True)
        if args.report:
            Path(args.report).write_text("\n".join(REPORT) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
