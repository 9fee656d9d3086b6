"""Parts written with ``shard_layers``: each array is one shard object per range of layers, so a pipeline stage's
reader fetches only its own shards (indexes and chunks), and plain zarr still reads the array."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest
import zarr

import routelog
from routelog.errors import CorruptDataError
from routelog.format import keys
from routelog.format.documents import RoutingArrayInfo
from routelog.format.part import PartOptions
from routelog.format.spec import ModelSpec
from routelog.store.verify import verify_store
from tests.records import random_routing

LAYERS = 7


def _store(experts: int, *, weights: bool = False, shard_layers: int | None = 4) -> tuple[routelog.Store, dict]:
    spec = ModelSpec(name="t", num_layers=LAYERS, moe_layers=tuple(range(LAYERS)), num_experts=experts, topk=4)
    rng = np.random.default_rng(experts)
    url = f"memory://layer-shards/{uuid.uuid4().hex}"
    options = PartOptions(chunk_rows=32, chunk_layers=2, shard_layers=shard_layers, weights_dtype="float32")
    truth = {}
    with routelog.open_writer(url, 0, model_spec=spec, options=options) as writer:
        for i in range(4):
            ids = random_routing(rng, 70 + 9 * i, LAYERS, experts, 4)
            gates = rng.random(ids.shape).astype(np.float32) if weights else None
            writer.append(routelog.Record(f"s{i}", ids, prompt_len=10, response_len=60 + 9 * i, weights=gates))
            truth[f"s{i}"] = (np.sort(ids, axis=-1), gates, ids)
    return routelog.open_store(url), truth


@pytest.mark.parametrize("experts", [64, 300])  # uint8 IDs, and uint16 IDs
def test_every_layer_reads_back_and_each_shard_is_its_own_object(experts: int) -> None:
    store, truth = _store(experts, weights=True)
    snapshot = store.step(0)
    (commit,) = snapshot.commits
    assert commit.routing.shard_layers == 4
    shards = sorted(o.key for o in commit.objects if "/c/" in o.key)
    assert shards == ["routing/c/0/0/0", "routing/c/1/0/0", "weights/c/0/0/0/0", "weights/c/1/0/0/0"]
    for got in snapshot.read_many(snapshot.sample_ids, weights=True):
        ids, gates, raw = truth[got.sample_id]
        np.testing.assert_array_equal(got.expert_ids, ids)
        assert got.weights is not None
        paired = np.take_along_axis(gates, np.argsort(raw, axis=-1), -1)
        np.testing.assert_array_equal(got.weights.transpose(1, 0, 2), paired)
    # Layer ranges that cross the shard boundary, or lie in one shard.
    for layers in ([3, 4], [5, 6], [0], [6, 1]):
        got = snapshot.read("s2", moe_layers=layers)
        assert got.layers == tuple(sorted(layers))
        np.testing.assert_array_equal(got.by_layer, truth["s2"][0][:, sorted(layers)].transpose(1, 0, 2))
    assert verify_store(store).ok


def test_a_stage_reads_only_its_own_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    store, truth = _store(64)
    read: list[str] = []
    original = store.storage.read_ranges

    def counting(ranges: list[tuple[str, int, int]], *into: memoryview) -> list[Any]:
        read.extend(key for key, _, _ in ranges)
        return original(ranges, *into)

    monkeypatch.setattr(store.storage, "read_ranges", counting)
    snapshot = store.step(0)
    got = snapshot.read_many(["s1", "s3"], moe_layers=[4, 5, 6])
    np.testing.assert_array_equal(got[1].by_layer, truth["s3"][0][:, 4:].transpose(1, 0, 2))
    shards = {key.rsplit("/routing/", 1)[1] for key in read if "/routing/" in key}
    assert shards == {"c/1/0/0"}, "the stage's layers live in shard 1 only: shard 0 is never touched"


def test_plain_zarr_reads_a_layer_sharded_part() -> None:
    store, truth = _store(64)
    commit = store.step(0).commits[0]
    array = zarr.open_array(store.storage.zarr_store(f"{keys.part_dir(0, commit.part)}/routing"), mode="r")
    assert array.shape == (LAYERS, commit.routing.n_rows, 4)
    assert array.metadata.chunk_grid.chunk_shape[0] == 4, "one shard per 4 layers"
    stored = np.asarray(array[...])
    for sid in store.step(0).sample_ids:
        (span,) = store.step(0).info(sid).spans
        np.testing.assert_array_equal(
            stored[:, span.row : span.row + span.n_rows], truth[sid][0][: span.n_rows].transpose(1, 0, 2)
        )


def test_a_damaged_shard_fails_only_the_layers_it_holds() -> None:
    store, truth = _store(64)
    (commit,) = store.step(0).commits
    key = f"{keys.part_dir(0, commit.part)}/routing/c/1/0/0"
    data = bytearray(store.storage.read(key))
    data[-20] ^= 0xFF  # inside the last inner chunk of shard 1
    store.storage.write(key, bytes(data))
    snapshot = routelog.open_store(store.url).step(0)
    np.testing.assert_array_equal(
        snapshot.read("s3", moe_layers=[0, 1, 2, 3]).by_layer, truth["s3"][0][:, :4].transpose(1, 0, 2)
    )
    with pytest.raises(CorruptDataError, match=r"routing/c/1/0/0.*cannot be decoded"):
        snapshot.read("s3", moe_layers=[6])
    report = verify_store(store)
    assert not report.ok and any("c/1/0/0" in p for p in report.problems)


def test_a_missing_shard_is_refused_naming_it() -> None:
    store, _ = _store(64)
    (commit,) = store.step(0).commits
    store.storage.delete([f"{keys.part_dir(0, commit.part)}/routing/c/1/0/0"])
    with pytest.raises(CorruptDataError, match="missing"):
        routelog.open_store(store.url).step(0).read("s0", moe_layers=[5])


def test_shard_layers_must_be_whole_chunks_of_fewer_layers_than_the_array() -> None:
    with pytest.raises(ValueError, match="multiple of chunk_layers"):
        PartOptions(chunk_layers=4, shard_layers=6)
    store, _ = _store(64)
    info = store.step(0).commits[0].routing.model_dump()
    for bad in (3, LAYERS, 8):
        with pytest.raises(ValueError, match="shard_layers"):
            RoutingArrayInfo.model_validate({**info, "shard_layers": bad})
    # A spec with fewer layers than shard_layers keeps one shard (nothing to split).
    one, _ = _store(64, shard_layers=8)
    assert one.step(0).commits[0].routing.shard_layers is None
