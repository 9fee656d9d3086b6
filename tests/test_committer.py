"""The commit path of format 4: committers that append many parts per log entry, the digests that spare readers of
the log the indexes of commits they do not collide with, listing the log from the last position read, and the
backoff of writers that contend for one position."""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import routelog
from routelog import Record
from routelog.errors import CorruptDataError, FormatVersionError
from routelog.fault_proxy import FaultProxy
from routelog.format import keys
from routelog.format.digest import decode_hashes, encode_hashes, sample_id_hash
from routelog.format.documents import CommitGroup, parse_log_document
from routelog.store.committer import (
    CommitReply,
    CommitRequest,
    Committer,
    CommitterUnavailableError,
    JsonClient,
    JsonCommitter,
    LookupReply,
    LookupRequest,
    PartProposal,
    RecordKey,
)
from routelog.store.steplog import Backoff
from routelog.store.storage import Storage
from routelog.store.verify import verify_store
from routelog.synth import synthetic_spec
from tests.records import sample_records

SPEC = synthetic_spec(layers=4, experts=32, topk=4)


def _records(prefix: str, n: int, seed: int = 0) -> list[Record]:
    return sample_records(SPEC, n, seed, prefix, tokens=(20, 40))


def _entries(store: routelog.Store, step: int = 0) -> list[Any]:
    storage = store.storage
    names = storage.list(keys.log_dir(step))
    return [parse_log_document(storage.read(f"{keys.log_dir(step)}/{n}"), n) for n in names]


def _write_together(store: routelog.Store, committer: Any, writers: int, records: int = 1) -> list[Any]:
    """``writers`` writer threads of ``committer`` closing at once; returns the writers."""
    opened = [
        store.writer(0, f"w{i}", background=False, flush_bytes=1 << 40, flush_seconds=None, committer=committer)
        for i in range(writers)
    ]
    for i, writer in enumerate(opened):
        for record in _records(f"w{i}/", records, seed=i):
            writer.append(record)
    start = threading.Barrier(writers, timeout=60)

    def close(writer: Any) -> None:
        start.wait()
        writer.close()

    threads = [threading.Thread(target=close, args=(w,)) for w in opened]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return opened


def _slow_committer(store_url: str, committer_id: str) -> Committer:
    """A committer on a slow storage: the parts that arrive while it creates an entry wait for the next one."""
    committer_store = routelog.open_store(store_url)
    slow = committer_store.storage.create

    def create(key: str, data: bytes, **options: bool) -> bool:
        time.sleep(1.0)
        return slow(key, data, **options)

    committer_store.storage.create = create  # type: ignore[method-assign]
    return Committer(committer_store, committer_id=committer_id)


def test_a_seal_after_a_drop_of_one_commit_of_an_entry_lists_the_entry_s_commits_in_order(store_url: str) -> None:
    """The first commit of a commit entry dropped whole and the second live: the seal names both in their order
    (by slot), reads the live one and never the dropped one."""
    store = routelog.create_store(store_url, SPEC)
    _write_together(store, _slow_committer(store_url, "batcher"), 6)
    grouped = next(e for e in _entries(store) if len(e.commits) >= 2)
    dropped = grouped.commits[0]
    store.drop(0, parts=[dropped.part])
    live = sorted(routelog.open_store(store_url).step(0).sample_ids)
    seal = store.seal(0)
    assert seal.consolidated is not None
    sealed = routelog.open_store(store_url).step(0)
    assert sealed.sealed and sorted(sealed.sample_ids) == live
    assert f"w{dropped.writer_id[1:]}/s0" not in live and verify_store(routelog.open_store(store_url)).ok


def test_a_shared_committer_commits_many_writers_in_few_entries(store_url: str) -> None:
    store = routelog.create_store(store_url, SPEC)
    writers = _write_together(store, _slow_committer(store_url, "batcher"), 24)
    entries = _entries(store)
    assert all(isinstance(e, CommitGroup) and e.committer == "batcher" for e in entries)
    # Parts that wait while an entry is created go in the next one together: 24 writers whose parts are ready
    # within a few seconds of each other (more on a loaded machine) take a handful of 1-second creates.
    assert len(entries) <= 6 and max(len(e.commits) for e in entries) >= 8, [len(e.commits) for e in entries]
    commits = [c for e in entries for c in e.commits]
    assert sorted(c.writer_id for c in commits) == sorted(f"w{i}" for i in range(24))
    assert [c.slot for e in entries for c in e.commits] == [s for e in entries for s in range(len(e.commits))]
    snapshot = routelog.open_store(store_url).step(0)
    assert sorted(snapshot.sample_ids) == sorted(f"w{i}/s0" for i in range(24))
    assert all(len(w.commits) == 1 for w in writers)
    for commit in commits:  # each commit's digest names its own records
        (sid,) = (r.sample_id for r in snapshot.infos() if r.sample_id.startswith(f"{commit.writer_id}/"))
        assert commit.sample_id_hashes("test").tolist() == [sample_id_hash(sid)]
    report = verify_store(routelog.open_store(store_url))
    assert report.ok, report.problems


def test_digests_spare_the_indexes_of_commits_a_writer_does_not_collide_with(memory_url: str) -> None:
    """A writer among many reads the log's entries, never the indexes of commits whose digests miss its sample
    ids; a real collision reads the one index it collides with."""
    store = routelog.create_store(memory_url, SPEC)
    for i in range(6):
        with store.writer(0, f"w{i}") as writer:
            for record in _records(f"w{i}/", 3, seed=i):
                writer.append(record)
    reader = routelog.open_store(memory_url)
    read: list[str] = []
    many = reader.storage.read_many
    reader.storage.read_many = lambda ks: (read.extend(ks), many(ks))[1]  # type: ignore[method-assign]
    with reader.writer(0, "late", background=False) as writer:
        writer.append(_records("late/", 1, seed=99)[0])  # tokens of its own: no prefix to share either
    assert not [k for k in read if k.endswith(keys.INDEX)], "no index read: no digest holds the new sample id"
    read.clear()
    again = _records("w3/", 1, seed=3)[0]  # w3's first record, sent again
    with reader.writer(0, "resend", background=False) as writer:
        writer.append(again)
    assert writer.already_present == [again.sample_id]
    indexes = {k for k in read if k.endswith(keys.INDEX)}  # (its committer's check, and its prefix search)
    assert len(indexes) == 1 and "/w3." in next(iter(indexes)), indexes


def test_a_part_already_in_the_log_is_decided_there_not_committed_again(memory_url: str) -> None:
    """A writer whose shared committer committed its part but never answered asks its own committer, which finds
    the part in the log: one commit, and the same outcome."""
    store = routelog.create_store(memory_url, SPEC)
    shared = Committer(routelog.open_store(memory_url))
    request = _request(store, "w", _records("w/", 2))
    first = shared.commit(request).outcomes[0]
    assert first.error is None and sorted(first.committed) == ["w/s0", "w/s1"]
    own = Committer(routelog.open_store(memory_url), shared=False)
    again = own.commit(request).outcomes[0]
    assert again.commit == first.commit and again.committed == first.committed
    assert len(_entries(store)) == 1


def test_a_part_after_a_part_not_committed_in_one_request_fails_with_it(memory_url: str) -> None:
    """A writer's parts in one request may share rows in order: when one is not committed (here: its time ran
    out), the ones after it are not committed either."""
    store = routelog.create_store(memory_url, SPEC)
    late = _request(store, "w", _records("a/", 1), expires_in=-1.0)
    fine = _request(store, "w", _records("b/", 1), seq=1)
    reply = Committer(store).commit(CommitRequest(0, "w", (*late.parts, *fine.parts)))
    assert [o.error for o in reply.outcomes] == ["expired", "dependent"]
    assert _entries(store) == []


def test_writers_commit_through_a_committer_reached_as_json(memory_url: str) -> None:
    """What crosses a process boundary (a Ray actor's, say) is JSON: the writers' parts commit as through the
    committer itself."""
    store = routelog.create_store(memory_url, SPEC)
    server = JsonCommitter(Committer(routelog.open_store(memory_url)))
    sent: list[bytes] = []

    def call(method: str, writer_id: str, payload: bytes) -> bytes:
        sent.append(payload)
        reply: bytes = getattr(server, method)(payload)
        return reply

    _write_together(store, JsonClient(call), 4, records=2)
    assert sorted(routelog.open_store(memory_url).step(0).sample_ids) == sorted(
        f"w{i}/s{k}" for i in range(4) for k in range(2)
    )
    assert all(isinstance(json.loads(p), dict) for p in sent)


class _Unreachable:
    """A shared committer whose transport fails on every commit, ``before`` or ``after`` the committer saw it."""

    shared = True

    def __init__(self, committer: Committer, when: str) -> None:
        self.committer, self.when = committer, when

    def lookup(self, request: LookupRequest) -> LookupReply:
        return self.committer.lookup(request)

    def commit(self, request: CommitRequest) -> CommitReply:
        if self.when == "after":
            self.committer.commit(request)
        raise CommitterUnavailableError(f"no answer ({self.when})")


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_writer_whose_shared_committer_does_not_answer_commits_once_through_its_own(
    memory_url: str, when: str
) -> None:
    store = routelog.create_store(memory_url, SPEC)
    committer = _Unreachable(Committer(routelog.open_store(memory_url)), when)
    with store.writer(0, "w", committer=committer) as writer:
        for record in _records("w/", 3):
            writer.append(record)
        assert writer.shared_committer
    assert not writer.shared_committer, "after a failure the writer commits through its own for a while"
    assert len(writer.commits) == 1
    (entry,) = _entries(store)
    assert entry.committer == ("w" if when == "before" else committer.committer.committer_id)
    assert sorted(routelog.open_store(memory_url).step(0).sample_ids) == ["w/s0", "w/s1", "w/s2"]


def _request(
    store: routelog.Store, writer_id: str, records: list[Record], *, expires_in: float = 600.0, seq: int = 0
) -> CommitRequest:
    """A request for one uploaded part of ``records`` (built and uploaded as a writer would)."""
    from routelog.format.part import PartOptions, build_part
    from routelog.format.record import prepare_record
    from routelog.store.writer import part_commit, upload_part

    prepared = [prepare_record(r, store.model_spec, 0, "sorted", "bfloat16") for r in records]
    built = build_part(prepared, store.model_spec, PartOptions(dedup="off"))
    name = keys.new_part_name(writer_id, seq)
    infos = upload_part(store.storage, 0, name, built)
    commit = part_commit(built, writer_id, seq, name, 0, infos)
    keys_ = tuple(RecordKey(p.row.sample_id, p.row.token_hash, p.row.n_tokens) for p in prepared)
    return CommitRequest(0, writer_id, (PartProposal(commit, keys_, (), expires_in),))


# -- digests ---------------------------------------------------------------------------------------------------------
def test_digests_round_trip_and_refuse_what_the_commit_cannot_hold() -> None:
    hashes = [sample_id_hash(f"s{i}") for i in range(5)]
    text = encode_hashes(hashes)
    assert decode_hashes(text, 5, "here").tolist() == sorted(hashes)
    with pytest.raises(CorruptDataError, match="more hashes"):
        decode_hashes(text, 4, "here")
    with pytest.raises(CorruptDataError, match="sorted and distinct"):
        decode_hashes(base64.b64encode(np.array([2, 1], "<u8").tobytes()).decode(), 5, "here")
    with pytest.raises(CorruptDataError, match="whole number"):
        decode_hashes("AAAA", 5, "here")


def test_a_digest_missing_a_record_is_damage_verify_reports(memory_url: str) -> None:
    """A digest that misses a sample id would hide a duplicate from every writer trusting it: verify says so."""
    store = routelog.create_store(memory_url, SPEC)
    with store.writer(0, "w") as writer:
        for record in _records("w/", 3):
            writer.append(record)
    (commit,) = store.step(0).commits
    assert commit.digest is not None
    fewer = commit.digest.model_copy(update={"sample_ids": encode_hashes([sample_id_hash("w/s0")])})
    from tests.records import replace_commit

    replace_commit(store.storage, 0, commit.model_copy(update={"digest": fewer}))
    report = verify_store(routelog.open_store(memory_url))
    assert any("digest" in p and "sample ids" in p for p in report.problems), report.problems


def test_a_reader_of_format_3_refuses_a_commit_entry_of_format_4(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = routelog.create_store(memory_url, SPEC)
    with store.writer(0, "w") as writer:
        writer.append(_records("w/", 1)[0])
    key = keys.log_key(0, 0)
    data = store.storage.read(key)
    monkeypatch.setattr(routelog.format.documents, "FORMAT_VERSION", 3)
    with pytest.raises(FormatVersionError, match="format version 4"):
        parse_log_document(data, key)


# -- the log, listed from where it was read --------------------------------------------------------------------------
@pytest.fixture
def counted_s3(s3_endpoint: str, s3_bucket: str) -> Iterator[tuple[Storage, list[str]]]:
    """A storage on the moto server behind a proxy that records every request's method and target."""
    seen: list[str] = []
    with FaultProxy(s3_endpoint, observer=lambda method, target, headers: seen.append(f"{method} {target}")) as proxy:
        options = {"endpoint_url": proxy.endpoint, "skip_instance_cache": True}
        yield Storage.open(f"s3://{s3_bucket}/{uuid.uuid4().hex[:8]}", options), seen


def test_the_log_is_listed_from_the_last_position_read(counted_s3: tuple[Storage, list[str]]) -> None:
    """One request lists what was appended after a known position, however many entries came before it (S3
    ``StartAfter``: a listing of the whole log would take a page per 1,000 entries)."""
    storage, seen = counted_s3
    directory = keys.log_dir(0)
    storage.write_many({f"{directory}/{keys.log_name(p)}": b"{}" for p in range(1005)})
    seen.clear()
    before = time.time()
    names = storage.list_after(directory, keys.log_name(1001))
    assert list(names) == [keys.log_name(p) for p in (1002, 1003, 1004)]
    assert len(seen) == 1 and "start-after=" in seen[0].lower(), seen
    assert all(abs(stored - before) < 60 for stored in names.values()), "each with the storage's time"
    assert storage.list_after(directory, keys.log_name(1004)) == {}


# -- the backoff of contending writers ------------------------------------------------------------------------------
def test_the_backoff_is_carried_from_one_append_to_the_next() -> None:
    """A lost position widens the wait by a slot, a won one narrows it by one rather than closing it: a writer that
    just appended waits before its next attempt, so those that waited longest get their turn."""
    backoff = Backoff(slot=0.03)
    assert backoff.wait() == 0.0
    for _ in range(4):
        backoff.lost()
    backoff.won()
    waits = [backoff.wait() for _ in range(200)]
    assert 0 < max(waits) <= 3 * 0.03 and min(waits) >= 0
    for _ in range(1000):
        backoff.lost()
    assert max(backoff.wait() for _ in range(200)) <= Backoff.MAX_WAIT
    backoff.observe(1.0)
    assert 0.03 < backoff.slot <= 1.0


@pytest.mark.parametrize("forgery", ["a part twice", "another slot", "another time", "a feature hidden"])
def test_a_forged_commit_entry_is_refused(memory_url: str, forgery: str) -> None:
    """A commit entry commits each part once, its commits carry its position, time and their slots, and it names
    every feature they need (so a reader that lacks one refuses the entry before anything else)."""
    store = routelog.create_store(memory_url, SPEC)
    with store.writer(0, "w") as writer:
        writer.append(_records("w/", 1)[0])
    key = keys.log_key(0, 0)
    raw = json.loads(store.storage.read(key))
    first = raw["commits"][0]
    if forgery == "a part twice":
        raw["commits"].append(dict(first, slot=1))
    elif forgery == "another slot":
        first["slot"] = 3
    elif forgery == "another time":
        first["created_at"] = "2020-01-01T00:00:00Z"
    else:
        first["features"] = ["ranked_context"]
    store.storage.write(key, json.dumps(raw).encode())
    with pytest.raises(CorruptDataError, match=r"twice|slot|features|transform"):
        routelog.open_store(memory_url).step(0)


def test_a_committer_serves_many_steps_and_forgets_the_oldest(memory_url: str) -> None:
    """An RL run commits step after step through one committer: it keeps what it knows of the last few steps only,
    and a step it forgot is read from its log again when used."""
    from routelog.store.committer import STEPS_KEPT

    store = routelog.create_store(memory_url, SPEC)
    committer = Committer(routelog.open_store(memory_url))
    for step in range(STEPS_KEPT + 3):
        with store.writer(step, "w", committer=committer) as writer:
            writer.append(_records(f"{step}/", 1)[0])
    assert len(committer._steps) == STEPS_KEPT
    with store.writer(0, "w", committer=committer) as writer:  # forgotten: read again, the re-send found present
        writer.append(_records("0/", 1)[0])
    assert writer.already_present == ["0/s0"]
    assert all(len(store.step(step)) == 1 for step in range(STEPS_KEPT + 3))
