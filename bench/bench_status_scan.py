"""What one pass of `regen status --watch` / one `regen metrics` scrape costs as a run grows (`RunScanner`).

Why: status and metrics re-scan the run on every pass. If a pass lists every attempt folder of the run, a scrape
every 15 s at a thousand GPUs' run (1.4M shards) is ~1.4M directory listings a scrape; the fleet harness
(bench/bench_fleet_scale.py) saw the scrape's latency grow with the run. This lays down runs of the job's shard
counts with the workers' own writers (an attempt record and a published shard with its completion marker per
shard; a few shards open: attempts without a marker, as a fleet in flight holds them) and times, for each size
(operation counting off; the operations are counted in a second pass):

- `cold`: the first scan of a fresh scanner (a `regen status` process reads every marker and attempt once);
- `warm`: the next scan of the same scanner (what each `--watch` pass and each scrape costs);
- `walk`: the baseline, measured in the same run: a recursive listing of `attempts/` (fsspec's `find`), the
  least a pass pays that lists every attempt folder.

It prints the warm scan's ratio to the walk and each column's growth exponent over the sizes (time ~ shards^b:
b near 1 grows with the run, near 0 does not). Storage operations are counted by app/base/storage_counts.py.

    python bench/bench_status_scan.py                       # 1,428 / 4,285 / 14,282 shards (10-100% of the job)
    python bench/bench_status_scan.py --shards 14282,142820 --keep /data/scan   # the job and 10x it, kept
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.base.config import scope as settings_scope  # noqa: E402
from app.base.ids import shard_id  # noqa: E402
from app.base.ledger import record_attempt  # noqa: E402
from app.base.storage import RunStore, Storage  # noqa: E402
from app.base.storage_counts import read_all  # noqa: E402
from workers.shard.shard_output import publish_shard  # noqa: E402

RUN_ID = "scan"
OPEN = 10  # shards in flight: attempts without a marker (a fleet of ~10 task slots)


def lay_down(root: Path, shards: int) -> RunStore:
    """`shards` published shards (attempt record, one small record, completion marker) and OPEN open ones."""
    store = RunStore(Storage(str(root)), RUN_ID)
    done_mark = root / RUN_ID / ".laid-down"
    if done_mark.exists() and int(done_mark.read_text()) == shards:
        return store
    store.storage.write_json(store.manifest_path, {"run_id": RUN_ID, "counts": {"shards": shards + OPEN}})
    record = {"id": "x", "status": "ok", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "num_prompt_tokens": 1,
              "num_output_tokens": 2, "finish_reason": "stop", "flags": []}
    for s in range(shards):
        sid = shard_id(s)
        record_attempt(store, sid, "a0", f"gpu{s % 8}@host{s % 2}", stage="generate")
        summary = {"samples": 1, "ok": 1, "rejected": {}, "flags": {}, "stubs": 0, "prompt_tokens": 1,
                   "generated_tokens": 2, "generation_seconds": 0.5, "worker": f"gpu{s % 8}@host{s % 2}",
                   "device": "stand-in"}
        assert publish_shard(store, sid, "a0", [{**record, "id": f"{sid}-0"}], None, summary)
    for s in range(shards, shards + OPEN):
        record_attempt(store, shard_id(s), "a0", f"gpu{s % 8}@host{s % 2}", stage="generate")
    done_mark.write_text(str(shards))
    return store


def timed(fn, repeat: int) -> float:
    """Median seconds of `repeat` calls."""
    return statistics.median(timeit.repeat(fn, number=1, repeat=repeat))


def _ops(c) -> int:
    return sum(v for k, v in c.items() if ":" not in k and not k.startswith("bytes"))


def measure(store: RunStore, counts: Path, repeat: int) -> dict:
    """Times with operation counting off (it costs a line per operation), then the operations of one cold and
    one warm scan with it on; each pass in a settings scope of its own, as a `regen` command runs."""
    from app.ops.status import RunScanner

    storage = store.storage
    os.environ.pop("REGEN_STORAGE_COUNTS", None)
    with settings_scope():
        t0 = time.perf_counter()
        scanner = RunScanner(store)
        scanner.scan()
        cold = time.perf_counter() - t0
        warm = timed(scanner.scan, repeat)
        walk = timed(lambda: storage.fs.find(storage.path(store.rel("attempts"))), repeat)
    os.environ["REGEN_STORAGE_COUNTS"] = str(counts)
    with settings_scope():
        before = read_all(str(counts))
        scanner = RunScanner(store)
        scanner.scan()
        mid = read_all(str(counts))
        scanner.scan()
        after = read_all(str(counts))
    os.environ.pop("REGEN_STORAGE_COUNTS", None)
    return {"cold_s": cold, "warm_s": warm, "walk_s": walk, "cold_ops": _ops(mid - before),
            "warm_lists": (after - mid)["list"], "warm_reads": (after - mid)["read"]}


def growth(xs: list[int], ys: list[float]) -> float | None:
    """Least-squares slope of log y over log x."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if y > 0]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", default="1428,4285,14282", help="run sizes in shards, comma-separated")
    ap.add_argument("--repeat", type=int, default=5, help="warm scans and walks timed per size (median)")
    ap.add_argument("--keep", default=None, help="lay the runs down here and reuse them [default: a temp dir]")
    args = ap.parse_args()
    sizes = [int(x) for x in args.shards.split(",")]
    base = Path(args.keep or tempfile.mkdtemp(prefix="status-scan-"))
    counts = base / "counts"
    rows = []
    for n in sizes:
        t0 = time.perf_counter()
        store = lay_down(base / f"run{n}", n)
        print(f"{n:,} shards laid down in {time.perf_counter() - t0:.0f} s", flush=True)
        rows.append((n, measure(store, counts, args.repeat)))
    print(f"\n**RunScanner over a run of N shards ({OPEN} open), {base}**\n")
    print("| shards | cold scan s | storage ops (cold) | warm scan s | listings (warm) | reads (warm) "
          "| walk of attempts/ s | warm / walk |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, m in rows:
        print(f"| {n:,} | {m['cold_s']:.3f} | {m['cold_ops']:,} | {m['warm_s']:.4f} | {m['warm_lists']:.0f} "
              f"| {m['warm_reads']:.0f} | {m['walk_s']:.3f} | {m['warm_s'] / m['walk_s']:.3f} |")
    ns = [n for n, _ in rows]
    exps = {k: growth(ns, [m[k] for _, m in rows]) for k in ("cold_s", "warm_s", "walk_s")}
    print("\ngrowth b (time ~ shards^b): " + ", ".join(f"{k.removesuffix('_s')} {v:.2f}" if v is not None
                                                     else f"{k} -" for k, v in exps.items()))


if __name__ == "__main__":
    main()
