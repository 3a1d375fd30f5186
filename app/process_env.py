"""The environment regen writes, all in this module: each worker child's, and vLLM's in an engine's process.

Rule: configuration reaches a process through its environment only where a child must have it before it
imports anything (the GPUs it may see, the config it is handed, vLLM's switches); everything else is read once
by the child's entry point (app/settings.py lists every variable). Why here: one place to look for what a child
is told, beside the one module that reads the environment, in the base that both the worker's plumbing
(workers/process/supervisor.py) and its engine (workers/engine/in_process.py) import downward.
"""

from __future__ import annotations

import os


def worker_child_env(worker_config: str, visible: str | None, broker_url: str, queues: str,
                     extra: dict | None = None) -> dict:
    """The environment of one `python -m workers.worker_main` child: this process's, plus `extra`, plus what the
    child is handed (its WorkerConfig as JSON, `WorkerConfig.to_env()`; its broker and queues), pinned to
    `visible` GPUs (none: a CPU worker) before anything in it touches CUDA."""
    env = dict(os.environ)
    env.update(extra or {})
    env["REGEN_WORKER_CONFIG"] = worker_config
    env["REGEN_BROKER_URL"] = broker_url
    env["REGEN_QUEUES"] = queues
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["CUDA_VISIBLE_DEVICES"] = "" if visible is None else visible
    return env


def prepare_vllm_env(in_process: bool) -> None:
    """Before this process builds a vLLM engine: the engine core in this process when `in_process` (vLLM reads
    VLLM_ENABLE_V1_MULTIPROCESSING when it builds one), and no usage reports unless the operator asked for them.
    vLLM's own processes inherit this."""
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
