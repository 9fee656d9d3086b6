"""Golden stores: every later routelog must still read the stores earlier format versions wrote."""

from __future__ import annotations

import json
import os
import shutil
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
import zstandard

import routelog
from routelog.format import keys
from routelog.format.part import shard_layout
from routelog.format.shard import decode_shard_index
from routelog.store.verify import verify_store

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = sorted(FIXTURES.glob("golden-v*"))


@pytest.mark.parametrize("golden", GOLDEN, ids=[p.name for p in GOLDEN])
def test_golden_stores_read_exactly(golden: Path, tmp_path: Path) -> None:
    with np.load(golden / "expected.npz", allow_pickle=False) as expected_file:
        expected = dict(expected_file)
    stores = sorted({key.split("/")[0] for key in expected})
    assert stores, "a golden fixture without expectations proves nothing"
    for name in stores:
        copy = tmp_path / name
        shutil.copytree(golden / name, copy)  # read a copy: the fixture itself must never change
        store = routelog.open_store(str(copy))
        checked = 0
        weights = any(k.startswith(f"{name}/") and k.endswith("/weights") for k in expected)
        for step in store.steps():
            snapshot = store.step(step)
            for got in snapshot.read_many(snapshot.sample_ids, weights=weights):
                key = f"{name}/{got.sample_id}"
                np.testing.assert_array_equal(got.expert_ids, expected[f"{key}/ids"])
                np.testing.assert_array_equal(got.valid, expected[f"{key}/valid"])
                if f"{key}/tokens" in expected:
                    assert got.info.token_ids is not None
                    np.testing.assert_array_equal(got.info.token_ids, expected[f"{key}/tokens"])
                if weights:
                    assert got.weights is not None
                    np.testing.assert_array_equal(got.weights.transpose(1, 0, 2), expected[f"{key}/weights"])
                columns = [c for c in ("logprob_infer", "logprob_train") if f"{key}/{c}" in expected]
                values = snapshot.token_values([got.sample_id], snapshot.value_columns())[got.sample_id]
                if any(k.startswith(f"{name}/") and "/logprob_" in k for k in expected):
                    assert sorted(values) == columns, (got.sample_id, sorted(values))
                for column in columns:
                    np.testing.assert_array_equal(values[column], expected[f"{key}/{column}"])
                if f"{key}/indexer" in expected:  # revision 4.1
                    np.testing.assert_array_equal(snapshot.read_indexer(got.sample_id), expected[f"{key}/indexer"])
                checked += 1
        assert checked == sum(1 for k in expected if k.startswith(f"{name}/") and k.endswith("/ids"))
        assert verify_store(store).ok


def test_golden_metadata_survives() -> None:
    store = routelog.open_store(str(FIXTURES / "golden-v1" / "dense-first"))
    assert store.run.run_id == "golden-dense-first"
    assert store.run.config == {"purpose": "golden fixture"}
    assert store.model_spec.moe_layers == (3, 4, 5, 6)
    info = store.step(1).info("step1/req-3/0")
    assert info.engine == "vllm"
    assert info.engine_version == "0.22.0"
    assert [(s.start, s.end, s.source) for s in info.segments] == [(0, 8, "prompt"), (8, 59, "response")]
    assert info.n_missing == 4
    assert info.extra == '{"reward": 0.75}'


def test_golden_v2_holds_what_format_2_adds() -> None:
    """The format-2 fixtures exercise the new parts of the format: ranked layers, repeats and shared prefixes."""
    for name in ("grpo-96", "grpo-384"):
        store = routelog.open_store(str(FIXTURES / "golden-v2" / name))
        snapshot = store.step(0)
        assert {c.routing.transform for c in snapshot.commits} == {"ranked_gaps"}
        assert snapshot.routed_rows > snapshot.stored_rows, "GRPO prompts are stored once"
        assert store.model_spec.num_experts == int(name.split("-")[1])


def test_golden_v2_shares_across_parts_and_writers_and_keeps_weights() -> None:
    store = routelog.open_store(str(FIXTURES / "golden-v2" / "shared-weights"))
    snapshot = store.step(0)
    assert {c.weights.dtype for c in snapshot.commits if c.weights} == {"bfloat16", "float32"}
    assert any(c.weights is None for c in snapshot.commits), "a part whose record carried no weights"
    parts = {c.part: c.writer_id for c in snapshot.commits}
    references = {
        (parts[snapshot.commits[snapshot._commit_of(snapshot._position(sid))].part], span.part.rsplit("/", 1)[1])
        for sid in snapshot.sample_ids
        for span in snapshot.info(sid).spans
        if span.part is not None
    }
    assert {(writer, parts[part]) for writer, part in references} >= {
        ("worker-a", "worker-a"),
        ("worker-b", "worker-b"),
        ("worker-b", "worker-a"),
    }, "spans point into earlier parts of the same writer and of the other writer"


def test_a_format_1_reader_refuses_format_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A format-1 reader runs the same version check with FORMAT_VERSION = 1: it refuses, with the typed error."""
    import routelog.format.documents

    shutil.copytree(FIXTURES / "golden-v2" / "grpo-96", tmp_path / "store")
    monkeypatch.setattr(routelog.format.documents, "FORMAT_VERSION", 1)
    with pytest.raises(routelog.FormatVersionError, match="format version 2"):
        routelog.open_store(str(tmp_path / "store"))


def test_a_format_2_reader_refuses_format_3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import routelog.format.documents

    shutil.copytree(FIXTURES / "golden-v3" / "history", tmp_path / "store")
    monkeypatch.setattr(routelog.format.documents, "FORMAT_VERSION", 2)
    with pytest.raises(routelog.FormatVersionError, match="format version 3"):
        routelog.open_store(str(tmp_path / "store"))


def test_golden_v3_holds_a_step_log_with_every_kind_of_entry() -> None:
    """The format-3 fixture's step log: commits, drops by sample, part and writer, a sample id written again after
    its drop, an annotation, the seal and a drop after it; readers apply each by its position."""
    store = routelog.open_store(str(FIXTURES / "golden-v3" / "history"))
    log = [
        json.loads((FIXTURES / "golden-v3" / "history" / keys.log_dir(0) / n).read_text())
        for n in sorted(os.listdir(FIXTURES / "golden-v3" / "history" / keys.log_dir(0)))
    ]
    kinds = [doc["kind"].removeprefix("routelog.") for doc in log]
    assert kinds == ["commit"] * 4 + ["drop", "commit", "drop", "commit", "annotation", "seal", "drop"]
    snapshot = store.step(0)
    assert snapshot.sealed and sorted(snapshot.sample_ids) == ["a", "b", "c", "d"]
    assert snapshot.info("b").n_tokens == 28, "b was dropped, then written again with other tokens"
    assert "r" not in snapshot and len(snapshot.dropped_commits) == 3


def _chunk_trailers(store: routelog.Store) -> list[tuple[int, list[int]]]:
    """Every inner chunk of every part's routing: its payload version and layer modes (FORMAT.md section 5)."""
    found = []
    for step in store.steps():
        snapshot = store.step(step)
        for commit in snapshot.commits:
            layout = shard_layout(commit.routing)
            for obj in commit.objects:
                if not obj.key.startswith(commit.routing.path + "/c/"):
                    continue
                data = store.storage.read(f"{keys.part_dir(step, commit.part)}/{obj.key}")
                index = decode_shard_index(data[: layout.index_nbytes], layout, len(data))
                for offset, nbytes in index.reshape(-1, 2):
                    payload = data[int(offset) : int(offset + nbytes) - 4]  # the crc32c follows each chunk
                    first = int.from_bytes(payload[:4], "little")
                    rest = zstandard.ZstdDecompressor().decompress(payload[4 + first :])
                    layers = commit.routing.chunk_layers
                    found.append((rest[-1], list(rest[-9 - layers : -9])))
    return found


@pytest.mark.parametrize("name", ["dictionaries-64-8", "dictionaries-64-6", "dictionaries-300-8"])
def test_golden_v2_holds_chunks_with_dictionaries(name: str) -> None:
    """The dictionary fixtures exercise chunk payload version 2 (layers keeping a dictionary of their distinct rows,
    ranked ones among them) on each kernel path; the other format-2 fixtures hold version-1 chunks only."""
    modes = [
        mode
        for version, modes in _chunk_trailers(routelog.open_store(str(FIXTURES / "golden-v2" / name)))
        for mode in modes
        if version == 2
    ]
    assert 4 | 2 in modes and 4 | 2 | 1 in modes, "dictionaries, of plain and of ranked layers"
    for older in ("grpo-96", "grpo-384", "dense-first"):
        assert {
            version for version, _ in _chunk_trailers(routelog.open_store(str(FIXTURES / "golden-v2" / older)))
        } == {1}


def test_golden_v4_holds_indexer_rows_of_revision_4_1() -> None:
    """The `indexer` store: parts naming the feature `indexer_positions`, a shared layer stored through its
    source, records across keyframes (700 tokens), and a record without indexer rows beside them."""
    with np.load(FIXTURES / "golden-v4" / "expected.npz", allow_pickle=False) as expected:
        rows = {k.split("/")[1]: expected[k] for k in expected.files if k.startswith("indexer/") and "/indexer" in k}
    assert sorted(rows) == ["p0-r0", "p0-r1", "p0-r2", "p1-r0"] and rows["p1-r0"].shape == (700, 3, 12)
    snapshot = routelog.open_store(str(FIXTURES / "golden-v4" / "indexer")).step(0)
    assert snapshot.sealed and all(c.features == ["indexer_positions"] for c in snapshot.commits)
    assert snapshot.store.model_spec.indexer is not None and snapshot.store.model_spec.indexer.shared == (2,)
    np.testing.assert_array_equal(
        snapshot.read_indexer("p1-r0", layers=[2], tokens=(500, 700)), rows["p1-r0"][500:, [2]]
    )
    with pytest.raises(routelog.errors.ValuesNotFoundError):
        snapshot.read_indexer("p0-plain")


def test_golden_v4_holds_a_step_archived_in_revision_4_2(tmp_path: Path) -> None:
    """The `archived` store: the `history` step archived after its seal (its shadowed copy in an archive part of
    its own), its original parts and the seal's consolidated copies reclaimed, then a drop by an original part's
    name: read through the archive parts, as of before the archive refused as reclaimed."""
    copy = tmp_path / "archived"
    shutil.copytree(FIXTURES / "golden-v4" / "archived", copy)
    store = routelog.open_store(str(copy))
    snapshot = store.step(0)
    assert {c.writer_id for c in snapshot.parts} == {"archive"} and len(snapshot.parts) == 2
    assert {c.routing.transform for c in snapshot.parts} == {"ranked_context"}
    kinds = [json.loads(p.read_text())["kind"] for p in sorted((copy / "steps/0000000000/log").iterdir())]
    assert kinds.count("routelog.archive") == 1 and kinds[-1] == "routelog.drop"
    archived_at = kinds.index("routelog.archive")
    log = copy / "steps/0000000000/log"
    for position in range(len(kinds)):  # a checkout's mtimes are its own: the storage's times, a second apart
        os.utime(log / keys.log_name(position), (1_800_000_000 + position, 1_800_000_000 + position))
    with pytest.raises(routelog.errors.HistoryReclaimedError):
        store.step(0, as_of=datetime.fromtimestamp(1_800_000_000 + archived_at - 1, UTC))
    assert len(store.step(0, as_of=datetime.fromtimestamp(1_800_000_000 + archived_at, UTC))) == len(snapshot) + 1
    assert verify_store(store).ok
