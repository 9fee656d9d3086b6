"""A snapshot decodes each chunk once for the records stored side by side in it, within its byte budget."""

from __future__ import annotations

import subprocess
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import routelog
from routelog import PartOptions
from routelog.store.blocks import BlockRequest, ReadCache, fetch_blocks
from routelog.synth import synthetic_spec


def _store(tmp_path: Path, records: int = 8, tokens: int = 1024) -> tuple[str, np.ndarray[Any, Any]]:
    url = str(tmp_path / "store")
    rng = np.random.default_rng(0)
    ids = np.sort(np.argsort(rng.random((records, tokens, 4, 64)), axis=-1)[..., :8], axis=-1).astype(np.uint8)
    with routelog.open_writer(url, 0, model_spec=synthetic_spec(4, 64, 8)) as writer:
        for n in range(records):
            writer.append(routelog.Record(sample_id=f"r{n}", expert_ids=ids[n], prompt_len=8, response_len=tokens - 8))
    return url, ids


def _chunk_bytes_read(snapshot: routelog.StepSnapshot) -> list[int]:
    """Bytes of routing chunks ``snapshot`` reads from now on (every ranged read of a shard past its index)."""
    storage = snapshot.store.storage
    read: list[int] = []
    ranges = storage.read_ranges

    def counted(wanted: list[tuple[str, int, int]], *into: memoryview) -> list[Any]:
        read.extend(hi - lo for key, lo, hi in wanted if "/routing/c/" in key and lo > 0)
        return ranges(wanted, *into)

    storage.read_ranges = counted  # type: ignore[method-assign]
    return read


def test_records_side_by_side_decode_their_shared_chunks_once(tmp_path: Path) -> None:
    url, ids = _store(tmp_path)  # 8 records of 1024 rows: four share each 4096-row chunk
    cached = routelog.open_store(url).step(0)
    uncached = routelog.open_store(url).step(0)
    uncached._index_cache.chunk_budget = 0
    with_cache, without = _chunk_bytes_read(cached), _chunk_bytes_read(uncached)
    for n in range(8):
        np.testing.assert_array_equal(cached.read(f"r{n}").expert_ids, ids[n])
        np.testing.assert_array_equal(uncached.read(f"r{n}").expert_ids, ids[n])
    assert len(with_cache) == 2 and len(without) == 8  # one read per chunk, against one per record
    assert sum(without) > 3 * sum(with_cache)


def test_the_cache_keeps_the_latest_chunks_within_its_budget() -> None:
    cache = ReadCache(chunk_bytes=3000)
    chunks = [np.full(1000, n, np.uint8) for n in range(5)]
    for n, chunk in enumerate(chunks):
        cache.keep(("shard", n), chunk)
        cache.chunk(("shard", 0))  # the first stays the most recently used
    assert [n for n in range(5) if cache.chunk(("shard", n)) is not None] == [0, 3, 4]
    cache.keep(("shard", 9), np.zeros(4000, np.uint8))  # larger than the whole budget: not kept
    assert cache.chunk(("shard", 9)) is None and cache.chunk(("shard", 4)) is not None


def test_reading_a_step_never_imports_pandas(tmp_path: Path) -> None:
    """pyarrow imports pandas (a third of a second) on its first conversion to or from numpy; routelog's read path
    converts through buffers, so a process that opens a step, reads records and loads a micro-batch never does."""
    url, _ = _store(tmp_path)
    code = f"""
import sys
import routelog
from routelog.align import AlignmentPlan, MicroBatch, Packing, ParallelLayout, RankCoords
from routelog.loader import ReplayLoader
store = routelog.open_store({url!r})
snapshot = store.step(0)
snapshot.read("r1")
snapshot.read_many(["r2", "r5"])
plan = AlignmentPlan(store.model_spec, ParallelLayout(), Packing("verl"), RankCoords(), (MicroBatch(("r0", "r3")),))
ReplayLoader(store, 0, plan, prefetch=0).load(0)
print("pandas" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_rows_decoded_into_destinations_are_the_blocks_rows(tmp_path: Path, data: st.DataObject) -> None:
    """A block holds the part's rows; ``fetch_blocks`` writing a request's rows into destinations instead (a
    reader's records: whole chunks in place, shared chunks copied, overlapping and gapped destinations) hands out
    exactly the same rows."""
    chunk_rows = data.draw(st.sampled_from([256, 1024]), label="chunk_rows")
    url, rows = _shared_store(tmp_path, chunk_rows)
    snapshot = routelog.open_store(url).step(0)
    part_key = snapshot._part_key("r0")
    commit = snapshot._commit_for(part_key)
    n_rows = commit.routing.n_rows
    lo = data.draw(st.integers(0, n_rows - 1), label="lo")
    hi = data.draw(st.integers(lo + 1, n_rows), label="hi")
    layers = data.draw(st.sampled_from([(0, 4), (1, 3), (2, 4)]), label="layers")
    request = BlockRequest.of(part_key, commit, layers, (lo, hi))
    (block,) = fetch_blocks(snapshot.store.storage, [request])
    np.testing.assert_array_equal(block, rows[layers[0] : layers[1], lo:hi])
    cuts = sorted(data.draw(st.lists(st.integers(lo, hi), max_size=4), label="cuts"))
    bounds = [lo, *cuts, hi]
    spans = [(a, b) for a, b in pairwise(bounds) if a < b]
    kept = [span for span in spans if data.draw(st.booleans(), label="kept")] or spans[:1]
    if data.draw(st.booleans(), label="overlap"):
        kept.append((lo, hi))
    destinations = [(a, np.full((layers[1] - layers[0], b - a, 8), 255, np.uint8)) for a, b in kept]
    (empty,) = fetch_blocks(snapshot.store.storage, [request], ReadCache(), into=[destinations])
    assert empty.size == 0
    for a, view in destinations:
        np.testing.assert_array_equal(view, block[:, a - lo : a - lo + view.shape[1]])


def test_a_reads_arrays_are_its_own_after_the_next_read(tmp_path: Path) -> None:
    """Chunks are read into one buffer the snapshot reuses: nothing handed out may point into it."""
    url, _ = _shared_store(tmp_path, 1024)
    snapshot = routelog.open_store(url).step(0)
    first = snapshot.read_many(["r0", "r1"])
    copies = [r.expert_ids.copy() for r in first]
    snapshot.read_many(["r5", "r6", "r7"])
    for routing, copy in zip(first, copies, strict=True):
        np.testing.assert_array_equal(routing.expert_ids, copy)


def test_ranges_read_into_a_buffer_are_the_ranges(tmp_path: Path) -> None:
    from routelog.store.storage import Storage

    for storage in (Storage.open(str(tmp_path / "local")), Storage.open(f"memory://{tmp_path.name}-ranges")):
        storage.write("a", bytes(range(200)))
        storage.write("b", bytes(range(100, 0, -1)))
        ranges = [("a", 3, 50), ("b", 0, 100), ("a", 150, 200)]
        buffer = memoryview(bytearray(300))
        assert [bytes(v) for v in storage.read_ranges(ranges, buffer)] == storage.read_ranges(ranges)
        with pytest.raises(FileNotFoundError, match="past the end"):
            storage.read_ranges([("a", 190, 210)], buffer)
        with pytest.raises(FileNotFoundError):
            storage.read_ranges([("missing", 0, 10)], buffer)


def _shared_store(tmp_path: Path, chunk_rows: int) -> tuple[str, np.ndarray[Any, Any]]:
    """Records of 100 to 700 tokens (chunks shared between records, records across chunks), 4 layers, top-8 of 64,
    in one part; and the part's rows, ``[layers, rows, 8]``."""
    url = str(tmp_path / f"store-{chunk_rows}")
    rng = np.random.default_rng(chunk_rows)
    records = []
    for n in range(8):
        tokens = int(rng.integers(100, 700))
        ids = np.sort(np.argsort(rng.random((tokens, 4, 64)), axis=-1)[..., :8], axis=-1).astype(np.uint8)
        records.append(routelog.Record(sample_id=f"r{n}", expert_ids=ids, prompt_len=8, response_len=tokens - 8))
    if not Path(url).exists():
        options = PartOptions(chunk_rows=chunk_rows, chunk_layers=3)  # the last layer chunk: 1 layer, 2 of padding
        with routelog.open_writer(url, 0, model_spec=synthetic_spec(4, 64, 8), options=options) as writer:
            for record in records:
                writer.append(record)
    return url, np.concatenate([r.expert_ids for r in records]).transpose(1, 0, 2)
