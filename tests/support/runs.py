"""Helpers for end-to-end tests: produce a run through the real CLI and wait for its shards on storage."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from app.base.hidden_file import HiddenFileReader
from app.base.jsonl_zst import loads_jsonl_zst
from app.base.storage import RunStore, Storage
from app.cli import main
from tests.support.paths import FORMATS_DIR
from tests.support.polling import wait_for
from tests.support.redis_db import E2E_BROKER
from tests.support.workers import E2E_LAYERS


def prompts_file(folder: Path, n_synthetic: int = 6, with_formats: bool = True) -> Path:
    """One row of every dataset shape (tests/fixtures/formats) plus a few short single-turn prompts."""
    path = folder / "prompts.jsonl"
    lines = []
    if with_formats:
        for f in sorted(FORMATS_DIR.glob("*.jsonl")):
            lines += [ln for ln in f.read_text().splitlines() if ln.strip()]
    lines += [json.dumps({"question": f"What is {i} times {i + 1}? Show your work."}) for i in range(n_synthetic)]
    path.write_text("\n".join(lines) + "\n")
    return path


def produce(storage: Path, run_id: str, inputs: list[Path], model: Path, *extra: str, queue: str = "regen",
            broker: str = E2E_BROKER) -> dict:
    args = ["produce", *map(str, inputs), "--run", run_id, "--storage", str(storage), "--model", str(model),
            "--broker", broker, "--queue", queue, "--max-tokens", "24",
            "--shard-size", "4", *extra]
    if "--layers" not in extra:
        args += ["--layers", E2E_LAYERS]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads((storage / run_id / "produce.json").read_text())


def wait_run_done(storage: Path, run_id: str, timeout: float = 180, marker: str = "done") -> list[str]:
    store = RunStore(Storage(str(storage)), run_id)
    shards = json.loads((storage / run_id / "produce.json").read_text())["counts"]["shards"]

    markers = store.done_shards if marker == "done" else store.captured_shards

    def finished():  # marker sets, not raw listings: a marker being created has a temporary name beside it
        names = markers()
        return sorted(names) if len(names) >= shards else None

    return wait_for(finished, timeout, f"{shards} {marker} markers of run {run_id}")


def wait_run_done_after_kills(storage: Path, run_id: str, broker: str = E2E_BROKER, queue: str = "regen",
                              timeout: float = 300) -> list[str]:
    """`wait_run_done` for a run whose worker was SIGKILLed; returns the shards `regen reconcile` had to re-send.

    kombu's Redis transport pops a message (BRPOP) and records it in its unacked hash only afterwards, in the
    consumer: a worker SIGKILLed between the two loses that message from Redis for good, and nothing restores it.
    Storage still shows the shard undone, and `regen reconcile` (storage is the record of what is done) is the
    documented recovery. It is run here only for what that window explains: Redis holds nothing (queue and
    unacked hash empty), so nothing is coming back, and the undone shards were never attempted. Every other
    shard must come back and complete on its own.
    """
    import redis

    from app.base.ids import shard_id

    store = RunStore(Storage(str(storage)), run_id)
    n_shards = json.loads((storage / run_id / "produce.json").read_text())["counts"]["shards"]
    client = redis.Redis.from_url(broker)
    reconciled: list[str] = []

    def finished():
        undone = {shard_id(i) for i in range(n_shards)} - store.done_shards()
        if not undone:
            return True
        lost = not client.llen(queue) and not client.hlen("unacked") and not any(
            store.storage.listdir(store.attempts_dir(s)) for s in undone)
        if lost and not reconciled:
            result = CliRunner().invoke(main, ["reconcile", run_id, "--storage", str(storage), "--broker", broker,
                                               "--queue", queue], catch_exceptions=False)
            assert result.exit_code == 0, result.output
            reconciled.extend(sorted(undone))
            print(f"[{run_id}] lost in kombu's fetch window, re-sent by reconcile: {reconciled}")
        return False

    wait_for(finished, timeout, f"{n_shards} done markers of run {run_id}", interval=1.0)
    return reconciled


def run_records(storage: Path, run_id: str) -> list[dict]:
    store = RunStore(Storage(str(storage)), run_id)
    out = []
    for shard in sorted(store.done_shards()):
        marker = store.done_marker(shard)
        out += loads_jsonl_zst(store.storage.read_bytes(marker["files"]["records"]["path"]))
    return out


def run_states(storage: Path, run_id: str, staged: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """sample_id -> (token_ids, states) from every shard's hidden file (inline, or the staged capture's)."""
    store = RunStore(Storage(str(storage)), run_id)
    out = {}
    for shard in sorted(store.done_shards()):
        if staged:
            path = store.storage.read_json(store.captured_path(shard))["hidden"]["path"]
        else:
            path = store.done_marker(shard)["files"]["hidden"]["path"]
        with store.storage.open(path) as fh:
            reader = HiddenFileReader(fh)
            for i, entry in enumerate(reader.entries):
                out[entry["sample_id"]] = reader.read(i)
    return out
