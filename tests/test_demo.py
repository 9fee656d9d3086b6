"""The main job: ``routelog demo`` records, stores, loads aligned and replays, and replay does what R3 promises:
zero routing differences and a lower training-inference KL; and it prints the README's table, whose numbers it
reproduces within the tolerances the README states (bf16 arithmetic differs between CPUs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import routelog
import routelog.audit
from routelog.cli.demo_command import DENSE_LABEL, MODEL_LABELS
from routelog.demo import STAGES
from routelog.store.verify import verify_store

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")


README = Path(__file__).resolve().parent.parent / "README.md"
TOLERANCE = {"router": 0.015, "token": 0.03, "kl": 1.3}
"""What the README states: router diff within 1.5 points, token diff within 3 points, KL within a factor 1.3."""


def _readme_table() -> dict[str, list[str]]:
    """The README's demo table: label -> its cells."""
    rows = {}
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in (*MODEL_LABELS.values(), DENSE_LABEL):
            rows[cells[0]] = cells[1:]
    return rows


def _pair(cell: str) -> tuple[float, float]:
    def value(text: str) -> float:
        text = text.strip()
        return 0.0 if text == "0" else float(text.removesuffix("%").strip()) / (100 if text.endswith("%") else 1)

    before, after = cell.split("->")
    return value(before), value(after)


def test_demo_shows_replay_working_and_the_readme_table(tmp_path: Path) -> None:
    """Also: with output redirected the demo prints a line per stage, the README's table, then where its stores are
    and the commands to explore them, and those commands reproduce its "without R3" figures from storage."""
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "routelog", "demo", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    for name in MODEL_LABELS:
        m = metrics[name]
        for mode in ("no_replay", "replay"):
            assert set(m[mode]) >= {"router_diff_rate", "token_diff_rate", "kl_k3", "f_t2"}
        assert m["replay"]["router_diff_rate"] == 0.0, "replayed routers must pick exactly the recorded experts"
        assert m["replay"]["token_diff_rate"] == 0.0
        assert m["no_replay"]["router_diff_rate"] > 0.0, "bf16 inference vs fp32 training must disagree somewhere"
        assert m["replay"]["kl_k3"] < m["no_replay"]["kl_k3"]
        assert m["router_grad_norm_with_replay"] > 0, "replay keeps the router's gradient"
        if name == "deepseek_v32":  # its sparse-attention indexers are recorded, stored and replayed too
            assert m["replay"]["indexer_diff_rate"] == 0.0, "replayed indexers must select the recorded keys"
            assert m["no_replay"]["indexer_diff_rate"] > 0.0
        assert "dense_kl_k3" in m
        store = routelog.open_store(m["store"])
        assert len(store.step(0)) == metrics["config"]["batch"]
        assert verify_store(store).ok
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "router diff (no R3 -> R3)" in result.stdout and MODEL_LABELS["qwen3_moe"] in result.stdout
    readme = _readme_table()
    assert set(readme) == {*MODEL_LABELS.values(), DENSE_LABEL}
    for name, label in MODEL_LABELS.items():
        m, (router, token, indexer, kl) = metrics[name], readme[label]
        (router_off, router_on), (token_off, token_on) = _pair(router), _pair(token)
        if indexer:
            indexer_off, indexer_on = _pair(indexer)
            assert indexer_on == 0.0
            assert abs(m["no_replay"]["indexer_diff_rate"] - indexer_off) <= TOLERANCE["router"], (label, indexer)
        kl_off, kl_on = _pair(kl)
        assert router_on == token_on == 0.0
        assert abs(m["no_replay"]["router_diff_rate"] - router_off) <= TOLERANCE["router"], (label, router)
        assert abs(m["no_replay"]["token_diff_rate"] - token_off) <= TOLERANCE["token"], (label, token)
        for measured, stated in ((m["no_replay"]["kl_k3"], kl_off), (m["replay"]["kl_k3"], kl_on)):
            assert 1 / TOLERANCE["kl"] <= measured / stated <= TOLERANCE["kl"], (label, kl)
    dense = float(readme[DENSE_LABEL][-1])
    assert 1 / TOLERANCE["kl"] <= metrics["dense"]["kl_k3"] / dense <= TOLERANCE["kl"]
    stages = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in stages] == [f"[{i}/{STAGES}" for i in range(1, STAGES + 1)]

    qwen = metrics["qwen3_moe"]
    commands = [line.strip() for line in result.stdout.splitlines() if line.strip().startswith("routelog ")]
    assert f"routelog inspect {qwen['store']}" in commands
    diff = next(c for c in commands if c.startswith("routelog diff"))
    args = diff.split("#")[0].split()[1:]
    args[args.index("--plot") + 1] = str(tmp_path / "diff.png")
    reproduced = subprocess.run(
        [sys.executable, "-m", "routelog", *args, "--json"], capture_output=True, text=True, timeout=300, check=False
    )
    assert reproduced.returncode == 0, reproduced.stderr
    stored = json.loads(reproduced.stdout)
    assert stored["router_diff_rate"] == pytest.approx(qwen["no_replay"]["router_diff_rate"])
    assert stored["token_diff_rate"] == pytest.approx(qwen["no_replay"]["token_diff_rate"])
    mismatch = routelog.audit.mismatch(qwen["store"])
    assert mismatch.steps[0].kl_k3 == pytest.approx(qwen["no_replay"]["kl_k3"], rel=1e-5)


def test_the_demo_says_it_started_before_it_loads_torch(tmp_path: Path) -> None:
    """The first line comes before the imports that take seconds on a busy host (torch, transformers). (Its output
    directory is under a file: it stops once it has loaded them.)"""
    (tmp_path / "file").write_text("")
    out = str(tmp_path / "file" / "demo")
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "routelog", "demo", "--out", out, "--quick"],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    lines = result.stderr.splitlines()
    said = next(i for i, line in enumerate(lines) if line.startswith("routelog demo: loading torch"))
    torch = next(i for i, line in enumerate(lines) if line.startswith("import time") and line.endswith("| torch"))
    assert said < torch
