"""Compressing a part's chunks on several threads (``encode_threads``): the same objects byte for byte, every codec;
a failed chunk leaves nothing running; writers, process writers, ingest and the CLI take the option and refuse
anything but an int >= 1."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

import routelog
from routelog import ModelSpec, PartOptions, ProcessWriter, Record, StreamRows, StreamSpec
from routelog.format.part import build_part
from routelog.format.record import prepare_record
from routelog.format.shard import ShardLayout, WrittenFile, encode_shards
from routelog.synth import random_topk
from tests.records import sample_records

SPEC = ModelSpec(
    name="threads",
    num_layers=6,
    moe_layers=(1, 2, 3, 4, 5),
    num_experts=32,
    topk=4,
    streams=(StreamSpec(name="indexer", num_layers=1, universe=32, topk=4),),
)


def _records(seed: int, n: int = 9) -> list[Record]:
    """Records with token ids, routing weights and an extra stream, long enough for several 16-row chunks."""
    rng = np.random.default_rng(seed)
    records = []
    for record in sample_records(SPEC, n, seed, tokens=(20, 70)):
        rows = record.expert_ids.shape[0]
        extra = StreamRows(np.sort(random_topk(rng, rows, 32, 4), axis=-1).reshape(rows, 1, 4))
        weights = rng.random(record.expert_ids.shape).astype(np.float32)
        records.append(Record(**{**record.__dict__, "streams": {"indexer": extra}, "weights": weights}))
    return records


def _stored(obj: Any) -> bytes:
    if isinstance(obj, WrittenFile):
        return Path(obj.path).read_bytes()
    return bytes(obj)


@pytest.mark.parametrize(
    ("transform", "order"),
    [("ranked_gaps", "sorted"), ("sorted_gaps", "sorted"), ("ranked_context", "sorted"), ("ranked_gaps", "score")],
)
def test_a_pool_builds_the_same_objects(transform: str, order: str) -> None:
    options = PartOptions(
        chunk_rows=16,
        chunk_layers=1,
        shard_layers=2,
        transform=cast(Any, transform),
        topk_order=cast(Any, order),
        dedup="off",
    )
    records = _records(3)
    built = []
    for pool in (None, ThreadPoolExecutor(3)):
        prepared = [prepare_record(r, SPEC, 0, options.topk_order) for r in records]
        built.append(build_part(prepared, SPEC, options, pool=pool))
        if pool is not None:
            pool.shutdown()
    alone, pooled = ({key: _stored(obj) for key, obj in part.objects.items()} for part in built)
    assert alone.keys() == pooled.keys()
    assert sum(key.count("/c/") for key in alone) >= 3 + 1 + 3  # routing, stream and weights shards
    for key in alone:
        assert alone[key] == pooled[key], key


def test_a_failed_chunk_leaves_no_compression_running() -> None:
    """The build fails with the chunk's error once every chunk it started has stopped: the caller may let the rows
    go at once."""
    layout = ShardLayout(1, 16 * 12, 4, 1, 16, np.dtype(np.uint8))  # format 1's plain chunks
    rows = np.sort(random_topk(np.random.default_rng(0), 16 * 12, 32, 4), axis=-1).astype(np.uint8)[None]
    lock = threading.Lock()
    state = {"calls": 0, "running": 0}

    def transform(block: np.ndarray) -> np.ndarray:
        with lock:
            state["calls"] += 1
            state["running"] += 1
            failing = state["calls"] == 3
        try:
            if failing:
                raise RuntimeError("chunk 3 fails")
            threading.Event().wait(0.01)
            return block
        finally:
            with lock:
                state["running"] -= 1

    with ThreadPoolExecutor(2) as pool, pytest.raises(RuntimeError, match="chunk 3 fails"):
        encode_shards(rows, layout, 3, transform, pool=pool)
    assert state["running"] == 0
    assert state["calls"] < 12  # the chunks not started when it failed were cancelled


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_threaded_writer_stores_what_one_thread_stores(where: str, tmp_path: Path, memory_url: str) -> None:
    base = str(tmp_path) if where == "local" else memory_url
    records = _records(5, 12)
    options = PartOptions(chunk_rows=16, chunk_layers=2)
    stores = []
    for threads in (1, 3):
        url = f"{base}/threads-{threads}"
        with routelog.open_writer(
            url, 0, model_spec=SPEC, writer_id="w", options=options, encode_threads=threads, flush_bytes=6000
        ) as writer:
            assert writer.encode_threads == threads
            for record in records:
                writer.append(record)
        stores.append(routelog.open_store(url))
    one, three = (store.step(0).commits for store in stores)
    assert len(one) == len(three) > 1
    for a, b in zip(one, three, strict=True):  # the same objects, of the same sizes and digests
        assert a.objects == b.objects
        assert sum(info.key.count("/c/") for info in a.objects) >= 3
    snapshot = stores[1].step(0)
    got = {g.sample_id: g for g in snapshot.read_many(snapshot.sample_ids, weights=True)}
    for record in records:
        valid = np.asarray(got[record.sample_id].valid)
        np.testing.assert_array_equal(
            np.asarray(got[record.sample_id].expert_ids)[valid], np.sort(record.expert_ids, axis=-1)[valid]
        )


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "2"])
def test_encode_threads_must_be_an_int_of_one_or_more(bad: Any, memory_url: str, tmp_path: Path) -> None:
    store = routelog.create_store(memory_url, SPEC)
    with pytest.raises(ValueError, match="encode_threads must be an int >= 1"):
        store.writer(0, "w", encode_threads=bad)
    with pytest.raises(ValueError, match="encode_threads must be an int >= 1"):
        ProcessWriter(memory_url, 0, encode_threads=bad)  # refused before a process starts
    source = tmp_path / "routing.jsonl"
    source.write_text("")
    from routelog.ingest import IngestSource, ingest

    with pytest.raises(ValueError, match="encode_threads must be an int >= 1"):
        ingest(IngestSource("vllm", (source,)), memory_url, 0, encode_threads=bad)


def test_the_cli_takes_encode_threads(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    command = [sys.executable, "-m", "routelog", "synth", url, "--records", "3", "--tokens", "40", "--json"]
    done = subprocess.run([*command, "--encode-threads", "2"], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["new"] == 3
    for refused_command in (
        [*command, "--encode-threads", "0"],
        [*command[:4], "ingest", url, "x.jsonl", "--encode-threads", "0"],
    ):
        refused = subprocess.run(refused_command, check=False, capture_output=True, text=True, timeout=120)
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode != 0 and len(lines) == 1, refused.stderr
        assert "--encode-threads" in lines[0] and "greater than or equal to 1" in lines[0]
