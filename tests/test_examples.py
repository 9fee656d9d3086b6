"""The examples a user copies must keep running."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_store_quickstart(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "store_quickstart.py"), str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "req-3/0 (130, 6, 6) global layers (6, 7, 8, 9, 10, 11) missing rows 1" in result.stdout


def test_ingest_engines(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "ingest_engines.py"), str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "cmpl-1 vllm (20, 4, 4) layers (2, 3, 4, 5) missing rows 1" in result.stdout
    assert "rid-1 sglang (20, 4, 4) layers (2, 3, 4, 5) missing rows 1" in result.stdout


def test_megatron_replay() -> None:
    result = subprocess.run(
        [sys.executable, "-W", "ignore", str(EXAMPLES / "megatron_replay.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "micro-batch 0: 31 rows x 3 routers replayed (29 recorded" in result.stdout


def test_r3_on_cpu(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "r3_on_cpu.py"), str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "with R3: router diff 0.00%" in result.stdout


@pytest.mark.verl
def test_verl_r3() -> None:
    pytest.importorskip("verl")
    result = subprocess.run(
        [sys.executable, "-W", "ignore", str(EXAMPLES / "verl_r3.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the batch now carries ['routelog_sample_id', 'uid'] and no routed_experts" in result.stdout
    assert result.stdout.count("every routed token took its rollout experts") == 2


def test_slime_r3() -> None:
    result = subprocess.run(
        [sys.executable, "-W", "ignore", str(EXAMPLES / "slime_r3.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "every rank's replayed rows are the rollout's routes at its tokens" in result.stdout


def test_nemo_rl_r3() -> None:
    result = subprocess.run(
        [sys.executable, "-W", "ignore", str(EXAMPLES / "nemo_rl_r3.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "routers selected the recorded experts on every replayed row" in result.stdout
