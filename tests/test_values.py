"""Per-token value columns: stored with records, attached later by annotations, read only when asked for."""

from __future__ import annotations

import io
import time
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import routelog
from routelog import ModelSpec, Record
from routelog.errors import CorruptDataError, DuplicateSampleError, InvalidRecordError, RecordNotFoundError
from routelog.format.values import LOGPROB_INFER, LOGPROB_TRAIN, VALUES_OBJECT, values_from_parquet, values_to_parquet
from routelog.store.annotate import annotate
from routelog.store.gc import collect_garbage
from routelog.store.seal import seal_step
from routelog.store.verify import verify_store


def records(spec: ModelSpec, n: int, *, with_values: bool = True, seed: int = 0) -> list[Record]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        tokens = int(rng.integers(6, 30))
        logprobs = np.full(tokens, np.nan, np.float32)
        logprobs[3:] = -rng.random(tokens - 3)
        out.append(
            Record(
                sample_id=f"s{i}",
                expert_ids=np.argsort(rng.random((tokens, spec.num_moe_layers, spec.num_experts)), -1)[
                    ..., : spec.topk
                ],
                prompt_len=3,
                response_len=tokens - 3,
                token_ids=rng.integers(0, 100, tokens),
                token_values={LOGPROB_INFER: logprobs} if with_values and i % 3 else None,
            )
        )
    return out


def test_values_round_trip_on_every_backend(store_url: str, small_spec: ModelSpec) -> None:
    store = routelog.create_store(store_url, small_spec)
    written = records(small_spec, 9)
    with store.writer(0, "w", flush_bytes=1 << 10) as writer:
        for record in written:
            writer.append(record)
    snapshot = store.step(0)
    assert snapshot.value_columns() == [LOGPROB_INFER]
    got = snapshot.token_values(snapshot.sample_ids, [LOGPROB_INFER, LOGPROB_TRAIN])
    for record in written:
        if record.token_values is None:
            assert got[record.sample_id] == {}
        else:
            np.testing.assert_array_equal(got[record.sample_id][LOGPROB_INFER], record.token_values[LOGPROB_INFER])
    assert verify_store(store).ok


def test_readers_that_do_not_ask_never_fetch_values(memory_url: str, small_spec: ModelSpec) -> None:
    store = routelog.create_store(memory_url, small_spec)
    with store.writer(0, "w") as writer:
        for record in records(small_spec, 4):
            writer.append(record)
    fetched: list[str] = []
    storage = store.storage
    real_read, real_ranges = storage.read, storage.read_ranges
    storage.read = lambda key: fetched.append(key) or real_read(key)  # type: ignore[method-assign]
    storage.read_ranges = lambda r, *into: fetched.extend(k for k, _, _ in r) or real_ranges(r, *into)  # type: ignore[method-assign]
    snapshot = store.step(0)
    snapshot.read_many(snapshot.sample_ids)
    assert fetched and not any(key.endswith(VALUES_OBJECT) for key in fetched)
    snapshot.token_values(["s1"], [LOGPROB_INFER])
    assert any(key.endswith(VALUES_OBJECT) for key in fetched)


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"logprob_infer": np.zeros(5)}, "expected"),
        ({"Bad-Name": np.zeros(10)}, "column name"),
        ({"logprob_infer": np.full(10, np.inf)}, r"\+inf"),
        ({"logprob_infer": ["a"] * 10}, "not numeric"),
    ],
)
def test_bad_values_are_refused_naming_sample_and_column(
    memory_url: str, small_spec: ModelSpec, values: dict[str, object], problem: str
) -> None:
    store = routelog.create_store(memory_url, small_spec)
    good = records(small_spec, 2, with_values=False)
    with store.writer(0, "w") as writer:
        writer.append(good[0])
        ids = np.argsort(np.random.default_rng(1).random((10, small_spec.num_moe_layers, small_spec.num_experts)), -1)
        with pytest.raises(InvalidRecordError, match=problem) as info:
            writer.append(
                Record(
                    sample_id="bad",
                    expert_ids=ids[..., : small_spec.topk],
                    prompt_len=2,
                    response_len=8,
                    token_values=values,
                )  # type: ignore[arg-type]
            )
        assert info.value.sample_id == "bad" and info.value.field.startswith("token_values")
    assert store.step(0).sample_ids == ["s0"]  # the good record was committed, nothing of the bad one


def test_annotations_attach_training_logprobs_after_the_fact(memory_url: str, small_spec: ModelSpec) -> None:
    store = routelog.create_store(memory_url, small_spec)
    written = records(small_spec, 6)
    with store.writer(0, "rollout") as writer:
        for record in written:
            writer.append(record)
    seal_step(store, 0)  # annotations are additive: accepted on a sealed step
    train = {r.sample_id: np.linspace(-1, 0, r.n_tokens) for r in written[:4]}
    with store.annotate(0, "trainer") as annotator:
        for sid, values in train.items():
            annotator.add(sid, {LOGPROB_TRAIN: values})
    snapshot = store.step(0)
    assert snapshot.value_columns() == [LOGPROB_INFER, LOGPROB_TRAIN]
    got = snapshot.token_values(snapshot.sample_ids, [LOGPROB_TRAIN])
    for sid, values in train.items():
        np.testing.assert_allclose(got[sid][LOGPROB_TRAIN], values.astype(np.float32))
    assert got["s4"] == {} and got["s5"] == {}
    report = verify_store(store)
    assert report.ok, report.problems
    assert collect_garbage(store, 0.0, force=True).orphans == {}  # committed annotations are never garbage


def test_annotations_check_the_record_they_attach_to(memory_url: str, small_spec: ModelSpec) -> None:
    store = routelog.create_store(memory_url, small_spec)
    written = records(small_spec, 2)
    with store.writer(0, "w") as writer:
        for record in written:
            writer.append(record)
    annotator = store.annotate(0, "trainer")
    with pytest.raises(RecordNotFoundError, match="nope"):
        annotator.add("nope", {LOGPROB_TRAIN: np.zeros(3)})
    with pytest.raises(InvalidRecordError, match="token_hash"):
        annotator.add("s0", {LOGPROB_TRAIN: np.zeros(written[0].n_tokens)}, token_hash="blake2b-128:00")
    with pytest.raises(InvalidRecordError, match="shape"):
        annotator.add("s0", {LOGPROB_TRAIN: np.zeros(written[0].n_tokens + 1)})
    assert annotator.commit() is None  # nothing valid was added, nothing is written
    assert store.step(0).annotations == []


def test_a_column_given_twice_is_an_error_not_a_silent_choice(memory_url: str, small_spec: ModelSpec) -> None:
    store = routelog.create_store(memory_url, small_spec)
    written = records(small_spec, 3)
    with store.writer(0, "w") as writer:
        for record in written:
            writer.append(record)
    n = written[1].n_tokens
    annotate(store, 0, "t1", {"s1": {LOGPROB_TRAIN: np.zeros(n)}})
    time.sleep(0.03)
    between = datetime.now(UTC)  # as-of views go by the storage's times of the entries
    time.sleep(0.03)
    annotate(store, 0, "t2", {"s1": {LOGPROB_TRAIN: np.ones(n) * -1}})
    with pytest.raises(DuplicateSampleError, match="given twice"):
        store.step(0).token_values(["s1"], [LOGPROB_TRAIN])
    assert not verify_store(store).ok
    # ...but reading other columns, and reading as of before the second annotation, still works.
    assert LOGPROB_INFER in store.step(0).token_values(["s1"], [LOGPROB_INFER])["s1"]
    assert store.step(0, as_of=between).token_values(["s1"], [LOGPROB_TRAIN])["s1"][LOGPROB_TRAIN].tolist() == [0.0] * n


def test_orphaned_annotation_data_is_collected(memory_url: str, small_spec: ModelSpec) -> None:
    store = routelog.create_store(memory_url, small_spec)
    with store.writer(0, "w") as writer:
        writer.append(records(small_spec, 1)[0])
    # An annotator that died after uploading its values, before its commit:
    store.storage.write("steps/0000000000/annotations/t.00000000.abcdef012345/values.parquet", b"partial")
    report = collect_garbage(store, 0.0, delete=True, force=True)
    assert list(report.orphans) == ["steps/0000000000/annotations/t.00000000.abcdef012345/values.parquet"]
    assert verify_store(store).ok


# -- bounded reading: a values object decodes only within the records and tokens of the part it belongs to --------
def _values_object(lengths: dict[str, list[int | None]]) -> bytes:
    """One row per position of the lists, ``{column: [values per row, None = null cell]}``."""
    rows = len(next(iter(lengths.values())))
    return values_to_parquet(
        [
            (
                f"s{i}",
                None,
                {name: np.arange(n[i], dtype=np.float32) for name, n in lengths.items() if n[i] is not None},
            )
            for i in range(rows)
        ],
        sorted(lengths),
    )


def test_a_values_object_reads_within_the_records_and_tokens_of_its_part() -> None:
    data = _values_object({LOGPROB_INFER: [100, None, 300]})
    got = values_from_parquet(data, [LOGPROB_INFER], "v", declared=[LOGPROB_INFER], max_records=3, max_tokens=400)
    assert got.token_hashes == {"s0": None, "s1": None, "s2": None}
    assert got.values["s1"] == {}
    np.testing.assert_array_equal(got.values["s2"][LOGPROB_INFER], np.arange(300, dtype=np.float32))


def test_a_values_object_holding_more_than_its_part_is_refused_naming_it() -> None:
    data = _values_object({LOGPROB_INFER: [100, None, 300]})
    with pytest.raises(CorruptDataError, match="v: the footer declares 3 rows; at most 2 records"):
        values_from_parquet(data, [LOGPROB_INFER], "v", max_records=2, max_tokens=400)
    # 100 + 300 values and one null cell, where 200 tokens of 3 records allow 203
    with pytest.raises(CorruptDataError, match=r"v: column logprob_infer\.list\.element declares 401 values"):
        values_from_parquet(data, [LOGPROB_INFER], "v", max_records=3, max_tokens=200)


def test_a_column_not_asked_for_is_neither_checked_nor_decoded() -> None:
    data = _values_object({LOGPROB_INFER: [10, 10], LOGPROB_TRAIN: [1 << 20, None]})
    got = values_from_parquet(data, [LOGPROB_INFER], "v", max_records=2, max_tokens=20)
    assert {sid: sorted(columns) for sid, columns in got.values.items()} == {
        "s0": [LOGPROB_INFER],
        "s1": [LOGPROB_INFER],
    }
    with pytest.raises(CorruptDataError, match="logprob_train"):
        values_from_parquet(data, [LOGPROB_TRAIN], "v", max_records=2, max_tokens=20)


def test_a_values_object_without_sample_ids_is_corrupt() -> None:
    sink = io.BytesIO()
    pq.write_table(pa.table({LOGPROB_INFER: pa.array([[0.5]], pa.list_(pa.float32()))}), sink)
    with pytest.raises(CorruptDataError, match="v: not a values object"):
        values_from_parquet(sink.getvalue(), [LOGPROB_INFER], "v", max_records=1, max_tokens=1)
