"""Fleet throughput vs vLLM called directly, on the CPU with the tiny Qwen3 (one command, ~20 minutes on 2 cores).

    python bench/bench_fleet.py [--prompts 512] [--max-tokens 256] [--shard-size 32] [--rounds 6]
                                [--warm-rounds 1] [--directs 2] [--fleets 2] [--in-worker] [--engine-only]
                                [--ab-engine-host | --ab-env KEY=VALUE ...]

Direct: `LLM.generate` over all of a round's prompts (token-id prompts, same sampling, vLLM built from the
worker's own `llm_kwargs` with the max_model_len the worker derives from the run, capture files in the worker's
scratch place, /dev/shm: on a disk-backed /tmp their writes cost the direct side ~7%).
Fleet: `regen produce` -> local Redis -> a real `regen worker --cpu` process -> shards on storage. Steady-state
tokens/s is measured from the first shard's engine start to the moment the last shard's completion marker is on
storage (the marker file's mtime), so the worker's start-up is not counted, but everything between shards
(writing, marker, ack, fetching the next message, rendering prompts) is, and so is the side work of the pass's
last shards: ending at the last shard's engine end, as before, let a worker whose side threads wait for the
engine to run dry (SCHED_IDLE) leave most of a short pass's side work outside the window. The worker's task slots let the next shards generate while the previous one is
written, so the engine's idle time is the gaps in the union of the shards' engine spans; it is printed too.
A shard's span is the engine's own (workers/engine/request.py `EngineSpan`: when vLLM took its requests, when its last
one finished there). Spans taken on the task's side, as before, ended only once the last result had crossed the
pipe and been checked by the worker's starved side threads, which on this 2-core box is after the next shard had
already started: they printed "0 ms" while the engine stood idle 35-80 ms before most shards.

Several processes of each side: a vLLM process here keeps a speed of its own for its whole life (memory
placement, which core its OpenMP team lands on). Measured on a 2-core EPYC in 8 alternating rounds, a second
direct process identical to the first ran at a median 0.944 of it, while two engine-host processes
(workers/engine/process.py, spawned from a plain Python process) ran at 0.997 and 1.011 of it: one process's luck
is as large as the target's margin, and with one direct and one worker it decided the ratio. So the bench starts
`--directs` direct processes and `--fleets` workers (2 each by default), times one pass of every one per round,
and takes the ratio of the fleet's mean rate to direct's mean rate; each process's own median against the
round's direct mean is printed too, so the spread shows. `--in-worker` adds `LLM.generate` run by each worker
on its own engine (in its engine's process, between shards: workers/doubles/bench_task.py), which takes that worker's
own process difference out of its comparison.

How the comparison is kept fair on a noisy machine (speeds here move by 20-30% within minutes):
- Every process is started once and kept: a round is one timed pass of each (~5-15 s apiece), so the passes of
  a round are seconds apart, not the minute a fresh worker takes to start.
- Each round has prompts of its own ("Round 3a, question i ..."), so no pass hits prefix-cache entries left by an
  earlier pass; every process runs the same prompts within a round (each has an engine of its own), a worker's
  own direct pass a second set of the same shape ("Round 3b"), since it shares that worker's prefix cache.
- The order rotates from round to round, so drift does not favour one side.
- Every process first runs `--warm-rounds` untimed rounds of full-size passes: a process's first passes at a new
  size ran at a third to two thirds of its later speed here.
- Each fleet round is produced onto a queue the worker does not consume yet; the worker is then told to consume
  it (Celery's `add_consumer` remote control), so producing does not overlap the timed window.
- The ratio is taken within each round and the median printed, with a bootstrap interval; absolute figures mean
  little here.
Three figures that do not move with the machine's noise are printed too, since a throughput ratio here does (the
same settings gave 0.92 in one run and 0.96 in another). First, the workers' CPU per shard by part, read from /proc
per thread (the engine's, and the side work's: the Celery process and the engine host's other threads). Second, the
drain: the time from the engine's last end of a pass to its last marker on storage, which a pass of a few shards
pays in full and a run of thousands of shards once. Third, the CPU per 1,000 generated tokens: a direct process's
whole CPU (`time.process_time` around its pass, its capture-file tidying included), and a worker's engine (its
engine thread and OpenMP team) and side work. It shows where the shortfall goes: on the 2-core EPYC the workers'
engines took ~9% more CPU per token than direct processes doing the same generation (309 against 283 ms, medians of
6 passes), besides ~12 ms of side work, because each millisecond a side thread holds one of the team's cores the
other OpenMP thread spins at the next barrier. On 2 cores nearly all of the fleet's shortfall is the side work's
CPU taken from the engine's OpenMP team (each millisecond of it on a core the team spins on stalls the whole team)
plus the drain; cutting side CPU per shard is what moves the ratio.
Outputs are 256 tokens by default. The worker's side work is mostly per sample (rendering the prompt, reading,
checking and compressing its capture, its record): measured on a 2-core Xeon, ~0.8 ms of CPU per sample plus ~9
ms per 1,000 tokens. At 64 tokens per output, the earlier default, the per-sample part weighed 16 times per token
what it does at 1,024-token outputs and 64 times what it does at the 4,096 `regen produce` allows by default, and
thinking-mode outputs run to thousands of tokens. So the bench measured little but the per-sample path: 0.889 of
direct, where 256-token outputs gave 0.982 and 1.036 and 512-token ones 0.994 on the same box.
`--prompts 1024 --max-tokens 64 --shard-size 64 --rounds 10` (~15 minutes) is that stress case, kept for work on
the per-sample path.
Passes have at least twice as many shards as the worker's task slots (512 prompts: 16 shards of 32 against 8
slots on the CPU preset), so most shards are refills: fetched and started while earlier ones are still being
written, as in a long run. With 256 prompts, as before, a pass's 4 shards were all taken at once, the engine
never waited for a shard fetched while another was being written, and "max 0 ms" said nothing about a long run:
there the task's start (storage checks, its attempt record, rendering) and the previous shard's write run on side
threads the engine leaves a thin share of the cores, 0.3-1.2 s each under load here, and the spare slots are the
buffer. Longer passes also make the drain a smaller part of each pass, as it is of a run.
`--ab-env KEY=VALUE` (repeatable) starts one more worker with those environment settings instead (for example
`--ab-env REGEN_SIDE_THREADS=idle`) and adds one pass of it to every round, its gaps printed apart.
`--ab-engine-host` starts one more worker with the other engine placement (REGEN_ENGINE_HOST flipped: the CPU
engine in the worker's own process instead of a process of its own) and adds one pass of it to every round.
On this 2-core CPU the worker's compression and writes compete with the engine for the same cores (and, in one
process, for the GIL: the tiny model's steps are mostly Python); on a GPU host the engine core is a process of its
own and they overlap with GPU work.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BROKER = "redis://127.0.0.1:6379/8"
LAYERS = [1, 2, 4]
MAX_PROMPT_TOKENS = 2048  # the fleet's worker derives max_model_len = this + max_tokens from the run; direct uses the same
WARM_UP_PROMPTS = 16
PASS_TIMEOUT = 900  # seconds one timed pass may take before the bench gives up


def _child_prelude(model: str, max_tokens: int, scratch: str, tag: str) -> str:
    """Start of a long-lived timed child: `o` (the worker's EngineOptions for this bench), `round_prompts(r)`,
    and `serve(run_once)`, which runs one timed pass per "go <round>" line on stdin and answers on the original
    stdout (everything the child itself prints goes to stderr, so vLLM's logs cannot be mistaken for a result)."""
    return f"""
import json, os, shutil, sys, threading, time
results = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, {str(REPO)!r})
from workers.process.context import scratch_root
from workers.engine.options import EngineOptions
o = EngineOptions(model={model!r}, capture_layers=tuple({LAYERS!r}), max_model_len={MAX_PROMPT_TOKENS + max_tokens},
                  scratch_dir=os.path.join(scratch_root(), f"regen-bench-{tag}-{{os.getpid()}}"))
def round_prompts(r):
    return json.load(open(os.path.join({scratch!r}, f"prompts-{{r}}.json")))
def serve(run_once):
    try:
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] != "go":
                break
            cpu = time.process_time()
            tokens, seconds = run_once(cmd[1])
            cpu = time.process_time() - cpu  # every thread of this process, the untimed tidying included
            results.write(json.dumps({{"tokens": tokens, "seconds": seconds, "cpu": cpu}}) + "\\n")
    finally:
        shutil.rmtree(o.scratch_dir, ignore_errors=True)
        os._exit(0)
"""


class _Child:
    """A child process that builds its engine once, then times one pass per `timed(round)` call."""

    def __init__(self, code: str, log: Path):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(log, "wb"), text=True,  # noqa: SIM115
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def timed(self, round_name: str) -> tuple[int, float, list[float], dict]:
        """(tokens, seconds, [], {"cpu": {"process": CPU seconds of the child's pass}})."""
        self.proc.stdin.write(f"go {round_name}\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], PASS_TIMEOUT)[0]:  # a pass takes seconds: fail, never hang
            raise SystemExit(f"bench child gave no result in {PASS_TIMEOUT} s; the end of {self.log}:\n"
                             + self.log.read_text()[-3000:])
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"bench child failed; the end of {self.log}:\n" + self.log.read_text()[-3000:])
        result = json.loads(line)
        return result["tokens"], result["seconds"], [], {"cpu": {"process": result["cpu"]}}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def direct_child(model: str, max_tokens: int, scratch: str, tag: str = "direct") -> _Child:
    """`LLM.generate` over a round's prompts, one call per pass."""
    return _Child(_child_prelude(model, max_tokens, scratch, tag) + f"""
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from app.base.library_patches import fix_vllm_cpu_expand
from workers.engine.llm_arguments import llm_kwargs
fix_vllm_cpu_expand()  # as the worker's engine does
llm = LLM(**llm_kwargs(o))
def params(n):
    return [SamplingParams(temperature=0.6, top_p=0.95, max_tokens={max_tokens}, seed=i,
                           extra_args={{"kv_transfer_params": {{"include_output_tokens": True}}}}) for i in range(n)]
def run_once(r):
    prompts = [TokensPrompt(prompt_token_ids=p) for p in round_prompts(r)]
    sampling = params(len(prompts))
    t = time.monotonic()
    outs = llm.generate(prompts, sampling, use_tqdm=False)
    dt = time.monotonic() - t
    shutil.rmtree(o.scratch_dir, ignore_errors=True)  # this pass's capture files, outside the timed window
    os.makedirs(o.scratch_dir, exist_ok=True)
    return sum(len(x.outputs[0].token_ids) for x in outs), dt
run_once("warm")
serve(run_once)
""", Path(scratch, f"{tag}.log"))


def engine_only_child(model: str, max_tokens: int, shard_size: int, scratch: str, slots: int) -> _Child:
    """The worker's `InProcessEngine` class alone (no Celery, no records): shards of `shard_size` from `slots`
    threads, as many as the worker's task slots, capture files read and removed. Separates what the engine class
    costs from what the rest of the worker costs. (Two threads, as before, fed 64 sequences to a 64-sequence
    engine, so every shard's end left it short until its thread came back: docs/performance.md, 2026-12-06.)"""
    return _Child(_child_prelude(model, max_tokens, scratch, "engine") + f"""
from workers.engine.in_process import InProcessEngine
from workers.engine.request import GenRequest
engine = InProcessEngine(o)
def requests(ids, first):
    return [GenRequest(str(first + i), p, {{"temperature": 0.6, "top_p": 0.95, "max_tokens": {max_tokens},
                                           "seed": first + i}}, capture=True) for i, p in enumerate(ids)]
def run_once(r):
    prompts = round_prompts(r)
    shards = iter([(k, prompts[k:k + {shard_size}]) for k in range(0, len(prompts), {shard_size})])
    lock, tokens = threading.Lock(), []
    def slot():
        while True:
            with lock:
                k, ids = next(shards, (None, None))
            if ids is None:
                return
            engine.run(requests(ids, k), lambda res: tokens.append(len(res.output_token_ids)))
    t = time.monotonic()
    slots = [threading.Thread(target=slot) for _ in range({slots})]
    for th in slots:
        th.start()
    for th in slots:
        th.join()
    return sum(tokens), time.monotonic() - t
run_once("warm")
serve(run_once)
""", Path(scratch, "engine.log"))


_TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(task: Path) -> float:
    """CPU seconds so far (utime + stime) of one thread, `task` being its /proc/<pid>/task/<tid> folder."""
    stat = (task / "stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _worker_cpu(root_pid: int) -> dict[str, float]:
    """CPU seconds so far of a `regen worker` and its children, by part: "engine" (the engine host's engine
    thread and its OpenMP team), "host side" (the engine host's other threads: delivery, vLLM's idle loops) and
    "worker" (the supervisor and the Celery process: task slots, delivery, encoders, Celery's consumer).

    Read from /proc per thread, so it is exact up to the clock tick and does not move with the machine's noise
    the way a throughput ratio does: how much CPU the fleet's side work takes per shard, next to the engine's."""
    from workers.engine.in_process import ENGINE_THREAD
    from workers.engine.process import PROCESS_NAME

    out = {"engine": 0.0, "host side": 0.0, "worker": 0.0}
    pids, seen = [root_pid], set()
    while pids:
        pid = pids.pop()
        seen.add(pid)
        try:
            process = Path(f"/proc/{pid}/comm").read_text().strip()
            for task in Path(f"/proc/{pid}/task").iterdir():
                seconds = thread_cpu(task)
                if process != PROCESS_NAME:
                    out["worker"] += seconds
                elif (task / "comm").read_text().strip() == ENGINE_THREAD:
                    out["engine"] += seconds
                else:
                    out["host side"] += seconds
                pids += [int(c) for c in (task / "children").read_text().split() if int(c) not in seen]
        except (OSError, ValueError):  # a thread or process that ended meanwhile
            continue
    return out


def _worker_cpu_since(root_pid: int, before: dict[str, float]) -> dict[str, float]:
    """CPU seconds by part (`_worker_cpu`) the worker has used since `before` was read."""
    now = _worker_cpu(root_pid)
    return {part: now[part] - before[part] for part in now}


class Fleet:
    """One `regen worker --cpu` process kept for the whole bench; each round is a run of its own."""

    def __init__(self, model: str, scratch: str, max_tokens: int, shard_size: int, tag: str = "", env: dict | None = None):
        import redis

        from app.base.celery_app import create_app
        from app.base.config import BrokerConfig

        if not tag:  # the first fleet only: a second one must not wipe the first worker's remote-control bindings
            redis.Redis.from_url(BROKER).flushdb()
        self.scratch, self.model, self.max_tokens, self.shard_size = scratch, model, max_tokens, shard_size
        self.storage = os.path.join(scratch, f"storage{tag}")
        self.tag = tag
        self.env = {**os.environ, "REGEN_BROKER_URL": BROKER, "HF_HUB_OFFLINE": "1", "REGEN_BENCH_TASKS": "1",
                    **(env or {})}
        self.app = create_app(BrokerConfig.from_env(BROKER))
        self.control = self.app.control
        # Queues of this bench's own: a worker left over from an interrupted bench must not take these shards.
        self.prefix = f"regen-bench-{os.getpid()}{tag}"
        self.log = Path(scratch, f"worker{tag}.log")
        self.shards: dict[str, int] = {}
        self.name = f"bench{os.getpid()}{tag}"  # remote control goes to this worker alone
        # The warm-up run has the rounds' shard size: the worker sizes its task slots by the --run's shards.
        warm_shards = self._produce("warm")
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "worker", "--cpu", "--run", "bench-warm", "--storage", self.storage,
             "--name", self.name, "--queue", f"{self.prefix}-warm,{self.prefix}-direct"],
            env=self.env, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
        self._wait_done("warm", warm_shards)

    def _produce(self, round_name: str) -> int:
        subprocess.run(
            [sys.executable, "-m", "app.cli", "produce", str(Path(self.scratch, f"prompts-{round_name}.jsonl")),
             "--run", f"bench-{round_name}", "--storage", self.storage, "--model", self.model,
             "--layers", "vllm:" + ",".join(map(str, LAYERS)), "--max-tokens", str(self.max_tokens),
             "--top-k", "0", "--shard-size", str(self.shard_size), "--max-prompt-tokens",
             str(MAX_PROMPT_TOKENS), "--pause-stub-rate", "1", "--queue", f"{self.prefix}-{round_name}"],
            env=self.env, check=True, capture_output=True)
        produced = json.loads(Path(self.storage, f"bench-{round_name}", "produce.json").read_text())
        return produced["counts"]["shards"]

    def direct_in_worker(self, round_name: str, sampling_of: str) -> tuple[int, float, list[float], dict]:
        """`LLM.generate` over the round's prompts on the worker's own engine (workers/doubles/bench_task.py), with the
        sampling of run `bench-<sampling_of>`; extras as `timed`'s (CPU by part over the whole exchange)."""
        from app.base.celery_app import BENCH_DIRECT_TASK

        manifest = json.loads(Path(self.storage, f"bench-{sampling_of}", "run.json").read_text())
        result = Path(self.scratch, f"worker-direct-{round_name}{self.tag}.json")
        cpu_before = _worker_cpu(self.worker.pid)
        self.app.send_task(BENCH_DIRECT_TASK, queue=f"{self.prefix}-direct", kwargs={
            "prompts": json.loads(Path(self.scratch, f"prompts-{round_name}.json").read_text()),
            "sampling": manifest["settings"]["sampling"], "result_path": str(result)})
        self._wait_for(result.exists, "its direct pass")
        cpu = _worker_cpu_since(self.worker.pid, cpu_before)
        got = json.loads(result.read_text())
        return got["tokens"], got["seconds"], [], {"cpu": cpu}

    def _wait_done(self, round_name: str, shards: int) -> list[dict]:
        done = Path(self.storage, f"bench-{round_name}", "done")
        self._wait_for(lambda: done.exists() and len(list(done.glob("shard-*.json"))) >= shards, f"run {round_name}")
        # Each marker with the time it reached storage: it is the shard's last write (local storage: the mtime).
        return [{**json.loads(p.read_text()), "stored": p.stat().st_mtime} for p in done.glob("shard-*.json")]

    def _wait_for(self, ready, what: str, timeout: float = PASS_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.worker.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the bench worker exited or timed out in {what}; the end of its log:\n"
                                 + self.log.read_text()[-3000:])
            time.sleep(0.1)

    def produce(self, round_name: str) -> None:
        """Put the round's shards on a queue of their own, which the worker does not consume yet."""
        self.shards[round_name] = self._produce(round_name)

    def timed(self, round_name: str) -> tuple[int, float, list[float], dict]:
        """(tokens, seconds, engine gaps, extras): extras has the pass's CPU seconds by part (`_worker_cpu`),
        its shard count, and its drain (the last marker's time on storage after the engine's last end)."""
        shards = self.shards.pop(round_name)
        cpu_before = _worker_cpu(self.worker.pid)
        queue = f"{self.prefix}-{round_name}"
        worker = [f"{self.name}@{socket.gethostname()}"]
        if not self.control.add_consumer(queue, reply=True, timeout=10, destination=worker):
            raise SystemExit(f"the bench worker {worker[0]} did not answer add_consumer")
        try:
            markers = sorted(self._wait_done(round_name, shards), key=lambda m: m["engine_started"])
        finally:
            self.control.cancel_consumer(queue, reply=True, timeout=10, destination=worker)
        cpu = _worker_cpu_since(self.worker.pid, cpu_before)
        tokens = sum(m["generated_tokens"] for m in markers)
        stored = max(m["stored"] for m in markers)
        span = stored - markers[0]["engine_started"]
        # Shards overlap on the engine (several task slots), so idle time is the gaps in the union of busy spans.
        gaps, end = [], markers[0]["engine_finished"]
        for m in markers[1:]:
            gaps.append(max(0.0, m["engine_started"] - end))
            end = max(end, m["engine_finished"])
        extras = {"cpu": cpu, "shards": shards, "drain": stored - end}
        return tokens, span, gaps, extras

    def close(self) -> None:
        self.worker.terminate()
        self.worker.wait(timeout=120)
        if os.environ.get("REGEN_BENCH_KEEP_LOG"):
            import shutil

            shutil.copy(self.log, os.environ["REGEN_BENCH_KEEP_LOG"] + self.name.removeprefix(f"bench{os.getpid()}"))


def write_prompts(tokenizer, scratch: str, round_name: str, n: int) -> None:
    """The round's prompts, as a producer input file (fleet) and as rendered token ids (direct, engine-only)."""
    from workers.shard.generate import render_prompt

    rows = [{"question": f"Round {round_name}, question {i}: what is {i} * {i + 3}? Explain the steps briefly."}
            for i in range(n)]
    Path(scratch, f"prompts-{round_name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ids = [render_prompt(tokenizer, [{"role": "user", "content": r["question"]}], None, True) for r in rows]
    Path(scratch, f"prompts-{round_name}.json").write_text(json.dumps(ids))


def _engine_host_default() -> bool:
    """Whether the CPU worker runs its engine in a process of its own (workers/engine/process.py) without flags."""
    import click

    from workers.process.devices import PRESETS

    choice = os.environ.get("REGEN_ENGINE_HOST")  # read as `regen worker --engine-host` reads it
    return PRESETS["cpu"].get("host_process", False) if choice is None else click.BOOL.convert(choice, None, None)


def _ms_per_ktok(result: tuple, *parts: str) -> float:
    """CPU milliseconds per 1,000 generated tokens of one timed pass (tokens, seconds, gaps, extras), summed over
    `parts` of its `extras["cpu"]`."""
    tokens, _, _, extras = result
    return sum(extras["cpu"][part] for part in parts) * 1e6 / tokens


def _median(xs: list[float]) -> float:
    return float(np.median(xs))


def _median_interval(xs: list[float], level: float = 0.9) -> tuple[float, float]:
    """A bootstrap interval for the median of per-round ratios (rounds resampled with replacement, fixed seed).

    Rounds here scatter by +-10% or more, so a median of 7 moves by several percent from one bench to the next:
    as much as the distance to the target. The interval says how far this bench's median can be trusted."""
    if len(xs) < 3:
        return min(xs), max(xs)
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(np.asarray(xs), size=(10_000, len(xs)), replace=True), axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(medians, tail)), float(np.quantile(medians, 1 - tail))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=512,
                    help="per pass; at least twice as many shards as the worker's task slots (8 on the CPU preset "
                         "with 32-sample shards), so most shards are fetched while earlier ones are still being "
                         "written (refills), as in a long run")
    ap.add_argument("--max-tokens", type=int, default=256,
                    help="per output; 64 makes the bench a stress case of the per-sample path (see the docstring)")
    ap.add_argument("--shard-size", type=int, default=32,
                    help="half the production default, so a 512-prompt pass has twice the task slots' shards; "
                         "per-shard work weighs twice what it does in a run")
    ap.add_argument("--rounds", type=int, default=6,
                    help="one pass of every direct process and every worker each, order rotating; the ratio is taken "
                         "per round, then the median")
    ap.add_argument("--warm-rounds", type=int, default=1,
                    help="untimed rounds of full-size passes for every process before the timed ones")
    ap.add_argument("--directs", type=int, default=2,
                    help="direct processes, each started once; a round's baseline is their mean rate, so one "
                         "process's lasting luck (+-5%% here) does not set the ratio")
    ap.add_argument("--fleets", type=int, default=2,
                    help="workers, each started once (queues, storage and engine of its own); a round's fleet rate "
                         "is their mean")
    ap.add_argument("--in-worker", action="store_true",
                    help="also time LLM.generate on each worker's own engine (in its engine process) every round: "
                         "the fleet against direct with that process's own difference taken out")
    ap.add_argument("--engine-only", action="store_true",
                    help="also run the worker's InProcessEngine class alone each round (no Celery, no records), to tell what the "
                         "engine class costs from what the rest of the worker costs")
    ap.add_argument("--ab-env", action="append", default=[], metavar="KEY=VALUE",
                    help="also run a worker with these environment settings (repeatable), one pass per round, to "
                         "measure what they change, e.g. REGEN_SIDE_THREADS=idle")
    ap.add_argument("--ab-engine-host", action="store_true",
                    help="also run a worker whose engine runs in its own process (--no-engine-host: in the "
                         "worker's), one pass per round, to measure what the engine host changes")
    args = ap.parse_args()
    if args.directs < 1 or args.fleets < 1:
        ap.error("--directs and --fleets must be at least 1")
    if args.ab_env and args.ab_engine_host:
        ap.error("--ab-env and --ab-engine-host each start the one other worker: choose one")
    ab_env = dict(kv.split("=", 1) for kv in args.ab_env if "=" in kv)
    if len(ab_env) != len(args.ab_env):
        ap.error("--ab-env takes KEY=VALUE")
    from transformers import AutoTokenizer

    from workers.tiny_model import build_tiny_qwen3

    ratios: dict[str, list[float]] = {"fleet/direct": [], "fleet/other": []}
    own: dict[str, list[float]] = {}  # each process's rate / the round's direct mean: how far its luck goes
    host_default = _engine_host_default()
    gaps_ms: list[float] = []
    cpu_ms_per_shard: dict[str, list[float]] = {}  # the fleet workers' CPU by part, per shard, one value per pass
    drains: list[tuple[float, float]] = []  # (drain, pass window) seconds per fleet pass
    # CPU ms per 1,000 generated tokens, one value per pass: a direct process's whole CPU, a worker's engine
    # (its engine thread and OpenMP team) and its side work. Where the engine's exceeds direct's, the engine did
    # the same work with more CPU: its OpenMP team spun at barriers while a side thread held one of its cores.
    cpu_per_ktok: dict[str, list[float]] = {"direct": [], "fleet engine": [], "fleet side": [], "in worker": [],
                                         "engine class": []}
    other_gaps_ms: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_qwen3(os.path.join(tmp, "tiny"))
        tok = AutoTokenizer.from_pretrained(model)
        write_prompts(tok, tmp, "warm", WARM_UP_PROMPTS)
        # Warm-up rounds (untimed) first: a process's first full-size passes ran at a third to two thirds of its
        # later speed here, and a process that happened to be timed on one set the ratio of a short bench.
        rounds = [f"w{k}" for k in range(1, args.warm_rounds + 1)] + [str(r) for r in range(1, args.rounds + 1)]
        for r in rounds:
            write_prompts(tok, tmp, f"{r}a", args.prompts)
            if args.in_worker:
                write_prompts(tok, tmp, f"{r}b", args.prompts)
        from workers.process.devices import PRESETS, task_slots_for

        slots = task_slots_for(PRESETS["cpu"]["max_num_seqs"], args.shard_size, "cpu")
        pass_shards = -(-args.prompts // args.shard_size)
        if pass_shards < 2 * slots:
            print(f"note: a pass's {pass_shards} shards against the worker's {slots} task slots: most are taken at "
                  f"once, not fetched while another is being written, so the gap figure shows few of a long run's "
                  f"refills; use --prompts {2 * slots * args.shard_size} or more for that")
        print(f"prompts {args.prompts}, max_tokens {args.max_tokens}, shard size {args.shard_size}, capture inline "
              f"(vLLM layers {LAYERS}), {args.rounds} rounds of one pass each of {args.directs} direct processes "
              f"and {args.fleets} workers, order rotating; starting the engines", flush=True)
        directs = [direct_child(model, args.max_tokens, tmp, tag=f"direct{i + 1}") for i in range(args.directs)]
        engine_only = (engine_only_child(model, args.max_tokens, args.shard_size, tmp, slots)
                       if args.engine_only else None)
        fleets: list[Fleet] = []
        other = None
        try:
            for i in range(args.fleets):
                fleets.append(Fleet(model, tmp, args.max_tokens, args.shard_size, tag="" if i == 0 else f"-{i + 1}"))
            if args.ab_engine_host or ab_env:
                other = Fleet(model, tmp, args.max_tokens, args.shard_size, tag="-other",
                              env=ab_env or {"REGEN_ENGINE_HOST": "false" if host_default else "true"})
            for k, r in enumerate(rounds):
                # Every process runs the round's prompts "a" once (each has its own engine and prefix cache); a
                # worker's own direct pass runs "b" (same shape, other questions), so it gets no prefix-cache hits
                # from the fleet pass before it.
                passes: dict[str, Callable[[], tuple]] = {}
                for i, child in enumerate(directs):
                    passes[f"direct {i + 1}"] = lambda c=child, r=r: c.timed(f"{r}a")
                for i, fleet in enumerate(fleets):
                    fleet.produce(f"{r}a")
                    passes[f"fleet {i + 1}"] = lambda f=fleet, r=r: f.timed(f"{r}a")
                    if args.in_worker:
                        passes[f"in worker {i + 1}"] = lambda f=fleet, r=r: f.direct_in_worker(f"{r}b", f"{r}a")
                if other is not None:
                    other.produce(f"{r}a")
                    passes["other"] = lambda r=r: other.timed(f"{r}a")
                if engine_only is not None:
                    passes["engine"] = lambda r=r: engine_only.timed(f"{r}a")
                names = list(passes)
                order = names[k % len(names):] + names[:k % len(names)]
                got = {name: passes[name]() for name in order}
                if r.startswith("w"):
                    print(f"warm-up round {r[1:]} done (untimed)", flush=True)
                    continue
                rate = {name: got[name][0] / got[name][1] for name in names}
                direct = float(np.mean([rate[f"direct {i + 1}"] for i in range(len(directs))]))
                fleet_rate = float(np.mean([rate[f"fleet {i + 1}"] for i in range(len(fleets))]))
                round_gaps = [g * 1000 for i in range(len(fleets)) for g in got[f"fleet {i + 1}"][2]]
                gaps_ms += round_gaps
                round_cpu = {
                    "direct": [_ms_per_ktok(got[f"direct {i + 1}"], "process") for i in range(len(directs))],
                    "fleet engine": [_ms_per_ktok(got[f"fleet {i + 1}"], "engine") for i in range(len(fleets))],
                    "fleet side": [_ms_per_ktok(got[f"fleet {i + 1}"], "worker", "host side")
                                   for i in range(len(fleets))],
                    "in worker": [_ms_per_ktok(got[f"in worker {i + 1}"], "engine")
                                  for i in range(len(fleets)) if args.in_worker],
                    "engine class": [_ms_per_ktok(got["engine"], "process")] if engine_only is not None else [],
                }
                for kind, values in round_cpu.items():
                    cpu_per_ktok[kind] += values
                for i in range(len(fleets)):
                    extras = got[f"fleet {i + 1}"][3]
                    for part, seconds in extras["cpu"].items():
                        cpu_ms_per_shard.setdefault(part, []).append(seconds * 1000 / extras["shards"])
                    drains.append((extras["drain"], got[f"fleet {i + 1}"][1]))
                if other is not None:
                    other_gaps_ms += [g * 1000 for g in got["other"][2]]
                for name in names:
                    own.setdefault(name, []).append(rate[name] / direct)
                ratios["fleet/direct"].append(fleet_rate / direct)
                line = (f"round {r}: direct {direct:,.0f} tok/s (mean of {len(directs)}), fleet {fleet_rate:,.0f} "
                        f"(steady state, mean of {len(fleets)}); fleet/direct {ratios['fleet/direct'][-1]:.3f}; "
                        + ", ".join(f"{name} {rate[name] / direct:.3f}" for name in names)
                        + f"; longest engine gap {max(round_gaps, default=0):.0f} ms; CPU ms per 1k tokens: direct "
                        + ", ".join(f"{x:.0f}" for x in round_cpu["direct"]) + ", fleet engine "
                        + ", ".join(f"{x:.0f}" for x in round_cpu["fleet engine"]) + " + side "
                        + ", ".join(f"{x:.1f}" for x in round_cpu["fleet side"]))
                if other is not None:
                    ratios["fleet/other"].append(fleet_rate / rate["other"])
                print(line, flush=True)
        finally:
            for fleet in fleets + ([other] if other is not None else []):
                fleet.close()
            for child in directs + ([engine_only] if engine_only is not None else []):
                child.close()

    def summary(xs: list[float]) -> str:
        low, high = _median_interval(xs)
        return (f"{_median(xs):.3f} median of {len(xs)} rounds (90% interval of the median {low:.3f}-{high:.3f}; "
                f"rounds {min(xs):.3f}-{max(xs):.3f})")

    print(f"fleet / direct                          = {summary(ratios['fleet/direct'])}; target >= 0.95")
    print("each process / the round's direct mean (medians; a process's own lasting difference shows here):")
    print("   " + ", ".join(f"{name} {_median(xs):.3f}" for name, xs in own.items()))
    if args.in_worker:
        for i in range(args.fleets):
            per_round = [f / w for f, w in zip(own[f"fleet {i + 1}"], own[f"in worker {i + 1}"], strict=True)]
            print(f"fleet {i + 1} / direct on its own engine    = {summary(per_round)}: what the fleet path costs")
    if "engine" in own:
        print(f"engine class alone / direct             = {summary(own['engine'])}")
    if "other" in own and ab_env:
        label = " ".join(f"{k}={v}" for k, v in ab_env.items())
        print(f"worker with {label} / direct = {summary(own['other'])}")
        print(f"fleet / worker with {label} = {summary(ratios['fleet/other'])}")
    elif "other" in own:
        placements = ("in its own process", "in the worker's process")
        placement, other_placement = placements if host_default else placements[::-1]
        print(f"engine {other_placement} / direct{' ' * (23 - len(other_placement))} = {summary(own['other'])}")
        print(f"fleet (engine {placement}) / fleet (engine {other_placement}) = {summary(ratios['fleet/other'])}")
    if gaps_ms:
        print(f"engine idle gap between shards: median {_median(gaps_ms):.1f} ms, max {max(gaps_ms):.1f} ms over "
              f"{len(gaps_ms)} gaps  (target < 50 ms)")
    if cpu_ms_per_shard:
        engine, host, worker = (_median(cpu_ms_per_shard[p]) for p in ("engine", "host side", "worker"))
        print(f"fleet CPU per shard (medians over passes): engine {engine:,.0f} ms; side work {worker + host:.1f} ms "
              f"= {(worker + host) / engine:.1%} of the engine's (Celery process {worker:.1f} ms, engine host's "
              f"other threads {host:.1f} ms)")
        direct_cpu, engine_cpu, side_cpu = (_median(cpu_per_ktok[k]) for k in ("direct", "fleet engine", "fleet side"))
        line = (f"CPU per 1,000 generated tokens (medians over passes): direct {direct_cpu:.0f} ms (its whole "
                f"process); fleet engine {engine_cpu:.0f} ms ({engine_cpu / direct_cpu:.3f} of direct's) + side work "
                f"{side_cpu:.1f} ms")
        if cpu_per_ktok["in worker"]:
            line += (f"; LLM.generate on a worker's engine {_median(cpu_per_ktok['in worker']):.0f} ms (its engine "
                     f"thread and team)")
        if cpu_per_ktok["engine class"]:
            line += f"; the InProcessEngine class alone {_median(cpu_per_ktok['engine class']):.0f} ms (its whole process)"
        print(line)
        drain = [d for d, _ in drains]
        print(f"drain after the engine's last end of a pass (its last shard's side work, inside the window): median "
              f"{_median(drain) * 1000:.0f} ms, {_median([d / w for d, w in drains]):.1%} of a pass; a run pays it once")
    if other_gaps_ms:
        print(f"  the other worker's: median {_median(other_gaps_ms):.1f} ms, max {max(other_gaps_ms):.1f} ms over "
              f"{len(other_gaps_ms)} gaps")


if __name__ == "__main__":
    main()
