"""Many writers on a real S3 (moto over HTTP): concurrent processes commit exactly once, and writers killed with
SIGKILL at random points leave a sound store holding every record whose commit returned."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import routelog
from routelog.store.reader import StepSnapshot
from routelog.store.verify import verify_store
from tests.writer_child import SPEC as CHILD_SPEC

CHILD = str(Path(__file__).with_name("writer_child.py"))


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}


def test_eight_processes_commit_exactly_once(s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/concurrent"
    procs = [
        subprocess.Popen(
            [sys.executable, CHILD, url, f"worker-{i}", f"p{i}-", "200"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for i in range(8)
    ]
    committed: list[str] = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        committed += [
            sid
            for line in out.splitlines()
            if line.startswith("COMMITTED ")
            for sid in line.split(" ", 1)[1].split(",")
        ]
    snapshot = routelog.open_store(url).step(0)
    assert snapshot.shadowed == [], "no record committed twice"
    expected = sorted(f"p{i}-{j:05d}" for i in range(8) for j in range(200))
    assert sorted(snapshot.sample_ids) == expected
    assert sorted(committed) == expected
    assert len(snapshot.commits) > 8, "each worker committed several parts"
    assert verify_store(routelog.open_store(url)).ok


def test_sigkill_at_random_points_loses_nothing_committed(s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/killed"
    # The store exists before the first child: a child killed while still importing must not leave the
    # interim read below without a store to open (the children create it idempotently with the same spec).
    routelog.create_store(url, CHILD_SPEC)
    rng = random.Random(7)
    committed: set[str] = set()
    kills = 0
    deadline = time.monotonic() + 240
    while kills < 20 and time.monotonic() < deadline:
        proc = subprocess.Popen(
            [sys.executable, CHILD, url, "rollout-0", "s", "60", "600"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        time.sleep(rng.uniform(0.3, 3.0))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        out, _ = proc.communicate(timeout=60)
        committed |= {
            sid
            for line in out.splitlines()
            if line.startswith("COMMITTED ")
            for sid in line.split(" ", 1)[1].split(",")
        }
        interim = StepSnapshot.load(routelog.open_store(url), 0)  # readable after every kill, no duplicates
        assert interim.shadowed == []
        assert committed <= set(interim.sample_ids), "every record whose commit returned is present"
    assert kills >= 20
    report = verify_store(routelog.open_store(url))
    assert report.ok, report.problems
    final = subprocess.run(
        [sys.executable, CHILD, url, "rollout-0", "s", "60", "600"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
        check=False,
    )
    assert final.returncode == 0, final.stderr[-2000:]
    assert sorted(routelog.open_store(url).step(0).sample_ids) == [f"s{i:05d}" for i in range(60)]
    assert verify_store(routelog.open_store(url)).ok


def test_the_s3_server_decides_concurrent_creates_atomically(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's moto server (``routelog.testing.local_s3_server``) decides conditional creates as S3 does: of
    racing creates of one key exactly one succeeds and its bytes stay. moto alone checks then stores with a gap in
    between; a pause in that gap makes every racer pass the check unless the server holds them off."""
    from moto.s3.models import S3Backend

    from routelog.store.storage import Storage

    racers, key = 4, "steps/00000000/log/0000000000.json"
    check_object = S3Backend.get_object

    def slow_check(self: S3Backend, bucket_name: str, key_name: str, *args: object, **kwargs: object) -> object:
        found = check_object(self, bucket_name, key_name, *args, **kwargs)
        if key_name.endswith(key):
            time.sleep(0.2)  # between looking and storing: every racer looks before the first stores
        return found

    monkeypatch.setattr(S3Backend, "get_object", slow_check)
    storages = [Storage.open(f"s3://{s3_bucket}/race") for _ in range(racers)]
    start = threading.Barrier(racers)
    won: list[int] = []

    def create(i: int) -> None:
        start.wait(timeout=30)
        if storages[i].create(key, f"racer {i}".encode()):
            won.append(i)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(won) == 1, f"racers {won} all created the key"
    assert storages[0].read(key) == f"racer {won[0]}".encode()
