"""Ship `regen-cpu-torchvision-standin.pth` at the top of site-packages (setuptools has no option for a file
there). The .pth names `regen_cpu_torchvision_standin/importable`, which Python appends to sys.path *after*
site-packages, so a real torchvision installed in site-packages is always found first."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "regen-cpu-torchvision-standin.pth"


class BuildWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH),
                       os.path.join(self.build_lib, PTH))


setup(cmdclass={"build_py": BuildWithPth})
