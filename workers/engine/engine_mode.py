"""The mode an engine runs in, read from the built engine (not from what regen asked for), for every attempt record.

Why: the engine path the tests run is not the users'. vLLM 0.32 on these CPUs runs its V1 model runner, no async
scheduling, chunked prefill off, eager; on a GPU host the same vLLM runs the V2 runner (wherever Triton works and
the features allow: `VllmConfig.use_v2_model_runner`), async scheduling, chunked prefill with a token budget,
CUDA graphs and torch.compile. Wrong states have come from exactly these differences upstream, so each sample's
attempt says which path made it, and `regen stats` / `regen verify` count samples and capture checks per mode:
two hosts (an sm_120 and an sm_100) or two vLLM versions are compared on the run's own data.

`held_mode(llm)` runs on the engine thread (`Engine.call`, also in a CPU worker's engine process); the device's
name, compute capability, driver and CUDA versions are read there too, where the engine's device is visible.
`mode_key` is the short label the counts are grouped by.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import subprocess

from app.base.library_patches import vllm_fixes


def held_mode(llm) -> dict:
    """The engine's mode as its own VllmConfig holds it, with the versions and the device (see the module)."""
    import torch
    import vllm

    cfg = llm.llm_engine.vllm_config
    sched, cache, comp, par = cfg.scheduler_config, cfg.cache_config, cfg.compilation_config, cfg.parallel_config
    runner = getattr(cfg, "use_v2_model_runner", None)
    if callable(runner):
        runner = runner()
    mode = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "model_runner": "unknown" if runner is None else ("V2" if runner else "V1"),
        "async_scheduling": bool(getattr(sched, "async_scheduling", False)),
        "chunked_prefill": bool(_first(sched, "enable_chunked_prefill", "chunked_prefill_enabled")),
        "max_num_batched_tokens": _int(getattr(sched, "max_num_batched_tokens", None)),
        "max_num_seqs": _int(getattr(sched, "max_num_seqs", None)),
        "prefix_caching": bool(getattr(cache, "enable_prefix_caching", False)),
        "enforce_eager": bool(getattr(cfg.model_config, "enforce_eager", False)),
        "compile_mode": _name(_first(comp, "mode", "level")),
        "cudagraph_mode": _name(getattr(comp, "cudagraph_mode", None)),
        "tensor_parallel_size": _int(getattr(par, "tensor_parallel_size", 1)),
        "dtype": _name(getattr(cfg.model_config, "dtype", None)),
        "fixes": vllm_fixes(),  # regen's fixes to this vLLM in the engine's process (app.base.library_patches)
    }
    mode.update(device_facts())
    return mode


def device_facts() -> dict:
    """The device an engine runs on: name, compute capability, driver and CUDA versions (None where none)."""
    import torch

    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return {"device": "cuda", "device_name": torch.cuda.get_device_name(index),
                "compute_capability": f"{major}.{minor}", "cuda": torch.version.cuda, "driver": _nvidia_driver()}
    return {"device": "cpu", "device_name": _cpu_name(), "compute_capability": None, "cuda": None, "driver": None}


def mode_key(mode: dict | None) -> str:
    """The short label samples are counted by: `sm_120 vLLM 0.33.0 V2 async chunked:8192 cudagraph:FULL tp1`,
    `cpu vLLM 0.32.0 V1 sync unchunked eager tp1`; prefix caching is named only where it is on."""
    if not mode or "error" in mode:
        return "unknown"
    cap = mode.get("compute_capability")
    device = f"sm_{cap.replace('.', '')}" if cap else mode.get("device") or "unknown"
    chunked = f"chunked:{mode.get('max_num_batched_tokens')}" if mode.get("chunked_prefill") else "unchunked"
    graphs = ("eager" if mode.get("enforce_eager") or mode.get("cudagraph_mode") in (None, "NONE")
              else f"cudagraph:{mode.get('cudagraph_mode')}")
    parts = [device, f"vLLM {mode.get('vllm')}", mode.get("model_runner") or "unknown",
             "async" if mode.get("async_scheduling") else "sync", chunked, graphs]
    if mode.get("prefix_caching"):
        parts.append("prefix-cache")
    parts.append(f"tp{mode.get('tensor_parallel_size') or 1}")
    return " ".join(str(p) for p in parts)


def _first(obj, *names):
    for name in names:
        if hasattr(obj, name):
            return getattr(obj, name)
    return None


def _name(value) -> str | None:
    if value is None:
        return None
    return str(getattr(value, "name", value)).removeprefix("torch.")


def _int(value) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _nvidia_driver() -> str | None:
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    with contextlib.suppress(Exception):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    return None


def _cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def read_mode(engine) -> dict:
    """`held_mode` of a built engine (`Engine.call`); an engine that cannot say (one without vLLM's config) gets
    `{"model_runner": "unknown", "error": ...}`, which `mode_key` labels "unknown", rather than no record."""
    try:
        return engine.call(held_mode)
    except Exception as exc:  # noqa: BLE001 - an engine without a VllmConfig still runs; its mode is unknown
        logging.getLogger("regen.engine").warning("engine mode unreadable: %r", exc)
        return {"model_runner": "unknown", "error": f"{type(exc).__name__}: {exc}"}
