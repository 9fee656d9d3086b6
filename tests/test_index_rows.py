"""Index rows read one at a time and all at once (a writer listing its peers' records, ``routelog verify``) are the
same validated rows, and a row that breaks the format is refused either way."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pydantic
import pytest

import routelog
from routelog import Record
from routelog.format.index_rows import IndexRows
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
