"""The compiled Thrift walks (``routelog/format/_cthrift.c``) read every footer and page header as the Python walks
of :mod:`routelog.format.parquet_limits` do: the same values from the Parquet objects pyarrow writes, and on forged
bytes (random bytes over a real footer or page header, cut short, grown) the same values or the same error."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routelog.errors import CorruptDataError
from routelog.format import parquet_limits
from routelog.format.kernels import compiled_module
from routelog.format.parquet_limits import MAX_SCHEMA_ELEMENTS, _footer_walk, _page_header, _Thrift

COMPILED = compiled_module("routelog.format._cthrift")
pytestmark = pytest.mark.skipif(COMPILED is None, reason="routelog was installed without its compiled walks")


def _objects() -> list[bytes]:
    """Parquet objects with the shapes routelog stores (scalars, strings, lists, lists of structs, nulls) in every
    codec and encoding option pyarrow writes them with."""
    table = pa.table(
        {
            "sample_id": ["a", "bb", None, "dddd"],
            "n_tokens": pa.array([1, 2, 3, 4], pa.int64()),
            "token_ids": pa.array([[1, 2], [], None, [7] * 40], pa.list_(pa.int32())),
            "spans": pa.array(
                [[{"row": 1, "n": 2}], [], [{"row": 3, "n": 4}, {"row": 5, "n": 6}], None],
                pa.list_(pa.struct([("row", pa.int64()), ("n", pa.int32())])),
            ),
            "weight": pa.array([0.5, None, 1.5, 2.5], pa.float32()),
            "flag": [True, False, None, True],
        }
    )
    objects = []
    for options in (
        {},
        {"compression": "zstd"},
        {"compression": "snappy", "use_dictionary": False},
        {"data_page_version": "2.0", "compression": "gzip"},
        {"write_statistics": False, "row_group_size": 2},
        {"column_encoding": {"n_tokens": "DELTA_BINARY_PACKED"}, "use_dictionary": ["sample_id"]},
    ):
        sink = io.BytesIO()
        pq.write_table(table, sink, **options)
        objects.append(sink.getvalue())
    return objects


OBJECTS = _objects()


def _outcome(call: Any) -> Any:
    try:
        return ("ok", call())
    except CorruptDataError as exc:
        return ("error", str(exc))


def _footer_span(data: bytes) -> tuple[int, int]:
    size = int.from_bytes(data[-8:-4], "little")
    return len(data) - 8 - size, len(data) - 8


def _compiled_footer(data: bytes, start: int, end: int, max_rows: int) -> Any:
    return parquet_limits._footer(data, start, end, "where", max_rows)


def _python_footer(data: bytes, start: int, end: int, max_rows: int) -> Any:
    return _footer_walk(_Thrift(data, start, end, "where"), max_rows)


def _python_page(data: bytes, start: int, end: int) -> Any:
    return _page_header(_Thrift(data, start, end, "where"))


def _compiled_page(data: bytes, start: int, end: int) -> Any:
    return parquet_limits._page(data, start, end, "where")


@pytest.mark.parametrize("data", OBJECTS)
def test_both_walks_read_what_pyarrow_writes(data: bytes) -> None:
    start, end = _footer_span(data)
    compiled = _compiled_footer(data, start, end, 100)
    assert compiled == _python_footer(data, start, end, 100)
    rows, elements, groups = compiled
    assert rows == 4 and len(elements) > 6 and sum(group.num_rows for group in groups) == 4
    for group in groups:
        for chunk in group.chunks:
            position = min(chunk.data_page_offset, chunk.dictionary_page_offset or chunk.data_page_offset)
            page = _compiled_page(data, position, position + chunk.compressed)
            assert page == _python_page(data, position, position + chunk.compressed)
            assert page.compressed >= 0 and page.body > position


FIXTURES = Path(__file__).parent / "fixtures"
STORED = sorted(FIXTURES.rglob("*.parquet"))
"""Every Parquet object of the golden stores, the corpus and the engine fixtures."""


@pytest.mark.parametrize("path", STORED, ids=lambda path: str(path.relative_to(FIXTURES)))
def test_both_walks_read_every_stored_object_alike(path: Path) -> None:
    data = path.read_bytes()
    start, end = _footer_span(data)
    compiled = _compiled_footer(data, start, end, 1 << 20)
    assert compiled == _python_footer(data, start, end, 1 << 20)
    for group in compiled[2]:
        for chunk in group.chunks:
            position = min(chunk.data_page_offset, chunk.dictionary_page_offset or chunk.data_page_offset)
            stop = position + chunk.compressed
            while position < stop:
                page = _compiled_page(data, position, stop)
                assert page == _python_page(data, position, stop)
                position = page.body + page.compressed


def _forged(data: bytes, start: int, end: int, draw: st.DataObject) -> tuple[bytes, int, int]:
    """``data[start:end]`` with some bytes overwritten, and perhaps cut short or grown."""
    body = bytearray(data[start:end])
    for _ in range(draw.draw(st.integers(1, 6), label="flips")):
        position = draw.draw(st.integers(0, len(body) - 1), label="position")
        body[position] = draw.draw(st.sampled_from([0x00, 0x0F, 0x15, 0x19, 0x1C, 0x7F, 0x80, 0xFF, 0x2C, 0xF9]))
    cut = draw.draw(st.integers(0, len(body)), label="cut")
    if draw.draw(st.booleans(), label="grow"):
        body[cut:cut] = draw.draw(st.binary(min_size=1, max_size=12), label="grown")
    elif draw.draw(st.booleans(), label="truncate"):
        del body[cut:]
    forged = data[:start] + bytes(body)
    return forged, start, len(forged)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(draw=st.data())
def test_forged_footers_read_alike(draw: st.DataObject) -> None:
    data = draw.draw(st.sampled_from(OBJECTS), label="object")
    forged, start, end = _forged(data, *_footer_span(data), draw)
    max_rows = draw.draw(st.sampled_from([0, 3, 100, 1 << 40]), label="max_rows")
    compiled = _outcome(lambda: _compiled_footer(forged, start, end, max_rows))
    assert compiled == _outcome(lambda: _python_footer(forged, start, end, max_rows))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(draw=st.data())
def test_forged_page_headers_read_alike(draw: st.DataObject) -> None:
    data = draw.draw(st.sampled_from(OBJECTS), label="object")
    _, _, groups = _compiled_footer(data, *_footer_span(data), 100)
    chunk = draw.draw(st.sampled_from([c for g in groups for c in g.chunks]), label="chunk")
    start = min(chunk.data_page_offset, chunk.dictionary_page_offset or chunk.data_page_offset)
    forged, start, _ = _forged(data, start, start + chunk.compressed, draw)
    end = min(len(forged), start + chunk.compressed)
    compiled = _outcome(lambda: _compiled_page(forged, start, end))
    assert compiled == _outcome(lambda: _python_page(forged, start, end))


@pytest.mark.parametrize(
    "body",
    [
        bytes([0x1C] * 40),  # structs nested past the depth limit
        bytes([0x19, 0xF9]) + b"\xff\xff\xff\xff\x07",  # a list of 2**31 - 1 lists
        bytes([0x1B, 0x7F]),  # a map of 127 entries in two bytes
        bytes([0x16]) + b"\xff" * 11,  # an integer longer than 10 bytes
        bytes([0x17, 0x00]),  # a double cut short
        bytes([0x0D]),  # a field of unknown type
        bytes([0x19, 0x1C, 0x48]) + b"\x05\xff\xfe",  # a name that is no UTF-8
    ],
)
def test_hostile_structures_fail_alike(body: bytes) -> None:
    compiled = _outcome(lambda: _compiled_footer(body, 0, len(body), 10))
    assert compiled[0] == "error"
    assert compiled == _outcome(lambda: _python_footer(body, 0, len(body), 10))


def test_the_compiled_walk_keeps_the_modules_limits() -> None:
    assert COMPILED is not None and COMPILED.MAX_DEPTH == parquet_limits._MAX_THRIFT_DEPTH
    schema = bytes([0x29, 0xFC, 0x81, 0x08]) + bytes(2000)  # field 2 (the schema): a list of 1025 structs
    assert MAX_SCHEMA_ELEMENTS == 1024
    error = _outcome(lambda: _compiled_footer(schema, 0, len(schema), 10))
    assert error == ("error", "where: the schema declares 1025 entries (at most 1024)")
