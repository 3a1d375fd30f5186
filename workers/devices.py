"""Which devices a host has, what class each is, and the engine presets for that class.

Detection uses `nvidia-smi` (no CUDA initialisation in the supervisor, so each child pins its own GPU with
CUDA_VISIBLE_DEVICES before anything touches CUDA). Every preset value can be overridden on the command line.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    index: str  # "cpu" or the GPU index as nvidia-smi numbers it
    name: str
    device_class: str  # cpu, sm_90, sm_100, sm_120, sm_other


# max_num_seqs, gpu_memory_utilization, enforce_eager, in_process engine core
PRESETS: dict[str, dict] = {
    "cpu": {"max_num_seqs": 64, "gpu_memory_utilization": 0.1, "enforce_eager": True, "in_process": True},
    "sm_90": {"max_num_seqs": 256, "gpu_memory_utilization": 0.90, "enforce_eager": False, "in_process": False},
    "sm_100": {"max_num_seqs": 512, "gpu_memory_utilization": 0.92, "enforce_eager": False, "in_process": False},
    "sm_120": {"max_num_seqs": 128, "gpu_memory_utilization": 0.90, "enforce_eager": False, "in_process": False},
    "sm_other": {"max_num_seqs": 128, "gpu_memory_utilization": 0.88, "enforce_eager": False, "in_process": False},
}


def classify(compute_cap: str) -> str:
    major = compute_cap.split(".")[0].strip()
    return {"9": "sm_90", "10": "sm_100", "12": "sm_120"}.get(major, "sm_other")


def detect_gpus() -> list[Device]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    devices = []
    for line in out.strip().splitlines():
        idx, name, cap = (p.strip() for p in line.split(",", 2))
        devices.append(Device(idx, name, classify(cap)))
    return devices


def preset_for(device_class: str, overrides: dict) -> dict:
    values = dict(PRESETS.get(device_class, PRESETS["sm_other"]))
    values.update({k: v for k, v in overrides.items() if v is not None})
    return values
