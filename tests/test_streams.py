"""Extra routing streams (format 1.2): MTP routing stored apart from the decoder's, and any other per-token top-k
decision described by its universe and K, on every backend."""

from __future__ import annotations

import numpy as np
import pytest

import routelog
from routelog import InvalidRecordError, ModelSpec, Record, StreamRows, StreamSpec
from routelog.store.verify import verify_store
from tests.records import random_routing

SPEC = ModelSpec.from_hf_config(
    {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 5,
        "first_k_dense_replace": 1,
        "n_routed_experts": 32,
        "num_experts_per_tok": 4,
        "num_nextn_predict_layers": 1,
    }
)
INDEXER = StreamSpec(name="indexer", num_layers=2, universe=4096, topk=16)


def _record(i: int, rng: np.random.Generator, spec: ModelSpec) -> Record:
    n = int(rng.integers(6, 40))
    valid = np.ones(n, bool)
    valid[-1] = False
    mtp_valid = valid.copy()
    mtp_valid[:2] = False  # MTP layers see shifted tokens: the first rows have no prediction target
    streams = {"mtp": StreamRows(random_routing(rng, n, 1, 32, 4), mtp_valid)}
    if spec.stream("indexer") is not None and i % 2 == 0:
        streams["indexer"] = StreamRows(random_routing(rng, n, 2, 4096, 16))
    return Record(
        sample_id=f"r{i}",
        expert_ids=random_routing(rng, n, spec.num_moe_layers, 32, 4),
        prompt_len=3,
        response_len=n - 3,
        valid=valid,
        streams=streams,
    )


def test_hf_and_megatron_specs_declare_the_mtp_stream() -> None:
    assert SPEC.stream("mtp") == StreamSpec(name="mtp", num_layers=1, universe=32, topk=4)
    megatron = ModelSpec.from_megatron(num_layers=4, num_moe_experts=8, moe_router_topk=2, mtp_num_layers=2)
    assert megatron.stream("mtp") is not None and megatron.stream("mtp").num_layers == 2  # type: ignore[union-attr]


def test_streams_round_trip_apart_from_the_decoder_routing(store_url: str) -> None:
    spec = SPEC.model_copy(update={"streams": (*SPEC.streams, INDEXER)})
    rng = np.random.default_rng(0)
    records = [_record(i, rng, spec) for i in range(7)]
    store = routelog.create_store(store_url, spec)
    with store.writer(0, "w", flush_bytes=4000) as writer:
        for record in records:
            writer.append(record)
    snapshot = routelog.open_store(store_url).step(0)
    decoder = {r.sample_id: r for r in snapshot.read_many(snapshot.sample_ids)}
    mtp = {r.sample_id: r for r in snapshot.read_many(snapshot.sample_ids, stream="mtp")}
    indexer = {r.sample_id: r for r in snapshot.read_many(snapshot.sample_ids, stream="indexer", moe_layers=[1])}
    for record in records:
        sid = record.sample_id
        assert decoder[sid].stream is None and mtp[sid].stream == "mtp"
        want = np.sort(np.asarray(record.expert_ids), -1)
        np.testing.assert_array_equal(decoder[sid].expert_ids[record.valid], want[record.valid])
        assert record.streams is not None
        rows = record.streams["mtp"]
        np.testing.assert_array_equal(mtp[sid].valid, rows.valid)
        np.testing.assert_array_equal(
            mtp[sid].expert_ids[np.asarray(rows.valid)], np.sort(np.asarray(rows.expert_ids), -1)[rows.valid]
        )
        if "indexer" in record.streams:
            got = indexer[sid].expert_ids
            assert got.dtype == np.int16 and got.shape[2] == 16  # uint16 storage above 256, read back as int16
            np.testing.assert_array_equal(got, np.sort(np.asarray(record.streams["indexer"].expert_ids), -1)[:, [1]])
        else:
            assert not indexer[sid].valid.any(), "a record without the stream has no rows of it"
    assert verify_store(routelog.open_store(store_url)).ok
    store.seal(0)
    sealed = routelog.open_store(store_url).step(0)
    assert [r.sample_id for r in sealed.read_many(["r2"], stream="indexer")] == ["r2"]


def test_streams_the_spec_does_not_declare_are_refused(memory_url: str) -> None:
    store = routelog.create_store(memory_url, SPEC)
    rng = np.random.default_rng(1)
    record = _record(0, rng, SPEC.model_copy(update={"streams": (*SPEC.streams, INDEXER)}))
    with store.writer(0, "w") as writer, pytest.raises(InvalidRecordError, match="not a stream of model"):
        writer.append(record)
    record = _record(1, rng, SPEC)
    assert record.streams is not None
    record.streams = {"mtp": StreamRows(np.zeros((record.n_tokens, 2, 4), np.int64))}
    with store.writer(0, "v") as writer, pytest.raises(InvalidRecordError, match=r"streams\['mtp'\]"):
        writer.append(record)


def test_a_stream_read_needs_a_declared_stream(memory_url: str) -> None:
    store = routelog.create_store(memory_url, SPEC)
    with store.writer(0, "w") as writer:
        writer.append(_record(0, np.random.default_rng(2), SPEC))
    with pytest.raises(ValueError, match="no stream"):
        store.step(0).read_many(["r0"], stream="indexer")
