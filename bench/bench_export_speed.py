"""One export process's write rate on one captured shard, against `dd` writing as many bytes in the same run.

Why beside bench/bench_scale.py: the scale harness times whole `regen export` commands on a 64-sample captured
shard (~12 GB written per format); this one lays down a shard of a few samples at the job's width (5120, the
DFlash layers and the final one, through bench/scale_run.py's writers: the same bytes per token) and times
`Exporter.export_shard` in process, so a change to the write path can be measured before/after in minutes, and
profiled (`--profile FORMAT`). Each format is timed `--repeat` times (best taken: the box is shared and noisy),
each time followed by dd (conv=fsync) of as many bytes to the same folder; the ratio is to the best dd.

    python bench/bench_export_speed.py --keep /tmp/speed-run [--samples 6] [--repeat 3] [--profile speculators]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import scale_run as sr  # noqa: E402
from bench_scale import STATE_FORMATS, dd_rate, du  # noqa: E402


def prepare(root: Path, samples: int) -> None:
    """A one-shard run of `samples` captured samples under `root/run` (reused when it is there)."""
    stamp = root / "speed.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("samples") == samples:
        return
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    sr.write_model(root / "model")
    t0 = time.perf_counter()
    info = sr.lay_down(root / "run", sr.Shape(samples, 1), root / "model", 1)
    print(f"laid down {samples} samples ({info['tokens']:,} tokens) in {time.perf_counter() - t0:.0f} s")
    stamp.write_text(json.dumps({"samples": samples, **info}))


def export_once(root: Path, fmt: str, out: Path, profile: cProfile.Profile | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds for one process to export the captured shard in `fmt` into a fresh `out` (start-up
    excluded; CPU is the process's, every thread, which other sessions' load moves less than the wall time)."""
    from app.data.export import Exporter, ExportOptions
    from app.data.run_reader import RunReader

    if out.exists():
        shutil.rmtree(out)
    opts = STATE_FORMATS[fmt]
    layers = opts[opts.index("--layers") + 1] if "--layers" in opts else None
    model = str(root / "model") if fmt == "specforge-eagle3" else None
    with RunReader(str(root / "run"), sr.RUN_ID) as reader:
        exporter = Exporter(reader, str(out), ExportOptions(fmt, layers=layers, model=model))
        info = reader.shard(sr.shard_id(0))
        if profile:
            profile.enable()
        t0, c0 = time.perf_counter(), time.process_time()
        exporter.export_shard(info, 0)
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        if profile:
            profile.disable()
    return secs, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", default="/tmp/regen-export-speed", help="folder of the laid-down run (reused)")
    ap.add_argument("--samples", type=int, default=6, help="captured samples (~3,000 tokens, ~180 MB raw each)")
    ap.add_argument("--repeat", type=int, default=3, help="timings per format; the best is reported")
    ap.add_argument("--formats", default=",".join(STATE_FORMATS), help="comma-separated export formats")
    ap.add_argument("--profile", default=None, help="a format to cProfile once after the timings")
    args = ap.parse_args()
    root = Path(args.keep)
    prepare(root, args.samples)
    out = root / "out"
    print(f"{'format':18s} {'MB':>8s} {'best s':>8s} {'MB/s':>8s} {'dd MB/s':>8s} {'export/dd':>9s} {'CPU s':>6s}")
    for fmt in args.formats.split(","):
        times, cpus, dds = [], [], []
        for _ in range(args.repeat):
            wall, cpu = export_once(root, fmt, out)
            times.append(wall)
            cpus.append(cpu)
            written = du(out)
            shutil.rmtree(out)
            dds.append(dd_rate(out, written))
            shutil.rmtree(out, ignore_errors=True)
        mbps = written / min(times) / 1e6
        print(f"{fmt:18s} {written / 1e6:8.0f} {min(times):8.2f} {mbps:8.1f} {max(dds):8.1f} "
              f"{mbps / max(dds):9.2f} {min(cpus):6.2f}   (times {', '.join(f'{t:.2f}' for t in times)}; "
              f"dd {', '.join(f'{d:.0f}' for d in dds)})", flush=True)
    if args.profile:
        # cProfile sees one thread: the profile runs the export without its read-ahead thread, so the decoding
        # shows beside the writing (each sample is then decoded and written in turn)
        from app.data import export_trainers

        export_trainers.read_ahead = iter
        prof = cProfile.Profile()
        secs, _ = export_once(root, args.profile, out, prof)
        shutil.rmtree(out, ignore_errors=True)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
        print(f"\nprofile of {args.profile} ({secs:.2f} s, without the read-ahead thread), by own time:\n{text.getvalue()}")


if __name__ == "__main__":
    main()
