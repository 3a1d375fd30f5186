"""What the token check adds to `regen verify --reference` at the job's lengths (one command, a minute on 2 cores).

    nice -n 10 python bench/bench_token_check.py [--prompt 1024] [--output 8192] [--vocab 248320]
        [--positions 1024] [--json OUT]

Two parts, each against its baseline in the same run:
1. The pass: on the tiny random Qwen3 the tests build, one sample of `--prompt` + `--output` tokens (the README
   job's `--max-tokens 8192`) through the reference as `verify --reference` ran it before (states only, the pass
   stopped at the deepest captured layer) and with the token check (the pass run to the final norm, the LM head
   over the output positions, every token judged). The tiny model's head is small (its vocabulary is a few
   hundred), so this part shows the pass's shape, not a real model's cost.
2. The judgement at a real vocabulary (`--vocab`, Qwen3.5/3.6's 248,320 by default): logits for `--positions`
   positions (its cost is per position, so a share of the output gives the ratio; 1,024 keeps it to a minute) judged at the thinking sampling (top-k 20: only 20 logits sorted per position) and at top-p alone
   (top_k 0: a sort of the whole vocabulary per position), against the LM head's own matmul at the 27B target's
   hidden size (5,120) for the same positions, the least a token check must add. A real target's pass costs
   ~27B x 2 FLOPs per token on top, so these ratios are upper bounds of the share on a real model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SETTINGS = {"thinking (top_k 20, top_p 0.95)": {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0},
            "top_p 0.95 alone": {"temperature": 0.6, "top_p": 0.95, "top_k": 0, "min_p": 0.0},
            "greedy": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}}
HIDDEN = 5120  # Qwen3.6-27B's hidden size


def timed(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--output", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=248_320)
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from app.data import token_check
    from app.data.reference import ReferenceCapture
    from workers.tiny_model import build_tiny_qwen3

    torch.manual_seed(0)
    report: dict = {"prompt": args.prompt, "output": args.output, "vocab": args.vocab}
    model = build_tiny_qwen3(os.path.join(tempfile.mkdtemp(prefix="bench-token-check-"), "tiny"))
    ref = ReferenceCapture(model, [1, 2, 4])
    vocab = ref.head.weight.shape[0]
    ids = torch.randint(10, vocab - 1, (args.prompt + args.output,)).tolist()
    rec = {"input_ids": ids, "num_prompt_tokens": args.prompt, "num_output_tokens": args.output,
           "loss_mask": [0] * args.prompt + [1] * args.output, "sampling": SETTINGS["greedy"]}
    states_s = timed(lambda: ref.capture(ids[:-1]), 2)

    def with_tokens():
        _, final = ref.capture_with_final(ids[:-1])
        token_check.check_record(token_check.record_chunks(final, rec), ref.head, rec)
    full_s = timed(with_tokens, 2)
    ref.close()
    report["tiny_pass"] = {"states_only_s": round(states_s, 3), "with_token_check_s": round(full_s, 3),
                           "ratio": round(full_s / states_s, 3)}
    print(f"tiny model, {args.prompt} + {args.output} tokens: states-only pass {states_s:.2f} s, with the token check "
          f"{full_s:.2f} s ({full_s / states_s:.2f}x)")

    n = args.positions
    hidden = torch.randn(n, HIDDEN, dtype=torch.bfloat16)
    head = torch.nn.Linear(HIDDEN, args.vocab, bias=False, dtype=torch.bfloat16)
    tokens = torch.randint(0, args.vocab, (n,))
    chunk = token_check.CHUNK

    def head_only():
        with torch.inference_mode():
            for start in range(0, n, chunk):
                head(hidden[start:start + chunk]).float()
    head_s = timed(head_only)
    report["head_s"] = round(head_s, 3)
    print(f"LM head {HIDDEN} x {args.vocab:,} over {n} positions (bf16, the baseline): {head_s:.2f} s")
    report["judge"] = {}
    for name, sampling in SETTINGS.items():
        def judged(sampling=sampling):
            with torch.inference_mode():
                for start in range(0, n, chunk):
                    logits = head(hidden[start:start + chunk]).float()
                    token_check.judge(logits, tokens[start:start + chunk], sampling, start, args.prompt)
        spent = timed(judged)
        report["judge"][name] = {"s": round(spent, 3), "ratio_to_head": round(spent / head_s, 3)}
        print(f"  head + judgement, {name}: {spent:.2f} s ({spent / head_s:.2f}x the head alone)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
