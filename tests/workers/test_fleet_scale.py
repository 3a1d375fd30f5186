"""bench/bench_fleet_scale.py in small: the real producer, Redis, `regen worker` processes with engines standing in
for GPUs (workers/doubles/stand_in.py), and storage, with one host SIGKILLed at the run's tail.

What it holds the harness to: every sample the producer enqueued is in exactly one record of a published shard
(nothing lost, nothing duplicated, the killed host's shards re-sent and finished by the other), and the storage
operations the processes counted (app/base/storage_counts.py) agree with what the storage holds at the end: as many
records files and completion markers as were renamed and linked into place (less those a lost race removed),
with the counted bytes, and a rename and an fsync for every local write. A few hundred shards of 8 samples with
short outputs keep it to about a minute.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys

import pytest

from tests.support.paths import REPO

SHARDS, SHARD_SIZE, MAX_TOKENS = 240, 8, 2048


def _harness():
    spec = importlib.util.spec_from_file_location("bench_fleet_scale", REPO / "bench" / "bench_fleet_scale.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(400)
def test_small_fleet_accounts_for_every_sample_and_its_storage_counts(tmp_path):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed")
    h = _harness()
    samples = SHARDS * SHARD_SIZE
    files = h.write_prompts(tmp_path / "prompts", samples)
    model = h.write_model(tmp_path / "model")
    redis = h.RedisServer(tmp_path / "redis")
    lines = []
    try:
        run = h.run_fleet(tmp_path, files, str(tmp_path / "storage"), model, redis, samples=samples, workers=2,
                          hosts=2, scale=5, rate=11_500, max_pending=40, kill_host=True, seqs=64, idle_window=2,
                          shard_size=SHARD_SIZE, max_tokens=MAX_TOKENS, timeout=300, log=lines.append,
                          fractions=(0.5, 1.0))
    finally:
        redis.stop()
    h.report(run, None, out=lines.append)
    text = "\n".join(lines)

    # Every sample once: as many records as enqueued, no sample id twice, every shard published.
    v = run.verify
    assert v["expected"] == samples and v["enqueued"] == samples, text
    assert v["records"] == v["unique"] == samples and v["duplicated"] == 0, text
    assert v["markers"] == SHARDS == run.checkpoints[-1].shards, text
    # The killed host held shards; each was re-sent to the other host and finished.
    assert run.reclaim is not None and run.reclaim["held"], text
    assert set(run.reclaim["resent"]) == set(run.reclaim["held"]) and "done_s" in run.reclaim, text

    # Counted operations against the files on storage.
    counted = h.read_counts(tmp_path / "storage-counts")  # every process's, once all have stopped
    seen = run.seen_by_storage
    lost = counted.get("delete:records", 0)  # a lost race (or a failed write) removes its records file
    # (a records file the killed host renamed into place before it could mark its shard stays, unreferenced)
    assert counted["rename:records"] - lost == seen["files:records"] >= SHARDS, text
    assert counted["link:done"] - lost == seen["files:done"] == SHARDS, text
    # A records file or marker whose write was counted but whose rename or link was not: the killed host died
    # between the two, so its bytes were written to a temporary that never became the file.
    unplaced = counted["write:records"] - counted["rename:records"] + counted["write:done"] - counted["link:done"]
    assert 0 <= unplaced <= 2 * run.workers, text
    if not lost and not unplaced:
        assert counted["bytes_written:records"] == seen["bytes:records"], text
        assert counted["bytes_written:done"] == seen["bytes:done"], text
    else:
        assert counted["bytes_written:records"] >= seen["bytes:records"], text
        assert counted["bytes_written:done"] >= seen["bytes:done"], text
    assert counted["bytes_written:produce.json"] >= seen["bytes:produce.json"] > 0
    # Local: every write is fsynced and put in place by a rename or a link; the killed host's processes may each
    # have died between the two.
    killed = 2 * run.workers
    assert 0 <= counted["write"] - counted["fsync"] <= killed, text
    assert 0 <= counted["write"] - counted["rename"] - counted["link"] <= killed, text
    assert seen["files:attempts"] >= SHARDS and counted["rename:attempts"] >= seen["files:attempts"], text
    # The report's per-shard rows are the counts divided by the shards done.
    rows = {name: windows for name, windows, _ in h.per_shard_rows(run)}
    cps = run.checkpoints
    assert rows["storage write"][-1] == pytest.approx(
        (cps[-1].storage["write"] - cps[-2].storage.get("write", 0)) / (cps[-1].shards - cps[-2].shards)), text
    assert cps[-1].storage["write"] <= counted["write"]
    json.dumps(h.to_json(run), default=str)  # what --json writes
