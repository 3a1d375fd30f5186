"""What stopping loops saves: tokens (and engine seconds) not generated when a looping model's requests are ended
by the loop stop (workers.engine.loop_stop) instead of running to `max_tokens`.

    python bench/bench_loop_stop.py                       # ~1-2 min on 2 busy cores
    python bench/bench_loop_stop.py --max-tokens 2048 --prompts 32

One real vLLM engine built as a worker builds it (`llm_kwargs` with the loop stop) on the tiny random Qwen3 (which
loops at once at low temperature, as thinking models are reported to at length); the same prompts, seeds and
sampling are generated twice on it, as the baseline (requests that do not ask for the stop) and with the stop,
so the only difference is the stop. Prints tokens generated and seconds for each, their ratios, how many
requests the stop ended, and checks that each stopped output is the baseline's own output up to the stop (the
stop changes nothing before it) followed by the forced end-of-turn id.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.base.loops import loop_stopped, stop_request  # noqa: E402
from app.base.process_env import prepare_vllm_env  # noqa: E402
from workers.engine.llm_arguments import llm_kwargs, sampling_params  # noqa: E402
from workers.engine.options import EngineOptions  # noqa: E402
from workers.engine.request import GenRequest  # noqa: E402
from workers.tiny_model import build_tiny_qwen3  # noqa: E402

MIN_REPEATS = 6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.1)
    args = ap.parse_args()
    prepare_vllm_env(True)
    from vllm import LLM

    model = build_tiny_qwen3(tempfile.mkdtemp(prefix="bench-loop-stop-"))
    options = EngineOptions(model=model, max_model_len=args.max_tokens + 256, max_num_seqs=args.prompts,
                            stop_loops=True)
    llm = LLM(**llm_kwargs(options))
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    prompts = []
    for i in range(args.prompts):
        text = tok.apply_chat_template([{"role": "user", "content": f"Question {i}: tell me about foxes."}],
                                       add_generation_prompt=True, enable_thinking=True, tokenize=False)
        prompts.append(tok.encode(text, add_special_tokens=False))
    base = {"temperature": args.temperature, "top_p": 0.95, "top_k": 0, "min_p": 0.0,
            "max_tokens": args.max_tokens}

    def generate(stop: bool):
        params = [sampling_params(GenRequest(str(i), p, {**base, "seed": i,
                                                         **({"stop_loop": stop_request(MIN_REPEATS, eos)}
                                                            if stop else {})}))
                  for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0] for o in outs], time.perf_counter() - t0

    generate(False)  # warm-up
    plain, plain_s = generate(False)
    stopped, stopped_s = generate(True)
    n_plain = sum(len(o.token_ids) for o in plain)
    n_stopped = sum(len(o.token_ids) for o in stopped)
    ended = 0
    for a, b in zip(plain, stopped, strict=True):
        ids = list(b.token_ids)
        if loop_stopped(ids, b.finish_reason, eos, MIN_REPEATS):
            ended += 1
            assert list(a.token_ids)[: len(ids) - 1] == ids[:-1], "the stop changed the output before it"
    print(f"tiny random Qwen3, {args.prompts} prompts, max_tokens {args.max_tokens}, temperature "
          f"{args.temperature}; vLLM on {os.cpu_count()} CPUs")
    print(f"baseline (no stop): {n_plain:,} tokens in {plain_s:.2f} s")
    print(f"loop stop:          {n_stopped:,} tokens in {stopped_s:.2f} s; {ended} of {args.prompts} requests ended")
    print(f"tokens generated: {n_stopped / n_plain:.3f} of the baseline ({n_plain - n_stopped:,} not generated); "
          f"engine seconds: {stopped_s / plain_s:.3f} of the baseline")


if __name__ == "__main__":
    main()
