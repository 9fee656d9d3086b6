"""The examples a user copies must keep running: each takes a store URL, or writes a scratch store it removes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from routelog.extras import VERL_INSTALL
from tests.not_installed import run_without

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, tmp_path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """Run an example in a fresh interpreter (as a user does: warnings shown), with its temporary folder under
    ``tmp_path``; it must succeed and leave nothing there."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not any(scratch.glob("routelog-*")), f"{script} left {list(scratch.iterdir())} in the temporary folder"
    return result


def test_store_quickstart(tmp_path: Path) -> None:
    out = _run("store_quickstart.py", tmp_path, str(tmp_path / "store"), timeout=120).stdout
    assert "req-3/0 (130, 6, 6) global layers (6, 7, 8, 9, 10, 11) missing rows 1" in out
    assert (tmp_path / "store").is_dir(), "a store URL given is where the example writes"


def test_ingest_engines(tmp_path: Path) -> None:
    out = _run("ingest_engines.py", tmp_path, str(tmp_path / "store"), timeout=120).stdout
    assert "cmpl-1 vllm (20, 4, 4) layers (2, 3, 4, 5) missing rows 1" in out
    assert "rid-1 sglang (20, 4, 4) layers (2, 3, 4, 5) missing rows 1" in out


def test_megatron_replay(tmp_path: Path) -> None:
    result = _run("megatron_replay.py", tmp_path)
    assert "micro-batch 0: 31 rows x 3 routers replayed (29 recorded" in result.stdout
    assert "UserWarning" not in result.stderr, "megatron-core's CPU warnings are filtered"


def test_r3_on_cpu(tmp_path: Path) -> None:
    assert "with R3: router diff 0.00%" in _run("r3_on_cpu.py", tmp_path, str(tmp_path / "store")).stdout


@pytest.mark.verl
def test_verl_r3(tmp_path: Path) -> None:
    pytest.importorskip("verl")
    out = _run("verl_r3.py", tmp_path).stdout
    assert "the batch now carries ['routelog_sample_id', 'uid'] and no routed_experts" in out
    assert out.count("every routed token took its rollout experts") == 2
    assert "router diff published for step 1 (random routes on a random model" in out


def test_slime_r3(tmp_path: Path) -> None:
    out = _run("slime_r3.py", tmp_path).stdout
    assert "every rank's routers pop what slime's own replay would have recorded" in out


def test_nemo_rl_r3(tmp_path: Path) -> None:
    out = _run("nemo_rl_r3.py", tmp_path).stdout
    assert "routers selected the recorded experts on every replayed row" in out


OPTIONAL = ("torch", "megatron", "transformers", "safetensors", "verl", "tensordict", "matplotlib", "ray", "s3fs")
"""Top-level packages of routelog's extras (routelog.extras.EXTRAS): what a user may not have installed."""


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_names_the_install_command_of_what_it_lacks(script: str, tmp_path: Path) -> None:
    """Without the optional packages an example either runs (it needs none) or ends at once with one line naming
    what is missing and the command installing it; never a ModuleNotFoundError traceback after loading the rest."""
    result = run_without(OPTIONAL, str(EXAMPLES / script), tmp_path=tmp_path)
    if result.returncode == 0:
        return  # the core's examples need nothing optional
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith(f"error: examples/{script} needs ") and "pip install 'routelog[" in lines[0], lines


def test_an_example_needing_verl_names_its_install_line(tmp_path: Path) -> None:
    result = run_without(("verl",), str(EXAMPLES / "verl_r3.py"), tmp_path=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == f"error: examples/verl_r3.py needs verl, not installed: {VERL_INSTALL}"
