"""A snapshot decodes each chunk once for the records stored side by side in it, within its byte budget."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

import routelog
from routelog.store.blocks import ReadCache
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

    def counted(wanted: list[tuple[str, int, int]]) -> list[bytes]:
        read.extend(hi - lo for key, lo, hi in wanted if "/routing/c/" in key and lo > 0)
        return ranges(wanted)

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
