"""The writer process: records cross into it through shared memory and JSON (no pickle) and read back exactly;
a record it refuses is reported at the caller's next call, naming the sample; no shared memory is left behind. A
writer process that is killed, stops answering or cannot start is reported as such (real signals, real processes),
naming the records not known to be committed, and nothing waits on it forever."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import routelog
from routelog import ProcessWriter, Record, Segment
from routelog.errors import StoreError
from routelog.store.process_writer import WriterProcessError
from routelog.store.writer import WriterError
from routelog.synth import synthetic_spec
from tests.records import random_routing, sample_records

SPEC = synthetic_spec(layers=4, experts=32, topk=4)


def _record(rng: np.random.Generator, sid: str, n: int) -> Record:
    valid = np.ones(n, bool)
    valid[-1] = False
    return Record(
        sample_id=sid,
        expert_ids=random_routing(rng, n, SPEC.num_moe_layers, SPEC.num_experts, SPEC.topk),
        prompt_len=3,
        response_len=n - 3,
        valid=valid,
        token_ids=rng.integers(0, 1000, n),
        group_id="g",
        policy_version=2,
        segments=[Segment(start=0, end=3, source="prompt"), Segment(start=3, end=n, source="response")],
        extra={"reward": 0.5},
        token_values={"logprob_infer": rng.normal(size=n).astype(np.float32)},
        weights=rng.random((n, SPEC.num_moe_layers, SPEC.topk)).astype(np.float32),
    )


def _segments() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_records_written_through_the_process_read_back_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    records = [_record(rng, f"r{i}", int(rng.integers(5, 300))) for i in range(12)]
    created: list[str] = []  # the segments this test's writers create (tests running beside it make their own)

    class Recorded(shared_memory.SharedMemory):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if kwargs.get("create"):
                created.append(self.name)

    monkeypatch.setattr(shared_memory, "SharedMemory", Recorded)
    url = str(tmp_path / "store")
    with ProcessWriter(url, 0, model_spec=SPEC, writer_id="engine", segments=2) as writer:
        for record in records[:8]:
            writer.append(record)
        writer.flush()
        assert writer.appended == 8 and writer.already_present == []
        assert "8 appended, 0 already present" in repr(writer) and "open" in repr(writer)
    assert "closed" in repr(writer)
    with ProcessWriter(url, 0, model_spec=SPEC, writer_id="engine", segments=2) as again:  # a rerun, as after a crash
        for record in records:
            again.append(record)
    # the counters an in-process writer keeps: the step already held the first 8
    assert again.appended == 4 and sorted(again.already_present) == sorted(r.sample_id for r in records[:8])
    assert created and not set(created) & _segments(), "the shared memory is freed"
    snapshot = routelog.open_store(url).step(0)
    got = {r.sample_id: r for r in snapshot.read_many([r.sample_id for r in records], weights=True)}
    values = snapshot.token_values([r.sample_id for r in records], ["logprob_infer"])
    for record in records:
        back = got[record.sample_id]
        valid = np.asarray(record.valid)
        np.testing.assert_array_equal(back.expert_ids[valid], np.sort(np.asarray(record.expert_ids), -1)[valid])
        assert back.info.segments == list(record.segments) and back.info.extra == '{"reward": 0.5}'
        assert back.info.token_hash == routelog.token_hash(np.asarray(record.token_ids))
        np.testing.assert_array_equal(
            values[record.sample_id]["logprob_infer"], np.asarray(record.token_values["logprob_infer"])
        )  # type: ignore[index]
        assert back.weights is not None and not np.isnan(back.weights[:, valid]).any()


def test_a_refused_record_is_reported_at_the_next_call_naming_it(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    good, bad = _record(rng, "good", 20), _record(rng, "bad", 20)
    ids = np.asarray(bad.expert_ids).copy()
    ids[4, 1] = [0, 0, 1, 2]  # a repeated expert
    bad = Record(**{**bad.__dict__, "expert_ids": ids})
    url = str(tmp_path / "store")
    writer = ProcessWriter(url, 0, model_spec=SPEC, writer_id="engine")
    writer.append(bad)
    # The next call after the refusal arrives raises it: the flush at the latest (it waits for the writer process's
    # answer). An append in between could meet it too, depending on how fast the writer process answers.
    with pytest.raises(WriterError, match=r"'bad'.*repeats an expert") as caught:
        writer.flush()
    assert caught.value.sample_ids == ["bad"]
    writer.append(good)
    writer.close()
    assert routelog.open_store(url).step(0).sample_ids == ["good"], "the good record is committed"


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="POSIX process priorities")
def test_the_writer_process_runs_at_a_lower_priority_than_the_engine(tmp_path: Path) -> None:
    spec = synthetic_spec(2, 16, 2)
    with ProcessWriter(str(tmp_path / "store"), 0, model_spec=spec, niceness=7) as writer:
        engine = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, writer._child.pid) == min(19, engine + 7)
    with ProcessWriter(str(tmp_path / "store2"), 0, model_spec=spec, niceness=0) as writer:
        assert os.getpriority(os.PRIO_PROCESS, writer._child.pid) == os.getpriority(os.PRIO_PROCESS, 0)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity (Linux)")
def test_the_writer_process_keeps_to_the_cpus_it_is_given(tmp_path: Path) -> None:
    spec = synthetic_spec(2, 16, 2)
    engine = os.sched_getaffinity(0)
    writer_cpus = {max(engine)}
    with ProcessWriter(str(tmp_path / "store"), 0, model_spec=spec, cpus=writer_cpus) as writer:
        assert os.sched_getaffinity(writer._child.pid) == writer_cpus
        writer.append(
            Record(sample_id="a", expert_ids=np.array([[[0, 1], [2, 3]]], np.uint8), prompt_len=0, response_len=1)
        )
    assert os.sched_getaffinity(0) == engine  # the engine's own mask is untouched
    assert routelog.open_store(str(tmp_path / "store")).step(0).read("a").expert_ids.tolist() == [[[0, 1], [2, 3]]]
    with ProcessWriter(str(tmp_path / "store2"), 0, model_spec=spec) as writer:
        assert os.sched_getaffinity(writer._child.pid) == engine  # by default the child inherits the engine's
    for wrong in (set(), {os.cpu_count() or 1}, {-1}):
        with pytest.raises(ValueError, match="cpus="):
            ProcessWriter(str(tmp_path / "store3"), 0, model_spec=spec, cpus=wrong)


def _small(sid: str) -> Record:
    return Record(sample_id=sid, expert_ids=np.array([[[0, 1], [2, 3]]], np.uint8), prompt_len=0, response_len=1)


def _left_behind(names: Iterable[str]) -> list[str]:
    return [name for name in names if os.path.exists(f"/dev/shm/{name}")]


def _stop(pid: int) -> None:
    """SIGSTOP the process and wait (bounded) until it is stopped: it answers nothing from then on."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.01)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_writer_process_is_reported_naming_every_record_not_flushed(tmp_path: Path, signum: int) -> None:
    spec = synthetic_spec(2, 16, 2)
    url = str(tmp_path / "store")
    appended: list[str] = []
    segments: list[str] = []

    writer = ProcessWriter(url, 0, model_spec=spec, writer_id="engine", segments=2)

    def write() -> None:
        with writer:
            writer.append(_small("flushed"))
            writer.flush()
            for i in range(3):
                writer.append(_small(f"r{i}"))
                appended.append(f"r{i}")
            segments.extend(writer._segments)
            os.kill(writer.pid, signum)
            for i in range(3, 10_000):  # appends go on until one sees the death (the pipe breaks, the pool runs dry)
                appended.append(f"r{i}")
                writer.append(_small(f"r{i}"))

    with pytest.raises(WriterProcessError) as caught:  # raised once: leaving the block does not raise it again
        write()
    error = caught.value
    assert isinstance(error, WriterError)
    assert error.sample_ids == appended, "every record appended since the acknowledged flush, this one included"
    assert error.returncode == -signum
    assert f"killed by {signal.Signals(signum).name}" in str(error) and "'r0', 'r1', 'r2'" in str(error)
    assert _left_behind(segments) == [], "every shared-memory segment is unlinked"
    for call in (lambda: writer.append(_small("later")), writer.flush):
        with pytest.raises(WriterProcessError) as again:
            call()
        assert again.value is error
    writer.close()  # reported already; closing again does nothing
    writer.close()
    with ProcessWriter(url, 0, writer_id="engine") as retry:  # the fix the message gives
        for sid in error.sample_ids:
            retry.append(_small(sid))
    assert sorted(routelog.open_store(url).step(0).sample_ids) == sorted(["flushed", *appended])


def test_a_writer_process_that_dies_during_a_flush_fails_the_flush(tmp_path: Path) -> None:
    writer = ProcessWriter(str(tmp_path / "store"), 0, model_spec=synthetic_spec(2, 16, 2))
    writer.append(_small("a"))
    writer.flush()
    writer.append(_small("b"))
    writer.append(_small("c"))
    segments = list(writer._segments)
    _stop(writer.pid)  # the flush below waits on a process that does not answer
    raised: list[BaseException] = []

    def flush() -> None:
        try:
            writer.flush()
        except BaseException as exc:  # handed to the test's thread
            raised.append(exc)

    flushing = threading.Thread(target=flush)
    flushing.start()
    os.kill(writer.pid, signal.SIGKILL)  # dies with the flush (sent or about to be) unanswered
    flushing.join(timeout=120)
    assert not flushing.is_alive(), "the flush did not return after the writer process died"
    assert len(raised) == 1 and isinstance(raised[0], WriterProcessError), raised
    assert raised[0].sample_ids == ["b", "c"] and "killed by SIGKILL" in str(raised[0])
    assert _left_behind(segments) == []
    writer.close()


def test_close_after_the_writer_process_was_killed_raises_once_and_frees_everything(tmp_path: Path) -> None:
    writer = ProcessWriter(str(tmp_path / "store"), 0, model_spec=synthetic_spec(2, 16, 2))
    writer.append(_small("a"))
    segments = list(writer._segments)
    os.kill(writer.pid, signal.SIGKILL)
    with pytest.raises(WriterProcessError, match="killed by SIGKILL") as caught:
        writer.close()
    assert caught.value.sample_ids == ["a"]
    assert _left_behind(segments) == []
    writer.close()  # idempotent
    with pytest.raises(WriterProcessError):
        writer.append(_small("b"))


def test_close_kills_a_writer_process_that_does_not_answer(tmp_path: Path) -> None:
    writer = ProcessWriter(str(tmp_path / "store"), 0, model_spec=synthetic_spec(2, 16, 2), close_timeout=1)
    writer.append(_small("a"))
    segments = list(writer._segments)
    _stop(writer.pid)
    killed = r"did not answer 'close' within 1 s \(close_timeout\) and was killed"
    with pytest.raises(WriterProcessError, match=killed) as caught:
        writer.close()
    assert caught.value.sample_ids == ["a"] and caught.value.returncode == -signal.SIGKILL
    assert _left_behind(segments) == []
    writer.close()


@pytest.mark.parametrize("call", ["flush", "append"])
def test_a_stopped_writer_process_fails_a_flush_or_an_append_within_its_bound(tmp_path: Path, call: str) -> None:
    """A writer process that stops answering (SIGSTOP, a host under memory pressure): a flush, or an append that
    needs a segment the process holds, waits at most ``answer_timeout``, then kills the process by its PID and raises
    naming the records not acknowledged, which a new writer re-sends."""
    url, spec = str(tmp_path / "store"), synthetic_spec(2, 16, 2)
    # 5 s: the first flush, answered, must not meet the bound on a loaded CI machine (1 s did, once)
    writer = ProcessWriter(url, 0, model_spec=spec, answer_timeout=5, segments=2)
    writer.append(_small("a"))
    writer.flush()
    writer.append(_small("b"))
    pid = writer.pid
    _stop(pid)
    started = time.monotonic()

    def waits() -> None:
        if call == "flush":
            writer.flush()
        for sid in ("c", "d", "e"):  # two segments: the third append waits for one the process never frees
            writer.append(_small(sid))

    with pytest.raises(WriterProcessError, match=r"within 5 s \(answer_timeout\) and was killed") as caught:
        waits()
    assert time.monotonic() - started < 20
    assert "b" in caught.value.sample_ids and "a" not in caught.value.sample_ids
    assert caught.value.returncode == -signal.SIGKILL
    writer.close()
    with ProcessWriter(url, 0, model_spec=spec) as again:
        for sid in caught.value.sample_ids:
            again.append(_small(sid))
    assert sorted(routelog.open_store(url).step(0).sample_ids) == sorted({"a", *caught.value.sample_ids})


def test_a_writer_process_that_cannot_start_says_why(tmp_path: Path) -> None:
    spec = synthetic_spec(2, 16, 2)
    with pytest.raises(StoreError, match=r"(?s)did not start: it exited with code 1.*StoreNotFoundError: no routelog"):
        ProcessWriter(str(tmp_path / "missing"), 0)
    routelog.create_store(str(tmp_path / "store"), spec)
    with pytest.raises(StoreError, match=r"(?s)exited with code 1.*ModelSpecError: store .* holds routing of model"):
        ProcessWriter(str(tmp_path / "store"), 0, model_spec=synthetic_spec(3, 16, 2))


@pytest.mark.parametrize("answers", [True, False])
def test_a_writer_process_commits_through_the_committer_its_engine_shares(tmp_path: Path, answers: bool) -> None:
    """Writer processes of several engines on one host commit through the committer the engines' processes share
    (their lookups and commits come up the pipe as JSON); one whose committer does not answer commits through its
    own, and nothing is lost."""
    from routelog.format.documents import CommitGroup, parse_log_document
    from routelog.store.committer import Committer, CommitterUnavailableError

    url = f"file://{tmp_path}/store"
    store = routelog.create_store(url, SPEC)
    shared = Committer(routelog.open_store(url), committer_id="engines")

    class Unanswered:
        shared = True

        def lookup(self, request: Any) -> Any:
            raise CommitterUnavailableError("down")

        def commit(self, request: Any) -> Any:
            raise CommitterUnavailableError("down")

    committer: Any = shared if answers else Unanswered()
    writers = [ProcessWriter(url, 0, writer_id=f"engine-{i}", committer=committer, niceness=0) for i in range(2)]
    for i, writer in enumerate(writers):
        for record in sample_records(SPEC, 3, seed=i, prefix=f"e{i}/"):
            writer.append(record)
    for writer in writers:
        writer.close()
    names = store.storage.list("steps/0000000000/log")
    entries = [parse_log_document(store.storage.read(f"steps/0000000000/log/{n}"), n) for n in names]
    assert all(isinstance(e, CommitGroup) for e in entries)
    assert {e.committer for e in entries} == ({"engines"} if answers else {"engine-0", "engine-1"})
    assert sorted(routelog.open_store(url).step(0).sample_ids) == sorted(
        f"e{i}/s{k}" for i in range(2) for k in range(3)
    )
