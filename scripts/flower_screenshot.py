"""Regenerate docs/img/flower-broker.png: Flower's Broker page over a real backlog, shot by headless Chromium.

    python scripts/flower_screenshot.py [--out docs/img/flower-broker.png] [--chromium chromium]

What it does, all with real parts: a private `redis-server` on a free port (nothing persisted), a config-only
model folder (the producer reads no weights), `produce` of three runs as `regen produce` would (one to the
default `regen` queue, one staged-capture run whose captures are sent to `regen.capture`, one produced to a queue
of its own, `team-b.regen`), Flower started as compose.yaml starts it (`celery -A app.ops.flower flower`, here
without a login, on 127.0.0.1 only), then `chromium --headless --screenshot` of `/broker`. Everything it starts
is stopped and its temporary folder removed at the end.

Needs Debian's `chromium` (`apt-get install chromium`); the tests and CI do not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"no answer from {url} in {timeout:.0f}s")


def make_backlog(work: Path, broker: str) -> dict[str, int]:
    """Three runs' shards waiting in Redis as the producer leaves them; {queue: messages}."""
    from app.celery_app import create_app
    from app.manifest import load
    from app.settings import BrokerSettings
    from app.storage import RunStore, Storage
    from producer.produce import produce, send_captures
    from producer.run_setup import ProduceOptions

    model = work / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 64,
                                                   "hidden_size": 5120}))
    storage = str(work / "store")
    results = {}
    for run_id, rows, kw in (("qwen36-dflash", 120, {}), ("qwen36-eagle3", 48, {"capture": "staged"}),
                             ("team-b-eval", 36, {"queue": "team-b.regen"})):
        rows_path = work / f"{run_id}.jsonl"
        rows_path.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"{run_id} {i}"},
                                                                   {"from": "gpt", "value": "-"}]}) + "\n"
                                     for i in range(rows)))
        results[run_id] = produce(ProduceOptions(inputs=[str(rows_path)], run_id=run_id, storage=storage,
                                                 model=str(model), broker=broker, shard_size=4, **kw))
    store = RunStore(Storage(storage), "qwen36-eagle3")
    app = create_app(BrokerSettings(url=broker))
    send_captures(store, app, results["qwen36-eagle3"].storage_url, load(store)["settings"],
                  [f"shard-{i:06d}" for i in range(5)])
    app.close()
    import redis

    client = redis.Redis.from_url(broker)
    return {q: client.llen(q) for q in ("regen", "regen.capture", "team-b.regen")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "img" / "flower-broker.png"))
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    parser.add_argument("--size", default="1100,420", help="window width,height in pixels")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="regen-flower-shot-"))
    procs = []
    try:
        redis_port, flower_port = free_port(), free_port()
        procs.append(subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                                       "--save", "", "--appendonly", "no", "--dir", str(work)],
                                      stdout=subprocess.DEVNULL))
        broker = f"redis://127.0.0.1:{redis_port}/0"
        deadline = time.monotonic() + 20
        while subprocess.run(["redis-cli", "-p", str(redis_port), "ping"], capture_output=True).stdout != b"PONG\n":
            if time.monotonic() > deadline:
                raise SystemExit("redis-server did not start")
            time.sleep(0.1)
        print("backlog:", make_backlog(work, broker))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "FLOWER_"))}
        env.update(REGEN_BROKER_URL=broker, PYTHONPATH=str(REPO))
        procs.append(subprocess.Popen([sys.executable, "-m", "celery", "-A", "app.ops.flower", "flower",
                                       f"--port={flower_port}", "--address=127.0.0.1"], cwd=REPO, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{flower_port}/broker"
        wait_http(url)
        out = Path(args.out).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([args.chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={work / 'chromium'}", f"--window-size={args.size}",
                        f"--screenshot={out}", url], check=True, capture_output=True, timeout=120)
        print(f"wrote {out} ({out.stat().st_size} bytes)")
        return 0
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
