"""The examples a user copies must keep running."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str, timeout: int = 300) -> str:
    """Run an example in a fresh interpreter; its stdout (it must succeed)."""
    result = subprocess.run(
        [sys.executable, "-W", "ignore", str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_store_quickstart(tmp_path: Path) -> None:
    out = _run("store_quickstart.py", str(tmp_path / "store"), timeout=120)
    assert "req-3/0 (130, 6, 6) global layers (6, 7, 8, 9, 10, 11) missing rows 1" in out


def test_ingest_engines(tmp_path: Path) -> None:
    out = _run("ingest_engines.py", str(tmp_path / "store"), timeout=120)
    assert "cmpl-1 vllm (20, 4, 4) layers (2, 3, 4, 5) missing rows 1" in out
    assert "rid-1 sglang (20, 4, 4) layers (2, 3, 4, 5) missing rows 1" in out


def test_megatron_replay() -> None:
    assert "micro-batch 0: 31 rows x 3 routers replayed (29 recorded" in _run("megatron_replay.py")


def test_r3_on_cpu(tmp_path: Path) -> None:
    assert "with R3: router diff 0.00%" in _run("r3_on_cpu.py", str(tmp_path / "store"))


@pytest.mark.verl
def test_verl_r3() -> None:
    pytest.importorskip("verl")
    out = _run("verl_r3.py")
    assert "the batch now carries ['routelog_sample_id', 'uid'] and no routed_experts" in out
    assert out.count("every routed token took its rollout experts") == 2


def test_slime_r3() -> None:
    assert "every rank's routers pop what slime's own replay would have recorded" in _run("slime_r3.py")


def test_nemo_rl_r3() -> None:
    assert "routers selected the recorded experts on every replayed row" in _run("nemo_rl_r3.py")
