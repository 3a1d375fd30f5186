"""Not torchvision: regen's CPU-only import stand-in (see regen_cpu_torchvision_standin). Everything here fails
when used."""

from regen_cpu_torchvision_standin import module_getattr, refuse_beside_real_torchvision

refuse_beside_real_torchvision()
__version__ = "0.0.0+regen.cpu.standin"  # no real torchvision reports this
__getattr__ = module_getattr(__name__)
