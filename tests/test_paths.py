"""Paths are data: a store's path holds any character its filesystem keeps, and reads back exactly as written, or
is refused at creation with one line; no path is ever handed to a call that expands glob patterns."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import routelog
from routelog.errors import StoreError
from routelog.format import keys
from routelog.store.verify import verify_store
from routelog.synth import synthetic_spec
from tests.records import sample_records

SPEC = synthetic_spec(layers=3, experts=16, topk=2)

KEPT = {
    "space": "run 42",
    "percent": "run%2042",
    "hash": "run#42",
    "braces": "run{a,b}",
    "quotes": "run'\"42",
    "shell": "run!$&;=+,~@",
    "unicode": "lauf-ü-运行",
    "dots": "run..42.",
    "dash first": "-run",
}
"""Character classes a store's path may hold: each round-trips through every operation."""

GLOB = {"star": "run*", "question mark": "run?", "brackets": "run[1]", "opening bracket": "run[", "closing": "run]"}
"""Characters fsspec reads as glob patterns: refused at creation."""


def _round_trip(url: str) -> None:
    """Write, read, drop, verify and gc (deleting what the drop freed): every object goes and comes by its name."""
    store = routelog.create_store(url, SPEC)
    records = sample_records(SPEC, 4, seed=1, tokens=(4, 12))
    with store.writer(0, "w") as writer:
        for record in records[:2]:
            writer.append(record)
    with store.writer(0, "v") as writer:
        for record in records[2:]:
            writer.append(record)
    reopened = routelog.open_store(url)
    snapshot = reopened.step(0)
    assert sorted(snapshot.sample_ids) == sorted(r.sample_id for r in records)
    for record in records:
        read = snapshot.read(record.sample_id).expert_ids[record.valid]
        np.testing.assert_array_equal(np.sort(read, axis=-1), np.sort(record.expert_ids[record.valid], axis=-1))
    dropped = snapshot.commits[0].part
    reopened.drop(0, parts=[dropped])
    assert verify_store(routelog.open_store(url)).ok
    report = routelog.open_store(url).gc(3600, delete=True, now=time.time() + 7200)
    assert report.trees == [keys.part_dir(0, dropped)] and not report.damaged
    assert sorted(routelog.open_store(url).step(0).sample_ids) == sorted(r.sample_id for r in records[2:])


@pytest.mark.parametrize("name", list(KEPT.values()), ids=list(KEPT))
def test_a_store_path_of_every_character_class_round_trips(tmp_path: Path, name: str) -> None:
    _round_trip(f"{tmp_path}/{name}")
    _round_trip(f"memory://routelog-tests/{uuid.uuid4().hex}/{name}")


@pytest.mark.parametrize("name", ["run 42", "run%2042", "run#42", "run{a,b}", "lauf-ü"])
def test_an_s3_prefix_of_every_character_class_round_trips(s3_bucket: str, name: str) -> None:
    _round_trip(f"s3://{s3_bucket}/{uuid.uuid4().hex[:6]}/{name}")


@pytest.mark.parametrize("name", list(GLOB.values()), ids=list(GLOB))
def test_a_path_with_glob_characters_is_refused_at_creation_with_nothing_written(
    tmp_path: Path, s3_bucket: str, name: str
) -> None:
    for url in (f"{tmp_path}/{name}", f"memory://routelog-tests/{uuid.uuid4().hex}/{name}", f"s3://{s3_bucket}/{name}"):
        with pytest.raises(StoreError, match=r"glob pattern: choose a path without \* \? \[ \]"):
            routelog.create_store(url, SPEC)
    assert not (tmp_path / name).exists()
    result = _synth(f"{tmp_path}/{name}")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "glob pattern" in lines[0], result.stderr
    assert not (tmp_path / name).exists()


def test_a_store_under_a_glob_named_directory_is_read_and_collected_by_its_exact_name(tmp_path: Path) -> None:
    """A store an earlier routelog created under ``run[1]``: read and gc'd through its own objects only, never those
    of ``run1``, which its name matches as a glob pattern."""
    made = tmp_path / "made"
    _round_trip_store = routelog.create_store(str(made), SPEC)
    with _round_trip_store.writer(0, "w") as writer:
        for record in sample_records(SPEC, 3, seed=2, tokens=(4, 12)):
            writer.append(record)
    glob_named, sibling = tmp_path / "run[1]", tmp_path / "run1"
    shutil.copytree(made, glob_named)
    shutil.copytree(made, sibling)
    store = routelog.open_store(str(glob_named))
    snapshot = store.step(0)
    assert len(snapshot.read_many(snapshot.sample_ids)) == 3
    part = snapshot.commits[0].part
    store.drop(0, parts=[part])
    report = routelog.open_store(str(glob_named)).gc(3600, delete=True, now=time.time() + 7200)
    assert report.trees == [keys.part_dir(0, part)]
    assert not (glob_named / keys.part_dir(0, part)).exists()
    assert (sibling / keys.part_dir(0, part)).exists() and verify_store(routelog.open_store(str(sibling))).ok


def test_a_path_component_longer_than_the_filesystem_allows_is_a_typed_error(tmp_path: Path) -> None:
    long = "x" * 300
    with pytest.raises(StoreError, match="300 bytes, longer than this filesystem's 255: choose a shorter"):
        routelog.create_store(f"{tmp_path}/{long}/run", SPEC)
    result = _synth(f"{tmp_path}/{long}")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "choose a shorter directory name" in lines[0], result.stderr
    assert list(tmp_path.iterdir()) == []


def _synth(url: str) -> subprocess.CompletedProcess[str]:
    """``routelog synth`` of a tiny step into ``url``."""
    return _cli(
        "synth",
        url,
        "--step",
        "0",
        "--records",
        "2",
        "--tokens",
        "6",
        "--layers",
        "3",
        "--experts",
        "16",
        "--topk",
        "2",
    )


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "routelog", *args], check=False, capture_output=True, text=True, timeout=120
    )
