"""Streaming writers: background uploads with backpressure and time-based flushes, retries of transient faults,
permanent faults surfaced, idempotent restarts, sealing, reading as of a time, and garbage collection."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest

import routelog
from routelog import ModelSpec, Record, StepSealedError
from routelog.format import keys
from routelog.format.part import PartOptions, build_part
from routelog.format.record import prepare_record
from routelog.store.gc import collect_garbage, parse_duration
from routelog.store.storage import Storage
from routelog.store.store import Store
from routelog.store.verify import verify_store
from routelog.store.writer import WriterError
from routelog.testing import FaultyFileSystem, faulty_storage

SPEC = ModelSpec(name="stream", num_layers=4, moe_layers=(1, 2, 3), num_experts=16, topk=2)


def records(n: int, seed: int = 0, prefix: str = "r", tokens: int = 24) -> Iterator[Record]:
    rng = np.random.default_rng(seed)
    for i in range(n):
        ids = np.argsort(rng.random((tokens, 3, 16)), axis=-1)[..., :2]
        yield Record(
            sample_id=f"{prefix}{i:04d}",
            expert_ids=ids,
            prompt_len=4,
            response_len=tokens - 4,
            token_ids=rng.integers(0, 500, tokens),
        )


def committed_ids(store: Store, step: int = 0) -> list[str]:
    return routelog.open_store(store.url).step(step).sample_ids if store.storage.protocol != "faulty" else []


class GatedFileSystem(FaultyFileSystem):
    """Holds every write until the test opens the gate: uploads that take as long as the test wants."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner, rate=0.0)
        self.gate = threading.Event()
        self.waiting = threading.Event()

    def pipe(self, path: Any, value: Any = None, **kwargs: Any) -> Any:
        self.waiting.set()
        if not self.gate.wait(timeout=30):
            raise TimeoutError("the test never opened the gate")
        return super().pipe(path, value, **kwargs)


def gated_store(url: str) -> tuple[Store, GatedFileSystem]:
    clean = routelog.create_store(url, SPEC)
    gated = GatedFileSystem(clean.storage.fs)
    return Store(Storage(url=clean.url, fs=gated, root=clean.storage.root), clean.run), gated


def test_append_does_not_wait_for_uploads_and_backpressure_bounds_memory(memory_url: str) -> None:
    store, gated = gated_store(memory_url)
    batch = list(records(8))
    one = prepare_record(batch[0], SPEC, 0, "sorted").raw_nbytes
    writer = store.writer(0, "w", flush_bytes=one, max_pending=1, flush_seconds=None)
    writer.append(batch[0])  # part 1: taken by the uploader, which now waits at the gate
    assert gated.waiting.wait(timeout=10)
    writer.append(batch[1])  # part 2: queued (max_pending = 1)
    assert writer.commits == [], "appends returned while the first upload is still in flight"
    blocked = threading.Thread(target=writer.append, args=(batch[2],), daemon=True)
    blocked.start()
    blocked.join(timeout=0.5)
    assert blocked.is_alive(), "a third full part must wait for room in the queue (backpressure)"
    assert writer.pending_parts <= 3
    gated.gate.set()
    blocked.join(timeout=30)
    assert not blocked.is_alive()
    for record in batch[3:]:
        writer.append(record)
    writer.close()
    assert sorted(committed_ids(store)) == [r.sample_id for r in batch]


def test_parts_are_flushed_by_age(memory_url: str) -> None:
    store = routelog.create_store(memory_url, SPEC)
    writer = store.writer(0, "w", flush_seconds=0.2)
    writer.append(next(records(1)))
    deadline = time.monotonic() + 10
    while not writer.commits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(writer.commits) == 1, "an old enough buffer is committed without flush() or close()"
    assert committed_ids(store) == ["r0000"]
    writer.close()


@pytest.mark.parametrize("after_rate", [0.0, 1.0], ids=["before", "lost-response"])
def test_transient_faults_are_retried(store_url: str, after_rate: float) -> None:
    routelog.create_store(store_url, SPEC)
    storage, faulty = faulty_storage(store_url, rate=0.3, seed=3, after_rate=after_rate)
    store = Store.on(storage)
    with store.writer(0, "w", flush_bytes=2000) as writer:
        for record in records(30):
            writer.append(record)
    assert faulty.injected > 5
    clean = routelog.open_store(store_url)
    assert sorted(clean.step(0).sample_ids) == [f"r{i:04d}" for i in range(30)], "every record exactly once"
    assert verify_store(clean).ok


def test_permanent_faults_surface_with_the_key_and_commit_nothing(memory_url: str) -> None:
    routelog.create_store(memory_url, SPEC)
    storage, _ = faulty_storage(memory_url, rate=0.0, permanent=r"index\.parquet")
    store = Store.on(storage)
    writer = store.writer(0, "w")
    for record in records(3):
        writer.append(record)
    with pytest.raises(WriterError, match=r"index\.parquet") as info:
        writer.close()
    assert info.value.sample_ids == ["r0000", "r0001", "r0002"]
    assert isinstance(info.value.__cause__, PermissionError)
    clean = routelog.open_store(memory_url)
    assert not clean.storage.list(keys.commits_dir(0)), "nothing half-committed"
    assert verify_store(clean).ok


def test_retries_are_bounded(memory_url: str) -> None:
    routelog.create_store(memory_url, SPEC)
    storage, _ = faulty_storage(memory_url, rate=1.0, after_rate=0.0)
    with pytest.raises(routelog.StoreError, match="failed after 12 attempts"):
        Store.on(storage)


def test_restarted_writer_skips_what_it_already_committed(store_url: str) -> None:
    store = routelog.create_store(store_url, SPEC)
    batch = list(records(10))
    first = store.writer(0, "rollout-7", flush_bytes=1, background=False)
    for record in batch[:5]:
        first.append(record)  # each append commits (flush_bytes=1); then the process "dies" without close()
    second = store.writer(0, "rollout-7")
    for record in batch:  # the caller re-sends everything
        second.append(record)
    second.close()
    assert second.already_present == [r.sample_id for r in batch[:5]]
    assert sorted(routelog.open_store(store_url).step(0).sample_ids) == [r.sample_id for r in batch]
    changed = next(records(1, seed=99))
    third = store.writer(0, "rollout-7")
    with pytest.raises(routelog.DuplicateSampleError, match="other tokens"):
        third.append(changed)
    third.abort()


def test_sealing_is_exactly_once_and_closes_the_step(store_url: str) -> None:
    store = routelog.create_store(store_url, SPEC)
    for w in range(3):
        with store.writer(0, f"w{w}", flush_bytes=1500) as writer:
            for record in records(6, seed=w, prefix=f"w{w}-"):
                writer.append(record)
    late = store.writer(0, "late")
    late.append(next(records(1, prefix="late-")))
    before = store.step(0)
    seal = store.seal(0)
    assert seal.n_records == 18
    assert store.seal(0) == seal, "sealing again is safe: the step's one seal"
    with pytest.raises(StepSealedError, match="sealed"):
        store.writer(0, "another")
    with pytest.raises(WriterError) as info:
        late.close()
    assert isinstance(info.value.__cause__, StepSealedError)
    after = routelog.open_store(store_url).step(0)
    assert after.sealed
    assert after.sample_ids == before.sample_ids
    for a, b in zip(after.read_many(after.sample_ids), before.read_many(before.sample_ids), strict=True):
        np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
    assert verify_store(routelog.open_store(store_url)).ok


def test_a_sealed_step_reads_in_four_requests_whatever_its_parts(memory_url: str) -> None:
    store = routelog.create_store(memory_url, SPEC)
    with store.writer(0, "w", flush_bytes=1) as writer:
        for record in records(40):
            writer.append(record)  # 40 parts
    store.seal(0)
    reopened = routelog.open_store(memory_url)
    calls: list[str] = []
    for name in ("read", "read_many", "list", "list_after"):
        original = getattr(reopened.storage, name)

        def counting(*args: Any, _original: Callable[..., Any] = original, _name: str = name, **kw: Any) -> Any:
            calls.append(_name)
            return _original(*args, **kw)

        setattr(reopened.storage, name, counting)
    snapshot = reopened.step(0)
    assert len(snapshot) == 40
    assert calls == ["read", "read_many", "list_after"], "the seal, its two consolidated objects in a batch, the log"


def test_reading_as_of_an_earlier_time(memory_url: str) -> None:
    store = routelog.create_store(memory_url, SPEC)
    with store.writer(0, "a") as writer:
        writer.append(next(records(1, prefix="early-")))
    middle = datetime.now(UTC)
    time.sleep(0.01)
    with store.writer(0, "b") as writer:
        writer.append(next(records(1, prefix="late-")))
    assert store.step(0, as_of=middle).sample_ids == ["early-0000"]
    assert sorted(store.step(0).sample_ids) == ["early-0000", "late-0000"]
    store.seal(0)
    assert store.step(0, as_of=middle).sample_ids == ["early-0000"], "a seal made later does not count"


def test_gc_removes_only_old_orphans(store_url: str) -> None:
    store = routelog.create_store(store_url, SPEC)
    with store.writer(0, "w") as writer:
        for record in records(3):
            writer.append(record)
    # A writer that died between its upload and its commit:
    built = build_part([prepare_record(r, SPEC, 0, "sorted") for r in records(2, prefix="dead-")], SPEC, PartOptions())
    orphan = keys.part_dir(0, keys.new_part_name("dead", 0))
    store.storage.write_many({f"{orphan}/{k}": v for k, v in built.objects.items()})
    young = collect_garbage(store, parse_duration("1h"))
    assert young.orphans == {}
    assert young.kept_young == len(built.objects)
    later = time.time() + 7200
    dry = collect_garbage(store, parse_duration("1h"), now=later)
    assert sorted(dry.orphans) == sorted(f"{orphan}/{k}" for k in built.objects)
    assert not dry.deleted
    assert store.storage.exists(f"{orphan}/{keys.INDEX}")
    done = collect_garbage(store, parse_duration("1h"), delete=True, now=later)
    assert done.deleted
    assert not store.storage.exists(f"{orphan}/{keys.INDEX}")
    reopened = routelog.open_store(store_url)
    assert reopened.step(0).sample_ids == ["r0000", "r0001", "r0002"]
    assert verify_store(reopened).ok
    assert not verify_store(reopened).notes, "no orphan left"


def test_parse_duration() -> None:
    assert parse_duration("90") == 90
    assert parse_duration("15m") == 900
    assert parse_duration("2d") == 172800
    with pytest.raises(ValueError, match="duration"):
        parse_duration("soon")
