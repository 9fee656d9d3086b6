"""Archiving a sealed step (``schemas/FORMAT.md`` section 3.15): every record read back as it was written (routing,
weights, streams, per-token values, indexer rows, holes, shared prefixes), on every backend; the operation's
edges (not sealed, archived already, interrupted); and what older readers do with it. The protocol under faults
and interleavings is proven in ``tests/test_protocol.py``."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import routelog
import routelog.format.documents
from routelog import ModelSpec, PartOptions, Record, StreamRows
from routelog.cli.main import app
from routelog.errors import FormatVersionError, HistoryReclaimedError, StepNotSealedError
from routelog.format import keys
from routelog.format.spec import IndexerSpec
from routelog.format.values import LOGPROB_INFER
from routelog.store.verify import verify_store
from tests.records import random_routing, sample_records

SPEC = ModelSpec(
    name="archive-test",
    num_layers=4,
    moe_layers=(1, 2, 3),
    num_experts=16,
    topk=2,
    mtp_layers=1,
    streams=(routelog.StreamSpec(name="mtp", num_layers=1, universe=16, topk=2),),
    indexer=IndexerSpec(index_topk=4, layers=(0, 3)),
)


def _indexer(n: int) -> np.ndarray:
    """Canonical indexer rows: query ``p`` keeps the last ``min(4, p + 1)`` positions."""
    rows = np.full((n, 2, 4), -1, np.int32)
    for p in range(n):
        kept = list(range(max(0, p - 3), p + 1))
        rows[p, :, : len(kept)] = kept
    return rows


def _records(seed: int, prefix: str, n: int = 6) -> list[Record]:
    """Records with everything a part can hold: holes, weights, an MTP stream, values, indexer rows on some, and
    a prompt shared by all (so format 2 stores it once, across parts too)."""
    rng = np.random.default_rng(seed)
    prompt = np.random.default_rng(7).integers(0, 300, 20)
    prompt_routes = random_routing(np.random.default_rng(8), 20, 3, 16, 2)
    out = []
    for i in range(n):
        length = int(rng.integers(4, 12))
        tokens = np.concatenate([prompt, rng.integers(300, 600, length)])
        total = tokens.size
        valid = np.ones(total, bool)
        valid[-1] = False
        if i % 3 == 1:
            valid[22:24] = False
        weights = rng.random((total, 3, 2)).astype(np.float32) if i % 2 == 0 else None
        out.append(
            Record(
                sample_id=f"{prefix}{i}",
                expert_ids=np.concatenate([prompt_routes, random_routing(rng, length, 3, 16, 2)]),
                prompt_len=20,
                response_len=total - 20,
                valid=valid,
                token_ids=tokens,
                group_id=f"g{i // 2}",
                weights=weights,
                streams={"mtp": StreamRows(random_routing(rng, total, 1, 16, 2), valid)},
                token_values={LOGPROB_INFER: -rng.random(total).astype(np.float32)},
                indexer=_indexer(total) if i % 2 == 1 else None,
            )
        )
    return out


def _written(url: str, **options: Any) -> routelog.Store:
    store = routelog.create_store(url, SPEC)
    for w, order in enumerate(["sorted", "sorted", "score"]):
        with store.writer(0, f"w{w}", options=PartOptions(topk_order=order), flush_bytes=1500, **options) as writer:  # type: ignore[arg-type]
            for record in _records(w, f"w{w}-"):
                writer.append(record)
    return store


def _contents(snapshot: routelog.StepSnapshot) -> dict[str, Any]:
    """Everything a reader reads of each record."""
    ids = snapshot.sample_ids
    out: dict[str, Any] = {}
    values = snapshot.token_values(ids, [LOGPROB_INFER])
    for routing, mtp in zip(snapshot.read_many(ids, weights=True), snapshot.read_many(ids, stream="mtp"), strict=True):
        sid = routing.sample_id
        info = snapshot.info(sid)
        try:
            indexer = snapshot.read_indexer(sid).tolist()
        except routelog.ValuesNotFoundError:
            indexer = None
        out[sid] = (
            routing.expert_ids.tolist(),
            routing.valid.tolist(),
            np.nan_to_num(routing.weights, nan=-1).tolist() if routing.weights is not None else None,
            mtp.expert_ids.tolist(),
            values[sid][LOGPROB_INFER].tolist(),
            indexer,
            info.token_ids,
            info.token_hash,
            info.group_id,
            routing.topk_order,
        )
    return out


def test_an_archived_step_reads_every_record_as_written(store_url: str) -> None:
    store = _written(store_url)
    store.seal(0)
    before = _contents(store.step(0))
    old = store.step(0)
    outcome = store.archive(0)
    assert outcome.entry is not None and not outcome.archived_already
    assert outcome.records == 18 and outcome.bytes_before == old.stored_bytes
    after = routelog.open_store(store_url).step(0)
    # score order kept, in a part of its own (the archive codec codes sorted sets)
    assert {(c.routing.topk_order, c.routing.transform) for c in after.parts} == {
        ("sorted", "ranked_context"),
        ("score", "none"),
    }
    assert outcome.bytes_after == after.stored_bytes
    assert [c.part for c in after.commits] == [c.part for c in old.commits]  # commits keep their identity
    assert _contents(after) == before
    report = verify_store(store)
    assert report.ok, report.problems
    again = store.archive(0)
    assert again.archived_already and again.entry is None
    assert (again.records, again.raw_bytes, again.bytes_after) == (
        outcome.records,
        outcome.raw_bytes,
        after.stored_bytes,
    )
    assert len(store.storage.list(keys.log_dir(0))) == outcome.entry.position + 1


def test_drops_after_an_archive_name_the_original_parts_and_writers(memory_url: str) -> None:
    store = _written(memory_url)
    store.seal(0)
    store.archive(0)
    part = store.step(0).commits[0].part
    store.drop(0, parts=[part])
    store.drop(0, writers=["w2"])
    store.drop(0, sample_ids=["w1-3"])
    snapshot = store.step(0)
    assert part not in {c.part for c in snapshot.commits}
    assert not any(s.startswith("w2-") for s in snapshot.sample_ids) and "w1-3" not in snapshot
    assert verify_store(store).ok


def test_views_before_the_archive_read_the_old_parts_until_gc_reclaims_them(tmp_path: Path) -> None:
    store = _written(f"file://{tmp_path}/s")
    store.seal(0)
    expected = _contents(store.step(0))
    sealed_at = datetime.now(UTC)
    original = store.step(0).parts
    store.archive(0)
    later = datetime.now(UTC) + timedelta(seconds=1)
    assert {c.routing.transform for c in store.step(0, as_of=sealed_at).parts} == {"ranked_gaps", "none"}
    assert _contents(store.step(0, as_of=sealed_at)) == expected
    young = store.gc(3600, delete=True, force=True)
    assert not young.trees  # within the grace: nothing goes
    report = store.gc(3600, delete=True, now=datetime.now(UTC).timestamp() + 7200)
    assert sorted(t.rsplit("/", 1)[1] for t in report.trees) == sorted(c.part for c in original)
    with pytest.raises(HistoryReclaimedError, match="archive"):
        store.step(0, as_of=sealed_at)
    assert _contents(store.step(0, as_of=later)) == expected
    assert _contents(store.step(0)) == expected
    assert verify_store(store).ok


def test_archiving_needs_a_sealed_step_and_leaves_an_interrupted_one_as_it_was(memory_url: str) -> None:
    store = _written(memory_url)
    with pytest.raises(StepNotSealedError, match="routelog seal"):
        store.archive(0)
    store.seal(0)
    listing = store.storage.list(keys.log_dir(0))
    parts = store.storage.list(keys.parts_dir(0))
    calls = []

    def interrupt() -> None:
        calls.append(1)
        if len(calls) == 10:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.archive(0, check=interrupt)
    assert store.storage.list(keys.log_dir(0)) == listing
    assert store.storage.list(keys.parts_dir(0)) == parts  # the archive parts uploaded so far are gone again
    assert store.archive(0).entry is not None  # resumed: done now


def test_a_reader_without_the_archive_feature_refuses_the_step(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _written(memory_url)
    store.seal(0)
    store.archive(0)
    monkeypatch.setattr(
        routelog.format.documents,
        "SUPPORTED_FEATURES",
        routelog.format.documents.SUPPORTED_FEATURES - {routelog.format.documents.ARCHIVE_FEATURE},
    )
    with pytest.raises(FormatVersionError, match="archive"):
        routelog.open_store(memory_url).step(0)


def test_the_archive_command_prints_bytes_and_is_a_no_op_the_second_time(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    store = routelog.create_store(url, SPEC.model_copy(update={"indexer": None, "streams": ()}))
    with store.writer(0, "w") as writer:
        for record in sample_records(store.model_spec, 12, 0):
            writer.append(record)
    runner = CliRunner()
    assert runner.invoke(app, ["archive", url]).exit_code == 1  # nothing sealed
    store.seal(0)
    first = runner.invoke(app, ["archive", url, "--step", "0"])
    assert first.exit_code == 0, first.output
    assert "archived step 0" in first.output and "->" in first.output
    second = runner.invoke(app, ["archive", url, "--json"])
    assert second.exit_code == 0, second.output
    [row] = json.loads(second.output)
    assert row["archived_already"] and row["entry"] is None and row["records"] == 12
    assert runner.invoke(app, ["verify", url]).exit_code == 0
