"""Per-token float columns stored next to the routing: the inference log-prob of each token, the training log-prob
when the trainer reports it, or any other per-token value a user declares.

A part's columns live in their own Parquet object (``values.parquet``: ``sample_id``, ``token_hash``, one
``list<float32>`` column per name), so readers that do not ask for values never fetch it, and those that do
fetch only the columns they name. Entry ``t`` of a column belongs to input position ``t`` (the same axis as the
routing rows); NaN means "no value" (e.g. prompt tokens have no sampling log-prob).
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from routelog.errors import CorruptDataError, InvalidRecordError
from routelog.format.parquet_limits import VALUE_BYTES, BoundedParquet, decoded_budget, most_records

LOGPROB_INFER: Final = "logprob_infer"
"""Log-probability of token ``t`` under the inference engine's sampling policy (NaN on prompt tokens)."""
LOGPROB_TRAIN: Final = "logprob_train"
"""Log-probability of token ``t`` recomputed by the trainer (NaN where not computed)."""

VALUES_OBJECT: Final = "values.parquet"
_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
_RESERVED = frozenset({"sample_id", "token_hash"})

FloatArray = npt.NDArray[np.float32]


def check_value_name(name: str, sample_id: str | None) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in _RESERVED:
        raise InvalidRecordError(
            sample_id,
            f"token_values[{name!r}]",
            "a column name must be 1-64 characters of lowercase letters, digits and '_', starting with a letter, "
            f"and not one of {sorted(_RESERVED)}",
            f"use e.g. {LOGPROB_INFER!r} or {LOGPROB_TRAIN!r}",
        )
    return name


def check_token_values(values: Mapping[str, Any] | None, n_tokens: int, sample_id: str) -> dict[str, FloatArray]:
    """Validate per-token columns of one record: each 1-D, ``n_tokens`` long, real numbers (NaN = no value)."""
    out: dict[str, FloatArray] = {}
    for name, column in (values or {}).items():
        field = f"token_values[{check_value_name(name, sample_id)!r}]"
        try:
            given = np.asarray(column)
        except (TypeError, ValueError) as exc:
            raise InvalidRecordError(sample_id, field, f"is not numeric ({exc})", "pass a float array") from None
        if given.dtype.kind not in "fiu":
            raise InvalidRecordError(
                sample_id, field, f"is not numeric (dtype {given.dtype}); expected real numbers", "pass a float array"
            )
        with np.errstate(over="ignore"):
            array = given.astype(np.float32)
        if array.shape != (n_tokens,):
            raise InvalidRecordError(
                sample_id,
                field,
                f"has shape {array.shape}, expected ({n_tokens},): one value per token (prompt + response)",
                "pad positions without a value (e.g. the prompt) with NaN",
            )
        if np.isposinf(array).any():
            raise InvalidRecordError(sample_id, field, "contains +inf", "a log-probability is at most 0; use NaN")
        out[name] = np.ascontiguousarray(array)
    return out


def values_to_parquet(
    rows: Sequence[tuple[str, str | None, Mapping[str, FloatArray]]], columns: Sequence[str]
) -> bytes:
    """``(sample_id, token_hash, {name: values})`` rows -> Parquet bytes; a row lacking a column stores null.

    Floats are byte-stream-split before zstd: log-probs share exponents, and splitting the bytes lets zstd see it.
    """
    arrays: dict[str, pa.Array] = {
        "sample_id": pa.array([sid for sid, _, _ in rows], pa.string()),
        "token_hash": pa.array([digest for _, digest, _ in rows], pa.string()),
    }
    for name in columns:
        present = [values.get(name) for _, _, values in rows]
        offsets = np.zeros(len(rows) + 1, np.int32)
        offsets[1:] = np.cumsum([0 if v is None else len(v) for v in present])
        flat = np.concatenate([v for v in present if v is not None] or [np.zeros(0, np.float32)])
        mask = pa.array([v is None for v in present], pa.bool_())
        arrays[name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.float32()), mask=mask)
    table = pa.table(arrays)
    sink = io.BytesIO()
    pq.write_table(
        table, sink, compression="zstd", use_byte_stream_split=list(columns) or False, write_statistics=["sample_id"]
    )
    return sink.getvalue()


@dataclass(frozen=True)
class ValuesContents:
    """What a values object holds for the columns asked for."""

    values: dict[str, dict[str, FloatArray]]
    """``{sample_id: {name: values}}`` (null cells skipped); every sample of the object has an entry."""
    token_hashes: dict[str, str | None]
    """The token hash each sample's values were computed on."""


def values_from_parquet(
    data: bytes,
    columns: Iterable[str],
    where: str,
    *,
    declared: Sequence[str] | None = None,
    max_records: int | None = None,
    max_tokens: int | None = None,
) -> ValuesContents:
    """The named columns of a values object; with ``declared``, the object's value columns must be exactly those
    its commit declares (a renamed or dropped declaration is damage, not a missing column).

    Nothing is decoded before the object's footer and the pages of the columns read are checked
    (:mod:`routelog.format.parquet_limits`): at most ``max_records`` rows (itself checked against the object's
    bytes), each column's lists holding at most ``max_tokens`` values in all, and a decoded size linear in those.
    Pass the records and tokens of the commit (or annotation) that lists the object (for an annotation, the tokens
    of the records it may annotate). None (until every caller passes them) means the format's absolute limits: as
    many records as the footer declares up to ``MAX_PART_ROWS`` (and its bytes can hold), ``MAX_RECORD_TOKENS``
    tokens each."""
    from routelog.format.documents import MAX_PART_ROWS  # format imports this module
    from routelog.format.limits import MAX_RECORD_TOKENS

    parquet = BoundedParquet(data, where, max_rows=most_records(len(data), max_records, where, fallback=MAX_PART_ROWS))
    names = parquet.columns
    if declared is not None and sorted(set(names) - _RESERVED) != sorted(declared):
        raise CorruptDataError(
            f"{where}: holds columns {sorted(set(names) - _RESERVED)}, its commit declares {sorted(declared)}"
        )
    if not set(names) >= _RESERVED:
        raise CorruptDataError(f"{where}: not a values object (it lacks {sorted(_RESERVED - set(names))})")
    present = list(dict.fromkeys(c for c in columns if c in names and c not in _RESERVED))
    records = parquet.num_rows  # at most max_records: checked
    tokens = records * MAX_RECORD_TOKENS if max_tokens is None else min(max(max_tokens, 0), records * MAX_RECORD_TOKENS)
    table = parquet.read(
        ["sample_id", "token_hash", *present],
        # a scalar: one value per row; a column's lists: n_tokens values per record, one level per null cell
        max_values=lambda leaf: records if leaf.repeated == 0 else tokens + records,
        max_bytes=decoded_budget(records, tokens, token_bytes=VALUE_BYTES * max(len(present), 1)),
    )
    sample_ids = table.column("sample_id").to_pylist()
    if len(set(sample_ids)) != len(sample_ids) or any(not isinstance(s, str) for s in sample_ids):
        raise CorruptDataError(f"{where}: sample ids are missing or repeated")
    out: dict[str, dict[str, FloatArray]] = {sid: {} for sid in sample_ids}
    for name in present:
        column = table.column(name).combine_chunks()
        if not pa.types.is_list(column.type) or not pa.types.is_floating(column.type.value_type):
            raise CorruptDataError(f"{where}: column {name!r} is {column.type}, not list<float32>")
        flat = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
        offsets = column.offsets.to_numpy()
        nulls = column.is_null().to_numpy(zero_copy_only=False)
        for i, sid in enumerate(sample_ids):
            if not nulls[i]:
                out[sid][name] = flat[offsets[i] - offsets[0] : offsets[i + 1] - offsets[0]]
    hashes = dict(zip(sample_ids, table.column("token_hash").to_pylist(), strict=True))
    return ValuesContents(values=out, token_hashes=hashes)
