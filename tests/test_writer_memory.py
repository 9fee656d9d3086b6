"""A writer's memory: a part's rows are never held twice, let go as they are encoded, and appends wait while the
background holds too many bytes (routelog.format.row_blocks, routelog.format.mapped, the writer's backpressure)."""

from __future__ import annotations

import gc
import queue
import tempfile
import threading
import uuid
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import routelog
from routelog import PartOptions, Record
from routelog.format import mapped
from routelog.format.dedup import PrefixIndex
from routelog.format.part import build_part
from routelog.format.record import PreparedRecord, prepare_record
from routelog.format.row_blocks import RowBlocks
from routelog.format.shard import WrittenFile, encode_shard, encode_shards
from routelog.store.storage import WRITE_PIECE_BYTES, MappedBody, Storage
from routelog.store.writer import HELD_FLUSHES
from routelog.synth import synthetic_spec
from tests.records import random_routing

SPEC = synthetic_spec(layers=6, experts=32, topk=4)


def _blocks(draw: st.DrawFn) -> tuple[list[np.ndarray], int]:
    layers = draw(st.integers(1, 7))
    sizes = draw(st.lists(st.integers(0, 9), min_size=1, max_size=6))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 250, (layers, m, 3), dtype=np.uint8) for m in sizes], layers


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_row_blocks_read_as_their_concatenation(data: st.DataObject) -> None:
    blocks, layers = _blocks(data.draw)
    whole = np.concatenate(blocks, axis=1)
    rows = RowBlocks(layers, 3, np.dtype(np.uint8))
    starts = [rows.append(block) for block in blocks]
    assert starts == list(np.cumsum([0, *(b.shape[1] for b in blocks)])[:-1])
    assert rows.n == whole.shape[1]
    start = data.draw(st.integers(0, rows.n))
    stop = data.draw(st.integers(start, rows.n))
    first = data.draw(st.integers(0, layers))
    last = data.draw(st.integers(first, layers))
    np.testing.assert_array_equal(rows.rows(start, stop, slice(first, last)), whole[first:last, start:stop])
    if rows.n:
        positions = np.array(data.draw(st.lists(st.integers(0, rows.n - 1), min_size=1, max_size=12)), np.int64)
        np.testing.assert_array_equal(rows.take(positions), whole[:, positions])
    rows.release(slice(0, layers))
    np.testing.assert_array_equal(rows.rows(0, rows.n), whole), "releasing rows not consumed changes nothing"


def test_consumed_rows_go_back_to_the_os_layer_by_layer() -> None:
    """A consumed block's released layers are discarded (their pages read as zeros: nothing reads them again); the
    layers not released yet are intact."""
    block = mapped.empty((4, 16384, 8), np.uint8)  # 512 KiB: mapped
    block[:] = 9
    rows = RowBlocks(4, 8, np.dtype(np.uint8))
    rows.append(block)
    rows.append(block[:, 100:])  # a record stored after a shared prefix: each layer's rows are a contiguous run
    assert isinstance(mapped.empty((1, 1 << 18), np.uint8).base.base, memoryview)
    rows.release(slice(0, 2))
    assert (block == 9).all(), "not consumed: nothing is discarded"
    rows.consume()
    rows.release(slice(0, 2))
    assert not block[:2].any(), "the released layers' pages went back"
    assert (block[2:] == 9).all(), "the other layers are untouched"
    small = np.full((2, 3, 8), 5, np.uint8)  # malloc's: never discarded
    mapped.discard(small)
    assert (small == 5).all()


def test_a_block_of_another_shape_is_refused() -> None:
    rows = RowBlocks(2, 3, np.dtype(np.uint8))
    with pytest.raises(ValueError, match="does not fit"):
        rows.append(np.zeros((2, 4, 4), np.uint8))
    with pytest.raises(IndexError):
        rows.rows(0, 1)


def _prepared(rng: np.random.Generator, sizes: list[int], spec: Any = SPEC, token_ids: bool = False) -> list[Any]:
    records = []
    for i, m in enumerate(sizes):
        record = Record(
            sample_id=f"s{i}",
            expert_ids=random_routing(rng, m, spec.num_moe_layers, spec.num_experts, spec.topk),
            prompt_len=1,
            response_len=m - 1,
            token_ids=rng.integers(0, 1000, m) if token_ids else None,
        )
        records.append(prepare_record(record, spec, 0, "sorted"))
    return records


def _one_record(records: list[PreparedRecord], spec: Any) -> list[PreparedRecord]:
    """One prepared record holding the records' rows concatenated (each already a sorted set, layer-major)."""
    whole = np.concatenate([r.rows for r in records], axis=1)
    record = Record(
        sample_id="all",
        expert_ids=np.ascontiguousarray(np.moveaxis(whole, 0, 1)),
        prompt_len=1,
        response_len=whole.shape[1] - 1,
    )
    return [prepare_record(record, spec, 0, "sorted")]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_a_part_encodes_from_its_records_blocks_to_the_bytes_of_one_array(data: st.DataObject) -> None:
    """Chunks gathered across the records' own arrays, by a build that keeps them or one that consumes them, are
    stored as the same bytes as the chunks of one concatenated array."""
    spec = synthetic_spec(layers=data.draw(st.integers(1, 9)), experts=32, topk=4)
    seed = data.draw(st.integers(0, 2**16))
    sizes = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=5))

    def prepared() -> list[PreparedRecord]:
        return _prepared(np.random.default_rng(seed), sizes, spec)

    records = prepared()
    chunk_layers = data.draw(st.integers(1, 4))
    options = PartOptions(
        chunk_rows=data.draw(st.sampled_from([8, 16, 64])),
        chunk_layers=chunk_layers,
        transform=data.draw(st.sampled_from(["ranked_gaps", "sorted_gaps"])),
        dedup="off",
        shard_layers=data.draw(st.sampled_from([None, chunk_layers])),
    )

    def arrays(objects: dict[str, Any]) -> dict[str, bytes]:
        return {key: bytes(value) for key, value in objects.items() if key.startswith("routing/")}

    one_array = arrays(build_part(_one_record(records, spec), spec, options).objects)
    assert arrays(build_part(records, spec, options).objects) == one_array
    assert not any(r.released for r in records), "a build that does not consume leaves the records whole"
    copies = prepared()
    assert arrays(build_part(records, spec, options, consume=True).objects) == one_array
    assert all(r.released and r.rows.shape[1] == 0 for r in records), "the consuming build took their rows"
    # written to their files as they are compressed: the same bytes, none held, the rows let go as they go
    with tempfile.TemporaryDirectory() as root:
        storage = Storage.open(root)
        released: list[int] = []
        built = build_part(
            copies,
            spec,
            options,
            consume=True,
            sink=lambda key, capacity, start: storage.file_sink(f"part/{key}", start),
            on_release=released.append,
        )
        shards = {key: data for key, data in built.objects.items() if key.startswith("routing/c")}
        assert shards and all(isinstance(data, WrittenFile) for data in shards.values())
        assert {key: storage.read(f"part/{key}") for key in shards} == {key: one_array[key] for key in shards}
        assert built.memory_nbytes == sum(len(v) for k, v in built.objects.items() if k not in shards)
        assert sum(released) == sum(r.raw_nbytes for r in copies), "every row is let go, and told"
        in_memory = build_part(prepared(), spec, options)
        assert built.object_infos() == in_memory.object_infos(), "the commit names the same objects and digests"


def test_encode_shard_of_an_array_is_one_of_encode_shards() -> None:
    rng = np.random.default_rng(5)
    records = _prepared(rng, [50, 30])
    built = build_part(records, SPEC, PartOptions(chunk_rows=16, dedup="off"))
    from routelog.format.part import shard_layout

    layout = shard_layout(built.routing)
    whole = np.concatenate([r.rows for r in records], axis=1)
    shard = encode_shard(whole, layout, 3)
    assert bytes(shard) == bytes(built.objects["routing/" + layout.shard_key()])
    assert {k: bytes(v) for k, v in encode_shards(whole, layout, 3).items()} == {layout.shard_key(): bytes(shard)}


def _alive(records: list[PreparedRecord]) -> list[weakref.ref[np.ndarray]]:
    return [weakref.ref(r.rows) for r in records]


def test_a_consuming_build_lets_the_rows_go_unless_the_prefix_index_keeps_them() -> None:
    """Rows no later record can share (no token ids) are freed by the build; rows candidates point at stay with
    the writer's prefix index, which compares later records against them."""
    rng = np.random.default_rng(7)
    options = PartOptions(dedup="step")
    plain = _prepared(rng, [40, 40])
    refs = _alive(plain)
    built = build_part(plain, SPEC, options, PrefixIndex(), "steps/0/parts/a", consume=True)
    gc.collect()
    assert built.routing.n_rows == 80
    assert [ref() for ref in refs] == [None, None], "nothing keeps the rows of records without token ids"

    shared = _prepared(rng, [40, 40], token_ids=True)
    refs = _alive(shared)
    prefixes = PrefixIndex()
    build_part(shared, SPEC, options, prefixes, "steps/0/parts/b", consume=True)
    gc.collect()
    assert all(ref() is not None for ref in refs), "the prefix index keeps rows that later records may share"
    assert not any(r.released for r in shared)
    assert prefixes.nbytes >= sum(ref().nbytes for ref in refs)  # type: ignore[union-attr]


def test_mapped_buffers() -> None:
    small = mapped.empty((2, 3), np.uint16)
    large = mapped.empty((4, mapped.MAPPED_MIN_BYTES), np.uint8)
    assert small.shape == (2, 3) and small.dtype == np.uint16
    assert large.shape == (4, mapped.MAPPED_MIN_BYTES) and large.flags.writeable
    large[:] = 7
    assert int(large.sum()) == 7 * large.size
    buffer = mapped.Buffer(1 << 20, start=4)
    buffer.add(b"abc")
    buffer.add(b"de")
    data = buffer.finish(b"HEAD")
    assert len(data) == 9 and bytes(data) == b"HEADabcde"


def test_appends_wait_while_the_background_holds_too_many_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """With one part being uploaded the next is still buffered and built; with two held, an append waits until the
    upload lets go of its bytes, and nothing is lost."""
    store = routelog.create_store(f"memory://writer-memory/{uuid.uuid4().hex}", SPEC)
    rng = np.random.default_rng(11)
    tokens = 400
    records = [
        Record(
            sample_id=f"r{i}",
            expert_ids=random_routing(rng, tokens, SPEC.num_moe_layers, SPEC.num_experts, SPEC.topk),
            prompt_len=1,
            response_len=tokens - 1,
        )
        for i in range(3)
    ]
    raw = tokens * SPEC.num_moe_layers * SPEC.topk
    gate = threading.Event()
    real_write_many = store.storage.write_many
    uploads: list[int] = []

    def held_write_many(objects: Any) -> None:
        uploads.append(len(objects))
        assert gate.wait(timeout=60), "the test never opened the gate"
        real_write_many(objects)

    monkeypatch.setattr(store.storage, "write_many", held_write_many)
    writer = store.writer(0, "w", flush_bytes=raw // 4, flush_seconds=None, max_pending=8)
    writer.append(records[0])  # its part is built, then held at its upload
    writer.append(records[1])  # one part being uploaded holds nothing back
    appended = threading.Event()

    def third() -> None:
        writer.append(records[2])
        appended.set()

    thread = threading.Thread(target=third, daemon=True)
    thread.start()
    assert not appended.wait(timeout=1.0), "two parts hold more than HELD_FLUSHES flush buffers: the append must wait"
    assert writer.pending_parts == 2 and HELD_FLUSHES <= 2  # each part holds its objects, several flush buffers
    gate.set()
    assert appended.wait(timeout=60)
    thread.join(timeout=60)
    writer.close()
    assert sorted(store.step(0).sample_ids) == ["r0", "r1", "r2"]
    for record in records:
        routing = store.step(0).read(record.sample_id)
        expected = np.sort(np.asarray(record.expert_ids), axis=-1).transpose(1, 0, 2)
        np.testing.assert_array_equal(routing.by_layer[:, routing.valid], expected[:, routing.valid])
        assert routing.valid.sum() >= tokens - 1


class BackpressureMachine(RuleBasedStateMachine):
    """An engine thread appends records of any size (several flush buffers, or a few rows) while uploads are held
    and let go, and flushes come between: the bytes the writer counts as held by its parts are never negative and
    return to nothing once it is idle, no append waits forever whatever the order, and every record is committed
    once and reads back. (That an append waits while the background holds too much is
    ``test_appends_wait_while_the_background_holds_too_many_bytes``.)"""

    FLUSH = 6 * 4 * 40  # 40 rows of SPEC's 6 layers x K = 4, in bytes

    def __init__(self) -> None:
        super().__init__()
        self.store = routelog.create_store(f"memory://writer-memory/{uuid.uuid4().hex}", SPEC)
        self.gate = threading.Event()
        self.gate.set()
        real_write_many = self.store.storage.write_many

        def gated_write_many(objects: Any) -> None:
            assert self.gate.wait(timeout=60), "uploads were held past the test"
            real_write_many(objects)

        self.store.storage.write_many = gated_write_many  # type: ignore[method-assign]
        self.writer = self.store.writer(0, "w", flush_bytes=self.FLUSH, flush_seconds=None, max_pending=8)
        self.rng = np.random.default_rng(0)
        self.records: dict[str, Record] = {}
        self.work: queue.Queue[Record | None] = queue.Queue()
        self.engine = threading.Thread(target=self._engine, daemon=True)
        self.engine.start()

    def _engine(self) -> None:
        while (record := self.work.get()) is not None:
            self.writer.append(record)

    @rule(tokens=st.integers(2, 120))
    def append(self, tokens: int) -> None:
        sid = f"s{len(self.records)}"
        record = Record(
            sample_id=sid,
            expert_ids=random_routing(self.rng, tokens, SPEC.num_moe_layers, SPEC.num_experts, SPEC.topk),
            prompt_len=1,
            response_len=tokens - 1,
        )
        self.records[sid] = record
        self.work.put(record)

    @rule()
    def hold_uploads(self) -> None:
        self.gate.clear()

    @rule()
    def let_uploads_go(self) -> None:
        self.gate.set()

    @rule()
    def flush(self) -> None:
        self.gate.set()
        self.work.put(None)  # the engine finishes its appends first
        self.engine.join(timeout=120)
        assert not self.engine.is_alive(), "an append never returned"
        self.writer.flush()
        with self.writer._lock:
            assert (self.writer._held_bytes, self.writer._pending) == (0, 0)
        self.engine = threading.Thread(target=self._engine, daemon=True)
        self.engine.start()

    @invariant()
    def the_accounting_holds(self) -> None:
        with self.writer._lock:
            assert self.writer._held_bytes >= 0 and self.writer._pending >= 0

    def teardown(self) -> None:
        self.flush()
        self.work.put(None)
        self.engine.join(timeout=60)
        self.writer.close()
        if not self.records:
            assert self.store.steps() == []
            return
        step = self.store.step(0)
        assert sorted(step.sample_ids) == sorted(self.records)
        for sid, record in self.records.items():
            routing = step.read(sid)
            expected = np.sort(np.asarray(record.expert_ids), axis=-1).transpose(1, 0, 2)
            np.testing.assert_array_equal(routing.by_layer[:, routing.valid], expected[:, routing.valid])


BackpressureMachine.TestCase.settings = settings(max_examples=15, stateful_step_count=25, deadline=None)
test_backpressure_interleavings = BackpressureMachine.TestCase


def test_s3_uploads_read_a_mapped_object_in_place_whole_and_in_parts(s3_bucket: str) -> None:
    """A mapped shard goes to S3 as a file read in place (:class:`MappedBody`), in one PUT or, above s3fs' chunk
    size, as a multipart upload of its slices; the objects read back byte for byte."""
    storage = Storage.open(f"s3://{s3_bucket}/mapped")
    rng = np.random.default_rng(7)
    buffer = mapped.Buffer(12 << 20, start=4)
    buffer.add(rng.integers(0, 256, (11 << 20) + 3, dtype=np.uint8).tobytes())
    data = buffer.finish(b"HEAD")
    storage.write_many({"one/shard": data, "one/small": b"plain bytes"})
    assert storage.read("one/shard") == bytes(data)
    assert storage.read("one/small") == b"plain bytes"
    # s3fs cuts an object of at least twice its chunk size into parts, each a slice of the body
    storage.fs.pipe_file(storage.path("parts/shard"), MappedBody(data), chunksize=5 << 20)
    assert storage.read("parts/shard") == bytes(data)


def test_local_files_larger_than_a_write_piece_are_written_whole(tmp_path: Path) -> None:
    """Local objects go to disk a piece at a time (:data:`WRITE_PIECE_BYTES`): a mapped shard and bytes objects of a
    piece and more, through every local write path (a part's new files, a replaced object, a create), read back byte
    for byte."""
    storage = Storage.open(str(tmp_path))
    rng = np.random.default_rng(11)
    buffer = mapped.Buffer(3 * WRITE_PIECE_BYTES, start=4)
    buffer.add(rng.integers(0, 256, 2 * WRITE_PIECE_BYTES + 5, dtype=np.uint8).tobytes())
    shard = buffer.finish(b"HEAD")
    exact = rng.integers(0, 256, WRITE_PIECE_BYTES, dtype=np.uint8).tobytes()
    longer = rng.integers(0, 256, WRITE_PIECE_BYTES + 1, dtype=np.uint8).tobytes()
    storage.write_many({"part/shard": shard, "part/exact": exact, "part/small": b"x"})
    storage.write("replaced", longer)
    assert storage.create("created", longer + exact)
    assert storage.read("part/shard") == bytes(shard) and len(shard) == 2 * WRITE_PIECE_BYTES + 9
    assert storage.read("part/exact") == exact and storage.read("part/small") == b"x"
    assert storage.read("replaced") == longer
    assert storage.read("created") == longer + exact
    assert not storage.create("created", b"other") and storage.read("created") == longer + exact


def test_a_mapped_body_reads_seeks_and_slices_like_a_file() -> None:
    data = bytes(range(256)) * 3
    body = MappedBody(memoryview(data))
    assert len(body) == len(data) and body.seekable() and body.readable()
    assert body.read(10) == data[:10] and body.tell() == 10
    assert body.seek(-6, 2) == len(data) - 6 and body.read() == data[-6:] and body.read() == b""
    assert body.seek(3) == 3 and body.seek(4, 1) == 7 and body.read(2) == data[7:9]
    part = body[100:300]
    assert len(part) == 200 and part.read() == data[100:300]
