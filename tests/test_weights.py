"""Routing weights stored beside the expert IDs (format 2, optional): they follow their experts, keep the chosen
precision, are never fetched unless asked for, and take part in shared-prefix comparisons."""

from __future__ import annotations

import uuid
from typing import Any, Literal

import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import routelog
from routelog import InvalidRecordError, PartOptions, Record
from routelog.format import keys
from routelog.format.weights import from_storage, to_storage
from routelog.store.verify import verify_store
from routelog.synth import synthetic_spec
from tests.records import random_routing

SPEC = synthetic_spec(layers=3, experts=16, topk=4)


def _record(
    rng: np.random.Generator, sid: str, tokens: int, *, weights: bool = True, prompt: np.ndarray | None = None
) -> Record:
    ids = random_routing(rng, tokens, SPEC.num_moe_layers, SPEC.num_experts, SPEC.topk)
    valid = np.ones(tokens, bool)
    valid[-1] = False
    gate = rng.random((tokens, SPEC.num_moe_layers, SPEC.topk)).astype(np.float32)
    token_ids = (
        rng.integers(0, 500, tokens)
        if prompt is None
        else np.concatenate([prompt, rng.integers(0, 500, tokens - prompt.size)])
    )
    return Record(
        sample_id=sid,
        expert_ids=ids,
        prompt_len=tokens - 5,
        response_len=5,
        valid=valid,
        token_ids=token_ids,
        weights=gate / gate.sum(axis=-1, keepdims=True) if weights else None,
    )


def _write(records: list[Record], dtype: Literal["bfloat16", "float32"] = "bfloat16") -> routelog.Store:
    url = f"memory://weights-tests/{uuid.uuid4().hex}"
    options = PartOptions(weights_dtype=dtype)
    with routelog.open_writer(url, step=0, model_spec=SPEC, options=options) as writer:
        for record in records:
            writer.append(record)
    return routelog.open_store(url)


def _by_expert(ids: np.ndarray, weights: np.ndarray) -> list[dict[int, float]]:
    """Each row as {expert: weight}: the pairing that must survive sorting."""
    return [
        dict(zip(i.tolist(), w.tolist(), strict=True))
        for i, w in zip(ids.reshape(-1, ids.shape[-1]), weights.reshape(-1, ids.shape[-1]), strict=True)
    ]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_weights_follow_their_experts_through_sorting(dtype: Literal["bfloat16", "float32"]) -> None:
    rng = np.random.default_rng(0)
    records = [_record(rng, f"r{i}", int(rng.integers(20, 90))) for i in range(4)]
    snapshot = _write(records, dtype).step(0)
    assert {c.weights.dtype for c in snapshot.commits if c.weights} == {dtype}
    for record, got in zip(records, snapshot.read_many([r.sample_id for r in records], weights=True), strict=True):
        assert got.weights is not None
        valid = record.valid
        assert valid is not None
        want = np.asarray(record.weights, np.float32)
        if dtype == "bfloat16":  # what a bf16 tensor holds
            want = torch.from_numpy(want).to(torch.bfloat16).float().numpy()
        got_ids = got.by_layer.transpose(1, 0, 2)[valid]
        got_weights = got.weights.transpose(1, 0, 2)[valid]
        assert _by_expert(got_ids, got_weights) == _by_expert(np.asarray(record.expert_ids)[valid], want[valid])
        assert np.isnan(got.weights[:, ~valid]).all(), "rows never computed have no weight"
        back = got.to_record()
        assert back.weights is not None and back.weights.shape == np.asarray(record.weights).shape


def test_weights_are_fetched_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    records = [_record(rng, f"r{i}", 40) for i in range(3)]
    snapshot = _write(records).step(0)
    storage = snapshot.store.storage
    read_ranges = storage.read_ranges
    keys_read: list[str] = []

    def counting(ranges: list[tuple[str, int, int]], *into: memoryview) -> list[Any]:
        keys_read.extend(key for key, _, _ in ranges)
        return read_ranges(ranges, *into)

    monkeypatch.setattr(storage, "read_ranges", counting)
    plain = snapshot.read_many(["r0", "r1"])
    assert plain[0].weights is None
    assert keys_read and not any("/weights/" in key for key in keys_read)
    snapshot.read_many(["r0"], weights=True)
    assert any("/weights/" in key for key in keys_read)


def test_records_without_weights_share_a_part_with_records_that_have_them() -> None:
    rng = np.random.default_rng(2)
    records = [
        _record(rng, "bare", 30, weights=False),
        _record(rng, "weighed", 30),
        _record(rng, "bare2", 30, weights=False),
    ]
    snapshot = _write(records).step(0)
    got = {r.sample_id: r for r in snapshot.read_many(["bare", "weighed", "bare2"], weights=True)}
    for sid in ("bare", "bare2"):
        weights = got[sid].weights
        assert weights is not None and np.isnan(weights).all()
        assert got[sid].to_record().weights is None
    weighed = got["weighed"].weights
    assert weighed is not None and not np.isnan(weighed[:, :-1]).any()
    without = _write([records[0]]).step(0)
    assert without.commits[0].weights is None, "a part whose records carry no weights has no weights array"
    assert without.read("bare").weights is None


def test_equal_routing_with_other_weights_is_not_shared() -> None:
    """A shared prefix must read back as each record wrote it: weights are compared as well as IDs."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 500, 40)
    a = _record(rng, "a", 60, prompt=prompt)
    b = _record(rng, "b", 60, prompt=prompt)
    ids_b = np.asarray(b.expert_ids).copy()
    ids_b[:40] = np.asarray(a.expert_ids)[:40]
    weights_b = np.asarray(b.weights).copy()
    weights_b[:40] = np.asarray(a.weights)[:40]
    same = Record(**{**b.__dict__, "expert_ids": ids_b, "weights": weights_b})
    assert _write([a, same]).step(0).stored_rows == 59 + 59 - 40
    weights_b[25, 1, 0] += 0.25
    other = Record(**{**b.__dict__, "expert_ids": ids_b, "weights": weights_b})
    snapshot = _write([a, other]).step(0)
    assert snapshot.stored_rows == 59 + 59 - 25, "the shared prefix ends at the first differing weight"
    got = snapshot.read_many(["b"], weights=True)[0]
    assert got.weights is not None
    want = torch.from_numpy(weights_b).to(torch.bfloat16).float().numpy()
    assert _by_expert(got.ids[:59], got.weights.transpose(1, 0, 2)[:59]) == _by_expert(ids_b[:59], want[:59])


def test_bad_weights_are_refused_naming_the_field() -> None:
    rng = np.random.default_rng(4)
    record = _record(rng, "r", 20)
    with pytest.raises(InvalidRecordError, match=r"'r'.*weights.*shape"):
        _write([Record(**{**record.__dict__, "weights": np.ones((20, 2, 4))})])
    broken = np.asarray(record.weights).copy()
    broken[3, 1, 2] = np.nan
    with pytest.raises(InvalidRecordError, match=r"weights.*token 3, layer 1"):
        _write([Record(**{**record.__dict__, "weights": broken})])
    broken[3, 1, 2] = 0.5
    broken[19] = np.inf  # the last row was never computed: its value is ignored
    assert _write([Record(**{**record.__dict__, "weights": broken})]).step(0).sample_ids == ["r"]


def test_plain_zarr_reads_the_weights_array() -> None:
    rng = np.random.default_rng(5)
    record = _record(rng, "r", 50)
    store = _write([record], "float32")
    commit = store.step(0).commits[0]
    array = zarr.open_array(store.storage.zarr_store(f"{keys.part_dir(0, commit.part)}/weights"), mode="r")
    planes = np.asarray(array[...])  # [layers, rows, K, 4] bytes of little-endian float32
    values = planes.view("<f4")[..., 0]
    got = store.step(0).read_many(["r"], weights=True)[0].weights
    assert got is not None
    np.testing.assert_array_equal(values, got[:, :49])


def test_a_damaged_weights_chunk_is_caught_by_verify() -> None:
    rng = np.random.default_rng(6)
    store = _write([_record(rng, "r", 50)])
    commit = store.step(0).commits[0]
    key = next(f"{keys.part_dir(0, commit.part)}/{o.key}" for o in commit.objects if o.key.startswith("weights/c/"))
    data = bytearray(store.storage.read(key))
    data[-10] ^= 0xFF
    store.storage.write(key, bytes(data))
    report = verify_store(store)
    assert not report.ok and any("weights" in p for p in report.problems)


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.integers(1, 64), elements=st.floats(width=32, allow_nan=True, allow_infinity=True)))
def test_bf16_storage_matches_torch(values: np.ndarray) -> None:
    want = torch.from_numpy(values.copy()).to(torch.bfloat16).float().numpy()
    got = from_storage(to_storage(values, "bfloat16"), "bfloat16")
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
