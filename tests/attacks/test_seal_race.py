"""Sealing while writers commit: a writer is told "committed" only for records every reader of the sealed step sees.

The race that lost records: a commit created after the sealer listed the step, checked before the seal existed,
was reported committed and then left out of the seal. The fence (``_SEALING.json`` created before the listing,
checked after every commit) is proven here with the window held open deterministically, then by a randomized
stress run on local disk and on a real S3 server (moto over HTTP).
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

import routelog
from routelog import keys
from routelog.errors import CommitUndecidedError, StepSealedError
from routelog.seal import seal_step
from routelog.writer import WriterError
from tests.attacks.kit import SPEC, make_records

_WAIT = 20.0
"""Upper bound of every wait in these tests (seconds); the waits end as soon as their condition holds."""


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + _WAIT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _hold_commit_creates(
    store: routelog.Store, arrived: threading.Event, release: threading.Event, created: threading.Event
) -> None:
    """Make this store object's commit creates signal ``arrived``, wait for ``release`` (the sealer has listed),
    create, then signal ``created``."""
    storage = store.storage
    original = storage.create

    def create(key: str, data: bytes) -> bool:
        if "/commits/" in key:
            arrived.set()
            assert release.wait(_WAIT), "the sealer never listed the step"
            result = original(key, data)
            created.set()
            return result
        return original(key, data)

    storage.create = create  # type: ignore[method-assign]


def test_a_commit_created_after_the_listing_is_refused_not_lost(store_url: str) -> None:
    """The window held open: the writer passed its pre-check before the seal started, and creates its commit
    after the sealer listed the step. It must learn that its records are not in the step."""
    routelog.create_store(store_url, SPEC)
    early, late = make_records(SPEC, 2, seed=1)
    with routelog.open_store(store_url).writer(0, "early", background=False) as writer:
        writer.append(early)
    writer_store = routelog.open_store(store_url)
    arrived, listed, created = threading.Event(), threading.Event(), threading.Event()
    _hold_commit_creates(writer_store, arrived, listed, created)
    late_writer = writer_store.writer(0, "late", background=False, seal_wait=_WAIT)
    late_writer.append(late)
    outcome: dict[str, Any] = {}

    def flush() -> None:
        try:
            late_writer.flush()
            outcome["committed"] = True
        except WriterError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=flush)
    thread.start()
    assert arrived.wait(_WAIT), "the writer never reached its commit"  # it passed its "not sealed" check

    def after_listing(names: Sequence[str]) -> None:
        assert names == ["early.00000000.json"]
        listed.set()
        assert created.wait(_WAIT), "the late commit was never created"

    seal = seal_step(routelog.open_store(store_url), 0, after_listing=after_listing)
    thread.join(_WAIT)
    assert not thread.is_alive()
    assert "committed" not in outcome, "a commit left out of the seal was reported committed"
    assert isinstance(outcome["error"].__cause__, StepSealedError)
    assert outcome["error"].sample_ids == [late.sample_id]
    assert seal.commits == ["early.00000000.json"]
    assert routelog.open_store(store_url).step(0).sample_ids == [early.sample_id]
    with pytest.raises(StepSealedError):
        late_writer.append(make_records(SPEC, 3, seed=2, prefix="again")[0])


def test_a_commit_before_the_intent_is_in_the_seal(store_url: str) -> None:
    routelog.create_store(store_url, SPEC)
    records = make_records(SPEC, 3, seed=3)
    writer = routelog.open_store(store_url).writer(0, "w", background=False)
    for record in records:
        writer.append(record)
    assert len(writer.flush()) == 1
    seal = routelog.open_store(store_url).seal(0)
    assert seal.commits == ["w.00000000.json"]
    assert sorted(routelog.open_store(store_url).step(0).sample_ids) == sorted(r.sample_id for r in records)


def test_a_seal_that_never_finishes_leaves_the_commit_undecided(memory_url: str) -> None:
    """A sealer that died after its intent: the writer cannot know whether a later seal lists its commit, so it
    says so (and how to finish the seal) instead of claiming success."""
    store = routelog.create_store(memory_url, SPEC)
    writer = store.writer(0, "w", background=False, seal_wait=0.3)
    writer.append(make_records(SPEC, 1, seed=4)[0])
    original = store.storage.create

    def create(key: str, data: bytes) -> bool:
        result = original(key, data)
        if "/commits/" in key:  # the sealer starts right after the create, then dies
            store.storage.create(keys.sealing_key(0), b"{}")
        return result

    store.storage.create = create  # type: ignore[method-assign]
    with pytest.raises(WriterError) as info:
        writer.flush()
    assert isinstance(info.value.__cause__, CommitUndecidedError)
    assert "routelog seal" in str(info.value)
    with pytest.raises(StepSealedError, match="being sealed"):
        store.writer(0, "other")
    finished = store.seal(0)  # running the seal again finishes it, with the undecided commit
    assert finished.commits == ["w.00000000.json"]


def _stress(url: str, *, writers: int, records_each: int, seed: int) -> None:
    """Writers commit one record per part while a sealer seals at a random moment; afterwards the sealed step
    holds exactly the records whose commits were confirmed."""
    routelog.create_store(url, SPEC)
    rng = random.Random(seed)
    confirmed: set[str] = set()
    refused: set[str] = set()
    causes: list[BaseException | None] = []
    lock = threading.Lock()
    started = threading.Barrier(writers + 1)

    def write(index: int) -> None:
        store = routelog.open_store(url)
        records = make_records(SPEC, records_each, seed=seed * 100 + index, prefix=f"w{index}/")

        def on_commit(_commit: object, sample_ids: list[str]) -> None:
            with lock:
                confirmed.update(sample_ids)

        try:
            writer = store.writer(0, f"w{index}", background=False, on_commit=on_commit, seal_wait=_WAIT)
        except StepSealedError:
            started.wait(_WAIT)
            return
        started.wait(_WAIT)
        for record in records:
            try:
                writer.append(record)
                writer.flush()
            except WriterError as exc:
                with lock:
                    refused.update(exc.sample_ids)
                    causes.append(exc.__cause__)
                return
            except StepSealedError:
                return

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    started.wait(_WAIT)
    deadline = time.monotonic() + _WAIT  # seal while writers commit: after the first commit (an empty step is
    while not confirmed and time.monotonic() < deadline:  # refused), at a random moment among the others
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.4))
    seal = routelog.open_store(url).seal(0)
    for thread in threads:
        thread.join(_WAIT * 3)
        assert not thread.is_alive()
    snapshot = routelog.open_store(url).step(0)
    assert snapshot.sealed
    got = set(snapshot.sample_ids)
    assert len(got) == len(snapshot.sample_ids) == seal.n_records  # each exactly once
    assert confirmed <= got, f"{len(confirmed - got)} confirmed records are missing from the sealed step"
    assert got <= confirmed, "the sealed step holds records whose writers were told they were refused"
    assert not (refused & got)
    assert all(isinstance(cause, StepSealedError) for cause in causes), causes


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_seal_during_commits_local(tmp_path: Path, seed: int) -> None:
    _stress(f"file://{tmp_path}/store", writers=3, records_each=40, seed=seed)


@pytest.mark.parametrize("seed", [4, 5])
def test_seal_during_commits_s3(s3_bucket: str, seed: int) -> None:
    _stress(f"s3://{s3_bucket}/runs/{uuid.uuid4().hex[:8]}", writers=2, records_each=15, seed=seed)
