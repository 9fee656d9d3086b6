"""The compiled kernels, built from source by pip with the machine's compiler: the codec's
(routelog/format/_ckernels.c), the bounded Parquet reader's Thrift walks (routelog/format/_cthrift.c) and the
audits' (routelog/audit/_ckernels.c).

``optional``: where no compiler is found the package still installs, and routelog.format.kernels and
routelog.audit.kernels use numpy, routelog.format.parquet_limits its Python reader (same results, slower).
Everything else is configured in pyproject.toml.
"""

import sys

from setuptools import Extension, setup

# No fused multiply-adds: the encoder's estimates must round alike on every machine so every build writes the
# same bytes (routelog/format/_ckernels.c).
FLAGS = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-std=c11"]

setup(
    ext_modules=[
        Extension(name, [f"{name.replace('.', '/')}.c"], extra_compile_args=FLAGS, optional=True)
        for name in (
            "routelog.format._ckernels",
            "routelog.format._ccontext",
            "routelog.format._cthrift",
            "routelog.format._cpositions",
            "routelog.audit._ckernels",
        )
    ]
)
