"""A stand-in, on this CPU machine, for a head host with vLLM's CUDA build and no GPU (where the producer, status,
verify, stats and export run): vLLM's platform detection finds no device there and settles on its own
`UnspecifiedPlatform` (device type ""), so `DeviceConfig()` raises "Failed to infer device type". Measured on
vllm 0.33.0 (CUDA build) without a GPU; here the CPU build's detection is overridden with that same platform
object, before anything of vLLM asks for it. Call it first thing in a process of its own."""

from __future__ import annotations


def install_no_device_platform_stand_in() -> None:
    import vllm.platforms as platforms
    from vllm.platforms.interface import UnspecifiedPlatform

    platforms._current_platform = UnspecifiedPlatform()
