"""The command line, run for real: in-process with typer's runner, and as a subprocess where exit codes and the
environment matter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import routelog
from routelog.cli import app

runner = CliRunner()


def _run(*args: str) -> str:
    result = runner.invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "routelog", *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )


def test_synth_inspect_ls_cat_verify(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    _run(
        "synth",
        url,
        "--step",
        "2",
        "--records",
        "6",
        "--tokens",
        "40",
        "--layers",
        "4",
        "--experts",
        "128",
        "--topk",
        "8",
        "--ragged",
        "--seed",
        "1",
    )
    _run("synth", url, "--step", "5", "--records", "2", "--tokens", "10")  # reuses the store's spec
    summary = json.loads(_run("inspect", url, "--json"))
    for key in ("format_version", "steps", "records", "tokens", "stored_bytes", "bytes_per_token_layer"):
        assert key in summary
    assert summary["format_version"] == routelog.FORMAT_VERSION
    assert summary["steps"] == [2, 5]
    assert summary["records"] == 8
    snap = routelog.open_store(url).step(2)
    assert summary["tokens"] == snap.n_tokens + routelog.open_store(url).step(5).n_tokens
    assert 4.0 < summary["bytes_per_token_layer"] < 8.0
    assert summary["codecs"] == {"ranked_gaps": sum(s["parts"] for s in summary["per_step"])}
    stats = json.loads(_run("stats", url, "--json"))
    assert stats["stored_bytes"] == summary["stored_bytes"], "stats and inspect count the same bytes"
    assert summary["run_document_bytes"] > 0
    listing = json.loads(_run("ls", url, "--step", "2", "--json"))
    assert [r["sample_id"] for r in listing] == snap.sample_ids
    assert all(r["missing_rows"] == 1 for r in listing), "synthetic records miss the final row like engines do"
    out = tmp_path / "one.npy"
    _run("cat", url, "--step", "2", "--sample", "000003", "--npy", str(out))
    ids = np.load(out, allow_pickle=False)
    assert ids.dtype == np.int16
    assert ids.shape[1:] == (4, 8)
    assert (ids[-1] == -1).all()
    assert (ids[:-1] >= 0).all()
    np.testing.assert_array_equal(ids, snap.read("000003").expert_ids)
    assert "sound" in _run("verify", url)
    assert "total: 8 records" in _run("inspect", url)
    assert "routing codecs: ranked_gaps (" in _run("inspect", url)
    assert "000003" in _run("ls", url, "--step", "2")
    stats = json.loads(_run("stats", url, "--json"))
    assert stats["bytes_per_token_layer"] == pytest.approx(summary["bytes_per_token_layer"]), "one definition"


def test_cat_full_layer_axis_marks_dense_layers(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "deepseek_v3",
                "num_hidden_layers": 6,
                "first_k_dense_replace": 2,
                "n_routed_experts": 32,
                "num_experts_per_tok": 4,
            }
        )
    )
    url = str(tmp_path / "run")
    _run("synth", url, "--records", "2", "--tokens", "12", "--model-spec", str(config))
    out = tmp_path / "full.npy"
    _run("cat", url, "--step", "0", "--sample", "000001", "--npy", str(out), "--layer-axis", "full")
    ids = np.load(out, allow_pickle=False)
    assert ids.shape == (12, 6, 4)
    assert (ids[:, :2] == -1).all(), "dense layers are -1 on the full axis"
    assert (ids[:-1, 2:] >= 0).all()


def test_verify_fails_on_corruption_and_errors_exit_2(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    _run("synth", url, "--records", "3", "--tokens", "30")
    shard = next((tmp_path / "run").rglob("routing/c/0/0/0"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = _cli("verify", url)
    assert result.returncode == 1
    assert "SHA-256" in result.stderr
    missing = _cli("inspect", str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert "no routelog store" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_s3_endpoint_from_storage_options_and_fsspec_environment(s3_endpoint: str, s3_bucket: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    url = f"s3://{s3_bucket}/cli-run"
    options = json.dumps({"endpoint_url": s3_endpoint})
    wrote = _cli("synth", url, "--records", "2", "--tokens", "8", "--storage-options", options, env=env)
    assert wrote.returncode == 0, wrote.stderr
    via_fsspec_env = _cli("inspect", url, "--json", env={**env, "FSSPEC_S3_ENDPOINT_URL": s3_endpoint})
    assert via_fsspec_env.returncode == 0, via_fsspec_env.stderr
    assert json.loads(via_fsspec_env.stdout)["records"] == 2
    via_aws_env = _cli("ls", url, "--step", "0", "--json", env={**env, "AWS_ENDPOINT_URL": s3_endpoint})
    assert via_aws_env.returncode == 0
    assert len(json.loads(via_aws_env.stdout)) == 2


def test_two_processes_share_a_step_with_sample_prefixes(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "routelog",
                "synth",
                url,
                "--records",
                "4",
                "--tokens",
                "16",
                "--sample-prefix",
                f"p{i}-",
                "--seed",
                str(i),
                "--layers",
                "3",
                "--experts",
                "16",
                "--topk",
                "2",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    snap = routelog.open_store(url).step(0)
    assert sorted(snap.sample_ids) == sorted(f"p{i}-{j:06d}" for i in range(2) for j in range(4))


@pytest.mark.parametrize("bad", ["not json", "[1, 2]"])
def test_bad_storage_options_are_reported(bad: str, tmp_path: Path) -> None:
    result = _cli("inspect", str(tmp_path), "--storage-options", bad)
    assert result.returncode == 2
    assert "--storage-options" in result.stderr


def test_seal_gc_and_ls_as_of(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    _run("synth", url, "--step", "0", "--records", "3", "--tokens", "16", "--layers", "2", "--sample-prefix", "a-")
    between = _run("ls", url, "--step", "0", "--json")
    time.sleep(0.05)  # clear of the filesystem's timestamp granularity: the storage's clock decides as-of views
    cutoff = datetime.now(UTC).isoformat()
    time.sleep(0.05)
    _run("synth", url, "--step", "0", "--records", "2", "--tokens", "16", "--layers", "2", "--sample-prefix", "b-")
    earlier = json.loads(_run("ls", url, "--step", "0", "--as-of", cutoff, "--json"))
    assert [r["sample_id"] for r in earlier] == [r["sample_id"] for r in json.loads(between)]
    assert len(json.loads(_run("ls", url, "--step", "0", "--json"))) == 5
    row = next(line for line in _run("ls", url, "--step", "0").splitlines() if "a-000001" in line)
    cells = [cell.strip() for cell in row.strip("│ ").split("│")]
    assert cells[6] == "0", f"policy version 0 (synth's policy is its step) is shown, not blank: {cells}"

    # A dead writer's upload (no commit) next to the committed parts:
    orphan = tmp_path / "run" / "steps" / f"{0:010d}" / "parts" / "dead.00000000.0badc0ffee"
    orphan.mkdir(parents=True)
    (orphan / "index.parquet").write_bytes(b"half an upload")
    dry = json.loads(_run("gc", url, "--older-than", "0", "--force", "--json"))
    assert list(dry["orphans"]) == ["steps/0000000000/parts/dead.00000000.0badc0ffee/index.parquet"]
    assert not dry["deleted"] and orphan.exists(), "a dry run by default"
    assert "kept" in _run("gc", url), "younger than the default 24 h grace period: kept"
    assert json.loads(_run("gc", url, "--older-than", "0", "--force", "--delete", "--json"))["deleted"]
    assert not (orphan / "index.parquet").exists()

    assert "5 records" in _run("seal", url, "--step", "0")
    again = _cli("seal", url, "--step", "0")
    assert again.returncode == 0 and "already sealed" in again.stdout, "sealing again is safe"
    refused = _cli("synth", url, "--step", "0", "--records", "1", "--tokens", "8", "--layers", "2")
    assert refused.returncode == 2 and "sealed" in refused.stderr
    assert len(json.loads(_run("ls", url, "--step", "0", "--json"))) == 5
    row = next(line for line in _run("ls", url, "--step", "0").splitlines() if "a-000001" in line)
    cells = [cell.strip() for cell in row.strip("│ ").split("│")]
    assert cells[6] == "0", f"policy version 0 (synth's policy is its step) is shown, not blank: {cells}"
    assert _cli("verify", url).returncode == 0


@pytest.mark.parametrize("asked", [["--version"], ["--help"], ["synth", "--help"]])
def test_version_and_help_import_nothing_heavy(asked: list[str]) -> None:
    """``routelog --version`` and ``--help`` load the command line alone (a loaded host once took 4 s for them):
    no numpy, pyarrow, pydantic or torch, none of the format's or the store's modules."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "routelog", *asked], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    heavy = {"numpy", "pyarrow", "torch", "routelog.format.documents", "routelog.store.store"}
    if len(asked) == 1:  # (a command's own help: typer looks for pydantic types among its options)
        heavy.add("pydantic")
    assert not heavy & imported, sorted(heavy & imported)


def test_flags_are_shown_without_a_value() -> None:
    """``--debug`` and ``--version`` take no value: the help must not show one (``--debug <bool>`` read as if it
    did)."""
    result = subprocess.run([sys.executable, "-m", "routelog", "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 0
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip().startswith("--")}
    for flag in ("--debug", "--version", "--help"):
        assert "<" not in lines[flag] and "BOOL" not in lines[flag].upper().split(flag.upper())[1], lines[flag]
