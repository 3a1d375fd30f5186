"""Regenerate docs/img/flower-broker.png: Flower's Broker page over a real backlog, shot by headless Chromium.

    python scripts/flower_screenshot.py [--out docs/img/flower-broker.png] [--chromium chromium]
    FLOWER_BASIC_AUTH=user:password python scripts/flower_screenshot.py --url http://127.0.0.1:5555/broker \
        --out docs/img/flower-broker-compose.png

With `--url`, it shoots a Flower that already runs (compose's: scripts/compose_check.py does this) instead of
starting one: the login comes from FLOWER_BASIC_AUTH, never argv, and reaches Flower through a proxy on
127.0.0.1 that adds the Authorization header, so Chromium's command line holds no password.

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
    from app.base.celery_app import create_app
    from app.base.config import BrokerConfig
    from app.base.manifest import load
    from app.base.storage import RunStore, Storage
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
    app = create_app(BrokerConfig(url=broker))
    send_captures(store, app, results["qwen36-eagle3"].storage_url, load(store)["settings"],
                  [f"shard-{i:06d}" for i in range(5)])
    app.close()
    import redis

    client = redis.Redis.from_url(broker)
    return {q: client.llen(q) for q in ("regen", "regen.capture", "team-b.regen")}


def shoot(chromium: str, url: str, out: Path, size: str, profile: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--user-data-dir={profile}", f"--window-size={size}", f"--screenshot={out}", url],
                   check=True, capture_output=True, timeout=120)
    print(f"wrote {out} ({out.stat().st_size} bytes)")


def shoot_running(args) -> int:
    """Shoot `args.url` of a running Flower through a local proxy that adds the login from FLOWER_BASIC_AUTH."""
    import base64
    import threading
    import urllib.error
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import urlsplit

    target = urlsplit(args.url)
    origin = f"{target.scheme}://{target.netloc}"
    login = os.environ.get("FLOWER_BASIC_AUTH", "")
    header = "Basic " + base64.b64encode(login.encode()).decode() if login else None

    class Proxy(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            req = urllib.request.Request(origin + self.path)
            if header:
                req.add_header("Authorization", header)
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    code, body, ctype = r.status, r.read(), r.headers.get("Content-Type", "text/html")
            except urllib.error.HTTPError as e:
                code, body, ctype = e.code, e.read(), e.headers.get("Content-Type", "text/plain")
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    work = Path(tempfile.mkdtemp(prefix="regen-flower-shot-"))
    try:
        local = f"http://127.0.0.1:{server.server_port}{target.path or '/'}"
        wait_http(local)
        shoot(args.chromium, local, Path(args.out).resolve(), args.size, work / "chromium")
        return 0
    finally:
        server.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "img" / "flower-broker.png"))
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    parser.add_argument("--size", default="1100,420", help="window width,height in pixels")
    parser.add_argument("--url", default=None,
                        help="shoot this page of a running Flower (login from FLOWER_BASIC_AUTH) instead of one started here")
    args = parser.parse_args()
    if args.url:
        return shoot_running(args)

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
        shoot(args.chromium, url, Path(args.out).resolve(), args.size, work / "chromium")
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
