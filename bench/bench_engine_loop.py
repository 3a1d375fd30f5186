"""The worker's engine against `LLM.generate` on the same engine, with no side work (~5 minutes on 2 cores).

    python bench/bench_engine_loop.py [--prompts 512] [--max-tokens 256] [--shard-size 32] [--rounds 6]
                                      [--ab-host-threads]

Why: the fleet bench (bench_fleet.py) cannot tell the engine's own loop (workers.engine.in_process: shards admitted
as task slots hand them over, one step at a time, results streamed) from the worker's side work beside it, nor
either from one process's lasting luck (+-5% between identical processes here). This bench starts the CPU
worker's engine process as the worker does (workers.engine.process, tiny Qwen3, capture inline) and, in each
round, times one pass of shards fed by as many threads as the worker's task slots, and one `LLM.generate` over
prompts of the same shape on that very engine (`Engine.call`), order rotating; `--ab-host-threads` adds a loop
pass with the engine process's other threads lowered, the policy before 2026-12-06. No Celery, records, encoding
or storage: this process only reads and removes the capture files. Printed: tokens/s, ratios to `LLM.generate`,
and the engine's CPU (its thread and OpenMP team, from /proc) per 1,000 tokens. Figures: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_fleet import LAYERS, MAX_PROMPT_TOKENS, _median_interval, thread_cpu, write_prompts  # noqa: E402
from workers.engine.scheduling import BATCH_NICE  # noqa: E402


def engine_cpu(pid: int, thread_name: str) -> float:
    """CPU seconds so far of process `pid`'s threads called `thread_name` (the engine thread and its team)."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == thread_name:
                total += thread_cpu(task)
        except OSError:  # a thread that ended meanwhile
            continue
    return total


LABELS = {"loop": "loop", "generate": "LLM.generate", "lowered": "loop with lowered host threads"}
HOST_SIDE_THREADS = ("regen-host", "regen-deliver")  # the engine process's main thread (and batches), delivery


def host_threads_policy(pid: int, lowered: bool) -> None:
    """Put the engine process's side threads under SCHED_BATCH at nice 19 (`lowered`) or back to the normal policy;
    threads it starts later inherit its main thread's."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() in HOST_SIDE_THREADS:
                tid = int(task.name)
                os.sched_setscheduler(tid, os.SCHED_BATCH if lowered else os.SCHED_OTHER, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, BATCH_NICE if lowered else 0)
        except (OSError, ValueError):  # a thread that ended meanwhile
            continue


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--shard-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--ab-host-threads", action="store_true",
                    help="also time the loop with the engine process's main, delivery and batch threads under "
                         "SCHED_BATCH at nice 19, as before 2026-12-06, in the same rounds")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from workers.doubles.bench_task import timed_generate
    from workers.engine.in_process import ENGINE_THREAD
    from workers.engine.options import EngineOptions
    from workers.engine.process import EngineProcess
    from workers.engine.request import GenRequest
    from workers.process.context import scratch_root
    from workers.process.devices import PRESETS, task_slots_for

    slots = task_slots_for(PRESETS["cpu"]["max_num_seqs"], args.shard_size, "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        # Built in a child: torch ops on this thread would give this process a second OpenMP team beside the engine
        # thread's, and libgomp, seeing more threads than cores, stops spin-waiting (the engine ran at ~0.75x).
        model = os.path.join(tmp, "tiny")
        subprocess.run([sys.executable, "-c", "import sys; from workers.tiny_model import build_tiny_qwen3; "
                        "build_tiny_qwen3(sys.argv[1])", model], check=True, cwd=Path(__file__).resolve().parents[1],
                       stdout=subprocess.DEVNULL)
        tok = AutoTokenizer.from_pretrained(model)
        options = EngineOptions(model=model, capture_layers=tuple(LAYERS),
                                max_model_len=MAX_PROMPT_TOKENS + args.max_tokens,
                                scratch_dir=os.path.join(scratch_root(), f"regen-bench-loop-{os.getpid()}"),
                                host_process=True)
        os.makedirs(options.scratch_dir, exist_ok=True)
        engine = EngineProcess(options)

        def requests(ids: list[list[int]], first: int) -> list[GenRequest]:
            return [GenRequest(str(first + i), p, {"temperature": 0.6, "top_p": 0.95, "max_tokens": args.max_tokens,
                                                   "seed": first + i}, capture=True) for i, p in enumerate(ids)]

        def loop_pass(ids: list[list[int]]) -> tuple[int, float]:
            shards = iter([(k, ids[k:k + args.shard_size]) for k in range(0, len(ids), args.shard_size)])
            lock, tokens = threading.Lock(), []

            def slot() -> None:
                while True:
                    with lock:
                        first, part = next(shards, (None, None))
                    if part is None:
                        return
                    engine.run(requests(part, first), lambda res: tokens.append(len(res.output_token_ids)))

            threads = [threading.Thread(target=slot) for _ in range(slots)]
            started = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return sum(tokens), time.monotonic() - started

        def generate_pass(ids: list[list[int]]) -> tuple[int, float]:
            return engine.call(timed_generate, requests(ids, 0))

        kinds = ["loop", "generate"] + (["lowered"] if args.ab_host_threads else [])
        print(f"{args.prompts} prompts a pass, max_tokens {args.max_tokens}, shards of {args.shard_size} from {slots} "
              f"threads (the CPU worker's task slots); one warm-up round, then {args.rounds}", flush=True)
        ratios: dict[str, list[float]] = {k: [] for k in kinds if k != "generate"}
        cpu: dict[str, list[float]] = {k: [] for k in kinds}
        try:
            for r in ["warm", *map(str, range(1, args.rounds + 1))]:
                passes = {}
                for kind in kinds:  # prompts of their own, so no pass meets another's cache
                    write_prompts(tok, tmp, f"{r}-{kind}", args.prompts)
                    passes[kind] = json.loads(Path(tmp, f"prompts-{r}-{kind}.json").read_text())
                k = 0 if r == "warm" else int(r)
                order = kinds[k % len(kinds):] + kinds[:k % len(kinds)]
                got = {}
                for kind in order:
                    host_threads_policy(engine.pid, lowered=kind == "lowered")
                    before = engine_cpu(engine.pid, ENGINE_THREAD)
                    tokens, seconds = (generate_pass if kind == "generate" else loop_pass)(passes[kind])
                    got[kind] = (tokens / seconds, (engine_cpu(engine.pid, ENGINE_THREAD) - before) * 1e6 / tokens)
                    host_threads_policy(engine.pid, lowered=False)
                if r == "warm":
                    continue
                for kind in kinds:
                    cpu[kind].append(got[kind][1])
                    if kind != "generate":
                        ratios[kind].append(got[kind][0] / got["generate"][0])
                print(f"round {r}: " + ", ".join(f"{LABELS[kind]} {got[kind][0]:,.0f} tok/s" for kind in kinds)
                      + "; / LLM.generate: " + ", ".join(f"{LABELS[kind]} {ratios[kind][-1]:.3f}" for kind in ratios)
                      + "; engine CPU ms per 1k tokens: "
                      + ", ".join(f"{LABELS[kind]} {got[kind][1]:.0f}" for kind in kinds), flush=True)
        finally:
            engine.shutdown()
            shutil.rmtree(options.scratch_dir, ignore_errors=True)
    for kind, xs in ratios.items():
        low, high = _median_interval(xs)
        print(f"{LABELS[kind]} / LLM.generate on the same engine = {np.median(xs):.3f} median of {len(xs)} rounds "
              f"(90% interval of the median {low:.3f}-{high:.3f}; rounds {min(xs):.3f}-{max(xs):.3f}); engine CPU "
              f"per 1,000 tokens {np.median(cpu[kind]):.0f} ms against {np.median(cpu['generate']):.0f} "
              f"({np.median(cpu[kind]) / np.median(cpu['generate']):.3f})")

if __name__ == "__main__":
    main()
