"""What the capture check costs a CPU engine at the default rate (one command, a few minutes on 2 cores).

    nice -n 10 python bench/bench_capture_check.py [--samples 640] [--max-tokens 256] [--shard-size 64]
        [--every 100] [--first 4] [--model DIR] [--json OUT]

One engine (the worker's own: workers/engine/process.EngineProcess, capture of vLLM layers 1-4 on the tiny
random Qwen3 the tests build, or --model) generates `--samples` chat prompts in shards of `--shard-size`, the
way a worker does (one engine batch per shard, per-sample seeds, capture inline). After each shard, the samples
the run's default policy picks (one in `--every` by sample id, the engine's first `--first`) are re-captured and
compared exactly as the worker does (workers/shard/capture_check.py: `recheck`, a prefill-only batch of their
own, then app/states_compare.compare). Both are timed on the same engine in the same run, so the figures are:
- the check's share of engine time: re-capture seconds / (generation seconds + re-capture seconds);
- the ratio of the run with the check to the same run without it: (generation + re-capture) / generation;
- both again without the engine's first samples (a one-time cost per engine, amortised over a real run's
  thousands of samples per worker), and the comparison's CPU time per checked sample (a task thread's, beside
  the engine).
The tiny model makes generation cheap per token (a fast engine, the hardest case for a fixed per-sample cost);
the check's cost per checked sample is one prefill of its ids, so on a real model it is a smaller share still
(a decode step costs about as much as a prefill of tens of tokens there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.base.ids import seed_for  # noqa: E402
from workers.engine.options import EngineOptions  # noqa: E402
from workers.engine.recapture import CheckPolicy, EngineChecks, Pending, recheck  # noqa: E402  # noqa: E402
from workers.engine.request import GenRequest, GenResult  # noqa: E402
from workers.shard.generate import render_prompt  # noqa: E402

LAYERS = (1, 2, 3, 4)
TOPICS = ["the water cycle", "binary search", "a haiku about rain", "the French revolution", "prime numbers",
          "photosynthesis", "a bash one-liner to count lines", "the rules of chess", "compound interest",
          "how vaccines work", "sorting algorithms", "the moon landing"]


def prompts(tokenizer, n: int) -> list[tuple[str, list[int]]]:
    out = []
    for i in range(n):
        text = f"Question {i}: explain {TOPICS[i % len(TOPICS)]} " + "in detail, step by step. " * (1 + i % 5)
        ids = render_prompt(tokenizer, [{"role": "user", "content": text}], None, thinking=True)
        out.append((f"bench-{i:06d}", ids))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=640)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--shard-size", type=int, default=64)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--first", type=int, default=4)
    ap.add_argument("--model", default=None, help="model folder (default: the tests' tiny Qwen3, built here)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from app.base.states_compare import compare
    from workers.engine.process import EngineProcess

    work = tempfile.mkdtemp(prefix="bench-capture-check-")
    model = args.model
    if model is None:
        from workers.tiny_model import build_tiny_qwen3

        model = build_tiny_qwen3(os.path.join(work, "tiny-qwen3"))
    engine = EngineProcess(EngineOptions(model=model, capture_layers=LAYERS, max_model_len=4096,
                                         max_num_seqs=args.shard_size, host_process=True,
                                         scratch_dir=os.path.join(work, "scratch")))
    policy, checks = CheckPolicy(args.every, args.first), EngineChecks()
    sampling = {"temperature": 0.6, "top_p": 0.95, "top_k": 0, "max_tokens": args.max_tokens}
    gen_s = check_s = first_s = compare_s = 0.0
    n_checked = n_first = failed = tokens = 0
    try:
        engine.run([GenRequest("warm", [1, 2, 3], {**sampling, "max_tokens": 4}, capture=True)], lambda r: None)
        todo = prompts(engine.tokenizer, args.samples)
        for start in range(0, len(todo), args.shard_size):
            shard = todo[start:start + args.shard_size]
            results: dict[str, GenResult] = {}
            requests = [GenRequest(sid, ids, {**sampling, "seed": seed_for(0, sid)}, capture=True)
                        for sid, ids in shard]
            t0 = time.perf_counter()
            engine.run(requests, lambda res, got=results: got.__setitem__(res.request_id, res))
            gen_s += time.perf_counter() - t0
            items, firsts = [], 0
            for k, (sid, _) in enumerate(shard):
                res = results[sid]
                tokens += len(res.output_token_ids)
                wanted, first = checks.wants(sid, policy)
                if wanted:
                    firsts += first
                    items.append(Pending(k, sid, res.prompt_token_ids + res.output_token_ids[:-1],
                                         res.captured_states, duplicate=first))
            if not items:
                continue
            t0 = time.perf_counter()
            outcomes = recheck(engine, items, list(LAYERS))  # its comparisons included, as in the worker
            spent = time.perf_counter() - t0
            check_s += spent
            if firsts:
                first_s += spent
                n_first += firsts
            n_checked += len(items)
            failed += sum(not o.ok for o in outcomes)
            t0 = time.perf_counter()
            for item in items:  # the comparison alone, again: the task thread's CPU per checked sample
                compare(item.stored, item.stored, list(LAYERS))
            compare_s += time.perf_counter() - t0
    finally:
        engine.shutdown()
    steady = check_s - first_s
    out = {
        "samples": args.samples, "max_tokens": args.max_tokens, "generated_tokens": tokens, "every": args.every,
        "first": args.first, "checked": n_checked, "of_which_first": n_first, "failed": failed,
        "generation_s": round(gen_s, 3), "check_s": round(check_s, 3), "check_first_s": round(first_s, 3),
        "share_of_engine_time": round(check_s / (gen_s + check_s), 5),
        "ratio_with_check": round((gen_s + check_s) / gen_s, 5),
        "share_without_first": round(steady / (gen_s + steady), 5),
        "ratio_without_first": round((gen_s + steady) / gen_s, 5),
        "compare_ms_per_checked_sample": round(1000 * compare_s / max(1, n_checked), 3),
    }
    print(f"generated {tokens:,} tokens in {gen_s:.2f} s; re-checked {n_checked} samples ({n_first} the engine's "
          f"first) in {check_s:.3f} s, {failed} failed")
    print(f"check's share of engine time: {100 * out['share_of_engine_time']:.2f}% "
          f"(run with / without the check: {out['ratio_with_check']:.4f}x)")
    print(f"  without the engine's first {args.first} samples (a one-time cost per engine): "
          f"{100 * out['share_without_first']:.2f}% ({out['ratio_without_first']:.4f}x)")
    print(f"comparison on the task thread: {out['compare_ms_per_checked_sample']:.2f} ms per checked sample")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
