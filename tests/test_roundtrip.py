"""Property: whatever valid routing goes in comes back (as sets, or exactly in score order), missing rows marked."""

from __future__ import annotations

import uuid

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import routelog
from routelog import ModelSpec, PartOptions, Record


@st.composite
def stores(draw: st.DrawFn) -> tuple[ModelSpec, list[Record], PartOptions]:
    experts = draw(st.integers(2, 1024))
    k = draw(st.integers(1, min(16, experts)))
    num_layers = draw(st.integers(1, 6))
    moe = tuple(sorted(draw(st.sets(st.integers(0, num_layers - 1), min_size=1))))
    spec = ModelSpec(num_layers=num_layers, moe_layers=moe, num_experts=experts, topk=k)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    records = []
    for i in range(draw(st.integers(1, 4))):
        tokens = draw(st.integers(1, 70))
        ids = np.stack([rng.choice(experts, size=k, replace=False) for _ in range(tokens * len(moe))])
        valid = np.array(draw(st.lists(st.booleans(), min_size=tokens, max_size=tokens)), dtype=bool)
        records.append(
            Record(
                sample_id=f"r{i}",
                expert_ids=ids.reshape(tokens, len(moe), k),
                prompt_len=draw(st.integers(0, tokens)) if tokens else 0,
                response_len=0,
                valid=valid,
            )
        )
        records[-1].response_len = tokens - records[-1].prompt_len
    options = PartOptions(
        chunk_rows=draw(st.sampled_from([1, 7, 64, 4096])),
        chunk_layers=draw(st.integers(1, 4)),
        topk_order=draw(st.sampled_from(["sorted", "score"])),
    )
    return spec, records, options


@given(stores(), st.integers(1, 4000))
def test_round_trip(case: tuple[ModelSpec, list[Record], PartOptions], flush_bytes: int) -> None:
    spec, records, options = case
    url = f"memory://routelog-props/{uuid.uuid4().hex}"
    with routelog.open_writer(url, 0, model_spec=spec, options=options, flush_bytes=flush_bytes) as writer:
        for record in records:
            writer.append(record)
    snapshot = routelog.open_store(url).step(0)
    for got, record in zip(snapshot.read_many([r.sample_id for r in records]), records, strict=True):
        want = np.asarray(record.expert_ids)
        if options.topk_order == "sorted":
            want = np.sort(want, axis=-1)
        valid = np.asarray(record.valid)
        np.testing.assert_array_equal(got.valid, valid)
        np.testing.assert_array_equal(got.expert_ids[valid], want[valid])
        assert (got.expert_ids[~valid] == -1).all()
        assert got.info.n_missing == int((~valid).sum())
