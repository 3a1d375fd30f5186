"""What looking at every row costs, at the job's width: a sample of ~3,000 tokens x 5 layers x 5120 (Qwen3.6-27B's
DFlash layers), bf16.

    python bench/bench_row_checks.py              # ~1 min on 2 busy cores
    python bench/bench_row_checks.py --tokens 4000 --repeat 5

Why: the quality gate runs these checks on every sample beside the engine (workers/shard/generate.py, on encoder
threads) and `regen verify` on every stored sample. They used to look at layers (zero throughout) and at 16 rows
a sample (stale rows); they now look at every row. Each figure is a median of `--repeat` runs on one sample, and
each is printed beside baselines measured in the same run on the same sample:
- `per-layer zero/NaN (old)`: the check `states_problem` was (column maxima per block: a layer zero throughout);
- `stale rows, 16 positions (old)`: `StaleRows(positions=16)`, the old probe;
- `encode (bf16, zstd 3)`: `app.base.hidden_file.encode_sample`, what the same encoder thread does next anyway.
The stale-row table is filled with 40 earlier samples first, so the lookups search a table of realistic size.
Detection: one stale row planted at a random position of each of `--trials` samples, copied from a random row of
an earlier sample in the table; the table finds it (full) or not (16 positions).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.base.hidden_file import encode_sample, float32_to_bf16  # noqa: E402
from app.base.quality import StaleRows, states_problem  # noqa: E402

_BLOCK = 1 << 16


def per_layer_check_old(states_u16: np.ndarray) -> str | None:
    """The per-layer check as it was before rows were looked at (a layer zero throughout, or a NaN/Inf)."""
    n_tokens = states_u16.shape[0]
    rows = states_u16.reshape(n_tokens, states_u16.shape[1], -1)
    block = max(1, _BLOCK // rows[0].size)
    top = np.zeros(rows.shape[1:], dtype=np.uint16)
    for start in range(0, n_tokens, block):
        np.maximum(top, np.left_shift(rows[start:start + block], 1).max(axis=0), out=top)
    if top.max() >= 0x7F80 << 1:
        return "states_nonfinite"
    return None if top.any(axis=1).all() else "states_zero"


def sample(rng: np.random.Generator, tokens: int, layers: int, hidden: int) -> np.ndarray:
    x = rng.standard_normal((tokens, layers, hidden), dtype=np.float32)
    x[:, :, 7] = 400.0  # a massive-activation channel, as real Qwen models carry
    return float32_to_bf16(x)


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--earlier", type=int, default=40, help="samples in the stale-row table before timing")
    ap.add_argument("--trials", type=int, default=10)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    states = sample(rng, args.tokens, args.layers, args.hidden)
    ids = np.arange(args.tokens, dtype=np.int64)
    mb = states.nbytes / 1e6
    print(f"sample: {args.tokens} tokens x {args.layers} layers x {args.hidden} = {mb:.0f} MB of bf16")

    earlier = [sample(rng, args.tokens, args.layers, 256) for _ in range(2)]  # cheap fill rows, as keys only
    full, probe = StaleRows(), StaleRows(positions=16)
    for k in range(args.earlier):
        fill = earlier[k % 2].copy()
        fill[:, :, 0] += k  # each earlier sample distinct
        full.check(ids + 10_000 * (k + 1), fill)
        probe.check(ids + 10_000 * (k + 1), fill)
    print(f"stale-row table before timing: {len(full):,} rows of {args.earlier} earlier samples")

    figures = {
        "encode (bf16, zstd 3)": timed(lambda: encode_sample("s", ids, states, list(range(args.layers))), args.repeat),
        "per-layer zero/NaN (old)": timed(lambda: per_layer_check_old(states), args.repeat),
        "per-row zero/NaN (now)": timed(lambda: states_problem(states), args.repeat),
        "stale rows, 16 positions (old)": timed(lambda: probe.check(ids, states), args.repeat),
        "stale rows, every row (now)": timed(lambda: full.check(ids, states), args.repeat),
    }
    encode = figures["encode (bf16, zstd 3)"]
    print(f"{'check':34} {'ms':>8} {'MB/s':>8} {'x encode':>9}")
    for name, seconds in figures.items():
        print(f"{name:34} {seconds * 1e3:8.1f} {mb / seconds:8.0f} {seconds / encode:9.2f}")
    before = figures["per-layer zero/NaN (old)"] + figures["stale rows, 16 positions (old)"]
    after = figures["per-row zero/NaN (now)"] + figures["stale rows, every row (now)"]
    print(f"row checks now / before: {after / before:.2f}x; now / encode: {after / encode:.2f}")

    found = {"every row": 0, "16 positions": 0}
    source_ids, source = ids + 5_000_000, sample(rng, args.tokens, args.layers, args.hidden)
    for trial in range(args.trials):
        tables = {"every row": StaleRows(), "16 positions": StaleRows(positions=16)}
        for table in tables.values():
            table.check(source_ids, source)
        bad = sample(rng, args.tokens, args.layers, args.hidden)
        t, s, layer = (int(rng.integers(args.tokens)), int(rng.integers(args.tokens)), int(rng.integers(args.layers)))
        bad[t, layer] = source[s, layer]
        for name, table in tables.items():
            found[name] += table.check(ids + 6_000_000 + trial * 10_000, bad) == "states_stale"
    print(f"one stale row in a {args.tokens}-token sample found: every row {found['every row']}/{args.trials}, "
          f"16 positions {found['16 positions']}/{args.trials}")


if __name__ == "__main__":
    main()
