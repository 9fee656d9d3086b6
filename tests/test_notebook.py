"""The Python API a notebook user expects: the Store as the one entry point, every writer option on
``open_writer``, Arrow/pandas tables of the index and of decoded routing, short reprs and HTML views."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import routelog
from routelog import audit
from routelog.format.routing import ROUTING_TABLE_SCHEMA
from routelog.synth import SynthConfig, synth_records, synthetic_spec

SPEC = synthetic_spec(3, 16, 2)


def _store(url: str) -> routelog.Store:
    commits: list[str] = []
    with routelog.open_writer(
        url,
        0,
        model_spec=SPEC,
        writer_id="nb",
        flush_bytes=1,
        flush_seconds=5.0,
        on_commit=lambda commit, sample_ids: commits.append(commit.name),
        on_duplicate="error",
        max_pending=1,
    ) as writer:
        for record in synth_records(SPEC, SynthConfig(records=5, tokens=9, ragged=True, seed=3)):
            writer.append(record)
    assert len(set(commits)) == 5, "open_writer passes every writer option on"
    assert commits == sorted(commits), "parts are committed in the order they were flushed"
    return routelog.open_store(url)


def test_index_table(memory_url: str) -> None:
    store = _store(memory_url)
    snapshot = store.step(0)
    table = snapshot.to_arrow()
    assert table.num_rows == len(snapshot)
    assert table.column("sample_id").to_pylist() == snapshot.sample_ids
    assert set(routelog.IndexRow.model_fields) | {"part"} == set(table.column_names)
    assert pa.types.is_integer(table.schema.field("policy_version").type), "nullable integers stay integers"
    assert table.column("part").to_pylist() == [c.part for c in snapshot.commits]
    chosen = snapshot.to_arrow(["000003", "000001"])
    assert chosen.column("sample_id").to_pylist() == ["000003", "000001"]
    frame = snapshot.to_pandas()
    assert list(frame["n_tokens"]) == [snapshot.info(s).n_tokens for s in snapshot.sample_ids]
    with pytest.raises(routelog.RecordNotFoundError):
        snapshot.to_arrow(["nope"])


def test_long_form_routing_table_matches_the_arrays_and_the_audit(memory_url: str) -> None:
    store = _store(memory_url)
    snapshot = store.step(0)
    table = snapshot.to_arrow(routing=True)
    assert table.schema == ROUTING_TABLE_SCHEMA
    routings = snapshot.read_many(snapshot.sample_ids)
    assert table.num_rows == sum(int(r.valid.sum()) for r in routings) * SPEC.num_moe_layers * SPEC.topk
    for routing in routings:
        rows = table.filter(pc.equal(table["sample_id"], routing.sample_id))
        rebuilt = np.full(routing.expert_ids.shape, -1, np.int32)
        layer_pos = {layer: j for j, layer in enumerate(routing.layers)}
        for token, layer, k, expert in zip(
            *(rows[c].to_numpy() for c in ("token", "layer", "k", "expert")), strict=True
        ):
            rebuilt[token, layer_pos[int(layer)], k] = expert
        np.testing.assert_array_equal(rebuilt, routing.expert_ids)
    # a DataFrame query equals the audit: expert load of layer 1
    load = table.filter(pc.equal(table["layer"], 1)).group_by("expert").aggregate([("expert", "count")])
    counts = dict(zip(load["expert"].to_pylist(), load["expert_count"].to_pylist(), strict=True))
    stats = audit.stats(memory_url)
    assert counts == {e: int(c) for e, c in enumerate(stats.layers[1].load) if c}
    one_layer = snapshot.to_pandas(["000002"], routing=True, moe_layers=[2])
    assert set(one_layer["layer"]) == {2} and set(one_layer["sample_id"]) == {"000002"}


def test_reprs_are_short_and_html_is_escaped(memory_url: str) -> None:
    spec = synthetic_spec(2, 8, 2)
    store = routelog.create_store(memory_url, spec)
    record = next(iter(synth_records(spec, SynthConfig(records=1, tokens=6))))
    record.sample_id = "<b>x</b>"
    with store.writer(0) as writer:
        writer.append(record)
    snapshot = store.step(0)
    routing = snapshot.read("<b>x</b>")
    for text in (repr(store), repr(snapshot), repr(routing)):
        assert len(text) < 200 and "\n" not in text
    assert "1 record" in repr(snapshot) and "1 part" in repr(snapshot) and "1 parts" not in repr(snapshot)
    assert "6 tokens (5 routed)" in repr(routing)
    for html in (store._repr_html_(), snapshot._repr_html_(), routing._repr_html_()):
        assert html.startswith("<div>") and "<table>" in html
        assert "<b>x</b>" not in html, "sample ids are escaped"
    assert "&lt;b&gt;x&lt;/b&gt;" in snapshot._repr_html_() and "&lt;b&gt;x&lt;/b&gt;" in routing._repr_html_()
    assert "steps" in store._repr_html_() and "[0]" in store._repr_html_()


def test_store_is_the_one_entry_point(memory_url: str) -> None:
    store = _store(memory_url)
    assert store.summary()["records"] == 5
    assert store.verify().ok
    outcome = store.drop(0, sample_ids=["000001"], reason="bad")
    assert outcome.drop is not None and outcome.drop.sample_ids == ["000001"] and "000001" not in store.step(0)
    report = store.gc(0, force=True)
    assert not report.deleted and report.damaged == []
