"""How far right engines' tokens sit from the edge of transformers' sampling set, and what the token check costs.

    nice -n 10 python bench/calibrate_token_noise.py [--samples 24] [--max-tokens 64]
        [--models dense,hybrid,hybrid-chunked] [--sampling thinking,nucleus,greedy] [--json OUT]

For each tiny random model the tests build (dense Qwen3, hybrid Qwen3.5) one CPU engine (the worker's own,
workers/engine/process.EngineProcess, capture inline as a run's) generates `--samples` prompts with per-sample
seeds at each sampling setting; then every generated token is judged by app.data.token_check against transformers
(app.data.reference, one pass per sample run to the LM head). Printed per model and setting: the tokens judged, the
largest margin past the set's edge in standard deviations of the position's logits (negative: inside the set),
how many tokens lie past the edge at all and past the tolerance (TOL_SIGMA), and the seconds of the reference's
states-only pass against the pass with the token check (the check's cost, as a ratio in the same run).
A random model's distribution is flat (every token near the nucleus edge), the hardest case for a tolerance.
`hybrid-generate` is the hybrid on a generation-only engine (no capture: vLLM's `extract_hidden_states` speculative
path off), the way a staged run generates. `hybrid-chunked` is the hybrid with chunked prefill on, which the CPU preset turns off (per-request seeds crash
it there, workers/engine/llm_arguments.py): greedy only, without seeds, to see whether the preset's setting is
what moves the hybrid's tokens.
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
from workers.engine.request import GenRequest, GenResult  # noqa: E402
from workers.shard.generate import render_prompt  # noqa: E402

SETTINGS = {"thinking": {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0},
            "nucleus": {"temperature": 0.6, "top_p": 0.95, "top_k": 0, "min_p": 0.0},
            "greedy": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}}
LAYERS = (1, 2, 4)
HYBRID_ARGS = ["max_num_batched_tokens=6144"]  # the tests' hybrid worker setting


def build(kind: str, folder: str) -> str:
    from workers.tiny_model import build_tiny_qwen3, build_tiny_qwen3_5

    return build_tiny_qwen3(folder) if kind.startswith("dense") else build_tiny_qwen3_5(folder)


def generate(model: str, kind: str, settings: list[str], samples: int, max_tokens: int, work: str) -> dict:
    from workers.engine.process import EngineProcess

    chunked = kind.endswith("-chunked")
    capture = None if kind.endswith("-generate") else LAYERS
    engine = EngineProcess(EngineOptions(model=model, capture_layers=capture, max_model_len=2048,
                                         max_num_seqs=samples, host_process=True,
                                         scratch_dir=os.path.join(work, "scratch-" + kind),
                                         extra={"enable_chunked_prefill": True} if chunked else {},
                                         vllm_args=HYBRID_ARGS if kind.startswith("hybrid") else []))
    out = {}
    try:
        for name in settings:
            requests = []
            for i in range(samples):
                text = f"Question {i}: explain topic {i % 7} " + "step by step. " * (1 + i % 5)
                ids = render_prompt(engine.tokenizer, [{"role": "user", "content": text}], None, thinking=True)
                sid = f"{name}-{i:04d}"
                seed = {} if chunked else {"seed": seed_for(0, sid)}
                requests.append(GenRequest(sid, ids, {**SETTINGS[name], "max_tokens": max_tokens, **seed},
                                           capture=capture is not None))
            got: dict[str, GenResult] = {}
            engine.run(requests, lambda res, got=got: got.__setitem__(res.request_id, res))
            out[name] = [(got[r.request_id].prompt_token_ids, got[r.request_id].output_token_ids) for r in requests]
    finally:
        engine.shutdown()
    return out


def judge(model: str, runs: dict) -> dict:
    import torch

    from app.data import token_check
    from app.data.reference import ReferenceCapture

    ref = ReferenceCapture(model, list(LAYERS))
    out = {}
    for name, samples in runs.items():
        sampling = SETTINGS[name]
        result = token_check.TokenResult()
        past_edge = 0
        states_s = full_s = 0.0
        for prompt, output in samples:
            ids = prompt + output
            t0 = time.perf_counter()
            ref.capture(ids[:-1])
            states_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            rec = {"input_ids": ids, "num_prompt_tokens": len(prompt), "num_output_tokens": len(output),
                   "loss_mask": [0] * len(prompt) + [1] * len(output), "sampling": sampling}
            _, final = ref.capture_with_final(ids[:-1])
            judged = token_check.check_record(token_check.record_chunks(final, rec), ref.head, rec)
            full_s += time.perf_counter() - t0
            result.add(judged)
            with torch.inference_mode():
                logits = ref.head(final[len(prompt) - 1:]).float()
            edge = token_check.candidate_edge(logits, sampling)
            chosen = logits.gather(1, torch.tensor(output)[:, None])[:, 0]
            past_edge += int((chosen < edge).sum())
        out[name] = {"tokens": result.checked, "worst_sigma": round(result.worst_sigma, 4), "past_edge": past_edge,
                     "past_tolerance": len(result.misses), "tolerance_sigma": token_check.TOL_SIGMA,
                     "reference_states_s": round(states_s, 3), "reference_with_tokens_s": round(full_s, 3),
                     "token_check_ratio": round(full_s / states_s, 3) if states_s else None,
                     "first_misses": [m.line() for m in result.misses[:3]]}
    ref.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--models", default="dense,hybrid,hybrid-generate,hybrid-chunked")
    ap.add_argument("--sampling", default="thinking,nucleus,greedy")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="calibrate-token-noise-")
    report = {}
    for kind in args.models.split(","):
        model = build(kind, os.path.join(work, kind))
        settings = ["greedy"] if kind.endswith("-chunked") else args.sampling.split(",")
        try:
            runs = generate(model, kind, settings, args.samples, args.max_tokens, work)
        except Exception as exc:  # an engine mode this vLLM cannot run: said, and the others still measured
            print(f"{kind}: engine failed: {type(exc).__name__}: {str(exc)[:300]}")
            report[kind] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            continue
        report[kind] = judge(model, runs)
        for name, r in report[kind].items():
            print(f"{kind} {name}: {r['tokens']} tokens, worst {r['worst_sigma']:+.3f} sd from the set's edge, "
                  f"{r['past_edge']} past the edge, {r['past_tolerance']} past the tolerance ({r['tolerance_sigma']} "
                  f"sd); reference pass {r['reference_states_s']:.2f} s, with the token check "
                  f"{r['reference_with_tokens_s']:.2f} s ({r['token_check_ratio']}x)")
            for line in r["first_misses"]:
                print("   ", line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
