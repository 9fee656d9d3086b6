"""Index rows (:class:`~routelog.format.documents.IndexRow`) out of an index table, one at a time and checked.

A record's token ids are most of its row: pydantic checks a list of ints one int at a time (measured: 450 us of a
4k-token record's row), and readers want them as an array anyway. So a row's other fields are taken one scalar per
column and validated by the model, while its token ids, where the column is a list of int32 without nulls (every
value fits the model's ``Int32``), are sliced out of the column's values as one array and only their count is
checked. A writer listing its peers' records takes only their token ids and spans (:func:`record_spans`), checked
for a whole index at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from routelog.errors import CorruptDataError
from routelog.format.arrow import to_numpy
from routelog.format.documents import IndexRow

BULK_SHARE = 16
""":meth:`IndexRows.fields` converts the columns whole once one row in this many was asked for."""


@dataclass(frozen=True)
class _TokenLists:
    """A ``token_ids`` column as arrays: record i's ids are ``values[offsets[i]:offsets[i + 1]]`` where
    ``present[i]``; ``null_ids`` marks the values that are null (read as 0), None when none is."""

    offsets: npt.NDArray[Any]
    values: npt.NDArray[Any]
    present: npt.NDArray[np.bool_]
    null_ids: npt.NDArray[np.bool_] | None

    @classmethod
    def of(cls, column: pa.Array | pa.ChunkedArray) -> _TokenLists:
        tokens = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        values = tokens.values  # a combined array starts at offset 0: its offsets index every list's values
        null_ids = to_numpy(pc.is_null(values)) if values.null_count else None
        return cls(to_numpy(tokens.offsets), to_numpy(values, fill=0), to_numpy(tokens.is_valid()), null_ids)

    def holding_nulls(self) -> npt.NDArray[np.bool_]:
        """Per record: whether a null id lies among its values."""
        if self.null_ids is None:
            return np.zeros(self.present.size, bool)
        before = np.concatenate([[0], np.cumsum(self.null_ids, dtype=np.int64)])
        return np.asarray(before[self.offsets[1:]] > before[self.offsets[:-1]])


class IndexRows:
    """The rows of ``table`` (an index, as a part writes it or a step's concatenation), but ``skip`` columns."""

    def __init__(self, table: pa.Table, skip: Sequence[str] = ()) -> None:
        self._columns = {
            name: column.combine_chunks()
            for name, column in zip(table.column_names, table.columns, strict=True)
            if name not in skip
        }
        self._tokens: _TokenLists | None = None
        tokens = self._columns.get("token_ids")
        if tokens is not None and pa.types.is_list(tokens.type) and tokens.type.value_type == pa.int32():
            lists = _TokenLists.of(tokens)
            if lists.null_ids is None:  # else (or of any other type) validated with the rest, one int at a time
                del self._columns["token_ids"]
                self._tokens = lists
        self.n: int = table.num_rows
        self._lists: dict[str, list[Any]] | None = None
        self._asked = 0

    def __len__(self) -> int:
        return self.n

    def fields(self, position: int) -> dict[str, Any]:
        """The row's values as Python objects (its token ids as they are stored, a list, where not apart).

        A pyarrow scalar per value costs a microsecond or more (a third of reading a corpus step's records went
        there), so once a sixteenth of the rows were asked for one by one, the columns are converted whole, once
        (but token ids kept in their column: a list per record, the bulk of an index); a caller taking one row of
        a large index still converts only that row."""
        if self._lists is None:
            self._asked += 1
            if self._asked * BULK_SHARE < self.n:
                return {name: column[position].as_py() for name, column in self._columns.items()}
            self._lists = {name: column.to_pylist() for name, column in self._columns.items() if name != "token_ids"}
        lists = self._lists
        return {
            name: lists[name][position] if name in lists else column[position].as_py()
            for name, column in self._columns.items()
        }

    def row(self, position: int, *, with_tokens: bool = True) -> tuple[IndexRow, npt.NDArray[np.int32] | None]:
        """The validated row, and its token ids as an array where they are kept apart (then the row holds them
        as a list too, unless ``with_tokens`` is false: a caller that only wants the array saves making it).
        Raises pydantic's ``ValidationError`` (a ``ValueError``) naming what breaks the format."""
        return self._validated(position, self.fields(position), with_tokens)

    def every(self, *, with_tokens: bool = True) -> list[tuple[IndexRow, npt.NDArray[np.int32] | None]]:
        """:meth:`row` of every row, in order: each column is converted once (a row at a time, a pyarrow scalar
        per value costs a microsecond or more: 40 us of each row of a part's index)."""
        columns = {name: column.to_pylist() for name, column in self._columns.items()}
        return [
            self._validated(position, {name: values[position] for name, values in columns.items()}, with_tokens)
            for position in range(self.n)
        ]

    def _validated(
        self, position: int, data: dict[str, Any], with_tokens: bool
    ) -> tuple[IndexRow, npt.NDArray[np.int32] | None]:
        tokens = None
        if self._tokens is not None:
            lists = self._tokens
            data["token_ids"] = None  # the other fields are validated without them; their count here
            if lists.present[position]:
                tokens = lists.values[lists.offsets[position] : lists.offsets[position + 1]]
                if len(tokens) != data.get("n_tokens"):
                    data["token_ids"] = tokens.tolist()  # the model's check names what is wrong
        row = IndexRow.model_validate(data)
        if tokens is not None and with_tokens:
            row = row.model_copy(update={"token_ids": tokens.tolist()})
        return row, tokens


@dataclass(frozen=True)
class RecordSpans:
    """What a shared-prefix index needs of an indexed record: its token ids and where its routing rows are."""

    tokens: npt.NDArray[np.int64]
    token_starts: npt.NDArray[np.int64]
    n_rows: npt.NDArray[np.int64]
    rows: npt.NDArray[np.int64]
    parts: list[str | None]
    """Each span's part key (None: the indexing part's own rows)."""


def record_spans(table: pa.Table, min_tokens: int, where: str) -> list[RecordSpans]:
    """The records of an index ``table`` with at least ``min_tokens`` token ids, without a model per row: a writer
    lists every peer's part this way (:mod:`routelog.store.peers`), and a pydantic row per record cost as much as
    the rest of its listing. The fields it reads are checked as :class:`IndexRow` checks them (token ids as many as
    ``n_tokens``, spans ascending, disjoint, inside the record, rows from 0): raises :class:`CorruptDataError`
    naming the record."""
    if "token_ids" not in table.schema.names or not table.num_rows:
        return []
    try:
        return _record_spans(table, min_tokens, where)
    except (pa.ArrowException, KeyError, TypeError) as exc:  # columns of other types than an index's
        raise CorruptDataError(f"{where}: the index's token_ids, n_tokens or spans cannot be read ({exc})") from exc


def _record_spans(table: pa.Table, min_tokens: int, where: str) -> list[RecordSpans]:
    n_tokens = to_numpy(table.column("n_tokens"), fill=-1).astype(np.int64)
    tokens = _TokenLists.of(table.column("token_ids"))
    counts = np.diff(tokens.offsets).astype(np.int64)
    values = tokens.values.astype(np.int64, copy=False)
    spans = table.column("spans").combine_chunks()
    flat = pc.list_flatten(spans)
    per_record = to_numpy(pc.list_value_length(spans), fill=0).astype(np.int64)
    owner = np.repeat(np.arange(table.num_rows), per_record)
    fields = ("token_start", "n_rows", "row")
    starts, lengths, rows = (to_numpy(flat.field(name), fill=-1).astype(np.int64) for name in fields)
    ends = starts + lengths
    first = np.ones(owner.size, bool)
    first[1:] = owner[1:] != owner[:-1]
    after = np.where(first, 0, np.concatenate([[0], ends[:-1]]))  # where the span before it (same record) ended
    bad_span = (starts < after) | (lengths < 1) | (rows < 0) | (ends > n_tokens[owner])
    bad = (tokens.present & ((counts != n_tokens) | tokens.holding_nulls())) | (n_tokens < 0)
    bad[owner[bad_span]] = True
    if bad.any():
        record = int(np.argmax(bad))
        sample = table.column("sample_id")[record].as_py()
        raise CorruptDataError(
            f"{where}: record {sample!r} has {int(counts[record])} token ids (or a null one) for "
            f"n_tokens={int(n_tokens[record])}, or spans that are not ascending, disjoint and inside its tokens"
        )
    parts = flat.field("part").to_pylist()
    span_offsets = np.concatenate([[0], np.cumsum(per_record)])
    return [
        RecordSpans(
            values[tokens.offsets[i] : tokens.offsets[i + 1]],
            starts[span_offsets[i] : span_offsets[i + 1]],
            lengths[span_offsets[i] : span_offsets[i + 1]],
            rows[span_offsets[i] : span_offsets[i + 1]],
            parts[span_offsets[i] : span_offsets[i + 1]],
        )
        for i in np.flatnonzero(tokens.present & (counts >= min_tokens)).tolist()
    ]


@dataclass(frozen=True)
class RowTokens:
    """The token id of each row of a part's routing array (context-coded chunks decode with them), made a window of
    rows at a time from the spans and token ids of the part's index: the array's ``n_rows`` is only a claim of its
    commit, and no table is sized by it (a part claiming 2**31 rows held 16 GiB of them). A row takes the token of
    the records whose spans in their own part cover it, -1 where none has token ids: what
    :func:`routelog.format.context.row_tokens` gives the writer for the whole array."""

    n_rows: int
    rows: npt.NDArray[np.int64]
    """Each span with token ids (every record's own spans, in index order): its first row, ..."""
    counts: npt.NDArray[np.int64]
    """... its rows, ..."""
    sources: npt.NDArray[np.int64]
    """... and where its first token lies in :attr:`values`."""
    values: npt.NDArray[Any]
    """The index's token ids, every record's one after another."""

    def window(self, start: int, stop: int) -> npt.NDArray[np.int64]:
        """The tokens of rows ``[start, stop)`` (clipped to the array's rows)."""
        stop = max(start, min(stop, self.n_rows))
        out = np.full(stop - start, -1, np.int64)
        for i in np.flatnonzero((self.rows < stop) & (self.rows + self.counts > start)).tolist():
            first, end = max(int(self.rows[i]), start), min(int(self.rows[i] + self.counts[i]), stop)
            source = int(self.sources[i]) + first - int(self.rows[i])
            out[first - start : end - start] = self.values[source : source + end - first]  # in order, as the writer's
        return out


def part_row_tokens(table: pa.Table, n_rows: int) -> RowTokens:
    """The token id of each row of a part's routing array ``[n_rows]``, from the part's index (every record it
    stored, dropped and shadowed ones too): the spans in their own part of the records with token ids, each
    inside the array and inside its record's ids (as :func:`routelog.format.context.row_tokens` takes them)."""
    tokens = _TokenLists.of(table.column("token_ids"))
    spans = table.column("spans").combine_chunks()
    flat = pc.list_flatten(spans)
    owner = np.repeat(np.arange(table.num_rows), to_numpy(pc.list_value_length(spans), fill=0))
    starts, counts, rows = (
        to_numpy(flat.field(name), fill=-1).astype(np.int64) for name in ("token_start", "n_rows", "row")
    )
    offsets = tokens.offsets.astype(np.int64)
    lengths = np.diff(offsets)[owner]
    kept = (
        to_numpy(pc.is_null(flat.field("part")))
        & tokens.present[owner]
        & (starts >= 0)
        & (counts >= 0)
        & (rows >= 0)
        & (rows + counts <= n_rows)
        & (starts + counts <= lengths)
    )
    return RowTokens(n_rows, rows[kept], counts[kept], offsets[owner[kept]] + starts[kept], tokens.values)
