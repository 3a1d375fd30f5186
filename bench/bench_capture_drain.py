"""How fast one worker drains finished samples' hidden states at a real model's size (one command, ~1 min).

    python bench/bench_capture_drain.py [--tokens 4000] [--layers 5] [--hidden 5120] [--samples 6]

Every finished sample goes: the connector's safetensors file in the scratch place -> the delivery thread reads it
-> an encoder thread checks the states (zero / NaN / Inf, token ids) and compresses them -> the shard's file. At
the tiny test model's size this is microseconds; at a real model's ([4000 tokens, 5 layers, 5120] bf16 = 205 MB
per sample) it decides whether a worker keeps up with a B200. This bench times each step per sample on files
written the way the connector writes them, and prints the tokens/s one worker can absorb:
- read: the worker's reader (a memory map above 1 MiB) against the copying reader it replaced (`read` +
  `safetensors.deserialize`) and against vLLM's loader (`safetensors.torch.load_file`);
- check + encode per sample, as bf16 and as a lossy `--states-dtype` (default fp8-e4m3), then the whole drain
  through the worker's encoder pool with 1 and 2 threads, both ways
  (`check_and_encode`, the function the worker runs; reading on one thread in front of it, as the delivery
  thread does);
- the ceiling before (copying read and check on the single delivery thread) and now (mapped read there, check and
  encode on the pool), from the figures above.
States are random normals rounded to bf16 (speeds only; bench_hidden_codec.py measures ratios on activations).
Speeds here move by 20-30% within minutes: every figure is the median of its samples, and ratios are taken within
the run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.base.quality import states_problem
from app.base.states_codec import DEFAULT_LOSSY, LOSSY_CODECS
from workers.engine.capture_file import read_capture_file
from workers.process.context import scratch_root
from workers.shard.states import check_and_encode


def copying_read(path: str) -> tuple[np.ndarray, np.ndarray]:
    """The reader the worker had before: the whole file read, then `safetensors.deserialize` (two copies)."""
    import safetensors

    with open(path, "rb") as fh:
        tensors = dict(safetensors.deserialize(fh.read()))
    ids, states = tensors["token_ids"], tensors["hidden_states"]
    return (np.frombuffer(ids["data"], dtype=np.int64).copy(),
            np.frombuffer(states["data"], dtype=np.uint16).reshape(states["shape"]))


def torch_read(path: str) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's loader: `safetensors.torch.load_file`, viewed as numpy."""
    import torch
    from safetensors.torch import load_file

    data = load_file(path)
    return data["token_ids"].numpy(), data["hidden_states"].view(torch.int16).numpy().view(np.uint16)


def timed(fn, *args, **kwargs) -> float:
    started = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - started


def write_samples(folder: str, n: int, tokens: int, layers: int, hidden: int) -> list[str]:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    paths = []
    for i in range(n):
        states = (torch.randn(tokens, layers, hidden, generator=gen) * 2).to(torch.bfloat16)
        path = os.path.join(folder, f"sample-{i}.safetensors")
        save_file({"hidden_states": states, "token_ids": torch.arange(tokens, dtype=torch.int64)}, path)
        paths.append(path)
    return paths


def drain(paths: list[str], threads: int, layer_ids: list[int], stored: str = "bf16") -> float:
    """Seconds to read every file on this thread and check + encode them on a pool of `threads`."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = []
        for i, path in enumerate(paths):
            token_ids, states = read_capture_file(path)
            futures.append(pool.submit(check_and_encode, f"s{i}", token_ids.tolist(), token_ids, states, layer_ids, 3,
                                       stored=stored))
        for f in futures:
            problems, _ = f.result()
            assert not problems, problems
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--states-dtype", choices=LOSSY_CODECS, default=DEFAULT_LOSSY,
                    help="the lossy stored dtype timed beside bf16 (encode per sample, and the drain)")
    args = ap.parse_args()
    lossy = args.states_dtype
    folder = os.path.join(scratch_root(), f"regen-bench-drain-{os.getpid()}")
    os.makedirs(folder, exist_ok=True)
    layer_ids = list(range(1, args.layers + 1))
    mb = args.tokens * args.layers * args.hidden * 2 / 1e6
    try:
        paths = write_samples(folder, args.samples, args.tokens, args.layers, args.hidden)
        print(f"{args.samples} samples of [{args.tokens}, {args.layers}, {args.hidden}] bf16 ({mb:.0f} MB each) "
              f"in {folder}")
        per = {name: [] for name in ("map", "copy", "torch", "check", "encode", "lossy")}
        for path in paths:
            for name, reader in (("map", read_capture_file), ("copy", copying_read), ("torch", torch_read)):
                per[name].append(timed(reader, path))
            token_ids, states = read_capture_file(path)
            per["check"].append(timed(states_problem, states))
            per["encode"].append(timed(check_and_encode, "s", token_ids.tolist(), token_ids, states, layer_ids, 3)
                                 - per["check"][-1])
            per["lossy"].append(timed(check_and_encode, "s", token_ids.tolist(), token_ids, states, layer_ids, 3,
                                      stored=lossy) - per["check"][-1])
        ms = {k: statistics.median(v) * 1000 for k, v in per.items()}
        print(f"read, ms per sample:   worker's reader {ms['map']:.2f} | copying reader {ms['copy']:.0f} "
              f"({ms['copy'] / ms['map']:.0f}x) | vLLM's load_file {ms['torch']:.2f} ({ms['torch'] / ms['map']:.1f}x)")
        print(f"check {ms['check']:.0f} ms ({mb / ms['check'] * 1000:.0f} MB/s), encode (level 3) {ms['encode']:.0f} ms "
              f"({mb / ms['encode'] * 1000:.0f} MB/s) per sample; stored as {lossy}: {ms['lossy']:.0f} ms "
              f"({mb / ms['lossy'] * 1000:.0f} MB/s, {ms['lossy'] / ms['encode']:.2f}x bf16's time)")
        rates = {}
        for threads in (1, 2):
            seconds = statistics.median(drain(paths, threads, layer_ids) for _ in range(2))
            rates[threads] = args.samples * args.tokens / seconds
            lossy_s = statistics.median(drain(paths, threads, layer_ids, lossy) for _ in range(2))
            print(f"drain through {threads} encoder thread(s): {rates[threads]:,.0f} tokens/s "
                  f"({args.samples / seconds:.1f} samples/s); stored as {lossy}: "
                  f"{args.samples * args.tokens / lossy_s:,.0f} tokens/s ({seconds / lossy_s:.2f}x bf16's)")
        print(f"2 threads / 1 thread = {rates[2] / rates[1]:.2f} (this box has {os.cpu_count()} cores)")
        old_delivery = args.tokens / ((ms["copy"] + ms["check"]) / 1000)
        new_delivery = args.tokens / (ms["map"] / 1000)
        per_thread = args.tokens / ((ms["check"] + ms["encode"]) / 1000)
        print(f"capture work on the single delivery thread: before {ms['copy'] + ms['check']:.0f} ms per sample "
              f"(copying read + check: at most {old_delivery:,.0f} tokens/s per worker), now {ms['map']:.2f} ms "
              f"(mapped read: {new_delivery / old_delivery:.0f}x the ceiling); each encoder thread adds "
              f"{per_thread:,.0f} tokens/s (a GPU worker has 2-8, workers/process/devices.encode_threads_for)")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
