"""A snapshot shared by threads (a trainer's data loader): every read equals a single-threaded one, however the
threads interleave; the snapshot's caches are looked up and changed under its lock."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import routelog
import routelog.store.reader
from routelog.format.values import LOGPROB_INFER
from routelog.synth import synthetic_spec
from tests.records import sample_records

SPEC = synthetic_spec(layers=4, experts=32, topk=4)


def _store(tmp_path: Path, parts: int, per_part: int) -> routelog.Store:
    store = routelog.create_store(str(tmp_path / "run"), SPEC)
    for p in range(parts):
        with store.writer(0, f"w{p}") as writer:
            for record in sample_records(SPEC, per_part, seed=p, prefix=f"p{p}-", tokens=(8, 40), logprobs=True):
                writer.append(record)
    return store


def test_threads_sharing_a_snapshot_read_what_one_thread_reads(tmp_path: Path) -> None:
    """8 threads, each reading per-token values and routing of records spread over more parts than the values cache
    holds (so it is filled and evicted all the time), compare every read with a single-threaded read."""
    store = _store(tmp_path, parts=9, per_part=6)
    ids = store.step(0).sample_ids
    single = routelog.open_store(str(tmp_path / "run")).step(0)
    expected = {sid: single.token_values([sid], [LOGPROB_INFER])[sid][LOGPROB_INFER] for sid in ids}
    routes = {r.sample_id: r.expert_ids for r in single.read_many(ids)}
    shared = routelog.open_store(str(tmp_path / "run")).step(0)
    errors: list[BaseException] = []
    start = threading.Barrier(8, timeout=60)

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        start.wait()
        try:
            for _ in range(150):
                sid = ids[int(rng.integers(len(ids)))]
                got = shared.token_values([sid], [LOGPROB_INFER])[sid][LOGPROB_INFER]
                np.testing.assert_array_equal(got, expected[sid])
                if rng.random() < 0.2:
                    np.testing.assert_array_equal(shared.read(sid).expert_ids, routes[sid])
        except BaseException as exc:  # reported to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors[:3]


class _SlowMoves(OrderedDict[Any, Any]):
    """A values cache whose ``move_to_end`` waits first: the window in which another thread evicts the entry a look-up
    just found, when the look-up and its use are not under one lock."""

    def move_to_end(self, key: Any, last: bool = True) -> None:
        threading.Event().wait(0.02)
        super().move_to_end(key, last)


def test_the_values_cache_is_looked_up_and_evicted_under_one_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads alternate between two parts with a cache of one values object: without the lock, one finds its
    part's object, the other evicts it, and the first's use of it raises KeyError."""
    store = _store(tmp_path, parts=2, per_part=2)
    monkeypatch.setattr(routelog.store.reader, "_VALUES_CACHE", 1)
    snapshot = routelog.open_store(str(tmp_path / "run")).step(0)
    snapshot._values_cache = _SlowMoves()
    first, second = "p0-s0", "p1-s0"
    errors: list[BaseException] = []

    def reads(sid: str) -> None:
        try:
            for _ in range(25):
                snapshot.token_values([sid], [LOGPROB_INFER])
        except BaseException as exc:  # reported to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=reads, args=(sid,)) for sid in (first, second, first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors[:3]
    assert len(store.step(0).sample_ids) == 4
