"""Sealing while writers commit: a writer is told "committed" only for records every reader of the sealed step sees.

The race that once lost records: a commit created after the sealer listed the step was reported committed and then
left out of the seal. In the step's log a commit and the seal take positions the storage orders, and a writer knows
every entry before its own: a commit before the seal is in it, one after it is refused. Both orders are held open
deterministically here, then a randomized stress run seals while writers commit, on local disk and on a real S3
server (moto over HTTP).
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import routelog
from routelog.errors import StepSealedError
from routelog.format import keys
from routelog.store.seal import seal_step
from routelog.store.writer import WriterError
from tests.attacks.kit import SPEC, make_records

_WAIT = 20.0
"""Upper bound of every wait in these tests (seconds); the waits end as soon as their condition holds."""


def _hold_commit_creates(store: routelog.Store, arrived: threading.Event, release: threading.Event) -> None:
    """Make this store object's first log create signal ``arrived`` and wait for ``release``."""
    storage = store.storage
    original = storage.create
    held: list[bool] = []

    def create(key: str, data: bytes, **options: bool) -> bool:
        if "/log/" in key and not held:
            held.append(True)
            arrived.set()
            assert release.wait(_WAIT), "never released"
        return bool(original(key, data, **options))

    storage.create = create  # type: ignore[method-assign]


def _late_writer(store_url: str, late: routelog.Record) -> tuple[threading.Thread, dict[str, Any], threading.Event]:
    """A writer whose commit is held at its create; returns its flushing thread, its outcome and the release."""
    writer_store = routelog.open_store(store_url)
    arrived, release = threading.Event(), threading.Event()
    _hold_commit_creates(writer_store, arrived, release)
    late_writer = writer_store.writer(0, "late", background=False)
    late_writer.append(late)
    outcome: dict[str, Any] = {"writer": late_writer}

    def flush() -> None:
        try:
            late_writer.flush()
            outcome["committed"] = True
        except WriterError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=flush)
    thread.start()
    assert arrived.wait(_WAIT), "the writer never reached its commit"  # it passed its "not sealed" check
    return thread, outcome, release


def test_a_commit_after_the_seal_is_refused_not_lost(store_url: str) -> None:
    """The writer passed its pre-check before the seal started; the seal takes the next position first. The
    writer learns from the log that its records are not in the step."""
    routelog.create_store(store_url, SPEC)
    early, late = make_records(SPEC, 2, seed=1)
    with routelog.open_store(store_url).writer(0, "early", background=False) as writer:
        writer.append(early)
    thread, outcome, release = _late_writer(store_url, late)
    seal = seal_step(routelog.open_store(store_url), 0)
    release.set()
    thread.join(_WAIT)
    assert not thread.is_alive()
    assert "committed" not in outcome, "a commit left out of the seal was reported committed"
    assert isinstance(outcome["error"].__cause__, StepSealedError)
    assert outcome["error"].sample_ids == [late.sample_id]
    assert seal.commits == ["0000000000.00000.json"]
    assert routelog.open_store(store_url).step(0).sample_ids == [early.sample_id]
    with pytest.raises(StepSealedError):
        outcome["writer"].append(make_records(SPEC, 3, seed=2, prefix="again")[0])


def test_a_commit_before_the_seal_is_in_it(store_url: str) -> None:
    """The sealer has read the log and consolidated it when the writer's commit takes the next position: the sealer
    reads it and seals after it, so the writer is right to report it committed."""
    routelog.create_store(store_url, SPEC)
    early, late = make_records(SPEC, 2, seed=1)
    with routelog.open_store(store_url).writer(0, "early", background=False) as writer:
        writer.append(early)
    thread, outcome, release = _late_writer(store_url, late)
    listings: list[list[str]] = []

    def after_listing(names: Sequence[str]) -> None:
        listings.append(list(names))
        if len(listings) == 1:  # let the held commit land between the sealer's read and its seal
            release.set()
            thread.join(_WAIT)

    seal = seal_step(routelog.open_store(store_url), 0, after_listing=after_listing)
    assert not thread.is_alive()
    assert outcome.get("committed"), outcome
    assert listings == [["0000000000.00000.json"], ["0000000000.00000.json", "0000000001.00000.json"]]
    assert seal.commits == ["0000000000.00000.json", "0000000001.00000.json"] and seal.position == 2
    assert sorted(routelog.open_store(store_url).step(0).sample_ids) == sorted([early.sample_id, late.sample_id])


def test_a_sealer_that_died_blocks_uploads_until_the_seal_is_run_again(memory_url: str) -> None:
    """A sealer that died after its intent: writers start no upload (the step is being sealed) and say how to
    finish; a commit made before is committed, and running the seal again seals it in."""
    store = routelog.create_store(memory_url, SPEC)
    writer = store.writer(0, "w", background=False)
    writer.append(make_records(SPEC, 1, seed=4)[0])
    assert len(writer.flush()) == 1
    store.storage.create(keys.sealing_key(0), b"{}")  # the sealer's intent, then it died
    with pytest.raises(StepSealedError, match="routelog seal"):
        store.writer(0, "other")
    finished = store.seal(0)
    assert finished.commits == ["0000000000.00000.json"]


def test_a_sealer_that_died_before_its_copy_is_completed(memory_url: str) -> None:
    """The seal entry exists but ``_SEALED.json`` does not: readers and writers find the seal in the log, and
    running the seal again writes the copy."""
    store = routelog.create_store(memory_url, SPEC)
    with store.writer(0, "w") as writer:
        writer.append(make_records(SPEC, 1, seed=4)[0])
    seal = store.seal(0)
    store.storage.delete([keys.seal_key(0)])
    assert routelog.open_store(memory_url).step(0).sealed
    with pytest.raises(StepSealedError):
        store.writer(0, "other")
    assert store.seal(0) == seal
    assert store.storage.exists(keys.seal_key(0))


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
            writer = store.writer(0, f"w{index}", background=False, on_commit=on_commit)
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
