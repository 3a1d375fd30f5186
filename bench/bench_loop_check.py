"""What the quality gate's `repetition_loop` check costs at the job's output lengths (8K to 32K tokens), and what
the loop stop's per-step check costs the engine.

    python bench/bench_loop_check.py                 # a few seconds
    python bench/bench_loop_check.py --repeat 2000

Why: `app.base.quality.repetition_loop` runs once per finished sample on the worker's delivery thread (sample_flags),
and the loop stop (workers.engine.loop_stop) runs it on the engine thread every CHECK_EVERY tokens of every
request that asks. Outputs: a random one (no loop: most period candidates fail at the first compare) and a looping
one (a period-37 span repeated to the end, the case that returns True). Each figure is a median per call, beside a
baseline measured in the same run on the same ids: `json.dumps` of the output ids, which the delivery thread does
for every record anyway (the record's input_ids are written as JSON).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.base.loops import MAX_PERIOD  # noqa: E402
from app.base.quality import repetition_loop  # noqa: E402

MIN_REPEATS = 6  # QualitySettings.repetition_min_repeats' default


def per_call(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--repeat", type=int, default=300)
    args = ap.parse_args()
    rng = random.Random(0)
    print(f"{'output':>8} {'kind':>8} {'repetition_loop':>16} {'json.dumps ids':>15} {'ratio':>7} "
          f"{'engine tail check':>18}")
    for n in (int(x) for x in args.lengths.split(",")):
        span = [rng.randrange(150_000) for _ in range(37)]
        outputs = {"random": [rng.randrange(150_000) for _ in range(n)],
                   "looping": [rng.randrange(150_000) for _ in range(n // 2)] + (span * n)[: n - n // 2]}
        for kind, ids in outputs.items():
            flagged = repetition_loop(ids, MIN_REPEATS)
            assert flagged == (kind == "looping"), (kind, flagged)
            check = per_call(lambda ids=ids: repetition_loop(ids, MIN_REPEATS), args.repeat)
            base = per_call(lambda ids=ids: json.dumps(ids), args.repeat)
            tail = per_call(lambda ids=ids: repetition_loop(ids[-MAX_PERIOD * MIN_REPEATS:], MIN_REPEATS),
                            args.repeat)
            print(f"{n:>8} {kind:>8} {check * 1e6:>13.1f} us {base * 1e6:>12.1f} us {check / base:>7.3f} "
                  f"{tail * 1e6:>15.1f} us")


if __name__ == "__main__":
    main()
