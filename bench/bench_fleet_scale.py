"""The write side at the job's size: the real producer, Redis, worker fleet and storage, with engines standing in
for GPUs, and what each part costs per shard at 10%, 50% and 100% of the run.

Why: the largest run real workers had finished was a few hundred samples (a CPU engine makes ~100 tokens a
second). The job is 914K thinking-mode samples in 14,282 shards of 64 on 11 GPUs, and the fleet may grow 100x.
What the fleet itself costs per shard (broker round trips, storage writes, listings, fsyncs, attempt records,
heartbeats), and whether any of it grows faster than the run, is invisible at 200 samples.

One command:

    python bench/bench_fleet_scale.py --scale 0.1                       # 1,428 shards, local storage
    nice -n 10 python bench/bench_fleet_scale.py --scale 1 --s3-scale 0.02 --json out.json   # the docs' table

What it does (every part is the product's, only the engine is the stand-in's, workers/doubles/stand_in.py):
1. A prompts file of the job's shape (`--scale` of 914K samples, ~120-token prompts; unique, so none is a
   duplicate), the tokenizer and config of the tiny Qwen3 (`regen tiny-model`) as the model, a private
   `redis-server` (no persistence, `noeviction`).
2. Backlog: `regen produce` of 10%, 50% and 100% of the prompts without `--max-pending` onto an empty Redis, each
   timed, with Redis' memory at the full backlog and its commands and bytes per shard (INFO commandstats/stats).
3. The fleet: `--hosts` `regen worker --stand-in-engine rate=R,scale=X,devices=K` supervisors (K = workers / hosts
   worker processes each, one stand-in GPU apiece), and `regen produce --max-pending` beside them. The stand-in
   runs X times faster than the device (`--rate` tokens/s at a full batch), and every time-based setting of the
   fleet is divided by X with it (heartbeats, hence leases and the dead-holder watch's period), so per-shard
   counts are those of the real-time fleet; times measured on the fleet's clock are multiplied back by X.
   At 10%, 50% and 100% of the shards done it reads: Redis INFO, every process's storage counts
   (REGEN_STORAGE_COUNTS, app/base/storage_counts.py), the fleet's CPU (every worker process and supervisor, less the
   stand-in engines' own threads), and times `regen status RUN --json` (a fresh process, less its `--help`
   start-up) and a `regen metrics` scrape.
4. A host's death: once the producer is done and the queue is empty (every remaining shard held), one host
   (its supervisor and workers) is SIGKILLed; the time until an idle worker re-sent each shard it held
   (app/base/dead_holders.py) and until they are done. The hosts share this machine, so the checkers see the
   processes dead at once (pid check); a host elsewhere is judged by its lease, up to one lease later.
5. `--s3-scale`: the fleet part again on `s3://` (moto's server with its requests counted as it served them,
   bench/s3_counting_server.py) at that fraction of the job.
It prints per-shard costs in each window, growth exponents b of each cumulative cost ~ shards^b between 10% and
100% (1: grows as the run; above 1: faster), the stand-ins' idle time between shards, and a projection of the
fleet at 100x (1,000 GPUs, 91M samples) from the measured per-shard costs (`project`).
Timings on a shared 2-core machine are noisy; counts per shard are not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

JOB_SAMPLES = 914_000
SHARD_SIZE = 64
JOB_SHARDS = math.ceil(JOB_SAMPLES / SHARD_SIZE)
FRACTIONS = (0.1, 0.5, 1.0)
RUN_ID = "job"
MAX_TOKENS = 8192
MAX_PROMPT_TOKENS = 4096
DEFAULT_HEARTBEAT_S = 30.0
PARTS = 10  # the prompts are 10 files of 10% each: a fraction of the job is its first files
_WORDS_TEXT = ("the of and to in is you that it he was for on are as with his they at be this have from or one "
               "had by word but not what all were we when your can said there use an each which she do how their if "
               "will up other about out many then them these so some her would make like him into time has look two "
               "more write go see number no way could people my than first water been call who oil its now find long "
               "down day did get come made may part")
_WORDS = _WORDS_TEXT.split()


# -- set-up ----------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_prompts(folder: Path, samples: int, seed: int = 0) -> list[Path]:
    """`samples` unique prompts in PARTS files (`prompt` column): "Question i:" and a slice of a fixed word text,
    log-normal around 90 words (12-2,000; ~120 tokens). Slicing one text keeps 914K prompts to seconds."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = np.array(_WORDS)[rng.integers(0, len(_WORDS), 400_000)]
    text = " ".join(words.tolist())
    starts = np.concatenate([[0], np.cumsum([len(w) + 1 for w in words])])
    per = math.ceil(samples / PARTS)
    files = []
    for p in range(PARTS):
        path = folder / f"part-{p:02d}.jsonl"
        files.append(path)
        if path.exists():
            continue
        lo, hi = p * per, min(samples, (p + 1) * per)
        r = np.random.default_rng([seed, p])
        lengths = np.clip(r.lognormal(math.log(90), 0.9, max(0, hi - lo)), 12, 2000).astype(int)
        at = r.integers(0, len(words) - 2001, max(0, hi - lo))
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as fh:
            fh.writelines(json.dumps({"prompt": f"Question {i}: " + text[starts[a]:starts[a + n] - 1]}) + "\n"
                          for i, a, n in zip(range(lo, hi), at.tolist(), lengths.tolist(), strict=True))
        tmp.rename(path)
    return files


def write_model(folder: Path) -> Path:
    """The tiny Qwen3's tokenizer and config (`regen tiny-model`), allowing the job's 4,096 + 8,192 tokens."""
    if not (folder / "config.json").exists():
        from workers.tiny_model import build_tiny_qwen3

        build_tiny_qwen3(str(folder))
        config = json.loads((folder / "config.json").read_text())
        config["max_position_embeddings"] = 16384
        (folder / "config.json").write_text(json.dumps(config))
    return folder


class RedisServer:
    """A private redis-server on a free port (no persistence, noeviction, as the fleet's Redis must run)."""

    def __init__(self, folder: Path, port: int | None = None):
        self.port = port or free_port()
        folder.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--maxmemory-policy", "noeviction", "--dir", str(folder)],
                                     stdout=open(folder / "redis.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
        import redis

        self.client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise SystemExit("redis-server did not start") from None
                time.sleep(0.1)

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def redis_stats(client) -> dict:
    """What Redis says it did: commands by name, bytes in and out, memory, its own CPU seconds."""
    info = client.info("all")
    commands = {k.removeprefix("cmdstat_"): v["calls"] for k, v in info.items() if k.startswith("cmdstat_")}
    return {"commands": commands, "calls": sum(commands.values()), "net_in": info["total_net_input_bytes"],
            "net_out": info["total_net_output_bytes"], "used_memory": info["used_memory"],
            "peak_memory": info["used_memory_peak"], "cpu": info["used_cpu_sys"] + info["used_cpu_user"]}


def diff(a: dict, b: dict) -> dict:
    """b - a for every count (nested `commands` too)."""
    out = {k: b[k] - a.get(k, 0) for k in b if isinstance(b[k], int | float)}
    if "commands" in b:
        out["commands"] = {k: v - a["commands"].get(k, 0) for k, v in b["commands"].items()
                           if v - a["commands"].get(k, 0)}
    return out


def env_for(broker: str, counts_dir: Path | None, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), "REGEN_BROKER_URL": broker,
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    env.pop("REGEN_STORAGE_COUNTS", None)
    if counts_dir is not None:
        env["REGEN_STORAGE_COUNTS"] = str(counts_dir)
    env.update(extra or {})
    return env


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", *args]


def produce_args(files: list[Path], storage: str, model: Path, max_pending: int | None,
                 shard_size: int = SHARD_SIZE, max_tokens: int = MAX_TOKENS) -> list[str]:
    args = ["produce", *map(str, files), "--run", RUN_ID, "--storage", storage, "--model", str(model),
            "--capture", "off", "--max-tokens", str(max_tokens), "--max-prompt-tokens", str(MAX_PROMPT_TOKENS),
            "--shard-size", str(shard_size)]
    return args + (["--max-pending", str(max_pending)] if max_pending is not None else [])


# -- the fleet's processes -------------------------------------------------------------------------------
def process_tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
        except OSError:
            continue
    return out


def _ticks(stat: str) -> tuple[str, int]:
    head, _, tail = stat.rpartition(")")
    fields = tail.split()
    return head.partition("(")[2], int(fields[11]) + int(fields[12])


class FleetCPU:
    """CPU seconds of every process under the supervisors (supervisors and their workers), and of the stand-in
    engines' own threads among them (the GPU's work, not the fleet's). Each process and thread counts with the
    last figure read from it, so one that exits (a SIGKILLed host) keeps what it used until then."""

    def __init__(self):
        self.hz = os.sysconf("SC_CLK_TCK")
        self.procs: dict[tuple[int, int], int] = {}  # (pid, start time) -> ticks
        self.threads: dict[tuple[int, int, int], int] = {}  # stand-in threads: (pid, tid, start) -> ticks

    def read(self, roots: list[int]) -> dict:
        from workers.doubles.stand_in import THREAD_NAME

        for root in roots:
            for p in process_tree(root):
                try:
                    with open(f"/proc/{p}/stat") as fh:
                        stat = fh.read()
                    start = int(stat.rpartition(")")[2].split()[19])
                    self.procs[(p, start)] = _ticks(stat)[1]
                    for tid in os.listdir(f"/proc/{p}/task"):
                        with open(f"/proc/{p}/task/{tid}/stat") as fh:
                            name, ticks = _ticks(fh.read())
                        if name.startswith(THREAD_NAME[:15]):
                            self.threads[(p, int(tid), start)] = ticks
                except OSError:
                    continue
        total, stand_in = sum(self.procs.values()) / self.hz, sum(self.threads.values()) / self.hz
        return {"cpu": total, "stand_in_cpu": stand_in, "fleet_cpu": total - stand_in}


@dataclass
class Host:
    name: str
    proc: subprocess.Popen
    log_dir: Path

    def ready(self) -> int:
        n = 0
        for log in self.log_dir.glob("*.log"):
            n += log.read_text(errors="replace").count(" ready.")
        return n

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_hosts(n_hosts: int, workers: int, spec: str, model: Path, storage: str, broker: str, work: Path,
                env: dict, max_tokens: int = MAX_TOKENS) -> list[Host]:
    hosts = []
    per = [workers // n_hosts + (1 if h < workers % n_hosts else 0) for h in range(n_hosts)]
    for h, k in enumerate(per):
        name = f"host{chr(ord('A') + h)}"
        log_dir = work / "logs" / name
        shutil.rmtree(log_dir, ignore_errors=True)
        log_dir.mkdir(parents=True)
        # --model, not --run: the workers start before the producer has written the run (it blocks at
        # --max-pending until they drain the queue); --max-model-len as `--run` would derive it
        proc = subprocess.Popen(cli("worker", "--model", str(model), "--storage", storage, "--broker", broker,
                                    "--max-model-len", str(MAX_PROMPT_TOKENS + max_tokens),
                                    "--stand-in-engine", f"{spec},devices={k}", "--name", f"{name}-",
                                    "--log-dir", str(log_dir)),
                                env=env, stdout=open(log_dir / "supervisor.out", "wb"),  # noqa: SIM115
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
        hosts.append(Host(name, proc, log_dir))
    return hosts


# -- storage views ---------------------------------------------------------------------------------------
class StorageView:
    """The harness's own reads of the run (not counted: the harness's environment has no REGEN_STORAGE_COUNTS)."""

    def __init__(self, root: str):
        from app.base.storage import RunStore, Storage

        self.storage = Storage(root)
        self.store = RunStore(self.storage, RUN_ID)

    def done(self) -> set[str]:
        if not self.storage.is_local:
            self.storage.fs.invalidate_cache()
        return self.store.done_shards()

    def markers(self) -> list[dict]:
        fs = self.storage.fs
        if not self.storage.is_local:
            fs.invalidate_cache()
        folder = self.storage.path(self.store.rel("done"))
        paths = [p for p in fs.ls(folder, detail=False) if p.endswith(".json")]
        out = []
        for i in range(0, len(paths), 500):
            data = fs.cat(paths[i:i + 500], on_error="omit")
            out.extend(json.loads(v) for v in data.values())
        return out

    def attempts(self, shard: str) -> list[dict]:
        from app.base.ledger import attempt_errors

        if not self.storage.is_local:
            self.storage.fs.invalidate_cache()
        return attempt_errors(self.store, shard)


def timed_command(args: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, cwd=REPO)
    return time.perf_counter() - t0


def scrape(port: int) -> float | None:
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=120) as r:
            r.read()
    except OSError:
        return None
    return time.perf_counter() - t0


def s3_counts(endpoint: str) -> dict:
    with urllib.request.urlopen(f"{endpoint}/_regen_counts", timeout=30) as r:
        return json.loads(r.read())


def engine_idle(markers: list[dict], scale: float, rate: float) -> dict:
    """From the completion markers' engine spans (workers/shard/generate.py): per worker, the time between its
    first shard's engine start and its last one's end in which no shard was in its engine, and the tokens made
    against what a full batch would have made in that window."""
    by_worker: dict[str, list[tuple[float, float, int]]] = {}
    for m in markers:
        if m.get("engine_started") is not None:
            by_worker.setdefault(m["worker"], []).append((m["engine_started"], m["engine_finished"],
                                                          m.get("generated_tokens", 0)))
    window = idle = tokens = 0.0
    gaps = []
    for spans in by_worker.values():
        spans.sort()
        start, end = spans[0][0], max(s[1] for s in spans)
        covered, reach = 0.0, start
        for a, b, _ in spans:
            if a > reach:
                gaps.append(a - reach)
            covered += max(0.0, b - max(a, reach))
            reach = max(reach, b)
        window += end - start
        idle += (end - start) - covered
        tokens += sum(s[2] for s in spans)
    return {"workers": len(by_worker), "window_s": window, "idle_s": idle,
            "idle_share": idle / window if window else None, "gaps": len(gaps),
            "utilisation": tokens / (rate * scale * window) if window else None,
            "idle_s_real_per_worker": idle * scale / max(1, len(by_worker))}


# -- one fleet run ---------------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    fraction: float
    shards: int
    t: float  # seconds since the producer started
    redis: dict
    storage: dict
    cpu: dict
    status_s: float | None = None
    metrics_s: float | None = None
    s3: dict | None = None


@dataclass
class FleetRun:
    storage: str
    shards: int
    samples: int
    workers: int
    hosts: int
    scale: float
    rate: float
    max_pending: int | None
    checkpoints: list[Checkpoint] = field(default_factory=list)
    idle_redis: dict | None = None
    idle_seconds: float = 0.0
    producer_s: float | None = None
    wall_s: float | None = None
    engine: dict | None = None
    tokens: int = 0  # generated by the published shards (`markers` of them)
    markers: int = 0
    reclaim: dict | None = None
    status_startup_s: float = 0.0
    partial: bool = False  # stopped at a deadline before every shard was done
    verify: dict | None = None
    seen_by_storage: dict | None = None


def run_fleet(work: Path, files: list[Path], storage_root: str, model: Path, redis: RedisServer, *, samples: int,
              workers: int, hosts: int, scale: float, rate: float, max_pending: int | None, kill_host: bool,
              fractions=FRACTIONS, s3_endpoint: str | None = None, extra_env: dict | None = None,
              seqs: int = 0, idle_window: float = 10.0, timeout: float = 7200, log=print,
              shard_size: int = SHARD_SIZE, max_tokens: int = MAX_TOKENS, deadline: float | None = None,
              kill_at: float | None = None) -> FleetRun:
    """Produce `files` onto an empty Redis with `--max-pending`, run the fleet until every shard is done, and
    measure at each fraction of the shards done (module docstring). With `deadline` (seconds after the producer's
    start) a run not done by then gets its last checkpoint at the shards done so far and is stopped there
    (`partial`)."""
    counts_dir = work / "storage-counts"
    shutil.rmtree(counts_dir, ignore_errors=True)
    counts_dir.mkdir(parents=True)
    redis.client.flushall()
    broker = redis.url(0)
    heartbeat = max(0.5, DEFAULT_HEARTBEAT_S / scale)
    env = env_for(broker, counts_dir, {"REGEN_HEARTBEAT_S": f"{heartbeat:g}", **(extra_env or {})})
    plain_env = env_for(broker, None, extra_env)
    shards = math.ceil(samples / shard_size)
    result = FleetRun(storage_root, shards, samples, workers, hosts, scale, rate, max_pending)
    view = StorageView(storage_root)
    spec = f"rate={rate:g},scale={scale:g}" + (f",seqs={seqs}" if seqs else "")
    fleet = start_hosts(hosts, workers, spec, model, storage_root, broker, work, env, max_tokens)
    metrics_port = free_port()
    metrics = None  # started once the producer has written the run (`--run` must exist)
    cpu = FleetCPU()
    producer = None
    try:
        t0 = time.monotonic()
        while sum(h.ready() for h in fleet) < workers:
            if any(h.proc.poll() is not None for h in fleet) or time.monotonic() - t0 > 600:
                raise SystemExit(f"workers did not start: see {work / 'logs'}")
            time.sleep(1)
        log(f"  {workers} workers ready in {time.monotonic() - t0:.0f} s")
        before_idle = redis_stats(redis.client)
        time.sleep(idle_window)
        result.idle_redis = diff(before_idle, redis_stats(redis.client))
        result.idle_seconds = idle_window
        result.status_startup_s = min(timed_command(cli("status", "--help"), plain_env) for _ in range(2))
        base_redis, base_storage = redis_stats(redis.client), Counter()
        base_cpu = cpu.read([h.proc.pid for h in fleet])
        base_s3 = s3_counts(s3_endpoint) if s3_endpoint else None
        t_start = time.monotonic()
        producer = subprocess.Popen(cli(*produce_args(files, storage_root, model, max_pending, shard_size,
                                                     max_tokens)), env=env,
                                    stdout=open(work / "produce.out", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                    cwd=REPO)
        targets = [max(1, round(f * shards)) for f in fractions]
        killed = None
        timers: list[threading.Thread] = []
        while targets:
            time.sleep(0.5)
            now_cpu = cpu.read([h.proc.pid for h in fleet if h.proc.poll() is None])
            if metrics is None and view.store.exists():
                metrics = subprocess.Popen(cli("metrics", "--port", str(metrics_port), "--addr", "127.0.0.1",
                                               "--storage", storage_root, "--broker", broker, "--run", RUN_ID),
                                           env=plain_env, stdout=open(work / "metrics.out", "wb"),  # noqa: SIM115
                                           stderr=subprocess.STDOUT, cwd=REPO)
            if producer.poll() is not None and result.producer_s is None:
                result.producer_s = time.monotonic() - t_start
                if producer.returncode != 0:
                    raise SystemExit(f"regen produce failed: see {work / 'produce.out'}")
            done = len(view.done())
            at_tail = result.producer_s is not None and redis.client.llen("regen") == 0
            if (kill_host and killed is None and hosts > 1 and done < shards
                    and (time.monotonic() - t_start >= kill_at if kill_at is not None else at_tail)):
                queued = redis.client.llen("regen")
                killed = kill_one_host(fleet[-1], view, done, log)
                killed["queue_at_kill"] = queued
            if killed is not None and "resent_s" not in killed:
                follow_reclaim(killed, view)
            if deadline is not None and time.monotonic() - t_start > deadline and done < targets[0]:
                result.partial = True
                targets = [done]
                fractions = (*fractions[:len(fractions) - 1], done / shards)
            while targets and done >= targets[0]:
                f = fractions[len(fractions) - len(targets)]
                cp = Checkpoint(f, done, time.monotonic() - t_start, diff(base_redis, redis_stats(redis.client)),
                                dict(Counter(_storage_counts(counts_dir)) - base_storage),
                                _cpu_diff(base_cpu, now_cpu))
                if s3_endpoint:
                    cp.s3 = {k: v - base_s3.get(k, 0) for k, v in s3_counts(s3_endpoint).items()}
                # timed beside the fleet, in a thread, so the next checkpoint is not late for it
                timers.append(threading.Thread(target=time_readers, args=(cp, storage_root, broker, plain_env,
                                                                          metrics_port, log), daemon=True))
                timers[-1].start()
                result.checkpoints.append(cp)
                log(f"  {f:.0%}: {done:,} shards at {cp.t:.0f} s")
                targets.pop(0)
            if time.monotonic() - t_start > timeout:
                raise SystemExit(f"timed out with {done:,} of {shards:,} shards done")
        result.wall_s = time.monotonic() - t_start
        for timer in timers:
            timer.join(timeout=600)
        if killed is not None and not result.partial:
            while "done_s" not in killed:
                follow_reclaim(killed, view)
                time.sleep(0.5)
        if killed is not None:
            follow_reclaim(killed, view)
            killed["queue_at_kill"] = killed.get("queue_at_kill")
            killed["watched_s"] = time.monotonic() - killed["t_kill"]
            result.reclaim = killed
        if producer.poll() is None and not result.partial:
            producer.wait(timeout=600)
        if result.producer_s is None and producer.poll() is not None:
            result.producer_s = result.wall_s
    finally:
        if producer is not None and producer.poll() is None:
            producer.kill()
        if metrics is not None:
            metrics.terminate()
            metrics.wait(timeout=30)
        for h in fleet:
            h.stop()
    markers = view.markers()
    result.tokens = sum(m.get("generated_tokens", 0) for m in markers)
    result.markers = len(markers)
    result.engine = engine_idle(markers, scale, rate)
    result.verify = accounting(view, markers, sum(m.get("samples", 0) for m in markers) if result.partial else samples)
    result.seen_by_storage = seen_on_storage(view) if view.storage.is_local else None
    return result


def read_counts(folder: Path) -> Counter:
    """Every process's storage counts under `folder` (app/base/storage_counts.py), summed."""
    return _storage_counts(folder)


def time_readers(cp: Checkpoint, storage_root: str, broker: str, env: dict, metrics_port: int, log) -> None:
    """`regen status RUN --json` (a fresh process) and one `regen metrics` scrape, timed while the fleet works."""
    cp.status_s = timed_command(cli("status", RUN_ID, "--storage", storage_root, "--broker", broker, "--json"), env)
    cp.metrics_s = scrape(metrics_port)
    log(f"  ({cp.fraction:.0%}: status {cp.status_s:.1f} s, metrics "
        f"{'-' if cp.metrics_s is None else round(cp.metrics_s, 2)} s)")


def _storage_counts(folder: Path) -> Counter:
    from app.base.storage_counts import read_all

    return read_all(str(folder))


def _cpu_diff(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in b}


def kill_one_host(host: Host, view: StorageView, done: int, log) -> dict:
    """SIGKILL `host` (its supervisor and workers); which not-done shards its workers were running."""
    done_now = view.done()
    held = []
    for shard_dir in view.storage.listdir(view.store.rel("attempts")):
        if shard_dir in done_now:
            continue
        records = view.attempts(shard_dir)
        if records and not any(r.get("ended") or r.get("error") for r in records) and \
                max(records, key=lambda r: r.get("started") or "").get("worker", "").startswith(host.name):
            held.append(shard_dir)
    t = time.monotonic()
    host.kill()
    log(f"  SIGKILLed {host.name} holding {len(held)} shards ({done:,} done)")
    return {"host": host.name, "held": held, "t_kill": t, "resent": {}, "at_done": done}


def follow_reclaim(killed: dict, view: StorageView) -> None:
    """How long after the kill each held shard got an attempt from another host, and was done."""
    now = time.monotonic() - killed["t_kill"]
    done = view.done()
    for shard in killed["held"]:
        if shard in killed["resent"]:
            continue
        records = view.attempts(shard)
        if shard in done or any(not (r.get("worker") or "").startswith(killed["host"]) for r in records):
            killed["resent"][shard] = now
    if len(killed["resent"]) == len(killed["held"]):
        killed.setdefault("resent_s", max(killed["resent"].values(), default=0.0))
        if all(s in done for s in killed["held"]):
            killed["done_s"] = now


def accounting(view: StorageView, markers: list[dict], samples: int) -> dict:
    """Every sample accounted for once: every marker's records file read back (its sample ids and statuses, found
    in the decompressed lines without building each record's token lists), ids unique, as many as enqueued."""
    import re

    import zstandard

    sample_id = re.compile(rb'"sample_id":"([^"]+)"')
    status = re.compile(rb'"status":"([a-z_]+)"')
    ids: Counter = Counter()
    statuses: Counter = Counter()
    lines = 0
    for m in markers:
        raw = zstandard.ZstdDecompressor().decompress(view.storage.read_bytes(m["files"]["records"]["path"]))
        for line in raw.splitlines():
            if not line.strip():
                continue
            lines += 1
            found = sample_id.search(line)
            ids[found.group(1) if found else b"?"] += 1
            st = status.search(line)
            statuses[st.group(1).decode() if st else "?"] += 1
    produce = view.storage.read_json(view.store.produce_path)
    return {"records": lines, "unique": len(ids), "duplicated": sum(1 for v in ids.values() if v > 1),
            "enqueued": (produce.get("counts") or {}).get("enqueued"), "produce_complete": produce.get("complete"),
            "expected": samples, "statuses": dict(statuses), "markers": len(markers),
            "marker_samples": sum(m.get("samples", 0) for m in markers)}


def seen_on_storage(view: StorageView) -> dict:
    """What the local storage holds at the end, counted from the files themselves: the figures the counted
    operations must agree with (files in place and their bytes, per area)."""
    root = Path(view.storage.path(view.store.rel()))
    out: Counter = Counter()
    for path in root.rglob("*"):
        if path.is_file() and ".tmp-" not in path.name:
            from app.base.storage_counts import area

            where = area(str(path.relative_to(root.parent)))
            out[f"files:{where}"] += 1
            out[f"bytes:{where}"] += path.stat().st_size
    return dict(out)


# -- the backlog (producer alone) ------------------------------------------------------------------------
def backlog(work: Path, files: list[Path], model: Path, redis: RedisServer, samples: int, fractions=FRACTIONS,
            log=print) -> list[dict]:
    """`regen produce` of each fraction without --max-pending onto an empty Redis: time, commands, memory."""
    out = []
    for f in fractions:
        part = files[:max(1, round(f * PARTS))]
        n = sum(p.read_bytes().count(b"\n") for p in part)
        storage = work / f"backlog-{round(f * 100):03d}"
        shutil.rmtree(storage, ignore_errors=True)
        redis.client.flushall()
        redis.client.config_resetstat()
        mem0 = redis.client.info("memory")["used_memory"]
        counts = work / "backlog-counts"
        shutil.rmtree(counts, ignore_errors=True)
        before = redis_stats(redis.client)
        t0 = time.perf_counter()
        p = subprocess.run(cli(*produce_args(part, str(storage), model, None)), env=env_for(redis.url(0), counts),
                           capture_output=True, text=True, cwd=REPO)
        seconds = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(f"regen produce failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
        r = diff(before, redis_stats(redis.client))
        shards = redis.client.llen("regen")
        row = {"fraction": f, "samples": n, "shards": shards, "seconds": seconds,
               "memory": redis.client.info("memory")["used_memory"] - mem0, "redis": r,
               "storage": dict(_storage_counts(counts))}
        out.append(row)
        log(f"  backlog {f:.0%}: {shards:,} shards queued in {seconds:.1f} s, Redis memory "
            f"{row['memory'] / 1e6:,.0f} MB ({row['memory'] / max(1, shards) / 1e3:.1f} KB a shard)")
        redis.client.flushall()
        shutil.rmtree(storage, ignore_errors=True)
    return out


# -- report ----------------------------------------------------------------------------------------------
STORAGE_KINDS = ("write", "fsync", "rename", "link", "put_if_absent", "read", "open", "stat", "exists", "list",
                 "mkdir", "delete")


def exponent(c10: float, c100: float, s10: int, s100: int) -> float | None:
    if c10 <= 0 or c100 <= 0 or s100 == s10:
        return None
    return math.log(c100 / c10) / math.log(s100 / s10)


def per_shard_rows(run: FleetRun) -> list[tuple[str, list[float | None], float | None]]:
    """(name, per-shard value in each window, growth exponent of the cumulative value)."""
    cps = run.checkpoints
    rows = []

    def add(name, get, per_shard=True, startup=0.0):
        values = [get(c) for c in cps]
        windows = []
        for i, c in enumerate(cps):
            v0, s0 = (values[i - 1], cps[i - 1].shards) if i else (0, 0)
            if values[i] is None or v0 is None:
                windows.append(None)
            else:
                windows.append((values[i] - v0) / max(1, c.shards - s0) if per_shard else values[i])
        b = exponent(values[0] or 0, values[-1] or 0, cps[0].shards, cps[-1].shards) if per_shard else (
            exponent(max(1e-3, values[0] - startup), max(1e-3, values[-1] - startup), cps[0].shards,
                     cps[-1].shards) if values[0] and values[-1] else None)
        rows.append((name, windows, b))

    add("Redis commands", lambda c: c.redis["calls"])
    add("Redis bytes in", lambda c: c.redis["net_in"])
    add("Redis bytes out", lambda c: c.redis["net_out"])
    add("Redis CPU s", lambda c: c.redis["cpu"])
    for kind in STORAGE_KINDS:
        if any(c.storage.get(kind) for c in cps):
            add(f"storage {kind}", lambda c, k=kind: c.storage.get(k, 0))
    add("storage bytes written", lambda c: c.storage.get("bytes_written", 0))
    add("storage bytes read", lambda c: c.storage.get("bytes_read", 0))
    if cps[0].s3 is not None:
        for kind in ("PUT", "GET", "HEAD", "LIST", "DELETE", "POST", "COPY"):
            if any(c.s3.get(kind) for c in cps):
                add(f"S3 {kind} (server)", lambda c, k=kind: c.s3.get(k, 0))
    add("fleet CPU s", lambda c: c.cpu["fleet_cpu"])
    add("stand-in CPU s", lambda c: c.cpu["stand_in_cpu"])
    add("status s (latency)", lambda c: c.status_s, per_shard=False, startup=run.status_startup_s)
    add("metrics scrape s", lambda c: c.metrics_s, per_shard=False)
    return rows


def top_commands(run: FleetRun, n: int = 8) -> list[tuple[str, float]]:
    c = run.checkpoints[-1]
    return [(k, v / c.shards) for k, v in sorted(c.redis["commands"].items(), key=lambda kv: -kv[1])[:n]]


def project(run: FleetRun, backlog_rows: list[dict] | None, gpus: int = 1000, samples: int = 91_400_000) -> dict:
    """The fleet at 100x from the measured per-shard costs (docstring of the module; assumptions named)."""
    last = run.checkpoints[-1]
    tokens_per_shard = run.tokens / max(1, run.markers or run.shards)
    shards_per_s = gpus * run.rate / tokens_per_shard  # the fleet's shard rate on real GPUs
    shards = math.ceil(samples / SHARD_SIZE)
    per_shard = {k: last.storage.get(k, 0) / last.shards for k in STORAGE_KINDS}
    idle_per_worker_s = run.idle_redis["calls"] / run.idle_seconds / run.workers if run.idle_redis else 0.0
    cmds = last.redis["calls"] / last.shards
    out = {
        "gpus": gpus, "samples": samples, "shards": shards, "tokens_per_shard": tokens_per_shard,
        "shards_per_s": shards_per_s, "run_hours": shards / shards_per_s / 3600,
        "redis_commands_per_s": cmds * shards_per_s + idle_per_worker_s * gpus,
        "redis_commands_per_shard": cmds, "idle_commands_per_worker_s": idle_per_worker_s,
        "redis_in_bytes_per_s": last.redis["net_in"] / last.shards * shards_per_s,
        "storage_ops_per_s": {k: v * shards_per_s for k, v in per_shard.items() if v},
        "storage_metadata_ops_per_s": sum(v for k, v in per_shard.items() if k != "write" and k != "read")
        * shards_per_s,
        "storage_write_bytes_per_s": last.storage.get("bytes_written", 0) / last.shards * shards_per_s,
        "fleet_cores_per_gpu": last.cpu["fleet_cpu"] / last.shards * run.rate / tokens_per_shard,
    }
    if backlog_rows:
        full = backlog_rows[-1]
        out["redis_backlog_bytes"] = full["memory"] / full["shards"] * shards
        first = backlog_rows[0]
        rate = (full["seconds"] - first["seconds"]) / max(1, full["shards"] - first["shards"])  # less start-up
        out["producer_s"] = first["seconds"] + max(0.0, rate) * (shards - first["shards"])
        out["producer_commands_per_shard"] = full["redis"]["calls"] / full["shards"]
    s10, s100 = run.checkpoints[0], last
    if s10.status_s and s100.status_s:
        b = exponent(max(1e-3, s10.status_s - run.status_startup_s), max(1e-3, s100.status_s - run.status_startup_s),
                     s10.shards, s100.shards) or 1.0
        net = max(1e-3, s100.status_s - run.status_startup_s)
        out["status_s"] = run.status_startup_s + net * (shards / s100.shards) ** max(1.0, b)
        out["status_exponent"] = b
    return out


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def report(run: FleetRun, backlog_rows: list[dict] | None, out=print) -> None:
    if run.partial:
        out(f"\n(stopped at its deadline: {run.checkpoints[-1].shards:,} of {run.shards:,} shards done; the last "
            "column is that point)")
    out(f"\n## Fleet: {run.shards:,} shards ({run.samples:,} samples) on {run.storage.split(':')[0] if '://' in run.storage else 'local'} storage, "
        f"{run.workers} workers on {run.hosts} hosts, stand-in {run.rate:,.0f} tokens/s x {run.scale:g}, "
        f"--max-pending {run.max_pending}")
    out(f"wall {run.wall_s:.0f} s ({run.wall_s * run.scale / 3600:.1f} h at real speed), producer "
        f"{run.producer_s or float('nan'):.0f} s; {run.tokens / max(1, run.markers or run.shards):,.0f} tokens a "
        "shard")
    cps = run.checkpoints
    out("\n| per shard, in the window up to | " + " | ".join(f"{c.fraction:.0%} ({c.shards:,})" for c in cps)
        + " | growth b |")
    out("|---|" + "---:|" * (len(cps) + 1))
    for name, windows, b in per_shard_rows(run):
        out(f"| {name} | " + " | ".join(fmt(w) for w in windows) + f" | {fmt(b)} |")
    out(f"\nstatus start-up (its --help) {run.status_startup_s:.2f} s; status/metrics rows are latencies, not per shard")
    out("top Redis commands per shard: " + ", ".join(f"{k} {v:.1f}" for k, v in top_commands(run)))
    if run.idle_redis:
        out(f"idle fleet: {run.idle_redis['calls'] / run.idle_seconds / run.workers:.1f} Redis commands/s per worker "
            f"({', '.join(f'{k} {v}' for k, v in sorted(run.idle_redis['commands'].items(), key=lambda kv: -kv[1])[:5])}"
            f" in {run.idle_seconds:.0f} s)")
    last = cps[-1]
    tokens_per_shard = run.tokens / max(1, run.markers or run.shards)
    cpu = last.cpu["fleet_cpu"] / last.shards
    out(f"fleet CPU {cpu * 1000:.0f} ms a shard -> {cpu * run.rate / tokens_per_shard:.3f} cores per GPU at "
        f"{run.rate:,.0f} tokens/s ({tokens_per_shard:,.0f} tokens a shard); Redis' own CPU "
        f"{last.redis['cpu'] / last.shards * 1000:.1f} ms a shard; stand-ins' own "
        f"{last.cpu['stand_in_cpu'] / last.shards * 1000:.1f} ms a shard")
    e = run.engine
    out(f"stand-in engines: idle {e['idle_share']:.1%} of their windows ({e['gaps']} gaps; "
        f"{e['idle_s_real_per_worker']:.0f} s per GPU at real speed), utilisation {e['utilisation']:.1%} of a full "
        f"batch")
    if run.reclaim:
        r = run.reclaim
        if "resent_s" in r:
            out(f"host death: {r['host']} SIGKILLed holding {len(r['held'])} shards ({r['queue_at_kill']} queued); "
                f"all re-sent after {r['resent_s']:.1f} s ({r['resent_s'] * run.scale:.0f} s at real speed)"
                + (f", done after {r['done_s']:.1f} s" if "done_s" in r else ""))
        else:
            out(f"host death: {r['host']} SIGKILLed holding {len(r['held'])} shards with {r['queue_at_kill']} "
                f"queued: {len(r['resent'])} re-sent in the {r['watched_s']:.0f} s watched "
                f"({r['watched_s'] * run.scale:.0f} s at real speed; every slot of every worker was full)")
    v = run.verify
    out(f"accounting: {v['records']:,} records, {v['unique']:,} unique samples, {v['duplicated']} duplicated, "
        f"{v['expected']:,} expected, {v['markers']:,} markers; statuses {v['statuses']}")
    if backlog_rows:
        out("\n| backlog (no --max-pending) | " + " | ".join(f"{r['fraction']:.0%}" for r in backlog_rows) + " |")
        out("|---|" + "---:|" * len(backlog_rows))
        out("| shards | " + " | ".join(f"{r['shards']:,}" for r in backlog_rows) + " |")
        out("| produce s | " + " | ".join(f"{r['seconds']:.1f}" for r in backlog_rows) + " |")
        out("| Redis memory MB | " + " | ".join(f"{r['memory'] / 1e6:,.1f}" for r in backlog_rows) + " |")
        out("| Redis KB a shard | " + " | ".join(f"{r['memory'] / r['shards'] / 1e3:.2f}" for r in backlog_rows) + " |")
        out("| Redis commands a shard | " + " | ".join(f"{r['redis']['calls'] / r['shards']:.2f}"
                                                    for r in backlog_rows) + " |")
        out("| storage ops a shard | " + " | ".join(
            f"{sum(v for k, v in r['storage'].items() if ':' not in k and not k.startswith('bytes')) / r['shards']:.3f}"
            for r in backlog_rows) + " |")


def report_projection(p: dict, out=print) -> None:
    out(f"\n## At 100x: {p['gpus']:,} GPUs, {p['samples'] / 1e6:.1f}M samples, {p['shards']:,} shards")
    out(f"{p['shards_per_s']:.1f} shards/s fleet-wide ({p['tokens_per_shard']:,.0f} tokens a shard), "
        f"{p['run_hours']:.1f} h")
    out(f"Redis: {p['redis_commands_per_s']:,.0f} commands/s ({p['redis_commands_per_shard']:.1f} a shard + "
        f"{p['idle_commands_per_worker_s']:.1f}/s per worker), {p['redis_in_bytes_per_s'] / 1e6:.1f} MB/s in"
        + (f"; the whole backlog would take {p['redis_backlog_bytes'] / 1e9:.1f} GB without --max-pending"
           if "redis_backlog_bytes" in p else ""))
    out("storage: " + ", ".join(f"{k} {v:,.0f}/s" for k, v in p["storage_ops_per_s"].items())
        + f"; metadata {p['storage_metadata_ops_per_s']:,.0f} ops/s, records {p['storage_write_bytes_per_s'] / 1e6:.1f} MB/s")
    out(f"fleet CPU: {p['fleet_cores_per_gpu']:.3f} cores per GPU")
    if "producer_s" in p:
        out(f"producer: {p['producer_s'] / 60:.0f} min for the whole input ({p['producer_commands_per_shard']:.2f} "
            "Redis commands a shard)")
    if "status_s" in p:
        out(f"regen status: {p['status_s']:.0f} s a call (growth b {p['status_exponent']:.2f})")


def from_json(d: dict) -> FleetRun:
    run = FleetRun(**{k: v for k, v in d.items() if k != "checkpoints"})
    run.checkpoints = [Checkpoint(**c) for c in d["checkpoints"]]
    run.markers = run.markers or (run.verify or {}).get("markers", 0)
    return run


def reprint(results: dict) -> None:
    """The tables of a `--json` file (bench/bench_fleet_scale.py --report FILE)."""
    backlog_rows = results.get("backlog")
    if "local" in results:
        run = from_json(results["local"])
        report(run, backlog_rows)
        report_projection(project(run, backlog_rows))
    if "s3" in results:
        report(from_json(results["s3"]), None)


def to_json(run: FleetRun) -> dict:
    from dataclasses import asdict

    return asdict(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=0.1, help="fraction of the job's 914K samples")
    ap.add_argument("--workers", type=int, default=8, help="worker processes, one stand-in GPU each")
    ap.add_argument("--hosts", type=int, default=2, help="supervisors the workers are split over (one is killed)")
    ap.add_argument("--rate", type=float, default=11_500, help="stand-in tokens/s per GPU at a full batch")
    ap.add_argument("--time-scale", type=float, default=25, help="the stand-ins run this many times faster")
    ap.add_argument("--seqs", type=int, default=0, help="stand-in batch (default: the preset's max_num_seqs)")
    ap.add_argument("--max-pending", type=int, default=200)
    ap.add_argument("--s3-scale", type=float, default=0.0, help="also run the fleet on s3:// (moto) at this fraction")
    ap.add_argument("--no-backlog", action="store_true", help="skip the producer-alone backlog pass")
    ap.add_argument("--no-kill", action="store_true", help="do not SIGKILL a host at the run's tail")
    ap.add_argument("--fractions", default="0.1,0.5,1", help="checkpoints, fractions of the run's shards done")
    ap.add_argument("--backlog-fractions", default="0.1,0.5,1", help="the producer-alone runs, fractions of the job")
    ap.add_argument("--deadline", type=float, default=None,
                    help="stop the local fleet this many seconds after the producer's start (last checkpoint there)")
    ap.add_argument("--kill-at", type=float, default=None,
                    help="SIGKILL a host this many seconds after the producer's start (default: at the run's tail, "
                         "once the queue is empty)")
    ap.add_argument("--skip-local", action="store_true", help="only the s3:// pass (with --s3-scale)")
    ap.add_argument("--report", type=Path, default=None, help="print the tables of a --json file again and exit")
    ap.add_argument("--work", type=Path, default=None, help="work folder (kept; prompts reused) [default: a temp dir]")
    ap.add_argument("--json", type=Path, default=None, help="write every measurement here")
    args = ap.parse_args()
    if args.report:
        reprint(json.loads(args.report.read_text()))
        return
    import tempfile

    work = args.work or Path(tempfile.mkdtemp(prefix="regen-fleet-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    samples = round(args.scale * JOB_SAMPLES)
    print(f"work folder {work}; {samples:,} samples ({math.ceil(samples / SHARD_SIZE):,} shards)")
    t0 = time.perf_counter()
    files = write_prompts(work / f"prompts-{samples}", samples)
    model = write_model(work / "model")
    print(f"prompts and model ready in {time.perf_counter() - t0:.0f} s")
    redis = RedisServer(work / "redis")
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    try:
        backlog_rows = None
        if not args.no_backlog:
            print("backlog (producer alone, no --max-pending):")
            backlog_rows = backlog(work, files, model, redis, samples,
                                   fractions=tuple(float(x) for x in args.backlog_fractions.split(",")))
            results["backlog"] = backlog_rows
        storage = work / "storage"
        shutil.rmtree(storage, ignore_errors=True)
        if args.skip_local:
            results["s3"] = to_json(s3_pass(work, model, redis, args))
            return
        print("fleet on local storage:")
        run = run_fleet(work, files, str(storage), model, redis, samples=samples, workers=args.workers,
                        hosts=args.hosts, scale=args.time_scale, rate=args.rate, max_pending=args.max_pending,
                        kill_host=not args.no_kill, seqs=args.seqs, deadline=args.deadline, kill_at=args.kill_at,
                        fractions=tuple(float(x) for x in args.fractions.split(",")))
        results["local"] = to_json(run)
        report(run, backlog_rows)
        projection = project(run, backlog_rows)
        results["projection"] = projection
        report_projection(projection)
        if args.s3_scale:
            results["s3"] = to_json(s3_pass(work, model, redis, args))
        shutil.rmtree(storage, ignore_errors=True)
    finally:
        redis.stop()
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; timings are from a shared 2-core machine (noisy); counts are not")


def s3_pass(work: Path, model: Path, redis: RedisServer, args) -> FleetRun:
    """The fleet on s3:// (moto's server, its requests counted as served) at `--s3-scale` of the job."""
    samples = round(args.s3_scale * JOB_SAMPLES)
    files = write_prompts(work / f"prompts-{samples}", samples)
    port = free_port()
    server = subprocess.Popen([sys.executable, str(REPO / "bench" / "s3_counting_server.py"), str(port)],
                              stdout=open(work / "moto.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    endpoint = f"http://127.0.0.1:{port}"
    s3_env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
              "REGEN_STORAGE_OPTIONS": json.dumps({"client_kwargs": {"endpoint_url": endpoint}})}
    os.environ.update(s3_env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                s3_counts(endpoint)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(f"moto did not start: see {work / 'moto.log'}") from None
                time.sleep(0.3)
        from app.base.storage import Storage

        Storage("s3://regen-bench").fs.mkdir("regen-bench")
        print(f"fleet on s3:// (moto) at {args.s3_scale:g} of the job ({math.ceil(samples / SHARD_SIZE):,} shards):")
        run = run_fleet(work, files, "s3://regen-bench/fleet", model, redis, samples=samples, workers=args.workers,
                        hosts=args.hosts, scale=args.time_scale, rate=args.rate, max_pending=args.max_pending,
                        kill_host=False, s3_endpoint=endpoint, extra_env=s3_env, seqs=args.seqs)
        report(run, None)
        return run
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
