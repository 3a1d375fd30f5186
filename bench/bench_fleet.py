"""Fleet throughput vs vLLM called directly, on the CPU with the tiny Qwen3 (one command, 3-7 minutes on 2 cores).

    python bench/bench_fleet.py [--prompts 512] [--max-tokens 64] [--shard-size 64] [--rounds 3] [--engine-only]

Direct: one `LLM.generate` over all prompts (token-id prompts, same sampling, vLLM built from the worker's own
`llm_kwargs` with the max_model_len the worker derives from the run, capture files in the worker's scratch
place, /dev/shm: on a disk-backed /tmp their writes cost the direct side ~7%).
Fleet: `regen produce` -> local Redis -> a real `regen worker --cpu` process -> shards on storage; steady-state
tokens/s is measured from the first shard's engine start to the last shard's engine end, so the worker's
start-up is not counted, but everything between shards (writing, marker, ack, fetching the next message,
rendering prompts) is. The worker's two task slots let the next shard start while the previous one is
written, so the engine's idle time is the gaps in the union of the shards' engine spans; it is printed too.
Both runs happen in this one invocation, alternating (direct, fleet) for `--rounds` rounds; the ratio is taken
within each round and the median printed, so it is meaningful on a noisy machine; absolute figures are not. On this 2-core CPU the worker's compression and writes compete with the engine for the same cores; on
a GPU host they overlap with GPU work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BROKER = "redis://127.0.0.1:6379/8"
LAYERS = [1, 2, 4]
MAX_PROMPT_TOKENS = 2048  # the fleet's worker derives max_model_len = this + max_tokens from the run; direct uses the same


def _options_code(model: str, max_tokens: int, scratch: str, tag: str) -> str:
    """Start of a timed child process: the prompts, and `o`, the worker's EngineOptions for this bench."""
    return f"""
import json, os, shutil, sys, threading, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, {str(REPO)!r})
from workers.context import scratch_root
from workers.engine import EngineOptions
prompts = json.load(open({scratch + '/prompts.json'!r}))
o = EngineOptions(model={model!r}, capture_layers=tuple({LAYERS!r}), max_model_len={MAX_PROMPT_TOKENS + max_tokens},
                  scratch_dir=os.path.join(scratch_root(), f"regen-bench-{tag}-{{os.getpid()}}"))
"""


def _timed(code: str) -> tuple[int, float]:
    """Run `code` in a fresh process; it prints {"tokens", "seconds"} as its last line."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return result["tokens"], result["seconds"]


def direct(model: str, prompts: list[list[int]], max_tokens: int, scratch: str) -> tuple[int, float]:
    """Generated tokens and seconds for one LLM.generate call (run in a fresh process)."""
    return _timed(_options_code(model, max_tokens, scratch, "direct") + f"""
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from workers.engine import llm_kwargs
llm = LLM(**llm_kwargs(o))
params = [SamplingParams(temperature=0.6, top_p=0.95, max_tokens={max_tokens}, seed=i,
                         extra_args={{"kv_transfer_params": {{"include_output_tokens": True}}}})
          for i in range(len(prompts))]
llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:8]], params[:8], use_tqdm=False)  # warm-up
t = time.monotonic()
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
dt = time.monotonic() - t
shutil.rmtree(o.scratch_dir, ignore_errors=True)
print(json.dumps({{"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": dt}}))
""")


def engine_only(model: str, max_tokens: int, shard_size: int, scratch: str) -> tuple[int, float]:
    """The worker's `Engine` class alone (fresh process, no Celery, no records): shards of `shard_size` from two
    threads, like the worker's two task slots, capture files read and removed. Separates what the engine class
    costs from what the rest of the worker costs."""
    return _timed(_options_code(model, max_tokens, scratch, "engine") + f"""
from workers.engine import Engine, GenRequest
engine = Engine(o)
def requests(ids, first):
    return [GenRequest(str(first + i), p, {{"temperature": 0.6, "top_p": 0.95, "max_tokens": {max_tokens},
                                           "seed": first + i}}, capture=True) for i, p in enumerate(ids)]
engine.run(requests(prompts[:8], 0), lambda r: None)  # warm-up
shards = iter([(k, prompts[k:k + {shard_size}]) for k in range(0, len(prompts), {shard_size})])
lock, tokens = threading.Lock(), []
def slot():
    while True:
        with lock:
            k, ids = next(shards, (None, None))
        if ids is None:
            return
        engine.run(requests(ids, k), lambda r: tokens.append(len(r.output_token_ids)))
t = time.monotonic()
slots = [threading.Thread(target=slot) for _ in range(2)]
for th in slots:
    th.start()
for th in slots:
    th.join()
dt = time.monotonic() - t
shutil.rmtree(o.scratch_dir, ignore_errors=True)
print(json.dumps({{"tokens": sum(tokens), "seconds": dt}}), flush=True)
os._exit(0)
""")


def fleet(model: str, inputs: Path, storage: str, max_tokens: int, shard_size: int) -> tuple[int, float, list]:
    import redis

    redis.Redis.from_url(BROKER).flushdb()
    env = {**os.environ, "REGEN_BROKER_URL": BROKER, "HF_HUB_OFFLINE": "1"}
    # A queue of this run's own: a worker left over from an interrupted bench would otherwise take these shards
    # and write them to its own (gone) storage, and this run would wait for them until its deadline.
    queue = f"regen-bench-{os.getpid()}-{Path(storage).name}"
    subprocess.run([sys.executable, "-m", "app.cli", "produce", str(inputs), "--run", "bench", "--storage", storage,
                    "--model", model, "--layers", "vllm:" + ",".join(map(str, LAYERS)), "--max-tokens",
                    str(max_tokens), "--top-k", "0", "--shard-size", str(shard_size),
                    "--max-prompt-tokens", str(MAX_PROMPT_TOKENS), "--pause-stub-rate", "1", "--queue", queue], env=env, check=True, capture_output=True)
    shards = json.loads(Path(storage, "bench", "produce.json").read_text())["counts"]["shards"]
    worker = subprocess.Popen([sys.executable, "-m", "app.cli", "worker", "--cpu", "--run", "bench", "--storage",
                               storage, "--name", "bench", "--queues", queue], env=env, stdout=open(Path(storage, "worker.log"), "wb"),  # noqa: SIM115
                              stderr=subprocess.STDOUT)
    done = Path(storage, "bench", "done")
    try:
        deadline = time.monotonic() + 900
        while not (done.exists() and len(list(done.glob("shard-*.json"))) >= shards):
            if time.monotonic() > deadline:
                raise SystemExit("fleet run timed out")
            time.sleep(0.2)
    finally:
        worker.terminate()
        worker.wait(timeout=120)
    if os.environ.get("REGEN_BENCH_KEEP_LOG"):
        import shutil

        shutil.copy(Path(storage, "worker.log"), os.environ["REGEN_BENCH_KEEP_LOG"])
    markers = sorted((json.loads(p.read_text()) for p in done.glob("shard-*.json")), key=lambda m: m["engine_started"])
    tokens = sum(m["generated_tokens"] for m in markers)
    span = markers[-1]["engine_finished"] - markers[0]["engine_started"]
    # Shards overlap on the engine (two task slots), so idle time is the gaps in the union of busy spans.
    gaps, end = [], markers[0]["engine_finished"]
    for m in markers[1:]:
        gaps.append(max(0.0, m["engine_started"] - end))
        end = max(end, m["engine_finished"])
    return tokens, span, gaps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--shard-size", type=int, default=64,
                    help="the production default; the second task slot queues its shard behind the first")
    ap.add_argument("--rounds", type=int, default=3,
                    help="direct then fleet, this many times; the ratio is taken per round, then the median")
    ap.add_argument("--engine-only", action="store_true",
                    help="also run the worker's Engine class alone each round (no Celery, no records), to tell what the "
                         "engine class costs from what the rest of the worker costs")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from workers.generate import render_prompt
    from workers.tiny_model import build_tiny_qwen3

    rounds, engine_ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_qwen3(os.path.join(tmp, "tiny"))
        tok = AutoTokenizer.from_pretrained(model)
        rows = [{"question": f"Question {i}: what is {i} * {i + 3}? Explain the steps briefly."}
                for i in range(args.prompts)]
        inputs = Path(tmp, "prompts.jsonl")
        inputs.write_text("".join(json.dumps(r) + "\n" for r in rows))
        prompts = [render_prompt(tok, [{"role": "user", "content": r["question"]}], None, True) for r in rows]
        Path(tmp, "prompts.json").write_text(json.dumps(prompts))
        print(f"prompts {args.prompts}, max_tokens {args.max_tokens}, shard size {args.shard_size}, capture inline "
              f"(vLLM layers {LAYERS}), {args.rounds} rounds of direct then fleet", flush=True)
        for r in range(args.rounds):
            d_tokens, d_seconds = direct(model, prompts, args.max_tokens, tmp)
            f_tokens, f_seconds, gaps = fleet(model, inputs, os.path.join(tmp, f"storage-{r}"), args.max_tokens,
                                              args.shard_size)
            d_rate, f_rate = d_tokens / d_seconds, f_tokens / f_seconds
            rounds.append((f_rate / d_rate, gaps))
            line = (f"round {r + 1}: direct {d_tokens} tokens in {d_seconds:.2f}s = {d_rate:,.0f} tok/s; fleet "
                    f"{f_tokens} tokens in {f_seconds:.2f}s = {f_rate:,.0f} tok/s (steady state); "
                    f"fleet/direct {f_rate / d_rate:.3f}")
            if args.engine_only:
                e_tokens, e_seconds = engine_only(model, args.max_tokens, args.shard_size, tmp)
                engine_ratios.append(e_tokens / e_seconds / d_rate)
                line += f"; engine class alone {e_tokens / e_seconds:,.0f} tok/s = {engine_ratios[-1]:.3f} of direct"
            print(line, flush=True)
    ratios = sorted(r for r, _ in rounds)
    gaps_ms = sorted(g * 1000 for _, gaps in rounds for g in gaps)
    print(f"fleet / direct = {ratios[len(ratios) // 2]:.3f} median of {len(ratios)} rounds "
          f"(min {ratios[0]:.3f}, max {ratios[-1]:.3f}; target >= 0.95)")
    if engine_ratios:
        engine_ratios.sort()
        print(f"engine class alone / direct = {engine_ratios[len(engine_ratios) // 2]:.3f} median "
              f"(min {engine_ratios[0]:.3f}, max {engine_ratios[-1]:.3f})")
    if gaps_ms:
        print(f"engine idle gap between shards: median {gaps_ms[len(gaps_ms) // 2]:.1f} ms, "
              f"max {gaps_ms[-1]:.1f} ms over {len(gaps_ms)} gaps  (target < 50 ms)")


if __name__ == "__main__":
    main()
