"""Each case of the protocol that once broke a step, as a named test (the model-based test interleaves them all).

Seal after a drop, a race or a part drop; drops that apply to what existed when they were made; part-mates of
dropped and shadowed records; shared rows and what may vanish; one winner forever; as-of views; durability;
ambiguous and unanswered creates; symbolic links; timestamps without an offset; a full disk; older readers.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import routelog
import routelog.format.documents
import routelog.store.gc
import routelog.store.storage
import routelog.store.writer
from routelog import Record
from routelog.errors import (
    CommitUndecidedError,
    FormatVersionError,
    HistoryReclaimedError,
    StoreError,
    UnsafeKeyError,
)
from routelog.fault_proxy import Fault, FaultProxy
from routelog.format import keys
from routelog.format.values import LOGPROB_INFER, LOGPROB_TRAIN
from routelog.store.fidelity import StepFidelity, write_fidelity
from routelog.store.gc import GcRefusedError
from routelog.store.verify import verify_store
from routelog.store.writer import WriterError
from routelog.testing import before_first_log_create, skewed_clock
from tests.protocol_model import SPEC, record_of

GOLDEN = Path(__file__).parent / "fixtures"


def _store(tmp_path: Path) -> tuple[str, routelog.Store]:
    url = f"file://{tmp_path}/{uuid.uuid4().hex[:8]}"
    return url, routelog.create_store(url, SPEC)


def _write(store: routelog.Store, writer_id: str, records: list[Record], **options: Any) -> routelog.StepWriter:
    with store.writer(0, writer_id, **options) as writer:
        for record in records:
            writer.append(record)
    return writer


def _records(*samples: str, variant: int = 0) -> list[Record]:
    return [record_of(sid, variant)[0] for sid in samples]


def _expected(sid: str, variant: int = 0) -> np.ndarray:
    return record_of(sid, variant)[1].ids


def _reads(url: str, step: int = 0) -> dict[str, np.ndarray]:
    snapshot = routelog.open_store(url).step(step)
    return {r.sample_id: r.expert_ids for r in snapshot.read_many(snapshot.sample_ids)}


def _moment() -> datetime:
    """Now, clear of the storage's timestamp granularity on both sides (a file's mtime comes from a coarse clock,
    some milliseconds behind the one a process reads): what was stored before is older, what is stored after newer.
    As-of views go by the storage's timestamps."""
    time.sleep(0.03)
    now = datetime.now(UTC)
    time.sleep(0.03)
    return now


def _race(url: str, record: Record, writer_ids: tuple[str, str]) -> list[routelog.StepWriter]:
    """Two writers that decide to write ``record`` before either commits (each one's first log create waits for
    the other's upload): the log orders their commits."""
    both_built = threading.Barrier(2, timeout=60)
    writers = []
    for writer_id in writer_ids:
        store = routelog.open_store(url)
        before_first_log_create(store.storage, both_built.wait)
        writer = store.writer(0, writer_id, background=False)
        writer.append(record)
        writers.append(writer)
    threads = [threading.Thread(target=w.close) for w in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return writers


# -- seal after a drop, a race, a part drop ------------------------------------------------------------------------
def test_seal_after_a_drop_reads_what_the_step_read_before(tmp_path: Path) -> None:
    """The README's flow: drop one record, seal. The sealed step reads exactly the live records, and every command
    that reads it works."""
    url, store = _store(tmp_path)
    _write(store, "rollout-0", _records("s0", "s1", "s2", "s3"))
    store.drop(0, sample_ids=["s3"])
    before = _reads(url)
    seal = store.seal(0)
    assert seal.n_records == 4, "the consolidated index holds every stored row; readers apply the drop"
    after = routelog.open_store(url).step(0)
    assert after.sealed and sorted(after.sample_ids) == ["s0", "s1", "s2"]
    assert {k: v.tolist() for k, v in _reads(url).items()} == {k: v.tolist() for k, v in before.items()}
    assert verify_store(routelog.open_store(url)).ok
    assert not routelog.open_store(url).gc(3600, delete=True).damaged


def test_seal_after_a_drop_through_the_cli(tmp_path: Path) -> None:
    url = str(tmp_path / "run")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "routelog", *args], capture_output=True, text=True, timeout=300, check=False
        )

    assert cli("synth", url, "--step", "0", "--records", "4", "--tokens", "32", "--layers", "2").returncode == 0
    assert cli("drop", url, "--step", "0", "--sample", "000003").returncode == 0
    again = cli("drop", url, "--step", "0", "--sample", "000003")
    assert again.returncode == 0 and "already dropped" in again.stdout + again.stderr, "safe to run again"
    sealed = cli("seal", url, "--step", "0")
    assert sealed.returncode == 0 and "3 records, 96 tokens" in sealed.stdout, sealed.stdout
    for command in (["ls", url, "--step", "0"], ["stats", url], ["inspect", url], ["verify", url]):
        result = cli(*command)
        assert result.returncode == 0, (command, result.stderr)
    assert cli("gc", url, "--older-than", "1h").returncode == 0


def test_seal_after_a_race_reads_the_winner(tmp_path: Path) -> None:
    url, _ = _store(tmp_path)
    (record,) = _records("s0")
    writers = _race(url, record, ("a", "b"))
    assert sorted(len(w.already_present) for w in writers) == [0, 1], "the later writer's copy is not the one read"
    before = _reads(url)
    routelog.open_store(url).seal(0)
    snapshot = routelog.open_store(url).step(0)
    assert snapshot.sealed and snapshot.sample_ids == ["s0"] and len(snapshot.shadowed) == 1
    np.testing.assert_array_equal(_reads(url)["s0"], before["s0"])
    assert verify_store(routelog.open_store(url)).ok


def test_seal_after_a_part_drop_that_live_records_read_through(tmp_path: Path) -> None:
    """Records of another writer share the dropped part's prompt rows: sealed, they read the same, and gc keeps the
    part while they do."""
    url, store = _store(tmp_path)
    _write(store, "a", _records("s0"))
    _write(store, "b", _records("s2", "s4"))  # the same prompt as s0: their prompt rows point into a's part
    part_a = next(c.part for c in store.step(0).commits if c.writer_id == "a")
    assert any(s.part is not None for s in store.step(0).info("s2").spans), "b's records share a's rows"
    store.drop(0, parts=[part_a])
    before = _reads(url)
    store.seal(0)
    assert _reads(url).keys() == {"s2", "s4"}
    for sid, ids in _reads(url).items():
        np.testing.assert_array_equal(ids, before[sid])
    store.gc(3600, delete=True, now=time.time() + 7200)
    assert store.storage.find(keys.part_dir(0, part_a)), "gc keeps a dropped part live records read through"
    assert set(_reads(url)) == {"s2", "s4"} and verify_store(routelog.open_store(url)).ok


# -- drops apply to what existed when they were made ----------------------------------------------------------------
@pytest.mark.parametrize("variant", [0, 1], ids=["same tokens", "other tokens"])
def test_a_sample_id_written_again_after_its_drop_is_live(tmp_path: Path, variant: int) -> None:
    url, store = _store(tmp_path)
    _write(store, "a", _records("s0", "s1"))
    store.drop(0, sample_ids=["s0"])
    writer = _write(store, "a", _records("s0", variant=variant))
    assert writer.appended == 1 and writer.already_present == [], "reported committed"
    np.testing.assert_array_equal(_reads(url)["s0"], _expected("s0", variant)), "and read"
    assert routelog.open_store(url).step(0, as_of=_moment()).sample_ids == ["s1", "s0"]


def test_a_dropped_writer_id_used_again_writes_live_records(tmp_path: Path) -> None:
    url, store = _store(tmp_path)
    _write(store, "rollout-0", _records("s0"))
    store.drop(0, writers=["rollout-0"])
    assert routelog.open_store(url).step(0).sample_ids == []
    _write(store, "rollout-0", _records("s1"))
    assert routelog.open_store(url).step(0).sample_ids == ["s1"]
    assert store.drop(0, writers=["rollout-0"]).drop is not None, "the new part is the writer's live one"
    assert routelog.open_store(url).step(0).sample_ids == []


def test_a_writer_that_read_the_step_before_a_drop_writes_the_dropped_record_again(tmp_path: Path) -> None:
    """A re-send whose present copy was dropped after the writer read the step: found present at append, checked
    again at the flush, and written (never reported present while no reader reads it)."""
    url, store = _store(tmp_path)
    _write(store, "a", _records("s0"))
    writer = store.writer(0, "b", background=False)
    store.drop(0, sample_ids=["s0"])
    writer.append(_records("s0")[0])
    assert writer.already_present == ["s0"]  # as the writer last read the step
    writer.close()
    assert writer.already_present == [] and writer.appended == 1
    assert routelog.open_store(url).step(0).sample_ids == ["s0"]


# -- part-mates of dropped and shadowed records --------------------------------------------------------------------
def test_values_of_live_records_read_beside_dropped_and_shadowed_part_mates(tmp_path: Path) -> None:
    url, store = _store(tmp_path)
    (shared,) = _records("s0")
    _race(url, shared, ("a", "b"))  # one part's s0 is a shadowed copy
    _write(store, "c", _records("s1", "s2", "s3"))
    store.drop(0, sample_ids=["s2"])
    with store.annotate(0, "trainer") as annotator:
        annotator.add("s1", {LOGPROB_TRAIN: np.zeros(len(record_of("s1", 0)[1].tokens), np.float32)})
    snapshot = routelog.open_store(url).step(0)
    values = snapshot.token_values(snapshot.sample_ids, [LOGPROB_INFER, LOGPROB_TRAIN])
    assert sorted(values) == ["s0", "s1", "s3"]
    for sid in values:
        np.testing.assert_array_equal(values[sid][LOGPROB_INFER], record_of(sid, 0)[1].logprob_infer)
    assert LOGPROB_TRAIN in values["s1"] and LOGPROB_TRAIN not in values["s3"]
    store.drop(0, sample_ids=["s1"])
    _write(store, "c", _records("s1", variant=1))
    rewritten = routelog.open_store(url).step(0).token_values(["s1"], [LOGPROB_TRAIN])
    assert rewritten == {"s1": {}}, "an annotation made before the drop gives nothing to the record written after"


# -- shared rows never point at what may vanish --------------------------------------------------------------------
def test_a_writer_forgets_parts_dropped_whole(tmp_path: Path) -> None:
    """A writer that stored a prompt learns of its part's drop at its next read of the step and stores the prompt
    again instead of pointing at a part gc may reclaim."""
    url, store = _store(tmp_path)
    writer = store.writer(0, "a", background=False)
    writer.append(_records("s0")[0])
    (first,) = writer.flush()
    routelog.open_store(url).drop(0, parts=[first.part])
    writer.append(_records("s2")[0])  # the same prompt
    writer.close()
    info = routelog.open_store(url).step(0).info("s2")
    assert all(span.part is None for span in info.spans), "no span points into the dropped part"


def test_a_span_into_another_step_is_refused_at_write(tmp_path: Path) -> None:
    """The writer's shared-prefix index is per step; a commit whose spans reach outside the step is refused before
    it is created, naming the sample."""
    _url, store = _store(tmp_path)
    _write(store, "a", _records("s0"))
    writer = store.writer(1, "b", background=False)
    other = keys.part_dir(0, store.step(0).commits[0].part)
    writer._prefixes._ids[other] = 0  # a foreign key in the index: what a bug would have to do
    original = routelog.store.writer.build_part

    def build(*args: Any, **kwargs: Any) -> Any:
        built = original(*args, **kwargs)
        row = built.rows[0]
        spans = [row.spans[0].model_copy(update={"part": other}), *row.spans[1:]]
        built.rows[0] = row.model_copy(update={"spans": spans})
        return built

    routelog.store.writer.build_part = build  # type: ignore[assignment]
    try:
        writer.append(_records("s2")[0])
        with pytest.raises(WriterError, match=r"'s2'.*another step"):
            writer.close()
    finally:
        routelog.store.writer.build_part = original  # type: ignore[assignment]
    assert store.storage.list(keys.log_dir(1)) == []


# -- one winner, forever -------------------------------------------------------------------------------------------
def test_the_winner_of_a_race_does_not_depend_on_the_writers_clocks(tmp_path: Path) -> None:
    """Two engines routed the same tokens differently and both copies were committed in a race: readers read the
    first commit's copy, even when the second commit's clock says it came first (a host whose clock is behind)."""
    url, _ = _store(tmp_path)
    (record,) = _records("s0")
    _race(url, record, ("a", "b"))
    first = _reads(url)["s0"]
    root = Path(url.removeprefix("file://"))
    for position, shift in ((0, timedelta(hours=1)), (1, -timedelta(hours=1))):
        path = root / keys.log_key(0, position)
        doc = json.loads(path.read_text())
        for dated in [doc, *doc.get("commits", [])]:  # a commit entry and its commits carry one time
            dated["created_at"] = (datetime.fromisoformat(dated["created_at"]) + shift).isoformat()
        path.unlink()
        path.write_text(json.dumps(doc))
    snapshot = routelog.open_store(url).step(0)
    assert snapshot.shadowed[0].kept == keys.member_name(0, 0)
    np.testing.assert_array_equal(_reads(url)["s0"], first)


def test_a_drop_in_the_commit_window_of_a_re_send_writes_it_after_all(tmp_path: Path) -> None:
    """A re-send found present when the writer decided, whose present copy a drop removed before the writer's
    commit landed: the writer writes it after all (never reports present what no reader reads)."""
    url, store = _store(tmp_path)
    _write(store, "a", _records("s0"))
    writer_store = routelog.open_store(url)
    writer = writer_store.writer(0, "b", background=False)
    for record in _records("s0", "s1"):
        writer.append(record)
    before_first_log_create(writer_store.storage, lambda: routelog.open_store(url).drop(0, sample_ids=["s0"]))
    writer.close()
    assert writer.already_present == [] and sum(c.n_records for c in writer.commits) == 2
    assert sorted(_reads(url)) == ["s0", "s1"]
    assert [c.writer_id for c in routelog.open_store(url).step(0).commits] == ["a", "b", "b"]


def test_a_seal_in_the_commit_window_refuses_the_commit(tmp_path: Path) -> None:
    """A seal that lands between a writer's decision and its commit: the commit after it is never part of the
    step, and the writer says so (StepSealedError naming its records), never reports them committed."""
    url, store = _store(tmp_path)
    _write(store, "a", _records("s0"))
    writer_store = routelog.open_store(url)
    writer = writer_store.writer(0, "b", background=False)
    writer.append(_records("s1")[0])
    before_first_log_create(writer_store.storage, lambda: routelog.open_store(url).seal(0))
    with pytest.raises(WriterError, match="sealed") as raised:
        writer.close()
    assert raised.value.sample_ids == ["s1"] and writer.commits == []
    assert sorted(_reads(url)) == ["s0"] and verify_store(routelog.open_store(url)).ok


# -- as-of views ---------------------------------------------------------------------------------------------------
def test_as_of_counts_only_entries_made_by_then_sealed_or_not(tmp_path: Path) -> None:
    url, store = _store(tmp_path)
    _write(store, "a", _records("s0"))
    before_seal = _moment()
    late = routelog.open_store(url).writer(0, "late", background=False)
    late.append(_records("s1")[0])
    store.seal(0)
    with pytest.raises(WriterError, match="sealed"):
        late.close()
    after = _moment()
    assert routelog.open_store(url).step(0, as_of=before_seal).sample_ids == ["s0"]
    assert not routelog.open_store(url).step(0, as_of=before_seal).sealed
    at_end = routelog.open_store(url).step(0, as_of=after)
    assert at_end.sealed and at_end.sample_ids == ["s0"], "a commit after the seal never counts"
    naive = after.replace(tzinfo=None)
    assert routelog.open_store(url).step(0, as_of=naive).sample_ids == ["s0"], "a naive time is read as UTC"


# -- clocks: the storage's orders and ages everything, never a writer's nor gc's host's ---------------------------
def test_a_writer_whose_clock_runs_hours_behind_cannot_place_its_commit_in_the_past(tmp_path: Path) -> None:
    url, store = _store(tmp_path)
    _write(store, "a", _records("s0"))
    then = _moment()
    with skewed_clock(-5 * 3600):
        _write(routelog.open_store(url), "behind", _records("s1"))
        routelog.open_store(url).drop(0, sample_ids=["s0"])
    between = _moment()
    with skewed_clock(5 * 3600):
        _write(routelog.open_store(url), "ahead", _records("s2"))
    assert routelog.open_store(url).step(0, as_of=then).sample_ids == ["s0"], "what was stored later is not shown"
    assert routelog.open_store(url).step(0, as_of=between).sample_ids == ["s1"]
    assert sorted(routelog.open_store(url).step(0, as_of=_moment()).sample_ids) == ["s1", "s2"]


def test_gc_counts_a_dropped_part_s_grace_from_when_the_storage_stored_the_drop(tmp_path: Path) -> None:
    url, store = _store(tmp_path)
    _write(store, "a", _records("s0"))
    part = store.step(0).commits[0].part
    two_hours_ago = time.time() - 7200  # the part was written long ago: only its drop's grace keeps it
    for file in Path(url.removeprefix("file://"), keys.part_dir(0, part)).rglob("*"):
        os.utime(file, (two_hours_ago, two_hours_ago))
    with skewed_clock(-5 * 3600):  # the dropping host's clock says the drop is five hours old
        store.drop(0, parts=[part])
    routelog.open_store(url).gc(3600, delete=True)
    assert store.storage.find(keys.part_dir(0, part)), "an as-of view may read it for the grace period"
    routelog.open_store(url).gc(3600, delete=True, now=time.time() + 7200)
    assert not store.storage.find(keys.part_dir(0, part))


def test_gc_on_a_host_whose_clock_runs_hours_ahead_deletes_nothing_young(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc deletes by the storage's time now (it creates an object and reads its timestamp), so a host clock five
    hours ahead neither reclaims a part dropped a moment ago nor a part a live writer has yet to commit."""
    url, store = _store(tmp_path)
    _write(store, "a", _records("s0"))
    dropped = store.step(0).commits[0].part
    store.drop(0, parts=[dropped])
    writer_store = routelog.open_store(url)
    writer = writer_store.writer(0, "slow", background=False)
    writer.append(_records("s1")[0])

    def crash() -> None:
        raise RuntimeError("the writer's host went away between its upload and its commit")

    before_first_log_create(writer_store.storage, crash)
    with pytest.raises(Exception, match="went away"):
        writer.close()
    uncommitted = set(store.storage.list(keys.parts_dir(0))) - {c.part for c in store.step(0).commits}
    assert uncommitted
    real = time.time
    monkeypatch.setattr(routelog.store.gc.time, "time", lambda: real() + 5 * 3600)
    report = routelog.open_store(url).gc(3600, delete=True)
    assert not report.trees and not report.orphans and report.kept_young >= 1
    assert store.storage.find(keys.part_dir(0, dropped))
    assert all(store.storage.find(keys.part_dir(0, p)) for p in uncommitted)


def test_an_as_of_view_of_reclaimed_history_says_so(tmp_path: Path) -> None:
    url, store = _store(tmp_path)
    _write(store, "a", _records("s1"))
    then = _moment()
    part = store.step(0).commits[0].part
    store.drop(0, parts=[part])
    assert routelog.open_store(url).step(0, as_of=then).sample_ids == ["s1"], "kept for the grace period"
    store.gc(3600, delete=True, now=time.time() + 7200)
    assert not store.storage.find(keys.part_dir(0, part))
    with pytest.raises(HistoryReclaimedError, match="reclaimed"):
        routelog.open_store(url).step(0, as_of=then)
    assert routelog.open_store(url).step(0).sample_ids == []


def test_an_as_of_view_whose_shared_rows_gc_reclaimed_says_so(tmp_path: Path) -> None:
    """A record read through a shared prefix keeps the part it points at only while it is live: once it is dropped
    and gc reclaims that part, an as-of view from when it was live is refused, not read short of its rows."""
    url, store = _store(tmp_path)
    _write(store, "a", _records("s0"))
    _write(store, "b", _records("s2"))  # s2's prompt rows point into a's part
    part_a = next(c.part for c in store.step(0).commits if c.writer_id == "a")
    store.drop(0, parts=[part_a])
    then = _moment()
    store.gc(3600, delete=True, now=time.time() + 7200)
    assert store.storage.find(keys.part_dir(0, part_a)), "kept while s2 reads through it"
    store.drop(0, sample_ids=["s2"])
    store.gc(3600, delete=True, now=time.time() + 7200)
    assert not store.storage.find(keys.part_dir(0, part_a))
    with pytest.raises(HistoryReclaimedError, match=part_a):
        routelog.open_store(url).step(0, as_of=then)
    assert routelog.open_store(url).step(0).sample_ids == []


# -- durability ----------------------------------------------------------------------------------------------------
def test_a_commit_is_on_stable_storage_before_it_is_reported(tmp_path: Path) -> None:
    """On local disk every object of the part, the log entry, and each directory holding a new name are fsynced
    before the writer returns the commit."""
    url, store = _store(tmp_path)
    synced: list[str] = []
    original = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        original(fd)

    os.fsync = fsync
    try:
        writer = store.writer(0, "a", background=False)
        writer.append(_records("s0")[0])
        (commit,) = writer.flush()
    finally:
        os.fsync = original
    root = f"{tmp_path}/{url.rsplit('/', 1)[1]}"
    part = f"{root}/{keys.part_dir(0, commit.part)}"
    log = f"{root}/{keys.log_dir(0)}"
    for obj in commit.objects:  # written in place (a name no reader reads before the commit), fsynced, its directory
        path = f"{part}/{obj.key}"
        assert path in synced and os.path.dirname(path) in synced, obj.key
    assert any(p.startswith(f"{log}/.0000000000.json.") for p in synced) and log in synced
    assert synced.index(log) > max(i for i, p in enumerate(synced) if p.startswith(part)), "data before the entry"
    assert f"{root}/{keys.parts_dir(0)}" in synced, "a new part directory is durable in its parent"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_commits_on_fsync_threads_of_its_own(tmp_path: Path) -> None:
    """A process starts its fsync threads once; a child it forks has none of them, and its commits start their own
    (handing the fsyncs to the parent's idle threads would wait for ever)."""
    url, store = _store(tmp_path)
    _write(store, "parent", _records("p0"))  # the parent's fsync threads are started, and idle now
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child's outcome is its exit code)
        code = 1
        try:
            _write(routelog.open_store(url), "child", _records("c0"))
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while (finished := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if finished[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's commit did not finish in 60 s")
    assert os.waitstatus_to_exitcode(finished[1]) == 0
    assert sorted(routelog.open_store(url).step(0).sample_ids) == ["c0", "p0"]


@pytest.mark.parametrize("operation", ["append", "flush", "close", "abort", "process writer"])
def test_a_writer_inherited_by_a_forked_child_refuses_at_once(tmp_path: Path, operation: str) -> None:
    """A child forked while the parent's writer is open has none of its threads: whatever it calls on that writer
    raises ForkedWriterError at once (naming both processes), never waits; the parent's writer goes on."""
    url, store = _store(tmp_path)
    if operation == "process writer":
        writer: Any = routelog.ProcessWriter(url, 0, writer_id="parent")
    else:
        writer = store.writer(0, "parent")
    writer.append(_records("p0")[0])
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child reports through the pipe)
        outcome = "no error"
        try:
            started = time.monotonic()
            try:
                if operation == "append":
                    writer.append(_records("c0")[0])
                else:
                    getattr(writer, "flush" if operation == "process writer" else operation)()
            except Exception as error:  # reported to the parent, which asserts on it
                outcome = f"{type(error).__name__} {time.monotonic() - started:.3f} {error}"
        finally:
            os.write(write, outcome.encode())
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60
    while (finished := os.waitpid(pid, os.WNOHANG)[0]) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    if finished == 0:  # the child waits on threads it does not have: the failure this test is about
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        outcome = pipe.read()
    name, seconds, message = outcome.split(" ", 2)
    assert name == "ForkedWriterError" and float(seconds) < 1.0, outcome
    assert f"opened by process {os.getpid()}, and this is process {pid}" in message
    writer.append(_records("p1")[0])
    writer.close()
    assert sorted(routelog.open_store(url).step(0).sample_ids) == ["p0", "p1"]


# -- ambiguous and unanswered creates --------------------------------------------------------------------------------
@pytest.fixture
def proxied(s3_fault_proxy: FaultProxy, s3_bucket: str) -> tuple[str, dict[str, Any], FaultProxy]:
    s3_fault_proxy.clear()
    options = {"endpoint_url": s3_fault_proxy.endpoint, "skip_instance_cache": True}
    url = f"s3://{s3_bucket}/{uuid.uuid4().hex[:8]}"
    routelog.create_store(url, SPEC, storage_options=options)
    return url, options, s3_fault_proxy


@pytest.mark.parametrize("operation", ["commit", "seal", "drop", "annotation", "fidelity"])
def test_a_lost_response_to_a_create_the_storage_applied_is_the_creates_own(
    proxied: tuple[str, dict[str, Any], FaultProxy], operation: str
) -> None:
    """The proxy forwards the conditional PUT and drops the answer: the client's retry meets 412 for its own
    object. Every kind of create reads it back and counts it once, never as another's."""
    url, options, proxy = proxied
    store = routelog.open_store(url, storage_options=options)
    _write(store, "a", _records("s0", "s1"))
    fault = Fault("lost_response", method="PUT", header="If-None-Match", times=1)
    try:
        proxy.inject(fault)
        if operation == "commit":
            _write(store, "b", _records("s2"))
        elif operation == "seal":
            store.seal(0)
        elif operation == "drop":
            store.drop(0, sample_ids=["s1"])
        elif operation == "annotation":
            with store.annotate(0, "trainer") as annotator:
                annotator.add("s0", {LOGPROB_TRAIN: np.zeros(len(record_of("s0", 0)[1].tokens), np.float32)})
        else:
            counts = StepFidelity(samples=2)
            counts.add(1, 40, 3)
            write_fidelity(store, 0, "rank-0", counts)
        assert proxy.counts["lost_response"] == 1, "the fault fired"
    finally:
        proxy.clear()
    reopened = routelog.open_store(url, storage_options=options)
    snapshot = reopened.step(0)
    names = reopened.storage.list(keys.log_dir(0))
    assert names == [keys.log_name(i) for i in range(len(names))]
    kinds = [json.loads(reopened.storage.read(f"{keys.log_dir(0)}/{n}"))["kind"] for n in names]
    expected_kind = {
        "commit": "routelog.commit",
        "seal": "routelog.seal",
        "drop": "routelog.drop",
        "annotation": "routelog.annotation",
    }
    if operation in expected_kind:
        assert kinds.count(expected_kind[operation]) == (2 if operation == "commit" else 1), kinds
    if operation == "seal":
        assert snapshot.sealed and reopened.storage.exists(keys.seal_key(0))
    if operation == "drop":
        assert snapshot.sample_ids == ["s0"]
    if operation == "fidelity":
        assert len(reopened.storage.list(keys.fidelity_dir(0))) == 1, "one document, not two"
    assert verify_store(reopened).ok


def test_an_unanswered_commit_is_undecided_not_refused(tmp_path: Path) -> None:
    """Every attempt of the commit's create fails and the entry is not there when read back: the writer cannot know
    whether a delayed request will land, and says so."""
    _url, store = _store(tmp_path)
    original = routelog.store.storage._create_file

    def unanswered(path: str, data: bytes) -> None:
        if "/log/" in path:
            raise TimeoutError("no answer")
        original(path, data)

    store.storage.sleep = lambda _seconds: None
    writer = store.writer(0, "a", background=False)
    writer.append(_records("s0")[0])
    routelog.store.storage._create_file = unanswered  # type: ignore[assignment]
    try:
        with pytest.raises(WriterError) as info:
            writer.flush()
    finally:
        routelog.store.storage._create_file = original  # type: ignore[assignment]
    assert isinstance(info.value.__cause__, CommitUndecidedError)
    assert "safe" in str(info.value)


# -- symbolic links, timestamps, full disks --------------------------------------------------------------------------
@pytest.mark.parametrize("link", ["step", "sealed"])
def test_gc_never_follows_a_symbolic_link(tmp_path: Path, link: str) -> None:
    url, store = _store(tmp_path)
    _write(store, "a", _records("s0"))
    store.seal(0)
    outside = tmp_path / "outside"
    (outside / "parts" / "x.00000000.00").mkdir(parents=True)
    victim = outside / "parts" / "x.00000000.00" / "index.parquet"
    victim.write_bytes(b"not the store's")
    (outside / "old.commits.json").write_bytes(b"not the store's either")
    old = time.time() - 10 * 86400
    for path in (victim, outside / "old.commits.json"):
        os.utime(path, (old, old))
    root = Path(url.removeprefix("file://"))
    if link == "step":
        (root / keys.step_dir(7)).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(outside, root / keys.step_dir(7))
    else:  # the seal's objects moved beside the victim's, the directory a link to them: readers still read them
        sealed = root / keys.step_dir(0) / keys.SEALED_DIR
        for path in sealed.iterdir():
            shutil.move(path, outside / path.name)
        sealed.rmdir()
        os.symlink(outside, sealed)
        assert routelog.open_store(url).step(0).sample_ids == ["s0"]
    report = routelog.open_store(url).gc(3600)
    assert report.damaged and any("symbolic link" in d for d in report.damaged), report.damaged
    with pytest.raises(GcRefusedError):
        routelog.open_store(url).gc(3600, delete=True)
    assert victim.read_bytes() == b"not the store's" and (outside / "old.commits.json").exists()
    with pytest.raises(UnsafeKeyError, match="symbolic link"):
        store.storage.find(keys.step_dir(7) if link == "step" else f"{keys.step_dir(0)}/{keys.SEALED_DIR}")


def test_timestamps_without_an_offset_are_read_as_utc(tmp_path: Path) -> None:
    """Documents written by another tool with naive times: plain reads, a race's winner, as-of reads and gc all
    work, reading them as UTC."""
    url, store = _store(tmp_path)
    _write(store, "a", _records("s0", "s1"))
    store.drop(0, sample_ids=["s1"])
    for name in store.storage.list(keys.log_dir(0)):
        key = f"{keys.log_dir(0)}/{name}"
        doc = json.loads(store.storage.read(key))
        doc["created_at"] = doc["created_at"].removesuffix("Z").split("+")[0]
        os.remove(f"{url.removeprefix('file://')}/{key}")
        store.storage.write(key, json.dumps(doc).encode())
    reopened = routelog.open_store(url)
    assert reopened.step(0).sample_ids == ["s0"]
    assert reopened.step(0, as_of=_moment()).sample_ids == ["s0"]
    assert reopened.step(0, as_of=datetime(2000, 1, 1, tzinfo=UTC)).sample_ids == []
    assert not reopened.gc(3600, delete=True, now=time.time() + 86400).damaged
    assert verify_store(reopened).ok


def test_a_full_disk_while_a_part_is_built_fails_its_records_with_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On local disk a part's shard goes to its file as it is compressed: a full disk there fails the part's
    records with the storage's typed error (not as records that cannot be stored), commits nothing, and the writer
    goes on once there is space again."""
    url, store = _store(tmp_path)
    _write(store, "a", _records("s0"))

    def full(*args: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    writer = store.writer(0, "b")
    for record in _records("s1", "s2"):
        writer.append(record)
    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(WriterError, match="no space left on the device") as failed:
        writer.flush()
    assert sorted(failed.value.sample_ids) == ["s1", "s2"]
    assert isinstance(failed.value.__cause__, StoreError) and "routelog gc" in str(failed.value.__cause__)
    assert routelog.open_store(url).step(0).sample_ids == ["s0"]
    monkeypatch.undo()
    for record in _records("s1", "s2"):  # nothing of them was kept: they are appended again
        writer.append(record)
    writer.close()
    assert sorted(_reads(url)) == ["s0", "s1", "s2"]
    assert verify_store(routelog.open_store(url)).ok


@pytest.mark.parametrize("operation", ["drop", "seal"])
def test_a_full_disk_in_drop_and_seal_is_a_typed_error_that_changes_nothing(tmp_path: Path, operation: str) -> None:
    url, store = _store(tmp_path)
    _write(store, "a", _records("s0", "s1"))
    original = routelog.store.storage._durable_temporary

    def full(directory: str, name: str, data: bytes) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    routelog.store.storage._durable_temporary = full  # type: ignore[assignment]
    try:
        with pytest.raises(StoreError, match="no space left"):
            store.drop(0, sample_ids=["s1"]) if operation == "drop" else store.seal(0)
    finally:
        routelog.store.storage._durable_temporary = original  # type: ignore[assignment]
    snapshot = routelog.open_store(url).step(0)
    assert sorted(snapshot.sample_ids) == ["s0", "s1"] and not snapshot.sealed
    assert verify_store(routelog.open_store(url)).ok
    if operation == "drop":  # once space is back it works
        assert store.drop(0, sample_ids=["s1"]).drop is not None
    else:
        assert store.seal(0).n_records == 2


# -- older readers and stores ----------------------------------------------------------------------------------------
def test_a_format_2_store_written_by_a_later_format_is_refused_by_a_format_2_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A format-3 (or later) writer appends to a step of a format-2 store through its log, after creating the marker
    a format-2 reader parses and refuses: no older routelog reads the step without the entries it cannot see."""
    shutil.copytree(GOLDEN / "golden-v2" / "grpo-96", tmp_path / "store")
    url = str(tmp_path / "store")
    store = routelog.open_store(url)
    step = store.steps()[0]
    before = sorted(store.step(step).sample_ids)
    dropped = before[0]
    store.drop(step, sample_ids=[dropped])
    assert sorted(routelog.open_store(url).step(step).sample_ids) == before[1:]
    assert store.storage.exists(f"{keys.commits_dir(step)}/{keys.LEGACY_MARKER}")
    store.seal(step)
    assert sorted(routelog.open_store(url).step(step).sample_ids) == before[1:]
    assert verify_store(routelog.open_store(url)).ok
    written = routelog.format.documents.FORMAT_VERSION
    monkeypatch.setattr(routelog.format.documents, "FORMAT_VERSION", 2)
    with pytest.raises(FormatVersionError, match=f"format version {written}"):
        routelog.format.documents.parse_document(
            store.storage.read(f"{keys.commits_dir(step)}/{keys.LEGACY_MARKER}"),
            routelog.format.documents.CommitRecord,
            "marker",
        )
