"""The shared store suite: every test runs on memory://, file:// and s3:// (a real moto server over HTTP)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import routelog
from routelog import (
    CorruptDataError,
    DuplicateSampleError,
    FormatVersionError,
    ModelSpec,
    ModelSpecError,
    PartOptions,
    Record,
    RecordNotFoundError,
    StoreNotFoundError,
)
from routelog.format import keys
from routelog.format.documents import FORMAT_VERSION, CommitRecord, IndexRow, ObjectInfo, Span
from routelog.format.part import index_to_parquet
from routelog.store.gc import collect_garbage
from routelog.store.storage import Storage
from routelog.store.verify import verify_store
from tests.records import replace_commit, sample_records

MakeRouting = Callable[..., np.ndarray]


def _records(spec: ModelSpec, n: int, seed: int, prefix: str = "") -> list[Record]:
    return sample_records(spec, n, seed, prefix, holes=True)


def _expected(record: Record, layers: list[int] | None = None) -> np.ndarray:
    ids = np.sort(record.expert_ids, axis=-1).astype(np.int16)
    if layers is not None:
        ids = ids[:, layers]
    ids[~np.asarray(record.valid)] = -1
    return ids


def test_round_trip_with_missing_rows_and_layer_subsets(
    store_url: str, dense_first_spec: ModelSpec, make_routing: MakeRouting
) -> None:
    records = _records(dense_first_spec, 7, seed=0)
    with routelog.open_writer(store_url, step=3, model_spec=dense_first_spec, writer_id="w0") as writer:
        for record in records:
            writer.append(record)
    store = routelog.open_store(store_url)
    assert store.steps() == [3]
    snapshot = store.step(3)
    assert snapshot.sample_ids == [r.sample_id for r in records]
    for got, record in zip(snapshot.read_many(snapshot.sample_ids), records, strict=True):
        np.testing.assert_array_equal(got.expert_ids, _expected(record))
        np.testing.assert_array_equal(got.valid, record.valid)
        assert got.layers == dense_first_spec.moe_layers
        assert got.info.token_hash == routelog.token_hash(np.asarray(record.token_ids))
        assert got.info.group_id == record.group_id
        assert got.info.policy_version == 7
    for subset in ([0], [1, 2], [0, 2, 4], [4]):
        (got,) = snapshot.read_many(["s4"], moe_layers=subset)
        np.testing.assert_array_equal(got.expert_ids, _expected(records[4], subset))
        assert got.layers == tuple(dense_first_spec.moe_layers[j] for j in subset)


def test_many_parts_and_two_writers_in_one_step(
    store_url: str, small_spec: ModelSpec, make_routing: MakeRouting
) -> None:
    first = _records(small_spec, 6, seed=1, prefix="a-")
    second = _records(small_spec, 5, seed=2, prefix="b-")
    options = PartOptions(chunk_rows=16, chunk_layers=4)
    store = routelog.create_store(store_url, small_spec)
    with store.writer(0, "a", options=options, flush_bytes=1500) as wa, store.writer(0, "b", options=options) as wb:
        for ra, rb in zip(first, [*second, None], strict=True):
            wa.append(ra)
            if rb is not None:
                wb.append(rb)
    assert len(wa.commits) > 1, "a small flush size must produce several parts"
    snapshot = routelog.open_store(store_url).step(0)
    assert sorted(snapshot.sample_ids) == sorted(r.sample_id for r in first + second)
    assert len(snapshot.commits) == len(wa.commits) + len(wb.commits)
    wanted = [r.sample_id for r in first + second][::-1]
    by_id = {r.sample_id: r for r in first + second}
    for got in snapshot.read_many(wanted, moe_layers=[1, 2, 5]):
        np.testing.assert_array_equal(got.expert_ids, _expected(by_id[got.sample_id], [1, 2, 5]))
    assert verify_store(routelog.open_store(store_url)).ok


def test_score_order_and_many_experts(store_url: str, make_routing: MakeRouting) -> None:
    spec = ModelSpec(num_layers=3, moe_layers=(0, 2), num_experts=384, topk=8)
    rng = np.random.default_rng(5)
    ids = make_routing(rng, 40, 2, 384, 8)
    store = routelog.create_store(store_url, spec)
    with store.writer(0, options=PartOptions(topk_order="score")) as writer:
        writer.append(Record(sample_id="x", expert_ids=ids, prompt_len=10, response_len=30))
    got = routelog.open_store(store_url).step(0).read("x")
    assert got.topk_order == "score"
    np.testing.assert_array_equal(got.expert_ids, ids), "score order is kept exactly"
    assert got.by_layer.dtype == np.uint16


def test_exclusive_create_on_every_backend(store_url: str) -> None:
    storage = Storage.open(store_url)
    assert storage.create("x/claim.json", b"1")
    assert not storage.create("x/claim.json", b"2")
    assert storage.read("x/claim.json") == b"1"


def test_a_local_exclusive_create_is_never_seen_half_written(tmp_path: Path) -> None:
    # A reader polling the name while a large object is created sees it absent or whole: an exclusive open would
    # show the name first, then the bytes as they are written (a commit a sealer or a reader finds empty).
    storage = Storage.open(f"file://{tmp_path}/store")
    path = tmp_path / "store" / "steps" / "big.json"
    data = bytes(range(256)) * (1 << 18)  # 64 MiB: its write takes long enough for many polls
    seen: set[int] = set()
    done = threading.Event()

    def poll() -> None:
        deadline = time.monotonic() + 30
        while not done.is_set() and time.monotonic() < deadline:
            try:
                seen.add(path.stat().st_size)
            except FileNotFoundError:
                seen.add(-1)

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        assert storage.create("steps/big.json", data)
    finally:
        done.set()
        reader.join()
    assert seen <= {-1, len(data)}, f"sizes seen while creating: {sorted(seen)[:5]}"
    assert storage.read("steps/big.json") == data
    assert sorted(p.name for p in path.parent.iterdir()) == ["big.json"], "no temporary file is left behind"
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    assert path.stat().st_mode == plain.stat().st_mode, "created with the permissions of any new file"


def test_a_temporary_left_by_a_writer_killed_mid_create_is_not_listed_and_breaks_nothing(
    tmp_path: Path, small_spec: ModelSpec
) -> None:
    url = f"file://{tmp_path}/store"
    store = routelog.create_store(url, small_spec)
    with store.writer(0, "w") as writer:
        writer.append(_records(small_spec, 1, seed=3)[0])
    log = tmp_path / "store" / keys.log_dir(0)
    (log / ".0000000001.json.0123abcd.tmp").write_bytes(b'{"half": ')  # killed before its link
    assert Storage.open(url).list(keys.log_dir(0)) == ["0000000000.json"]
    snapshot = routelog.open_store(url).step(0)
    assert len(snapshot.sample_ids) == 1
    assert verify_store(routelog.open_store(url)).ok
    assert collect_garbage(routelog.open_store(url), older_than=0.0, force=True).damaged == []


def test_a_local_filesystem_without_hard_links_still_creates_exclusively(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(source: str, target: str) -> None:
        raise OSError(errno.EPERM, "hard links are not supported here", target)

    monkeypatch.setattr(os, "link", no_links)
    storage = Storage.open(f"file://{tmp_path}/store")
    assert storage.create("x/claim.json", b"1")
    assert not storage.create("x/claim.json", b"2")
    assert storage.read("x/claim.json") == b"1"
    assert sorted(p.name for p in (tmp_path / "store" / "x").iterdir()) == ["claim.json"]


def test_missing_store_and_spec_mismatch(store_url: str, small_spec: ModelSpec) -> None:
    with pytest.raises(StoreNotFoundError, match="no routelog store"):
        routelog.open_store(store_url)
    store = routelog.create_store(store_url, small_spec, config={"lr": 1e-6})
    assert routelog.create_store(store_url, small_spec).run.run_id == store.run.run_id
    other = small_spec.model_copy(update={"num_experts": 64})
    with pytest.raises(ModelSpecError, match="Use a new URL"):
        routelog.create_store(store_url, other)
    assert routelog.open_store(store_url).run.config == {"lr": 1e-6}
    with pytest.raises(RecordNotFoundError, match="no steps yet"):
        store.step(0)
    with store.writer(0, "w") as writer:
        writer.append(_records(small_spec, 1, seed=2)[0])
    with pytest.raises(RecordNotFoundError, match="not committed"):
        store.step(0).read("nothing")
    with pytest.raises(RecordNotFoundError, match=r"its steps are \[0\]"):
        store.step(7)


def test_future_format_version_and_unknown_features(
    store_url: str, small_spec: ModelSpec, make_routing: MakeRouting
) -> None:
    store = routelog.create_store(store_url, small_spec)
    with store.writer(0, "w") as writer:
        writer.append(_records(small_spec, 1, seed=3)[0])
    commit_key = keys.log_key(0, 0)
    commit = json.loads(store.storage.read(commit_key))
    store.storage.write(commit_key, json.dumps({**commit, "features": ["prefix-dedup-v9"]}).encode())
    with pytest.raises(FormatVersionError, match="prefix-dedup-v9"):
        routelog.open_store(store_url).step(0)
    run = json.loads(store.storage.read(keys.RUN_DOCUMENT))
    store.storage.write(keys.RUN_DOCUMENT, json.dumps({**run, "format_version": FORMAT_VERSION + 1}).encode())
    with pytest.raises(FormatVersionError, match=f"format version {FORMAT_VERSION + 1}"):
        routelog.open_store(store_url)


def _shard_key(store: routelog.Store, step: int) -> str:
    (commit,) = store.step(step).commits
    shard = next(o.key for o in commit.objects if o.key.startswith("routing/c/"))
    return f"{keys.part_dir(step, commit.part)}/{shard}"


def test_corruption_is_detected_and_named(store_url: str, small_spec: ModelSpec, make_routing: MakeRouting) -> None:
    store = routelog.create_store(store_url, small_spec)
    with store.writer(0, "w", options=PartOptions(chunk_rows=16, chunk_layers=2)) as writer:
        for record in _records(small_spec, 4, seed=4):
            writer.append(record)
    key = _shard_key(store, 0)
    data = bytearray(store.storage.read(key))
    data[-10] ^= 0x55  # the last inner chunk: last layers of the last rows, i.e. sample s3
    store.storage.write(key, bytes(data))
    snapshot = routelog.open_store(store_url).step(0)
    snapshot.read("s0", moe_layers=[0, 1])  # untouched chunks still read
    with pytest.raises(CorruptDataError, match=r"s3") as info:
        snapshot.read("s3")
    assert key in str(info.value) or key.split("/")[-4] in str(info.value)
    report = verify_store(routelog.open_store(store_url))
    assert not report.ok
    assert any("SHA-256" in p for p in report.problems)


def test_missing_object_is_detected(store_url: str, small_spec: ModelSpec, make_routing: MakeRouting) -> None:
    store = routelog.create_store(store_url, small_spec)
    with store.writer(0, "w") as writer:
        writer.append(_records(small_spec, 1, seed=6)[0])
    store.storage.delete([_shard_key(store, 0)])
    with pytest.raises(CorruptDataError, match="missing"):
        routelog.open_store(store_url).step(0).read("s0")
    assert any("missing" in p for p in verify_store(routelog.open_store(store_url)).problems)


def test_restarted_writer_continues_its_sequence(
    store_url: str, small_spec: ModelSpec, make_routing: MakeRouting
) -> None:
    records = _records(small_spec, 3, seed=7)
    store = routelog.create_store(store_url, small_spec)
    with store.writer(2, "rollout-1") as writer:
        writer.append(records[0])
    with store.writer(2, "rollout-1") as writer:  # the same id after a restart
        writer.append(records[1])
    commits = store.step(2).commits
    assert [(c.writer_id, c.seq, c.name) for c in commits] == [
        ("rollout-1", 0, "0000000000.00000.json"),
        ("rollout-1", 1, "0000000001.00000.json"),
    ]
    assert all(c.part.startswith(f"rollout-1.{c.seq:08d}.") for c in commits)
    assert routelog.open_store(store_url).step(2).sample_ids == ["s0", "s1"]


def test_committing_a_sample_again_is_skipped_or_refused(store_url: str, small_spec: ModelSpec) -> None:
    """A re-run (same record, another writer) is skipped; with on_duplicate="error" it is refused; a record of the
    same id with other tokens is always refused."""
    first, other = _records(small_spec, 2, seed=8)
    store = routelog.create_store(store_url, small_spec)
    with store.writer(0, "a") as writer:
        writer.append(first)
    with store.writer(0, "b") as writer:
        writer.append(first)
        assert writer.already_present == [first.sample_id] and writer.appended == 0
    with store.writer(0, "c", on_duplicate="error") as writer, pytest.raises(DuplicateSampleError, match="already"):
        writer.append(first)
    impostor = Record(**{**other.__dict__, "sample_id": first.sample_id})
    with store.writer(0, "d") as writer, pytest.raises(DuplicateSampleError, match="other tokens"):
        writer.append(impostor)
    assert routelog.open_store(store_url).step(0).sample_ids == [first.sample_id]


def test_two_writers_racing_on_one_sample_leave_a_readable_store(store_url: str, small_spec: ModelSpec) -> None:
    """Both writers decide to write before either commits, so neither sees the other: the log orders their commits,
    readers read the earlier one's record, the later writer reports its copy as already present (never as
    committed), verify notes the shadowed copy, gc drops the shadowed part and later reclaims it."""
    record = _records(small_spec, 1, seed=8)[0]
    routelog.create_store(store_url, small_spec)
    both_built = threading.Barrier(2, timeout=60)
    racers = []
    for writer_id in ("a", "b"):
        racer = routelog.open_store(store_url)
        original, waited = racer.storage.create, []

        def create(
            key: str, data: bytes, original: Any = original, waited: list[bool] = waited, **options: bool
        ) -> bool:
            if "/log/" in key and not waited:  # each writer's first commit attempt waits for the other's upload
                waited.append(True)
                both_built.wait()
            return bool(original(key, data, **options))

        racer.storage.create = create  # type: ignore[method-assign]
        racers.append(racer.writer(0, writer_id, background=False))
    for writer in racers:
        writer.append(record)
    threads = [threading.Thread(target=writer.close) for writer in racers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    store = routelog.open_store(store_url)
    snapshot = routelog.open_store(store_url).step(0)
    assert snapshot.sample_ids == [record.sample_id]
    (shadow,) = snapshot.shadowed
    assert (shadow.kept, shadow.shadowed) == ("0000000000.00000.json", "0000000001.00000.json")
    later = next(w for w in racers if w.commits[0].name == shadow.shadowed)
    assert later.already_present == [record.sample_id], "the later writer learns its copy is not the one read"
    np.testing.assert_array_equal(snapshot.read(record.sample_id).expert_ids, _expected(record))
    report = verify_store(routelog.open_store(store_url))
    assert report.ok and any("raced" in note for note in report.notes)
    loser = next(c.part for c in snapshot.commits if c.name == shadow.shadowed)
    dry = collect_garbage(store, 0, force=True)
    assert dry.dead_parts == [keys.part_dir(0, loser)] and not dry.deleted
    collect_garbage(store, 0, delete=True, force=True)  # drops the dead part
    later = time.time() + 3600
    reclaimed = collect_garbage(store, 60, delete=True, force=True, now=later)
    assert any(key.startswith(keys.part_dir(0, loser)) for key in reclaimed.orphans)
    again = routelog.open_store(store_url).step(0)
    assert again.sample_ids == [record.sample_id] and again.shadowed == []
    assert verify_store(routelog.open_store(store_url)).ok


def test_span_references_into_another_step_are_refused(
    store_url: str, small_spec: ModelSpec, make_routing: MakeRouting
) -> None:
    """Shared prefixes stay inside their step (FORMAT.md section 6): gc reclaims a step's dropped parts by what that
    step's records read, so a span into another step is refused, naming the sample."""
    rng = np.random.default_rng(9)
    prompt = make_routing(rng, 6, small_spec.num_moe_layers, small_spec.num_experts, small_spec.topk)
    full = np.concatenate([prompt, make_routing(rng, 4, small_spec.num_moe_layers, small_spec.num_experts, 4)])
    store = routelog.create_store(store_url, small_spec)
    with store.writer(0, "p") as writer:
        writer.append(Record(sample_id="turn-1", expert_ids=prompt, prompt_len=6, response_len=0))
    (first,) = store.step(0).commits
    with store.writer(1, "q") as writer:
        writer.append(Record(sample_id="turn-2", expert_ids=full, prompt_len=6, response_len=4))
    # Rewrite turn 2 as a deduplicating writer would: its first 6 rows point into step 0's part.
    (commit,) = store.step(1).commits
    part_dir = keys.part_dir(1, commit.part)
    row = store.step(1).info("turn-2")
    shared = keys.part_dir(0, first.part)
    deduped = row.model_copy(
        update={"spans": [Span(token_start=0, n_rows=6, row=0, part=shared), Span(token_start=6, n_rows=4, row=6)]}
    )
    data = index_to_parquet([IndexRow.model_validate(deduped)])
    store.storage.write(f"{part_dir}/{keys.INDEX}", data)
    objects = [
        o if o.key != keys.INDEX else ObjectInfo(key=o.key, size=len(data), sha256=hashlib.sha256(data).hexdigest())
        for o in commit.objects
    ]
    replace_commit(store.storage, 1, commit.model_copy(update={"objects": objects}))
    snapshot = routelog.open_store(store_url).step(1)
    with pytest.raises(CorruptDataError, match="'turn-2' points at rows of another step"):
        snapshot.read("turn-2")
    assert isinstance(commit, CommitRecord)


def test_torch_view(store_url: str, small_spec: ModelSpec, make_routing: MakeRouting) -> None:
    torch = pytest.importorskip("torch")
    record = _records(small_spec, 2, seed=10)[1]
    with routelog.open_writer(store_url, step=0, model_spec=small_spec) as writer:
        writer.append(record)
    ids, valid = routelog.open_store(store_url).step(0).read("s1").to_torch()
    assert ids.dtype == torch.int16
    assert valid.dtype == torch.bool
    assert torch.equal(ids, torch.from_numpy(_expected(record)))


def test_reads_fetch_about_only_the_requested_bytes(
    memory_url: str, small_spec: ModelSpec, make_routing: MakeRouting
) -> None:
    spec = ModelSpec(num_layers=16, moe_layers=tuple(range(16)), num_experts=128, topk=8)
    rng = np.random.default_rng(11)
    records = [
        Record(sample_id=f"r{i}", expert_ids=make_routing(rng, 1024, 16, 128, 8), prompt_len=1, response_len=1023)
        for i in range(8)
    ]
    with routelog.open_writer(
        memory_url, step=0, model_spec=spec, options=PartOptions(chunk_rows=1024, chunk_layers=4)
    ) as writer:
        for record in records:
            writer.append(record)
    snapshot = routelog.open_store(memory_url).step(0)
    storage = snapshot.store.storage
    requested: list[tuple[str, int, int]] = []
    original = storage.read_ranges

    def counting(ranges: list[tuple[str, int, int]], *into: memoryview) -> list[Any]:
        requested.extend(ranges)
        return original(ranges, *into)

    storage.read_ranges = counting  # type: ignore[method-assign]
    snapshot.read_many(["r2", "r3"], moe_layers=[4, 5, 6, 7])  # 2 of 8 records, 4 of 16 layers
    shard_size = storage.size(_shard_key(snapshot.store, 0))
    fetched = sum(stop - start for _, start, stop in requested)
    assert fetched < shard_size * (2 / 8) * (4 / 16) * 1.5 + 2048, (fetched, shard_size)
    assert len(requested) <= 2  # the shard index, then one ranged read for adjacent chunks


def test_parts_open_with_zarr_python(store_url: str, small_spec: ModelSpec, make_routing: MakeRouting) -> None:
    """Format 2: with routelog installed, plain zarr-python reads expert IDs through the registered codec."""
    records = _records(small_spec, 3, seed=12)
    with routelog.open_writer(store_url, step=0, model_spec=small_spec) as writer:
        for record in records:
            writer.append(record)
    snapshot = routelog.open_store(store_url).step(0)
    (commit,) = snapshot.commits
    array = snapshot.open_zarr(commit.part)
    assert array.shape == (small_spec.num_moe_layers, commit.routing.n_rows, small_spec.topk)
    assert array.attrs["routelog"]["transform"] == "ranked_gaps"
    ids = np.asarray(array[...])
    info = snapshot.info("s2")
    for span in info.spans:
        rows = ids[:, span.row : span.row + span.n_rows].transpose(1, 0, 2)
        want = np.sort(records[2].expert_ids[span.token_start : span.token_start + span.n_rows], axis=-1)
        np.testing.assert_array_equal(rows, want)


def test_token_ids_are_stored_as_byte_planes_in_part_and_sealed_indexes(
    tmp_path: Path, dense_first_spec: ModelSpec
) -> None:
    import pyarrow.parquet as pq

    url = str(tmp_path / "store")
    records = _records(dense_first_spec, 5, seed=3)
    with routelog.open_writer(url, step=0, model_spec=dense_first_spec, writer_id="w0") as writer:
        for record in records:
            writer.append(record)
    store = routelog.open_store(url)
    store.seal(0)
    indexes = sorted((tmp_path / "store" / keys.step_dir(0)).rglob("*index.parquet"))
    assert len(indexes) == 2 and any(keys.SEALED_DIR in str(p) for p in indexes)
    for path in indexes:
        metadata = pq.ParquetFile(path).metadata.row_group(0)
        columns = {metadata.column(i).path_in_schema: metadata.column(i) for i in range(metadata.num_columns)}
        assert "BYTE_STREAM_SPLIT" in columns["token_ids.list.element"].encodings, path
    snapshot = routelog.open_store(url).step(0)
    for got, record in zip(snapshot.read_many(snapshot.sample_ids), records, strict=True):
        np.testing.assert_array_equal(got.info.token_ids, record.token_ids)
        np.testing.assert_array_equal(got.expert_ids, _expected(record))
