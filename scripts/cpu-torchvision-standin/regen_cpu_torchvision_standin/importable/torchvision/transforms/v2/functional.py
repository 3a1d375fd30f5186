"""Not torchvision: regen's CPU-only import stand-in; every name fails when used."""

from regen_cpu_torchvision_standin import module_getattr

__getattr__ = module_getattr(__name__)
