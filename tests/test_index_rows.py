"""Index rows read one at a time and all at once (a writer listing its peers' records, ``routelog verify``) are the
same validated rows, and a row that breaks the format is refused either way."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pydantic
import pytest

import routelog
from routelog import Record
from routelog.errors import CorruptDataError
from routelog.format.index_rows import BULK_SHARE, IndexRows, record_spans
from routelog.store.history import COMMIT_COLUMN
from routelog.synth import synthetic_spec


def _index(memory_url: str) -> pa.Table:
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 1000, 40)
    with routelog.open_writer(memory_url, 0, model_spec=synthetic_spec(4, 16, 2)) as writer:
        for n in range(6):
            tokens = int(rng.integers(20, 60))
            ids = np.sort(np.argsort(rng.random((tokens + 40, 4, 16)), axis=-1)[..., :2], axis=-1)
            ids[:40] = np.sort(np.argsort(np.random.default_rng(0).random((40, 4, 16)), axis=-1)[..., :2], axis=-1)
            writer.append(
                Record(
                    sample_id=f"s{n}",
                    expert_ids=ids,
                    prompt_len=40,
                    response_len=tokens,
                    token_ids=None if n == 4 else np.concatenate([prompt, rng.integers(0, 1000, tokens)]),
                    group_id="g" if n % 2 else None,
                )
            )
            if n == 2:
                writer.flush()  # later samples share the prompt's rows in the first part: rows with spans
    return routelog.open_store(memory_url).step(0).index


def test_every_row_at_once_is_each_row(memory_url: str) -> None:
    rows = IndexRows(_index(memory_url), skip=[COMMIT_COLUMN])
    every = rows.every()
    assert len(every) == 6 and any(len(row.spans) > 1 for row, _ in every)  # some rows point into another part
    for position, (row, tokens) in enumerate(every):
        one, one_tokens = rows.row(position)
        assert row == one
        assert (tokens is None and one_tokens is None) or np.array_equal(tokens, one_tokens)  # type: ignore[arg-type]
    assert [row for row, _ in rows.every(with_tokens=False)] == [
        rows.row(p, with_tokens=False)[0] for p in range(len(rows))
    ]


def test_rows_asked_for_one_by_one_are_the_same_before_and_after_the_columns_are_converted_whole(
    memory_url: str,
) -> None:
    """A large index's first rows are converted a scalar at a time, the rest from columns converted whole once
    enough were asked for (:data:`BULK_SHARE`): the same rows either way, token ids included."""
    table = pa.concat_tables([_index(memory_url)] * 10)
    every = IndexRows(table, skip=[COMMIT_COLUMN]).every()
    rows = IndexRows(table, skip=[COMMIT_COLUMN])
    scalar = table.num_rows // BULK_SHARE
    assert 1 < scalar < table.num_rows - 1
    for position in reversed(range(table.num_rows)):  # the first asked for (the last rows) one scalar at a time
        row, tokens = rows.row(position)
        assert row == every[position][0]
        assert (tokens is None and every[position][1] is None) or np.array_equal(tokens, every[position][1])  # type: ignore[arg-type]


def test_a_row_breaking_the_format_is_refused_all_at_once(memory_url: str) -> None:
    table = _index(memory_url)
    n_tokens = table.column("n_tokens").to_pylist()
    n_tokens[3] = -5
    forged = table.set_column(table.schema.get_field_index("n_tokens"), "n_tokens", pa.array(n_tokens, pa.int64()))
    rows = IndexRows(forged, skip=[COMMIT_COLUMN])
    with pytest.raises(pydantic.ValidationError) as one:
        rows.row(3)
    with pytest.raises(pydantic.ValidationError) as every:
        rows.every()
    assert str(every.value) == str(one.value)


def test_record_spans_are_the_validated_rows_tokens_and_spans(memory_url: str) -> None:
    table = _index(memory_url)
    every = IndexRows(table, skip=[COMMIT_COLUMN]).every()
    listed = record_spans(table, 0, "the index")
    with_tokens = [(row, tokens) for row, tokens in every if tokens is not None]
    assert len(listed) == len(with_tokens) == 5  # the record without token ids is no candidate
    assert any(part is not None for record in listed for part in record.parts), "some point into the other part"
    for record, (row, tokens) in zip(listed, with_tokens, strict=True):
        assert record.tokens.dtype == np.int64 and np.array_equal(record.tokens, tokens)  # type: ignore[arg-type]
        got = list(
            zip(record.token_starts.tolist(), record.n_rows.tolist(), record.rows.tolist(), record.parts, strict=True)
        )
        assert got == [(s.token_start, s.n_rows, s.row, s.part) for s in row.spans]
    shortest = min(len(tokens) for _, tokens in with_tokens)  # type: ignore[arg-type]
    assert len(record_spans(table, shortest + 1, "the index")) == sum(
        len(tokens) > shortest  # type: ignore[arg-type]
        for _, tokens in with_tokens
    )


def _forge_spans(table: pa.Table, position: int, change: dict[str, int | None]) -> pa.Table:
    spans = table.column("spans").to_pylist()
    spans[position] = [{**spans[position][0], **change}, *spans[position][1:]]
    at = table.schema.get_field_index("spans")
    return table.set_column(at, table.schema.field(at), pa.array(spans, table.schema.field(at).type))


@pytest.mark.parametrize(
    "change",
    [{"token_start": -1}, {"n_rows": 0}, {"n_rows": 10_000}, {"row": -3}, {"n_rows": None}, {"token_start": 30}],
    ids=["negative start", "empty span", "past the tokens", "negative row", "null count", "overlapping"],
)
def test_record_spans_refuse_what_the_row_model_refuses(memory_url: str, change: dict[str, int | None]) -> None:
    table = _index(memory_url)
    position = next(i for i, spans in enumerate(table.column("spans").to_pylist()) if len(spans) > 1)
    forged = _forge_spans(table, position, change)
    sample = table.column("sample_id")[position].as_py()
    with pytest.raises(pydantic.ValidationError):
        IndexRows(forged, skip=[COMMIT_COLUMN]).row(position)
    with pytest.raises(CorruptDataError, match=f"the index: record '{sample}'"):
        record_spans(forged, 0, "the index")


def test_record_spans_refuse_token_ids_that_miscount_and_columns_of_other_types(memory_url: str) -> None:
    table = _index(memory_url)
    n_tokens = table.column("n_tokens").to_pylist()
    n_tokens[1] += 1
    at = table.schema.get_field_index("n_tokens")
    miscounted = table.set_column(at, table.schema.field(at), pa.array(n_tokens, table.schema.field(at).type))
    with pytest.raises(CorruptDataError, match="record 's1' has"):
        record_spans(miscounted, 0, "the index")
    tokens = table.column("token_ids").to_pylist()
    tokens[2][7] = None
    at = table.schema.get_field_index("token_ids")
    holed = table.set_column(at, table.schema.field(at), pa.array(tokens, table.schema.field(at).type))
    with pytest.raises(pydantic.ValidationError):
        IndexRows(holed, skip=[COMMIT_COLUMN]).row(2)
    with pytest.raises(CorruptDataError, match=r"record 's2' has .* token ids \(or a null one\)"):
        record_spans(holed, 0, "the index")
    at = table.schema.get_field_index("spans")
    flat = table.set_column(at, "spans", pa.array(["no spans"] * table.num_rows))
    with pytest.raises(CorruptDataError, match="cannot be read"):
        record_spans(flat, 0, "the index")
