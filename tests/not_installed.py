"""Run a script or ``-m module`` in a fresh interpreter where some packages cannot be imported, as if a user had
not installed them (their import, and ``importlib.util.find_spec``, raise ``ModuleNotFoundError``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_LAUNCHER = """
import importlib.abc, runpy, sys
blocked = set(sys.argv[1].split(","))
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NotInstalled())
if sys.argv[2] == "-m":
    sys.argv = sys.argv[3:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_without(
    blocked: tuple[str, ...], *argv: str, tmp_path: Path, timeout: int = 120
) -> subprocess.CompletedProcess[str]:
    """``python argv...`` (a script path and its arguments, or ``-m module ...``) with ``blocked`` packages missing."""
    return subprocess.run(
        [sys.executable, "-c", _LAUNCHER, ",".join(blocked), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        cwd=tmp_path,
    )
