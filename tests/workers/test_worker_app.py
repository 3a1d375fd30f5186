"""The worker's Celery app exists only when an entry point builds it (workers/celery_worker.py): importing any
module builds no app, connects no signal, patches nothing in kombu and writes no environment variable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What a process looks like: Celery apps alive, receivers of the worker's signals, kombu's envelope parser,
# and the variables regen writes (app/base/process_env.py).
PROBE = """
import json, os
from celery import _state, signals
from kombu.transport import redis as kombu_redis
loads = kombu_redis.loads
WRITTEN = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "CUDA_VISIBLE_DEVICES",
           "REGEN_WORKER_CONFIG", "HF_HUB_OFFLINE")
env = {k: os.environ.get(k) for k in WRITTEN}

def probe(**extra):
    receivers = {s.name: len(s.receivers) for s in (signals.worker_process_init, signals.worker_ready,
                                                     signals.worker_shutdown, signals.worker_process_shutdown)}
    print(json.dumps({"apps": len(_state._apps), "receivers": receivers, "kombu_patched": kombu_redis.loads is not loads,
                      "env_changed": [k for k in WRITTEN if os.environ.get(k) != env[k]], **extra}))
"""


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE + code], capture_output=True, text=True, cwd=ROOT, check=True,
                         timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_every_module_builds_no_app_and_connects_nothing():
    seen = _run("""
import importlib, pathlib
names = sorted(".".join(p.with_suffix("").parts).removesuffix(".__init__")
               for package in ("app", "producer", "workers") for p in pathlib.Path(package).rglob("*.py")
               if p.name != "__main__.py")
for name in names:
    importlib.import_module(name)
probe(modules=len(names))
""")
    assert seen["modules"] > 60
    assert seen["apps"] == 0 and set(seen["receivers"].values()) == {0}, seen
    assert not seen["kombu_patched"] and seen["env_changed"] == [], seen


def test_the_entry_points_call_builds_the_app_and_connects_its_signals_once():
    seen = _run("""
from app.base.celery_app import BENCH_DIRECT_TASK, GENERATE_TASK
from app.base.config import Config
from workers.celery_worker import build_worker_app
plain = build_worker_app(Config())
plain_tasks = set(plain.tasks)  # before the second app: Celery shares a task registered later with every app
bench = build_worker_app(Config(bench_tasks=True))
probe(generate=GENERATE_TASK in plain_tasks, bench_plain=BENCH_DIRECT_TASK in plain_tasks,
      bench=BENCH_DIRECT_TASK in bench.tasks, transport=plain.conf.broker_transport)
""")
    assert seen["generate"] and seen["bench"] and not seen["bench_plain"], seen
    assert seen["apps"] == 2 and seen["receivers"] == {"worker_process_init": 1, "worker_ready": 2,
                                                       "worker_shutdown": 1, "worker_process_shutdown": 1}, seen
    assert seen["kombu_patched"] and seen["transport"] == "workers.process.message_guard:Transport", seen
