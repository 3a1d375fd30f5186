"""The environment regen writes, all in this module: each worker child's, and vLLM's in an engine's process.

Rule: configuration reaches a process through its environment only where a child must have it before it
imports anything (the GPUs it may see, the config it is handed, vLLM's switches); everything else is read once
by the child's entry point (app.base.config lists every variable). Why here: one place to look for what a child
is told, beside the one module that reads the environment, in the base that both the worker's plumbing
(workers.process.supervisor) and its engine (workers.engine.in_process) import downward.
"""

from __future__ import annotations

import os


def worker_child_env(worker_config: str, visible: str | None, broker_url: str, queues: str,
                     extra: dict | None = None, name: str | None = None) -> dict:
    """The environment of one `python -m workers.worker_main` child: this process's, plus `extra`, plus what the
    child is handed (its WorkerConfig as JSON, `WorkerConfig.to_env()`; its broker and queues), pinned to
    `visible` GPUs (none: a CPU worker) before anything in it touches CUDA. `name` (the worker's name on its
    host) gives the child a vLLM cache of its own (`own_vllm_cache`)."""
    env = dict(os.environ)
    env.update(extra or {})
    if name:
        env["VLLM_CACHE_ROOT"] = own_vllm_cache(env, name)
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


def own_vllm_cache(env: dict, name: str) -> str:
    """The vLLM cache folder of the worker called `name` on this host: `regen-{name}` under the operator's
    `VLLM_CACHE_ROOT` (default `~/.cache/vllm`, vLLM's).

    Why one per worker: workers that `regen worker` starts together on one host build their engines at the same
    moment, and vLLM's torch.compile cache (`torch_compile_cache/` under that root) is written without a lock;
    jobs started at once corrupted it (datatrove's inference runner takes a file lock around it for that
    reason). A lock would serialise the engines' builds, and with them the loading of each GPU's copy of the
    weights, minutes each at a real model's size; a folder per worker lets them build side by side, costs one
    compilation per worker (done in parallel, so no longer in wall time than one) and some disk, and the name
    being stable (gpu0@host, gpu1@host, ...) lets a restarted worker find its own compiled graphs again (docs/workers.md)."""
    root = env.get("VLLM_CACHE_ROOT") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "vllm")
    safe = "".join(c if c.isalnum() or c in "-_.@" else "_" for c in name)
    return os.path.join(root, f"regen-{safe}")


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment plus `extra`, for a child process a command starts (the self-check's engines)."""
    return {**os.environ, **extra}
