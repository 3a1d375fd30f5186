"""What `regen status`, `verify --sample`, `stats` and every export cost on a run of the real job's shape, and
how that cost grows with the run.

Why: regen is proven on runs of tens of samples; the job is 914K thinking-mode samples in 14,282 shards of 64
(bench/scale_run.py lays such a run down through the project's own writers; its docstring says how states at
the target's width fit on this disk: a staged run whose first `--states-shards` shards are captured). A step that
grows faster than the run (a listing per shard, a whole-run JSON in memory, an O(shards^2) loop) is invisible at
200 samples and costs days at 914K.

One command. It lays the run down (`--scale` of the job; `--keep DIR` keeps it and reuses it on the next call),
derives the first 10% and 50% of its shards as runs of their own (hard links, no copy), and times each command
as a user runs it (`python -m app.cli ...`, a fresh process) at 10%, 50% and 100%:
- rate: samples/s, and MB/s of what it reads (records and states) or writes (exports);
- growth: the time at each fraction, less the command's start-up (its `--help`, timed apart), and the exponent
  b of time ~ samples^b between 10% and 100% (1: grows as the run; above 1: faster);
- projection: the full job's time from the 100% figure and max(b, 1); for exports also the bytes the full job
  writes, and the time at the assumed storage's write rate (`--storage-gbps`) when processes are not the limit.
Exports are compared with `dd` writing as many bytes to the same disk in the same run (conv=fsync); the
target is 0.8 of dd's rate per process. Hidden-state exports write the captured shards (their rate, MB/s
and ratio to dd come from those) and walk the rest, so their growth is timed on the fractions with the capture
markers left out (`walk` rows): what the export costs per shard beside the bytes.

Fan-out: where `regen export`, `verify` or `stats` have `--processes N` and `--part I/N` (read from each
command's --help), each is also timed with `--processes 2` and as 2 parts run at once; otherwise one process.

    python bench/bench_scale.py --scale 0.01                  # ~9K samples, a few minutes
    python bench/bench_scale.py --scale 0.1 --keep /data/scale  # the docs' table; reruns reuse the run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import scale_run as sr  # noqa: E402

FRACTIONS = (0.1, 0.5, 1.0)
MIN_NET_S = 1.0  # a growth exponent from times closer than this to the start-up is noise
KNOWN_TEXT = ("sharegpt", "specforge-jsonl", "parquet")
STATE_FORMATS = {  # format -> export options (the run captured the DFlash layers and the final one)
    "specforge-dflash": ["--layers", "dflash"],
    "specforge-eagle3": ["--layers", "vllm:2,32,62"],  # EAGLE-3: three auxiliary layers, plus the final one
    "speculators": [],
}


# -- the run ---------------------------------------------------------------------------------------------
def prepare(root: Path, shape: sr.Shape, jobs: int) -> dict:
    """The laid-down run and its fractions under `root`, reused when `root` holds one of this shape."""
    stamp = root / sr.STAMP
    if stamp.exists():
        have = json.loads(stamp.read_text())
        if {"hidden": sr.HIDDEN, **have.get("shape", {})} == asdict(shape):
            print(f"reusing the run laid down in {root} ({have['samples']:,} samples, "
                  f"laid down in {have['lay_down_s']:.0f} s)")
            return have
        raise SystemExit(f"{root} holds a run of another shape ({have.get('shape')}): use another --keep")
    if root.exists() and any(root.iterdir()):
        raise SystemExit(f"{root} is not empty and holds no {sr.STAMP}: use an empty or new folder")
    root.mkdir(parents=True, exist_ok=True)
    sr.write_model(root / "model", shape.hidden)
    t0 = time.perf_counter()
    info = sr.lay_down(root / "f100", shape, root / "model", jobs)
    info["lay_down_s"] = time.perf_counter() - t0
    for f in FRACTIONS[:-1]:
        sr.derive(root / "f100", root / f"f{round(f * 100):03d}", shape, root / "model", shards_at(shape, f))
    for f in FRACTIONS:  # the same fractions without capture markers: what state exports cost besides bytes
        walk = root / f"walk{round(f * 100):03d}"
        sr.derive(root / "f100", walk, shape, root / "model", shards_at(shape, f))
        shutil.rmtree(walk / sr.RUN_ID / "captured", ignore_errors=True)
    info["store_bytes"] = du(root / "f100")
    info["state_bytes"] = sum(du(root / "f100" / sr.RUN_ID / "shards" / sr.shard_id(s))
                              for s in range(shape.states_shards))
    stamp.write_text(json.dumps(info))
    return info


def captured_tokens(storage: Path, shape: sr.Shape) -> int:
    """Tokens of the captured shards' samples (their done markers count them)."""
    total = 0
    for s in range(shape.states_shards):
        marker = json.loads((storage / sr.RUN_ID / "done" / f"{sr.shard_id(s)}.json").read_text())
        total += int(marker["prompt_tokens"]) + int(marker["generated_tokens"])
    return total


def shards_at(shape: sr.Shape, f: float) -> int:
    return shape.shards if f >= 1 else max(1, round(f * shape.shards))


def samples_at(shape: sr.Shape, f: float) -> int:
    return sum(shape.shard_samples(s) for s in range(shards_at(shape, f)))


def du(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                continue
    return total


# -- running the CLI -------------------------------------------------------------------------------------
def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", *args]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}


def run_timed(cmds: list[list[str]], ok_codes=(0,)) -> float:
    """Wall seconds for `cmds` started together (one command, or the parts of a fanned-out one)."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for c in cmds]
    for c, p in zip(cmds, procs, strict=True):
        _, err = p.communicate()
        if p.returncode not in ok_codes:
            raise RuntimeError(f"{' '.join(c[2:])} exited {p.returncode}: {err.decode(errors='replace')[-800:]}")
    return time.perf_counter() - t0


def startup(command: str) -> float:
    """Seconds of `regen COMMAND --help` in a fresh process: what every call costs before it reads anything."""
    t0 = time.perf_counter()
    subprocess.run(cli(command, "--help"), cwd=REPO, env=env(), capture_output=True, check=True)
    return time.perf_counter() - t0


def command_options(command: str) -> set[str]:
    """Every option name the CLI command takes (click introspection of the checkout's own CLI)."""
    from app.cli import data, ops

    found = {c.name: c for c in (*data.commands, ops.status)}[command]
    return {o for p in found.params for o in p.opts}


def fanout(command: str) -> list[str]:
    """The fan-out variants a command offers: `--processes N` and `--part I/N` where it has them."""
    opts = command_options(command)
    return [v for v, opt in (("2 processes", "--processes"), ("2 parts at once", "--part")) if opt in opts]


def export_formats() -> list[str]:
    from app.cli.data import export_cmd

    return list(next(p for p in export_cmd.params if p.name == "fmt").type.choices)


def variants(base: list[str], kinds: list[str]) -> dict[str, list[list[str]]]:
    out = {"1 process": [base]}
    if "2 processes" in kinds:
        out["2 processes"] = [[*base, "--processes", "2"]]
    if "2 parts at once" in kinds:
        out["2 parts at once"] = [[*base, "--part", "1/2"], [*base, "--part", "2/2"]]
    return out


def dd_rate(folder: Path, nbytes: int) -> float:
    """MB/s of dd writing `nbytes` to `folder`'s disk, flushed (conv=fsync)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "dd-reference.bin"
    blocks = max(1, math.ceil(nbytes / (4 << 20)))
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={blocks}", "conv=fsync", "status=none"],
                   check=True)
    secs = time.perf_counter() - t0
    path.unlink()
    return blocks * (4 << 20) / secs / 1e6


# -- measurements ----------------------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    variant: str
    startup: float
    times: dict[float, float] = field(default_factory=dict)  # fraction -> wall seconds
    samples: dict[float, int] = field(default_factory=dict)
    read_bytes: int = 0  # at 100%
    written: int = 0  # export bytes at 100%
    exported_samples: int = 0
    dd_mbps: float | None = None
    processes: int = 1

    def net(self, f: float) -> float:
        return max(1e-3, self.times[f] - self.startup)

    @property
    def exponent(self) -> float | None:
        lo, hi = min(self.times), max(self.times)
        if self.samples[hi] == self.samples[lo]:
            return None
        return math.log(self.net(hi) / self.net(lo)) / math.log(self.samples[hi] / self.samples[lo])


def time_command(name: str, base_for, kinds: list[str], startup: float, shape: sr.Shape, root: Path,
                 fractions, ok_codes=(0,), cleanup=None, prefix: str = "f") -> list[Row]:
    rows = []
    for variant, _ in variants(["x"], kinds).items():
        row = Row(name, variant, startup, processes=2 if variant != "1 process" else 1)
        for f in fractions:
            storage = root / f"{prefix}{round(f * 100):03d}"
            cmds = variants(base_for(storage), kinds)[variant]
            if cleanup:
                cleanup()
            row.times[f] = run_timed(cmds, ok_codes)
            row.samples[f] = samples_at(shape, f)
            print(f"  {name:28s} {variant:16s} {round(f * 100):3d}%: {row.times[f]:8.2f} s", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the job's 914K samples (default 1.0)")
    ap.add_argument("--states-shards", type=int, default=1,
                    help="shards captured at width 5120 (one is ~9 GB stored, ~12 GB per state export)")
    ap.add_argument("--keep", default=None, help="lay the run down here and keep it; a rerun reuses it")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes that lay the run down")
    ap.add_argument("--broker", default="memory://",
                    help="broker for `regen status` (queue lengths); its storage scan is what is timed")
    ap.add_argument("--sample", default="16", help="regen verify --sample (default 16 samples)")
    ap.add_argument("--storage-gbps", type=float, default=2.0,
                    help="assumed write rate of the job's shared storage, GB/s, for the projections")
    ap.add_argument("--fractions", default="0.1,0.5,1",
                    help="fractions of the run to time each command at (each of 0.1, 0.5, 1)")
    ap.add_argument("--hidden", type=int, default=sr.HIDDEN, help=argparse.SUPPRESS)  # the harness's test
    ap.add_argument("--skip", default="", help="comma-separated commands (status, verify, stats, export: every format) or export formats not to time")
    args = ap.parse_args()
    args.fractions = tuple(sorted(float(f) for f in args.fractions.split(",")))
    if not set(args.fractions) <= set(FRACTIONS):
        ap.error(f"--fractions: each of {', '.join(map(str, FRACTIONS))}")

    samples = max(1, round(sr.JOB_SAMPLES * args.scale))
    shape = sr.Shape(samples, min(args.states_shards, math.ceil(samples / sr.SHARD_SIZE)), hidden=args.hidden)
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench-scale-"))
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    try:
        print(f"run: {shape.samples:,} samples in {shape.shards:,} shards of {sr.SHARD_SIZE} "
              f"({args.scale:g} of the job), {shape.states_shards} captured at {shape.hidden} x {len(sr.LAYERS)} layers")
        info = prepare(root, shape, args.jobs)
        info["captured_tokens"] = captured_tokens(root / "f100", shape)
        tokens_per_sample = info["tokens"] / info["samples"]
        print(f"laid down {info['samples']:,} samples ({tokens_per_sample:,.0f} tokens each on average) in "
              f"{info['lay_down_s']:.0f} s = {info['samples'] / info['lay_down_s']:,.0f} samples/s with "
              f"{args.jobs} processes; store {info['store_bytes'] / 1e9:.2f} GB, of which states "
              f"{info['state_bytes'] / 1e9:.2f} GB; the full job at this rate: "
              f"{sr.JOB_SAMPLES / info['samples'] * info['lay_down_s'] / 3600:.1f} h", flush=True)
        rows = measure(root, shape, info, args, skip)
        report(rows, shape, info, args)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def measure(root: Path, shape: sr.Shape, info: dict, args, skip: set) -> list[Row]:
    rows: list[Row] = []
    out = root / "export-out"
    records_bytes = info["store_bytes"] - info["state_bytes"]

    def clear_out() -> None:
        shutil.rmtree(out, ignore_errors=True)

    if "status" not in skip:
        start = startup("status")
        rows += time_command("status", lambda s: cli("status", sr.RUN_ID, "--storage", str(s), "--broker",
                                                     args.broker, "--json", "--inspect-timeout", "0"),
                             [], start, shape, root, args.fractions)
    for command, extra, ok in (("verify", ["--sample", args.sample, "--json"], (0, 1)), ("stats", ["--json"], (0,))):
        if command in skip:
            continue
        start = startup(command)
        found = time_command(command + (f" --sample {args.sample}" if command == "verify" else ""),
                             lambda s, c=command, e=extra: cli(c, sr.RUN_ID, "--storage", str(s), *e),
                             fanout(command), start, shape, root, args.fractions, ok_codes=ok)
        for r in found:
            r.read_bytes = records_bytes
        rows += found
    if "verify" not in skip:
        rows.append(time_sample_choice(shape, args.fractions))
    if "export" in skip:
        return rows
    start = startup("export")
    kinds = fanout("export")
    for fmt in export_formats():
        if fmt in skip:
            continue
        base = lambda s, f=fmt: cli("export", sr.RUN_ID, "--storage", str(s), "--format", f, "--out", str(out),  # noqa: E731
                                   *STATE_FORMATS.get(f, []),
                                   *(["--model", str(root / "model")] if f == "specforge-eagle3" else []))
        if fmt in STATE_FORMATS:
            if shape.states_shards == 0:
                continue
            walk = time_command(f"{fmt} (walk)", base, kinds, start, shape, root, args.fractions, cleanup=clear_out,
                                prefix="walk")
            full = time_command(fmt, base, kinds, start, shape, root, fractions=(1.0,), cleanup=clear_out)
            for r in full:
                r.samples = {1.0: shape.states_shards * sr.SHARD_SIZE}
                r.read_bytes = info["state_bytes"]
            rows += walk
            found = full
        else:
            found = time_command(fmt, base, kinds, start, shape, root, args.fractions, cleanup=clear_out)
            for r in found:
                r.read_bytes = records_bytes
        # The output of the last timed variant (at 100%) is still there: its bytes, then dd of as many.
        written = du(out) if out.exists() else 0
        exported = exported_count(out)
        clear_out()
        rate = dd_rate(out, written) if written else None
        clear_out()
        for r in found:
            r.written, r.exported_samples, r.dd_mbps = written, exported, rate
        rows += found
    return rows


def time_sample_choice(shape: sr.Shape, fractions) -> Row:
    """`verify --sample 0.01`'s choice of samples (app/data/verify_sampled.choose) at the run's shard counts, in
    this process: on the laid-down run only the captured shards have samples to choose from, while on the job
    every shard has (a listing of each shard's good samples, 64 each, spread over the run's workers)."""
    from types import SimpleNamespace

    from app.data.verify_sampled import choose

    row = Row("verify --sample 0.01: the choice", "in process", 0.0)
    for f in fractions:
        results = [SimpleNamespace(shard=sr.shard_id(s), worker=f"gpu-host-{s % sr.WORKERS}",
                                   good_samples=[f"{s * sr.SHARD_SIZE + k:016x}" for k in range(shape.shard_samples(s))])
                   for s in range(shards_at(shape, f))]
        t0 = time.perf_counter()
        choose(results, 0.01)
        row.times[f] = time.perf_counter() - t0
        row.samples[f] = samples_at(shape, f)
        print(f"  {row.name:28s} {row.variant:16s} {round(f * 100):3d}%: {row.times[f]:8.2f} s", flush=True)
    return row


def exported_count(out: Path) -> int:
    total = 0
    done = out / "done"
    if done.is_dir():
        for name in os.listdir(done):
            if name.endswith(".json"):
                total += int(json.loads((done / name).read_text()).get("exported", 0))
    return total


# -- the table -------------------------------------------------------------------------------------------
def human(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def report(rows: list[Row], shape: sr.Shape, info: dict, args) -> None:
    job_ratio = sr.JOB_SAMPLES / shape.samples
    storage_mbps = args.storage_gbps * 1000
    print(f"\nassumed storage for the job: {args.storage_gbps:g} GB/s of writes (shared NFS/parallel file system);"
          f" job = {sr.JOB_SAMPLES:,} samples = {job_ratio:,.1f}x this run; times less each command's start-up")
    head = ("| command | variant | start-up s | 10% s | 50% s | 100% s | growth b | samples/s | MB/s | "
            "export/dd | job: projected |")
    print(head)
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        top = max(r.times)
        secs = r.net(top)
        b = r.exponent if min(r.net(f) for f in r.times) >= MIN_NET_S else None  # start-up bound: noise
        rate_samples = r.samples[top] / secs
        mbytes = (r.written or r.read_bytes) / 1e6
        mbps = mbytes / secs if mbytes else None
        ratio = None
        if r.written and r.dd_mbps:
            ratio = mbps / r.dd_mbps
        if r.name in STATE_FORMATS and r.written:  # bytes dominate: scale by the job's state tokens
            job_bytes = r.written / info["captured_tokens"] * info["tokens"] / info["samples"] * sr.JOB_SAMPLES
            proc = job_bytes / 1e6 / mbps
            disk = job_bytes / 1e6 / storage_mbps
            proj = (f"{job_bytes / 1e12:,.0f} TB: {human(proc)} at this rate, {human(disk)} at "
                    f"{args.storage_gbps:g} GB/s")
        else:
            scale = job_ratio if top >= 1 else sr.JOB_SAMPLES / r.samples[top]
            proj = human(secs * scale ** max(b or 1.0, 1.0))
            if r.written:
                job_bytes = r.written * job_ratio
                proj += f"; writes {job_bytes / 1e9:,.0f} GB ({human(job_bytes / 1e6 / storage_mbps)} at " \
                        f"{args.storage_gbps:g} GB/s)"
        cells = [r.name, r.variant, f"{r.startup:.1f}",
                 *(f"{r.times[f]:.2f}" if f in r.times else "" for f in FRACTIONS),
                 f"{b:.2f}" if b is not None else "-", f"{rate_samples:,.0f}" if rate_samples >= 10 else
                 f"{rate_samples:.2f}",
                 f"{mbps:,.1f}" if mbps else "",
                 f"{ratio:.2f}" + (f" ({ratio / r.processes:.2f}/process)" if r.processes > 1 else "")
                 if ratio else "", proj]
        print("| " + " | ".join(cells) + " |")
    dd = sorted({r.dd_mbps for r in rows if r.dd_mbps})
    if dd:
        print(f"\ndd with conv=fsync to the same disk: {dd[0]:,.0f}-{dd[-1]:,.0f} MB/s over the exports' sizes")
    print("growth b: time ~ samples^b from the smallest to the largest fraction timed (times less start-up; '-' "
          f"where a time is within {MIN_NET_S:g} s of the start-up); the projection uses max(b, 1), and "
          "state exports the job's tokens at the bytes per token written. State-export rows: their samples/s and MB/s are over the captured shards' "
          f"{shape.states_shards * sr.SHARD_SIZE} samples; their '(walk)' rows are the same export over the "
          "fractions without capture markers.")


if __name__ == "__main__":
    main()
