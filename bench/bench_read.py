"""Random-access read speed of hidden states: regen's shard files vs one safetensors file per sample.

Why: the shard format (app/base/hidden_file.py) trades decode work (zstd of the high bytes) for ~1.45x less disk.
A trainer reads samples in random order, so what matters is samples/s through `RegenDataset` compared with
the per-sample safetensors layout vLLM's extraction writes (and `regen export --format speculators` makes).

One command, synthetic data of realistic size (default 256 samples x 1024 tokens x 5 layers x 1024 hidden,
bf16: 10 MiB raw per sample), both layouts written in the same run, the same random sample order read from
each. "cold" passes first drop the files from the page cache with posix_fadvise(DONTNEED) (our own files
only); "warm" passes read them again from memory.

    python bench/bench_read.py [--samples 256 --tokens 1024 --layers 5 --hidden 1024 --reads 128]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.base.hidden_file import encode_sample, float32_to_bf16
from app.base.records import loss_mask
from app.base.storage import RunStore, Storage
from app.data.export_speculators import safetensors_bytes
from workers.shard.shard_output import publish_shard


def write_run(root: Path, args) -> tuple[list[Path], list[Path]]:
    """The same states as regen shards (publish_shard) and as per-sample safetensors files."""
    storage = Storage(str(root / "storage"))
    store = RunStore(storage, "bench")
    layers = list(range(1, args.layers + 1))
    storage.write_json(store.manifest_path, {
        "format": "regen.run/1", "run_id": "bench", "counts": {"shards": args.samples // args.shard_size},
        "settings": {"capture_mode": "inline", "layers": {"vllm_ids": layers}, "shard_size": args.shard_size,
                     "model": {"hidden_size": args.hidden}}})
    st_dir = root / "safetensors"
    st_dir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    per_sample = []
    for s in range(args.samples // args.shard_size):
        records, encoded = [], []
        for k in range(args.shard_size):
            i = s * args.shard_size + k
            ids = rng.integers(0, 150_000, args.tokens + 1).tolist()
            # Activations: a per-channel scale (some channels much larger, as in real models) times noise.
            scale = np.exp(rng.standard_normal((1, args.layers, args.hidden), dtype=np.float32))
            states = float32_to_bf16(rng.standard_normal((args.tokens, args.layers, args.hidden),
                                                         dtype=np.float32) * scale)
            sid = f"{i:016x}"
            n_prompt = args.tokens // 4
            records.append({"run_id": "bench", "shard_id": f"shard-{s:06d}", "sample_id": sid, "index": k,
                            "status": "ok", "input_ids": ids, "loss_mask": loss_mask(n_prompt, len(ids) - n_prompt),
                            "num_prompt_tokens": n_prompt, "num_output_tokens": len(ids) - n_prompt,
                            "hidden": {"index": k, "n_tokens": args.tokens, "layers": layers}})
            tokens = np.asarray(ids[:-1], dtype=np.int64)
            encoded.append(encode_sample(sid, tokens, states, layers, level=3))
            path = st_dir / f"{sid}.safetensors"
            path.write_bytes(safetensors_bytes({"hidden_states": ("BF16", states.shape, states.tobytes()),
                                                "token_ids": ("I64", tokens.shape, tokens.tobytes())}))
            per_sample.append(path)
        publish_shard(store, f"shard-{s:06d}", f"a{s}", records, encoded, {"samples": args.shard_size,
                                                                            "ok": args.shard_size})
    shard_files = sorted((root / "storage" / "bench" / "shards").rglob("*.hidden.rgh"))
    return shard_files, per_sample


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def time_reads(fn, order: list[int]) -> float:
    t0 = time.perf_counter()
    for i in order:
        fn(i)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--shard-size", type=int, default=64)
    ap.add_argument("--reads", type=int, default=128, help="random reads per pass")
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed after)")
    args = ap.parse_args()
    import torch
    from safetensors.torch import load_file

    from app.data.dataset import RegenDataset

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-read-"))
    try:
        t0 = time.perf_counter()
        shard_files, per_sample = write_run(root, args)
        raw = args.tokens * args.layers * args.hidden * 2
        shard_bytes = sum(p.stat().st_size for p in shard_files)
        st_bytes = sum(p.stat().st_size for p in per_sample)
        print(f"wrote {args.samples} samples ({raw / 2**20:.1f} MiB raw each) in {time.perf_counter() - t0:.1f}s: "
              f"shards {shard_bytes / 2**30:.2f} GiB, safetensors {st_bytes / 2**30:.2f} GiB "
              f"(disk ratio {st_bytes / shard_bytes:.2f}x)")
        ds = RegenDataset(str(root / "storage"), "bench")
        order = np.random.default_rng(1).permutation(args.samples)[: args.reads].tolist()

        def read_shard(i: int) -> torch.Tensor:
            return ds[i]["hidden_states"]

        def read_st(i: int) -> torch.Tensor:
            # clone(): load_file may hand back memory-mapped pages; a trainer touches every byte anyway.
            return load_file(str(per_sample[i]))["hidden_states"].clone()

        assert torch.equal(read_shard(order[0]).view(torch.int16), read_st(order[0]).view(torch.int16))
        results = {}
        for cache in ("cold", "warm"):
            for name, fn, files in (("regen shards", read_shard, shard_files), ("safetensors", read_st, per_sample)):
                if cache == "cold":
                    drop_cache(files)
                    ds.reader.close()
                secs = time_reads(fn, order)
                results[(cache, name)] = secs
                print(f"{cache:4s} {name:13s} {args.reads / secs:8.1f} samples/s  "
                      f"{args.reads * raw / secs / 2**20:8.1f} MiB/s (decoded bf16)")
        for cache in ("cold", "warm"):
            ratio = results[(cache, "safetensors")] / results[(cache, "regen shards")]
            print(f"{cache}: regen shards read at {ratio:.2f}x the speed of per-sample safetensors")
        print(f"total {time.perf_counter() - t0:.1f}s")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
