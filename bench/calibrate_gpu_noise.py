"""The noise floor between a GPU's and a CPU's forward pass of one model, at the real target's width.

Why: the capture checks (the worker's re-capture, `regen verify --reference`, `regen selfcheck`) judge a row by
its error relative to its own norm against `app.base.states_compare.REL_BOUND`, and by the shift/layer tests. On these
CPUs vLLM and transformers agree to ~3e-5 of the row, which says nothing about a GPU, whose kernels (flash
attention, fused residual adds, split-K matmuls) round differently at every layer. This script measures that on
a random Qwen3 at width 5120 (the 27B target's), with and without a massive-activation channel, over depth:

- `gpu_bf16` against `cpu_bf16`: transformers on the GPU against transformers on the CPU, both bf16 (what
  `verify --reference --device cpu` sees when the states came from a GPU host);
- each against `gpu_fp32` (the same weights in float32 on the GPU): how much of that is each side's rounding;
- `gpu_bf16` in one padded batch against each sequence alone: the noise floor of a re-capture with another
  batch composition (the worker's in-run check);
- `app.base.states_compare.compare` on the real pair (must pass) and on the pair shifted by one token (must fail).

Run on a machine with a GPU: `python bench/calibrate_gpu_noise.py --out DIR` (defaults: 64 layers, 5120 wide,
FFN 8192 so that the CPU pass fits in minutes; `--small` runs a 256-wide form anywhere as a smoke test). Prints
one table per channel value and writes `noise.json` with every figure.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: app.base.states_compare

from app.base.states_compare import REL_BOUND, compare  # noqa: E402


def build(args, device: str, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                         num_key_value_heads=min(8, args.hidden // 128), head_dim=128, max_position_embeddings=4096,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model.eval()


def forward(model, ids: list[list[int]], device: str, batched: bool) -> list[np.ndarray]:
    """Every sequence's `hidden_states` (all layers, float32 numpy [T, L+1, H]); one padded batch or one by one."""
    out = []
    with torch.inference_mode():
        if batched:
            width = max(len(x) for x in ids)
            tok = torch.zeros((len(ids), width), dtype=torch.long)
            mask = torch.zeros((len(ids), width), dtype=torch.long)
            for i, x in enumerate(ids):  # right padding: positions stay 0.. for every sequence
                tok[i, :len(x)] = torch.tensor(x)
                mask[i, :len(x)] = 1
            hs = model(input_ids=tok.to(device), attention_mask=mask.to(device), output_hidden_states=True).hidden_states
            stacked = torch.stack(hs, dim=2).float().cpu().numpy()  # [B, T, L+1, H]
            out = [stacked[i, :len(x)] for i, x in enumerate(ids)]
        else:
            for x in ids:
                hs = model(input_ids=torch.tensor([x], device=device), output_hidden_states=True).hidden_states
                out.append(torch.stack(hs, dim=2)[0].float().cpu().numpy())  # [T, L+1, H]
    return out


def rel_errors(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """||a - b|| / ||b|| per token and layer: [T, L]."""
    return np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(b, axis=-1), 1e-30)


def summary(errs: list[np.ndarray], layers: list[int]) -> dict:
    e = np.concatenate(errs, axis=0)  # [sum T, L+1]
    return {str(k): {"max": float(e[:, k].max()), "p999": float(np.quantile(e[:, k], 0.999)),
                     "median": float(np.median(e[:, k]))} for k in layers}


def bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).float().numpy()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--lengths", default="320,250,181,97")
    p.add_argument("--channels", default="none,some:400,some:2000,every:400",
                   help="massive-activation variants: none; some:V (the channel at V on the first token and ~6%% "
                        "of token ids, the layers' norm weights small on it, as trained models keep it); every:V "
                        "(at V in every token's embedding: a degenerate model whose tokens all look alike)")
    p.add_argument("--small", action="store_true", help="a 256-wide, 8-layer form (smoke test anywhere)")
    p.add_argument("--budget-s", type=float, default=420, help="stop starting new channel values after this")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if args.small:
        args.layers, args.hidden, args.ffn, args.lengths = 8, 256, 512, "40,31,17"
    t0 = time.perf_counter()
    gpu = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(os.cpu_count() or 1)
    device_name = torch.cuda.get_device_name(0) if gpu == "cuda" else "cpu"
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = np.random.default_rng(7)
    ids = [rng.integers(1, 4096, size=n).tolist() for n in lengths]
    ids[1][:64 if not args.small else 8] = ids[0][:64 if not args.small else 8]  # a shared prefix, as real runs have

    g16 = build(args, gpu, torch.bfloat16)
    c16 = copy.deepcopy(g16).to("cpu").eval()  # the same weights (and rotary buffers) on the CPU
    g32 = copy.deepcopy(g16).float().eval()  # the same bf16 weights, computed in float32 on the GPU
    print(f"device {device_name}; model {args.layers} layers x {args.hidden} (ffn {args.ffn}); "
          f"built in {time.perf_counter() - t0:.0f} s", flush=True)

    probe = sorted({1, 2, args.layers // 4, args.layers // 2, 3 * args.layers // 4, args.layers - 3,
                    args.layers - 1, args.layers})
    results = {"device": device_name, "torch": torch.__version__, "model": vars(args) | {"lengths": lengths},
               "rel_bound": REL_BOUND, "probe_layers": probe, "channels": {}}
    emb_g16, emb_c16, emb_g32 = (m.model.embed_tokens.weight for m in (g16, c16, g32))
    channel = 17
    base = emb_g32[:, channel].detach().clone()
    norms = [(m, layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
             for m in (g16, c16, g32) for layer in m.model.layers]
    massive_ids = torch.tensor([i for i in range(4096) if i % 17 == 0])  # id 0 is every sequence's first token
    for seq in ids:
        seq[0] = 0
    for variant in args.channels.split(","):
        if time.perf_counter() - t0 > args.budget_s:
            print(f"{variant}: skipped (budget)", flush=True)
            continue
        kind, _, v = variant.partition(":")
        value = float(v or 0)
        with torch.no_grad():
            col = base.clone()
            if kind == "every":
                col += value
            elif kind == "some":
                col[massive_ids.to(col.device)] += value
            for emb in (emb_g32, emb_g16, emb_c16):
                emb[:, channel] = col.to(emb.device, emb.dtype)
            for _, w_in, w_post in norms:  # trained models give a massive channel a small norm weight
                w_in[channel] = 0.02 if kind == "some" else 1.0
                w_post[channel] = 0.02 if kind == "some" else 1.0
        t = time.perf_counter()
        ref32 = forward(g32, ids, gpu, batched=False)
        a = forward(g16, ids, gpu, batched=False)
        batch = forward(g16, ids, gpu, batched=True)
        t_gpu = time.perf_counter() - t
        t = time.perf_counter()
        c = forward(c16, ids, "cpu", batched=False)
        t_cpu = time.perf_counter() - t
        figures = {
            "gpu_bf16_vs_cpu_bf16": summary([rel_errors(x, y) for x, y in zip(a, c, strict=True)], probe),
            "gpu_bf16_vs_fp32": summary([rel_errors(x, y) for x, y in zip(a, ref32, strict=True)], probe),
            "cpu_bf16_vs_fp32": summary([rel_errors(x, y) for x, y in zip(c, ref32, strict=True)], probe),
            "gpu_batched_vs_alone": summary([rel_errors(x, y) for x, y in zip(batch, a, strict=True)], probe),
        }
        sel = probe
        verdicts = []
        for x, y, seq in zip(a, c, ids, strict=True):
            right = compare(bf16(y[:, sel]), bf16(x[:, sel]), sel, token_ids=seq)
            wide = compare(bf16(y[:, sel]), bf16(x[:, sel]), sel, token_ids=seq, bound=2 * REL_BOUND)
            shifted_cand = np.concatenate([x[:1], x[:-1]], axis=0)[:, sel]
            shifted = compare(bf16(y[:, sel]), bf16(shifted_cand), sel, token_ids=seq)
            batched = compare(bf16(x[:, sel]), bf16(batch[ids.index(seq)][:, sel]), sel, token_ids=seq)
            verdicts.append({"tokens": len(seq), "right_ok": right.ok, "right": right.line(),
                             "right_at_twice_the_bound_ok": wide.ok, "right_at_twice_the_bound": wide.line(),
                             "shifted_ok": shifted.ok, "shifted": shifted.line(),
                             "batched_ok": batched.ok, "batched": batched.line()})
        norm = np.linalg.norm(c[0][:, probe], axis=-1).mean(axis=0)
        # how far apart neighbouring tokens' rows are, as a share of the row: the shift and far tests' room
        step = np.median(np.linalg.norm(np.diff(c[0][:, probe], axis=0), axis=-1), axis=0) / norm
        chan = np.abs(c[0][:, probe, channel]).mean(axis=0)
        results["channels"][variant] = {"figures": figures, "compare": verdicts,
                                           "row_norm_mean": dict(zip(map(str, probe), norm.tolist(), strict=True)),
                                           "channel_abs_mean": dict(zip(map(str, probe), chan.tolist(), strict=True)),
                                           "step_share": dict(zip(map(str, probe), step.tolist(), strict=True)),
                                           "seconds": {"gpu": t_gpu, "cpu": t_cpu}}
        print(f"\nmassive channel {variant} (gpu {t_gpu:.1f} s, cpu {t_cpu:.1f} s): worst error relative to the row"
              f" (max / p99.9), bound {REL_BOUND:g}", flush=True)
        print(f"{'layer':>6} {'row norm':>9} {'step':>6} {'gpu-cpu bf16':>20} {'gpu bf16-fp32':>20} {'cpu bf16-fp32':>20}"
              f" {'batched-alone':>20}")
        for k in probe:
            cells = [figures[n][str(k)] for n in ("gpu_bf16_vs_cpu_bf16", "gpu_bf16_vs_fp32", "cpu_bf16_vs_fp32",
                                                  "gpu_batched_vs_alone")]
            print(f"{k:>6} {norm[probe.index(k)]:>9.1f} {step[probe.index(k)]:>6.3f} " + " ".join(f"{x['max']:>9.2e}/{x['p999']:>9.2e}"
                                                                     for x in cells))
        for v in verdicts:
            print(f"  {v['tokens']} tokens: right {'PASS' if v['right_ok'] else 'FAIL'} ({v['right']}); at twice "
                  f"the bound {'PASS' if v['right_at_twice_the_bound_ok'] else 'FAIL'}; "
                  f"shifted {'caught' if not v['shifted_ok'] else 'MISSED'}; batched "
                  f"{'PASS' if v['batched_ok'] else 'FAIL'} ({v['batched']})", flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "noise.json").write_text(json.dumps(results, indent=1))
    worst = max((f["gpu_bf16_vs_cpu_bf16"][str(k)]["max"] for f in
                 (ch["figures"] for ch in results["channels"].values()) for k in probe), default=math.nan)
    print(f"\nworst gpu-vs-cpu error over every layer and channel value: {worst:.3g} "
          f"({worst / REL_BOUND:.2f} of REL_BOUND); total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
