#!/usr/bin/env python3
"""The compose check's scenario: compose.yaml as the fleet is deployed, a head and worker hosts, on a real engine.

Started by scripts/compose_check.sh once the engine, compose v2 and the `regen:cpu` image exist; only the
standard library and the `docker` CLI are used on the host, so it runs on any machine with an engine. It brings up
three compose projects from the repository's compose.yaml, each with its own .env, as three machines would:

- the head (`-p regen-check-head`): redis, flower and metrics, and the producer (`producer-cpu`, run once per run);
- two worker "hosts" (`-p regen-check-host-a`, `-p regen-check-host-b`): a CPU worker each (`worker-cpu0`, no
  head service: `up --no-deps`), joining the head by URL (`REGEN_BROKER_URL` naming the head's Redis, as a GPU
  host's .env does) on the head's network (a host's LAN: a compose override naming the head's network), with the
  storage folder bind-mounted in all three (NFS on real hosts).

and checks, printing each step with its figures:

1. a run produced on the head and finished by both hosts; `regen verify` (in a container) passes; every input
   line is in exactly one record (lost 0, duplicated 0);
2. a second run produced while both hosts' workers are frozen (`docker compose pause`): Flower answers on its
   published port only with its login, and its API lists the run's queue with the backlog; the metrics endpoint
   exports the same queue length; every published port is bound to 127.0.0.1 and nothing answers elsewhere;
3. host B killed mid-shard (`docker compose kill` of its whole project: a power cut): the run completes on host A
   (time from the kill), nothing lost or duplicated, `regen status` shows host B's worker dead;
4. `docker compose restart redis` on the head mid-run (AOF on): the queue is still there, the run completes;
5. every project taken `down` in the middle of a third run, then `up` (host B back too): the run resumes from
   storage and completes, and the two finished runs stay finished (no attempt added, no marker rewritten).
The workers serve every run with their model and layers, so they start twice in all (each start builds a vLLM
engine, the slow part on a loaded machine).
At the end the projects are removed with their volumes (`down -v`); `--keep` leaves them up for a look.
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
HEAD, HOSTS = "regen-check-head", {"a": "regen-check-host-a", "b": "regen-check-host-b"}
WORK = Path(os.environ.get("REGEN_CHECK_DIR") or "/tmp/regen-compose-check")
STORAGE = WORK / "storage"
INPUTS = WORK / "inputs"
HOST_NETWORK = WORK / "hosts-network.yaml"  # compose override: a worker host's project on the head's network
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
    """A project's .env: the head's secrets made here and free ports; a host's the head's URL and its name."""

    def __init__(self, project: str, values: dict[str, str]) -> None:
        self.project, self.values = project, values
        self.file = WORK / f"{project}.env"

    def set(self, **kw: str) -> None:
        self.values.update(kw)
        self.file.write_text("".join(f"{k}={v}\n" for k, v in self.values.items()))
        self.file.chmod(0o600)

    def __getitem__(self, key: str) -> str:
        return self.values[key]


COMMON = {"REDIS_IMAGE": os.environ.get("REDIS_IMAGE", "redis:7"), "REGEN_CPU_IMAGE": "regen:cpu",
          "REGEN_STORAGE_DIR": str(STORAGE), "REGEN_INPUT_DIR": str(INPUTS)}
PASSWORD = secrets.token_hex(16)
ENV = Env(HEAD, {**COMMON, "REDIS_PASSWORD": PASSWORD, "FLOWER_USER": "regen", "FLOWER_PASSWORD": secrets.token_hex(12),
                 "REDIS_PORT": str(free_port()), "FLOWER_PORT": str(free_port()), "METRICS_PORT": str(free_port())})
# A worker host knows the head by its URL (here the head's Redis container on the head's network, as a LAN name
# would be) and needs no Flower login; REDIS_PASSWORD is the one variable compose requires of every project.
HOST_ENV = {k: Env(p, {**COMMON, "REDIS_PASSWORD": PASSWORD, "REGEN_HOST": f"host-{k}",
                       "REGEN_BROKER_URL": f"redis://:{PASSWORD}@{HEAD}-redis-1:6379/0"}) for k, p in HOSTS.items()}


def dc(*args: str, project: str = HEAD, check: bool = True, timeout: float = 900,
       quiet: bool = False) -> subprocess.CompletedProcess:
    """`docker compose` on one project: the head, or a worker host (its project on the head's network)."""
    env = ENV if project == HEAD else next(e for e in HOST_ENV.values() if e.project == project)
    files = ["-f", str(REPO / "compose.yaml")] + ([] if project == HEAD else ["-f", str(HOST_NETWORK)])
    cmd = ["docker", "compose", *files, "-p", project, "--env-file", str(env.file), "--profile", "cpu", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        fail(f"`docker compose -p {project} {' '.join(args)}` exited {proc.returncode}: "
             f"{(proc.stderr or proc.stdout)[-1500:]}")
    if not quiet and proc.returncode == 0 and os.environ.get("REGEN_CHECK_VERBOSE"):
        print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
    return proc


def host_up(key: str) -> None:
    """Host `key`'s worker, alone in its project (`--no-deps`: the head's services are another host's)."""
    dc("up", "-d", "--no-deps", "worker-cpu0", project=HOSTS[key])


def in_container(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """A command in a fresh container of the CPU image with the head's broker and the storage (a `run` of
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


def host_addresses() -> list[str]:
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    except OSError:
        out = []
    return [a for a in out if ":" not in a and not a.startswith("127.")]


def ready_marks() -> dict[str, int]:
    """How often each host's worker has logged Celery's `ready.` (its log in the host's own folder on storage,
    appended across restarts)."""
    out = {}
    for key in HOSTS:
        log = STORAGE / "logs" / f"host-{key}" / "cpu0.log"
        out[key] = log.read_text(errors="replace").count(" ready.") if log.exists() else 0
    return out


def wait_workers_ready(before: dict[str, int], timeout: float, hosts=tuple(HOSTS)) -> float:
    """Until each of `hosts`' workers has logged `ready.` once more than in `before` (its engine is built before it
    consumes: from then on it takes shards)."""
    started = time.monotonic()
    wait_for(f"workers of host(s) {', '.join(hosts)} ready", lambda: all(ready_marks()[k] > before[k] for k in hosts),
             timeout, every=1)
    return time.monotonic() - started


def produce(run: str, path: str, args) -> str:
    """`regen produce` on the head, in a container of its producer-cpu service with its settings (the hosts'
    workers, started with `--run check-a`, serve every run with its model and layers, unrestarted); its output."""
    return dc("run", "--rm", "--no-deps", "-T", "producer-cpu", "regen", "produce", path, "--run", run, "--model",
              "/opt/regen/tiny-qwen3", "--layers", "vllm:1,2,4", "--max-tokens", str(args.max_tokens),
              "--shard-size", str(args.shard_size)).stdout


def down_all(*, volumes: bool = False, check: bool = True) -> None:
    extra = ["-v", "--remove-orphans"] if volumes else []
    for project in (*HOSTS.values(), HEAD):
        dc("down", *extra, project=project, check=check, quiet=True)


def snapshot(run: str) -> tuple[int, dict[str, int]]:
    """(attempt files, completion markers with their mtimes): what a re-run of a finished run would change."""
    attempts = sum(1 for _ in (STORAGE / run / "attempts").rglob("*.json"))
    return attempts, {p.name: p.stat().st_mtime_ns for p in (STORAGE / run / "done").glob("*.json")}


def check_run(run: str, n: int) -> None:
    step("   " + verify(run))
    counts = accounted(run, n)
    step(f"   input lines {n}: records {counts['records']}, lost {counts['lost']}, duplicated {counts['duplicated']}")


def scenario(args) -> None:
    ENV.set(REGEN_CPU_RUN="check-a", REGEN_CPU_MAX_TOKENS=str(args.max_tokens),
            REGEN_CPU_SHARD_SIZE=str(args.shard_size))
    for env in HOST_ENV.values():
        env.set(REGEN_CPU_RUN="check-a")
    STORAGE.mkdir(parents=True, exist_ok=True)
    down_all(volumes=True, check=False)
    HOST_NETWORK.write_text(f"networks:\n  default:\n    name: {HEAD}_default\n    external: true\n")
    step(f"projects: head {HEAD} (.env {ENV.file}, passwords made for this check), hosts "
         f"{', '.join(HOSTS.values())} (REGEN_BROKER_URL=redis://:***@{HEAD}-redis-1:6379/0, on the head's network); "
         f"storage {STORAGE} in all three; ports 127.0.0.1:{ENV['REDIS_PORT']} (redis), {ENV['FLOWER_PORT']} "
         f"(flower), {ENV['METRICS_PORT']} (metrics)")

    # 1. the head up, a run produced there, both hosts join by URL and finish it; verify in a container
    t = time.monotonic()
    dc("up", "-d", "redis", "flower", "metrics")
    produce("check-a", write_inputs("check-a", args.samples_a), args)
    total = shard_total("check-a")
    step(f"1. head up (redis, flower, metrics); producer-cpu produced check-a, {args.samples_a} samples in {total} "
         f"shards ({time.monotonic() - t:.0f}s)")
    marks = ready_marks()
    for key in HOSTS:
        host_up(key)
    ready = wait_workers_ready(marks, args.timeout)
    step(f"   hosts a and b up (`up -d --no-deps worker-cpu0` in each project): both workers ready (engines built) "
         f"{ready:.0f}s later")
    took = wait_done("check-a", args.timeout)
    st = status("check-a")
    per_worker = {w["name"]: w["shards_done"] for w in st["workers"]}
    step(f"   check-a complete {took:.0f}s after the workers were ready: {st['samples']['done']} samples, "
         f"{st['shards']['done']}/{total} shards, by worker {per_worker}")
    if len([k for k in per_worker.values() if k]) < 2:
        fail(f"expected both hosts' workers to finish shards of check-a: {per_worker}")
    check_run("check-a", args.samples_a)

    # 2. a backlog (both hosts' workers frozen): Flower (login, queue list), the metrics endpoint, the ports
    for project in HOSTS.values():
        dc("pause", "worker-cpu0", project=project)
    produce("check-b", write_inputs("check-b", args.samples_b), args)
    total_b = shard_total("check-b")
    backlog = llen("regen")
    step(f"2. both hosts' workers paused (`docker compose pause`); check-b produced: {args.samples_b} samples in "
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

    # 3. host b loses power mid-shard: every container of its project killed at once
    for project in HOSTS.values():
        dc("unpause", "worker-cpu0", project=project)
    held = wait_for("host b's worker mid-shard",
                    lambda: done_count("check-b") >= 2 and running_attempts("check-b", "cpu0@host-b"), args.timeout,
                    every=0.2)
    dc("kill", project=HOSTS["b"])
    t_kill = time.monotonic()
    done_at_kill = done_count("check-b")
    step(f"3. workers unpaused; `docker compose -p {HOSTS['b']} kill` (host b's power cut) while its worker held "
         f"{', '.join(held)} ({done_at_kill}/{total_b} shards done)")

    # 4. docker compose restart redis on the head, mid-run
    half = max(done_at_kill + 1, total_b // 2)
    wait_for("check-b half done", lambda: done_count("check-b") >= half, args.timeout, every=0.5)
    (waiting0, unacked0), done0 = held_messages(), done_count("check-b")
    t = time.monotonic()
    dc("restart", "redis")
    wait_for("redis healthy", lambda: "healthy" in dc("ps", "--format", "{{.Status}}", "redis", quiet=True).stdout,
             120)
    (waiting1, unacked1), done1 = held_messages(), done_count("check-b")
    step(f"4. `docker compose restart redis` on the head at {done0}/{total_b} shards done "
         f"({time.monotonic() - t:.0f}s to healthy): before, {waiting0} waiting + {unacked0} fetched; after, "
         f"{waiting1} + {unacked1} with {done1 - done0} shards finished meanwhile")
    if waiting1 + unacked1 + (done1 - done0) < waiting0 + unacked0:
        fail("messages were lost in the Redis restart")
    wait_done("check-b", args.timeout)
    step(f"   check-b complete {time.monotonic() - t_kill:.0f}s after the kill (host a alone since)")
    st = wait_for("regen status shows host b's worker dead",
                  lambda: (lambda s: s if any(w["name"].startswith("cpu0@host-b") and w["state"] == "dead"
                                             for w in s["workers"]) else None)(status("check-b")), 300, every=3)
    states = {w["name"]: w["state"] for w in st["workers"]}
    step(f"   regen status check-b: shards {st['shards']['done']}/{total_b} done, dead-lettered "
         f"{len(st['dead'])}, workers {states}")
    check_run("check-b", args.samples_b)

    # 5. every project down mid-run, then up (host b back too): the run resumes; finished runs stay finished
    produce("check-c", write_inputs("check-c", args.samples_c), args)
    total_c = shard_total("check-c")
    wait_for("check-c partly done", lambda: done_count("check-c") >= max(1, total_c // 4), args.timeout, every=0.5)
    finished = {run: snapshot(run) for run in ("check-a", "check-b")}
    t = time.monotonic()
    dc("stop", project=HOSTS["a"])  # what `down` does first; the exit code stays readable until it is removed
    rows = [json.loads(r) for r in dc("ps", "-a", "--format", "json", "worker-cpu0", project=HOSTS["a"],
                                      quiet=True).stdout.splitlines() if r.strip().startswith("{")]
    exit_code = rows[0].get("ExitCode") if rows else None
    down_all()
    at_down = done_count("check-c")
    how = "warm: its running shards finished" if exit_code == 0 else f"exit {exit_code}: killed at the grace period"
    step(f"5. check-c: {args.samples_c} samples in {total_c} shards on host a; `docker compose down` of all three "
         f"projects at {at_down}/{total_c} done ({time.monotonic() - t:.0f}s; host a's worker {how}); every "
         f"container gone, the storage folder and the head's Redis volume kept")
    marks = ready_marks()
    dc("up", "-d", "redis", "flower", "metrics")
    for key in HOSTS:
        host_up(key)
    again_a = produce("check-a", "/inputs/check-a.jsonl", args)
    said = "already produced" in again_a
    wait_done("check-c", args.timeout)
    step(f"   head and both hosts `up -d` again: the producer says check-a is already produced ({said}); check-c "
         f"complete {time.monotonic() - t:.0f}s after the down, {total_c - at_down} shards done since")
    check_run("check-c", args.samples_c)
    wait_workers_ready(marks, args.timeout)
    again = {run: snapshot(run) for run in ("check-a", "check-b")}
    queue = llen("regen")
    for run in ("check-a", "check-b"):
        step(f"   finished {run} after the down and up: attempts {finished[run][0]} -> {again[run][0]}, "
             f"completion markers unchanged: {finished[run][1] == again[run][1]}")
    step(f"   queue `regen` {queue}; both hosts' workers up again (host b's too, which the kill had stopped)")
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
            for project, services in ((HEAD, ("redis", "flower", "metrics")),
                                      *((p, ("worker-cpu0",)) for p in HOSTS.values())):
                for service in services:
                    tail = dc("logs", "--tail", "15", service, project=project, check=False, quiet=True)
                    print(f"--- {project} {service} ---\n{tail.stdout[-1500:]}{tail.stderr[-500:]}", file=sys.stderr)
        if not args.keep:
            down_all(volumes=True, check=False)
        if args.report:
            Path(args.report).write_text("\n".join(REPORT) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
