"""The compiled codec kernels (routelog/format/_ckernels.c), built from source by pip with the machine's compiler.

``optional``: where no compiler is found the package still installs, and routelog.format.kernels uses the numpy
kernels (same results, slower). Everything else is configured in pyproject.toml.
"""

import sys

from setuptools import Extension, setup

# No fused multiply-adds: the encoder's estimates must round alike on every machine so every build writes the
# same bytes (routelog/format/_ckernels.c).
FLAGS = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-std=c11"]

setup(
    ext_modules=[
        Extension("routelog.format._ckernels", ["routelog/format/_ckernels.c"], extra_compile_args=FLAGS, optional=True)
    ]
)
