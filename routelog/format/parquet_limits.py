"""Bounded reading of the Parquet objects routelog stores (``schemas/FORMAT.md`` section 9).

A Parquet file's footer declares its rows and column chunks, and each page header declares how many values the
page holds; run-length and dictionary encodings let a few bytes stand for millions of values (a 9 KB index whose
``token_ids`` is one list of 20 million zeros decodes to hundreds of MB). pyarrow trusts those declarations, so
routelog hands it an object only after this module has read the footer and every page header of the columns it
will decode, with its own Thrift reader (which allocates nothing the bytes do not hold; compiled where routelog was
built with a compiler, the same walk in Python otherwise), and checked them against
bounds the caller derives from what vouches for the object (a commit's records and tokens):

- the rows (and row groups) the footer declares;
- each leaf column's level count (every value, null and empty list its pages hold) against a bound per leaf;
- that the pages tile each column chunk exactly and hold exactly the values the footer declares (pyarrow stops
  reading a chunk at that count, so it decodes exactly the pages checked here, whatever else the footer says);
- that a dictionary page holds no more entries than its bytes can encode, and that only encodings whose decoded
  size the headers bound are used (never ``DELTA_BYTE_ARRAY``, whose shared prefixes grow quadratically);
- the decoded size, estimated from the headers (levels, values and offsets per value; for strings, the bytes of
  plain pages and the longest dictionary entry times the dictionary-encoded values), against a byte budget.

pyarrow then parses the same footer, with Thrift container limits no larger than the largest container these checks
accept, and must read in it what this module read: everything it uses to find and decode pages (a forged Thrift
encoding can make two readers disagree: Thrift's generated code reads a list's elements as their IDL type whatever
type the list declares). It decodes only the named columns (unknown columns never are). A forged object is refused
with :class:`~routelog.errors.CorruptDataError` before pyarrow allocates for its content.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple, NoReturn

import pyarrow as pa
import pyarrow.parquet as pq

from routelog.errors import CorruptDataError
from routelog.format.kernels import compiled_module
from routelog.format.limits import MIN_RECORD_BITS, check_count, most_items

# -- budgets ----------------------------------------------------------------------------------------------------------
RECORD_BYTES: Final = 64 << 10
"""Decoded bytes allowed per record: its scalars, names (at most 1024 characters each) and ``extra`` text."""
TOKEN_BYTES: Final = 64
"""Decoded bytes allowed per token of the index: its id (4 bytes, plus 4 of levels) and its share of spans and
segments, whose counts are bounded by the tokens."""
VALUE_BYTES: Final = 16
"""Decoded bytes allowed per token and per-token float column of a values object (4 of value, 4 of levels)."""
MIN_DECODED_BYTES: Final = 4 << 20
"""Every object may decode to this much whatever its counts (a small part's footer, schema and dictionaries)."""
MAX_STREAMS: Final = 64
"""Extra routing streams one index row may list, when its owner does not say how many its part holds."""

MAX_SCHEMA_ELEMENTS: Final = 1024
"""Fields of a Parquet schema, groups included (the index has about 50)."""
MAX_SCHEMA_DEPTH: Final = 16
"""Nesting of a Parquet schema (the index's deepest leaf, ``streams.list.element.spans.list.element.row``, is 6)."""
_MAX_THRIFT_DEPTH: Final = 32
_ROW_GROUP_BYTES: Final = 1 << 10
"""Estimated decoded bytes of one leaf column in one row group, whatever its values (arrays, buffers, headers)."""
_LEVEL_BYTES: Final = 8
"""Decoded bytes per level entry besides the value: definition and repetition levels (int16 each), validity and
list offsets."""

# Parquet's enums (parquet.thrift)
_BOOLEAN, _INT32, _INT64, _INT96, _FLOAT, _DOUBLE, _BYTE_ARRAY, _FIXED_LEN_BYTE_ARRAY = range(8)
_WIDTH: Final = {_BOOLEAN: 1, _INT32: 4, _INT64: 8, _INT96: 12, _FLOAT: 4, _DOUBLE: 8, _BYTE_ARRAY: 4}
_REPEATED: Final = 2
_DATA_PAGE, _INDEX_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = range(4)
_PLAIN, _PLAIN_DICTIONARY, _RLE, _BIT_PACKED = 0, 2, 3, 4
_DELTA_BINARY_PACKED, _DELTA_LENGTH_BYTE_ARRAY, _DELTA_BYTE_ARRAY, _RLE_DICTIONARY, _BYTE_STREAM_SPLIT = 5, 6, 7, 8, 9
_ENCODINGS: Final = {
    0: "PLAIN",
    2: "PLAIN_DICTIONARY",
    3: "RLE",
    4: "BIT_PACKED",
    5: "DELTA_BINARY_PACKED",
    6: "DELTA_LENGTH_BYTE_ARRAY",
    7: "DELTA_BYTE_ARRAY",
    8: "RLE_DICTIONARY",
    9: "BYTE_STREAM_SPLIT",
}
_CODECS: Final = {
    0: ("UNCOMPRESSED", None),
    1: ("SNAPPY", "snappy"),
    2: ("GZIP", "gzip"),
    4: ("BROTLI", "brotli"),
    6: ("ZSTD", "zstd"),
    7: ("LZ4", "lz4_raw"),
}
"""Parquet codecs read: (pyarrow's name, and its codec decompressing a page). LZO and Hadoop's LZ4 framing, which
pyarrow never writes, are refused."""
_MAGIC: Final = b"PAR1"
_LENGTH: Final = struct.Struct("<I")

# Thrift compact protocol types
_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE_T, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(13)


def most_records(nbytes: int, declared: int | None, where: str, *, fallback: int) -> int:
    """The rows an object of ``nbytes`` may hold: ``declared``, the ``n_records`` of what vouches for it (its
    commit, annotation or seal), once checked against its bytes; without one, the most its bytes can hold, at most
    ``fallback``."""
    most = most_items(nbytes, bits_each=MIN_RECORD_BITS)
    if declared is None:
        return min(most, fallback)
    expected = f"the records an object of {nbytes} bytes holds, {MIN_RECORD_BITS} bit each at the least"
    return check_count(declared, name="n_records", at_most=most, where=where, expected=expected)


def decoded_budget(records: int, tokens: int, *, token_bytes: int = TOKEN_BYTES) -> int:
    """The bytes an object of ``records`` records and ``tokens`` tokens may decode to: linear in both."""
    return MIN_DECODED_BYTES + max(records, 0) * RECORD_BYTES + max(tokens, 0) * token_bytes


# -- Thrift compact protocol ------------------------------------------------------------------------------------------
_COMPILED: Final = compiled_module("routelog.format._cthrift")
"""The walks below compiled (``routelog/format/_cthrift.c``: same reads, checks and messages; a part's index walked
in 0.25 ms rather than 1.9, 7.6 x, on the 2-core AMD EPYC), or
None where routelog was installed without a compiler (or ``ROUTELOG_KERNELS=numpy`` asks for the pure paths)."""
_MAX_COUNT: Final = 1 << 62
"""Limits handed to the compiled walk are clamped to this (no container can hold that many: each entry takes a
byte)."""


# -- Thrift compact protocol, in Python --------------------------------------------------------------------------------
def _int32(raw: int) -> int:
    """Apache Thrift's ``readVarint32``: the 64-bit varint truncated to a signed 32-bit integer."""
    raw &= 0xFFFFFFFF
    return raw - (1 << 32) if raw >> 31 else raw


def _zigzag32(raw: int) -> int:
    """Apache Thrift's ``readI32``: zigzag decoding of the varint truncated to 32 bits."""
    raw &= 0xFFFFFFFF
    return (raw >> 1) ^ -(raw & 1)


def _zigzag64(raw: int) -> int:
    return (raw >> 1) ^ -(raw & 1)


def _int16(value: int) -> int:
    value &= 0xFFFF
    return value - (1 << 16) if value >> 15 else value


class _Thrift:
    """A reader of Thrift compact-protocol structs in ``data[pos:end]`` that reads them exactly as Apache Thrift's
    C++ reader in pyarrow does (field ids, 32-bit truncation, any header byte of type 0 ending a struct, a field of
    an unexpected type skipped) and never allocates for a size it has not seen the bytes of."""

    __slots__ = ("data", "end", "pos", "where")

    def __init__(self, data: bytes, pos: int, end: int, where: str) -> None:
        self.data, self.pos, self.end, self.where = data, pos, end, where

    def fail(self, problem: str) -> NoReturn:
        raise CorruptDataError(f"{self.where}: {problem}")

    def byte(self) -> int:
        if self.pos >= self.end:
            self.fail("a Thrift structure runs past its bytes")
        value = self.data[self.pos]
        self.pos += 1
        return value

    def varint(self) -> int:
        # Called for nearly every value of every page header a bounded read walks: locals, no call per byte.
        data, pos, end = self.data, self.pos, self.end
        if pos < end and data[pos] < 0x80:  # most values fit one byte
            self.pos = pos + 1
            return data[pos]
        value = 0
        for shift in range(0, 70, 7):
            if pos >= end:
                self.pos = pos
                self.fail("a Thrift structure runs past its bytes")
            b = data[pos]
            pos += 1
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                self.pos = pos
                return value & 0xFFFFFFFFFFFFFFFF
        self.pos = pos
        raise CorruptDataError(f"{self.where}: a Thrift integer is longer than 10 bytes")

    def size(self, what: str) -> int:
        """A length or element count (``readVarint32``), never negative nor more than the bytes left."""
        n = _int32(self.varint())
        if not 0 <= n <= self.end - self.pos:
            self.fail(f"{what} declares {n} entries or bytes, {self.end - self.pos} bytes are left")
        return n

    def binary(self) -> bytes:
        n = self.size("a Thrift string")
        value = self.data[self.pos : self.pos + n]
        self.pos += n
        return value

    def text(self) -> str:
        try:
            return self.binary().decode()
        except UnicodeDecodeError:
            self.fail("a Parquet name is not UTF-8")

    def container(self, limit: int, what: str) -> tuple[int, int]:
        """Element count and declared type of a list or set, at most ``limit`` (and never more than the bytes
        left: every element takes at least one)."""
        header = self.byte()
        size, kind = header >> 4, header & 0x0F
        if size == 15:
            size = self.size(what)
        if size > min(limit, self.end - self.pos):
            self.fail(f"{what} declares {size} entries (at most {min(limit, self.end - self.pos)})")
        if kind > _STRUCT:
            self.fail(f"{what} holds elements of unknown Thrift type {kind}")
        return size, kind

    def fields(self, depth: int) -> Iterator[tuple[int, int]]:
        """``(field id, type)`` of each field of a struct; the caller reads or :meth:`skip` s each value."""
        if depth > _MAX_THRIFT_DEPTH:
            self.fail(f"Thrift structures nested deeper than {_MAX_THRIFT_DEPTH}")
        field_id = 0
        while True:
            if self.pos >= self.end:
                self.fail("a Thrift structure runs past its bytes")
            header = self.data[self.pos]
            self.pos += 1
            kind, delta = header & 0x0F, header >> 4
            if kind == _STOP:
                return
            if kind > _STRUCT:
                self.fail(f"a Thrift field of unknown type {kind}")
            field_id = _int16(field_id + delta) if delta else _int16(_zigzag32(self.varint()))
            yield field_id, kind

    def skip(self, kind: int, depth: int, element: bool = False) -> None:
        """Skip a value of the declared type (``element``: a container's, where a boolean takes a byte)."""
        if depth > _MAX_THRIFT_DEPTH:
            self.fail(f"Thrift structures nested deeper than {_MAX_THRIFT_DEPTH}")
        if kind in (_TRUE, _FALSE):
            if element:
                self.byte()
        elif kind == _BYTE:
            self.byte()
        elif kind in (_I16, _I32, _I64):
            self.varint()
        elif kind == _DOUBLE_T:
            if self.end - self.pos < 8:
                self.fail("a Thrift double runs past its bytes")
            self.pos += 8
        elif kind == _BINARY:
            self.binary()
        elif kind in (_LIST, _SET):
            size, inner = self.container(self.end - self.pos, "a Thrift list")
            for _ in range(size):
                self.skip(inner, depth + 1, element=True)
        elif kind == _MAP:
            size = self.size("a Thrift map")
            types = self.byte() if size else 0
            if types >> 4 > _STRUCT or types & 0x0F > _STRUCT:
                self.fail("a Thrift map holds entries of unknown type")
            for _ in range(size):
                self.skip(types >> 4, depth + 1, element=True)
                self.skip(types & 0x0F, depth + 1, element=True)
        elif kind == _STRUCT:
            for _, field_kind in self.fields(depth + 1):
                self.skip(field_kind, depth + 1)
        else:
            self.fail(f"a Thrift value of type {kind} where none may be")


# -- the footer -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParquetLeaf:
    """A leaf column of a Parquet schema."""

    path: tuple[str, ...]
    """Its names from the top-level column down, e.g. ``("token_ids", "list", "element")``."""
    physical: int
    type_length: int
    repeated: int
    """Repeated fields on its path (its maximum repetition level): 0 for a scalar column, 1 for a list."""

    @property
    def name(self) -> str:
        return ".".join(self.path)


class _Chunk(NamedTuple):
    physical: int | None
    path: tuple[str, ...]
    codec: int
    num_values: int
    compressed: int
    data_page_offset: int
    dictionary_page_offset: int | None


class _RowGroup(NamedTuple):
    num_rows: int
    chunks: list[_Chunk]


class _Element(NamedTuple):
    name: str
    physical: int | None
    type_length: int
    repetition: int
    children: int | None


def _read_i32(thrift: _Thrift) -> int:
    return _zigzag32(thrift.varint())


def _read_i64(thrift: _Thrift) -> int:
    return _zigzag64(thrift.varint())


def _schema_element(thrift: _Thrift, depth: int) -> _Element:
    name = physical = children = None
    type_length = repetition = 0
    # Each field is read only when it has its IDL type (as Thrift's generated reader does; a field of another type
    # is skipped and leaves the value read before, if any).
    for field_id, kind in thrift.fields(depth):
        if field_id == 4 and kind == _BINARY:
            name = thrift.text()
        elif field_id == 1 and kind == _I32:
            physical = _read_i32(thrift)
        elif field_id == 2 and kind == _I32:
            type_length = _read_i32(thrift)
        elif field_id == 3 and kind == _I32:
            repetition = _read_i32(thrift)
        elif field_id == 5 and kind == _I32:
            children = _read_i32(thrift)
        else:
            thrift.skip(kind, depth)
    if name is None:
        thrift.fail("a schema element has no name")
    return _Element(name, physical, type_length, repetition, children)


def _column_meta(thrift: _Thrift, depth: int) -> _Chunk:
    path: tuple[str, ...] = ()
    physical = codec = num_values = compressed = data_offset = dict_offset = None
    for field_id, kind in thrift.fields(depth):
        if field_id == 3 and kind == _LIST:
            size, element = thrift.container(MAX_SCHEMA_DEPTH, "a column chunk's path_in_schema")
            if element != _BINARY:
                thrift.fail("a column chunk's path_in_schema is not a list of names")
            path = tuple(thrift.text() for _ in range(size))
        elif field_id in (1, 4) and kind == _I32:
            value = _read_i32(thrift)
            if field_id == 1:
                physical = value
            else:
                codec = value
        elif field_id in (5, 7, 9, 11) and kind == _I64:
            value = _read_i64(thrift)
            if field_id == 5:
                num_values = value
            elif field_id == 7:
                compressed = value
            elif field_id == 9:
                data_offset = value
            else:
                dict_offset = value
        else:
            thrift.skip(kind, depth)
    if num_values is None or compressed is None or data_offset is None:
        thrift.fail("a column chunk lacks its value count, size or offset")
    return _Chunk(physical, path, -1 if codec is None else codec, num_values, compressed, data_offset, dict_offset)


def _column_chunk(thrift: _Thrift, depth: int) -> _Chunk:
    meta = None
    for field_id, kind in thrift.fields(depth):
        if field_id == 1:
            thrift.fail("a column chunk lives in another file (file_path)")
        if field_id in (8, 9):
            thrift.fail("a column chunk is encrypted")
        if field_id == 3 and kind == _STRUCT:
            meta = _column_meta(thrift, depth + 1)
        else:
            thrift.skip(kind, depth)
    if meta is None:
        thrift.fail("a column chunk has no metadata")
    return meta


def _row_group(thrift: _Thrift, depth: int, max_columns: int) -> _RowGroup:
    chunks: list[_Chunk] = []
    num_rows = None
    for field_id, kind in thrift.fields(depth):
        if field_id == 1 and kind == _LIST:
            size, element = thrift.container(max_columns, "a row group's column list")
            if element != _STRUCT:
                thrift.fail("a row group's columns are not structs")
            chunks = [_column_chunk(thrift, depth + 1) for _ in range(size)]
        elif field_id == 3 and kind == _I64:
            num_rows = _read_i64(thrift)
        else:
            thrift.skip(kind, depth)
    if num_rows is None:
        thrift.fail("a row group does not say how many rows it holds")
    return _RowGroup(num_rows, chunks)


def _leaves(elements: list[_Element], fail: Callable[[str], NoReturn]) -> list[ParquetLeaf]:
    """The leaf columns of a flattened schema (depth-first, as Parquet stores it)."""
    if not elements or not elements[0].children or elements[0].children < 0:
        fail("the schema has no columns")
    leaves: list[ParquetLeaf] = []
    position = 1

    def walk(count: int, path: tuple[str, ...], repeated: int) -> None:
        nonlocal position
        if len(path) >= MAX_SCHEMA_DEPTH:
            fail(f"the schema is nested deeper than {MAX_SCHEMA_DEPTH}")
        for _ in range(count):
            if position >= len(elements):
                fail("the schema declares more fields than it lists")
            element = elements[position]
            position += 1
            inner = repeated + (element.repetition == _REPEATED)
            if element.children is not None and element.children > 0:
                walk(element.children, (*path, element.name), inner)
            elif element.physical is None or element.physical not in _PHYSICAL:
                fail(f"schema field {'.'.join((*path, element.name))} has no valid physical type")
            else:
                leaves.append(ParquetLeaf((*path, element.name), element.physical, element.type_length, inner))

    walk(elements[0].children, (), 0)
    if position != len(elements):
        fail(f"the schema lists {len(elements)} fields, its tree holds {position}")
    return leaves


class _Page(NamedTuple):
    kind: int
    uncompressed: int
    compressed: int
    num_values: int
    encoding: int
    body: int
    """Offset of the page's (compressed) data."""


def _page(data: bytes, start: int, end: int, where: str) -> _Page:
    """The page header at ``start``, read by the compiled walk where it was built."""
    if _COMPILED is None:
        return _page_header(_Thrift(data, start, end, where))
    try:
        return _Page._make(_COMPILED.page_header(data, start, end))
    except ValueError as exc:
        raise CorruptDataError(f"{where}: {exc}") from exc


def _page_header(thrift: _Thrift) -> _Page:
    """A PageHeader, with the count and encoding of the sub-header its type names (as pyarrow picks them)."""
    kind = uncompressed = compressed = None
    headers: dict[int, tuple[int, int]] = {}  # sub-header field id: (num_values, encoding)
    for field_id, field_kind in thrift.fields(0):
        if field_id in (1, 2, 3) and field_kind == _I32:
            value = _read_i32(thrift)
            if field_id == 1:
                kind = value
            elif field_id == 2:
                uncompressed = value
            else:
                compressed = value
        elif field_id in (5, 7, 8) and field_kind == _STRUCT:
            headers[field_id] = _sub_header(thrift, field_id)
        else:
            thrift.skip(field_kind, 0)
    if kind is None or uncompressed is None or compressed is None:
        thrift.fail("a page header lacks its type or sizes")
    if uncompressed < 0 or compressed < 0:
        thrift.fail("a page header declares a negative size")
    num_values, encoding = headers.get({_DATA_PAGE: 5, _DICTIONARY_PAGE: 7, _DATA_PAGE_V2: 8}.get(kind, 0), (0, 0))
    if kind in (_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2) and num_values < 0:
        thrift.fail("a page header declares a negative value count")
    return _Page(kind, uncompressed, compressed, num_values, encoding, thrift.pos)


def _sub_header(thrift: _Thrift, which: int) -> tuple[int, int]:
    """``(num_values, encoding)`` of a DataPageHeader (5), DictionaryPageHeader (7) or DataPageHeaderV2 (8);
    levels must use RLE (or the old bit-packing), and a v2 page's levels must fit in it."""
    num_values, encoding = -1, -1
    for field_id, kind in thrift.fields(1):
        if field_id == 1 and kind == _I32:
            num_values = _read_i32(thrift)
        elif field_id == (4 if which == 8 else 2) and kind == _I32:
            encoding = _read_i32(thrift)
        elif which == 5 and field_id in (3, 4) and kind == _I32:
            if _read_i32(thrift) not in (_RLE, _BIT_PACKED):
                thrift.fail("a data page's levels use an encoding other than RLE")
        elif which == 8 and field_id in (5, 6) and kind == _I32:
            if _read_i32(thrift) < 0:
                thrift.fail("a data page declares levels of negative length")
        else:
            thrift.skip(kind, 1)
    return num_values, encoding


def _footer(
    data: bytes, start: int, end: int, where: str, max_rows: int
) -> tuple[int | None, list[_Element], list[_RowGroup]]:
    """The footer's rows, schema elements and row groups, read by the compiled walk where it was built."""
    if _COMPILED is not None:
        try:
            rows, elements, groups = _COMPILED.footer(
                data, start, end, MAX_SCHEMA_ELEMENTS, min(max_rows + 1, _MAX_COUNT), MAX_SCHEMA_DEPTH
            )
        except ValueError as exc:
            raise CorruptDataError(f"{where}: {exc}") from exc
        # Named views of the walk's tuples (a frozen dataclass per column chunk cost 13 ms of each writer's
        # refresh of 72 peer indexes)
        return (
            rows,
            [_Element._make(element) for element in elements],
            [_RowGroup(n, [_Chunk._make(chunk) for chunk in chunks]) for n, chunks in groups],
        )
    return _footer_walk(_Thrift(data, start, end, where), max_rows)


def _footer_walk(thrift: _Thrift, max_rows: int) -> tuple[int | None, list[_Element], list[_RowGroup]]:
    """:func:`_footer` in Python."""
    elements: list[_Element] = []
    groups: list[_RowGroup] = []
    num_rows = None
    for field_id, kind in thrift.fields(0):
        if field_id == 2 and kind == _LIST:
            count, element = thrift.container(MAX_SCHEMA_ELEMENTS, "the schema")
            if element != _STRUCT:
                thrift.fail("the schema is not a list of structs")
            elements = [_schema_element(thrift, 1) for _ in range(count)]
        elif field_id == 3 and kind == _I64:
            num_rows = _read_i64(thrift)
        elif field_id == 4 and kind == _LIST:
            # At most one row group per row (pyarrow writes one per 1 Mi rows): each costs decoding.
            count, element = thrift.container(max_rows + 1, "the row group list")
            if element != _STRUCT:
                thrift.fail("the row groups are not structs")
            groups = [_row_group(thrift, 1, len(elements) or MAX_SCHEMA_ELEMENTS) for _ in range(count)]
        elif field_id == 8:
            thrift.fail("the footer is encrypted")
        else:
            thrift.skip(kind, 0)
    return num_rows, elements, groups


# -- the checked object -----------------------------------------------------------------------------------------------
_PHYSICAL: Final = {
    _BOOLEAN: "BOOLEAN",
    _INT32: "INT32",
    _INT64: "INT64",
    _INT96: "INT96",
    _FLOAT: "FLOAT",
    _DOUBLE: "DOUBLE",
    _BYTE_ARRAY: "BYTE_ARRAY",
    _FIXED_LEN_BYTE_ARRAY: "FIXED_LEN_BYTE_ARRAY",
}


class BoundedParquet:
    """A Parquet object whose footer has been read and checked (rows, row groups, schema, and that pyarrow reads
    the same footer); :meth:`read` checks the pages of the columns asked for and decodes only them."""

    def __init__(self, data: bytes, where: str, *, max_rows: int) -> None:
        self.data, self.where = data, where
        size = len(data)
        if size < 12 or data[:4] != _MAGIC or data[-4:] != _MAGIC:
            self._fail("not a Parquet file (no PAR1 magic; encrypted footers are not read)")
        footer = int.from_bytes(data[-8:-4], "little")
        self.footer_start = size - 8 - footer
        if footer <= 0 or self.footer_start < 4:
            self._fail(f"the footer declares {footer} bytes, the object holds {size}")
        num_rows, elements, groups = _footer(data, self.footer_start, size - 8, f"{where} (Parquet footer)", max_rows)
        if num_rows is None or num_rows < 0:
            self._fail("the footer does not say how many rows the object holds")
        if num_rows > max_rows:
            self._fail(f"the footer declares {num_rows} rows; at most {max_rows} records may be there")
        if sum(g.num_rows for g in groups) != num_rows or any(g.num_rows < 0 for g in groups):
            self._fail(f"the row groups' rows do not add up to the {num_rows} the footer declares")
        self.num_rows: int = num_rows
        self.leaves = _leaves(elements, self._fail)
        for group in groups:
            if len(group.chunks) != len(self.leaves):
                self._fail(f"a row group holds {len(group.chunks)} column chunks for {len(self.leaves)} columns")
            for leaf, chunk in zip(self.leaves, group.chunks, strict=True):
                if chunk.path != leaf.path or chunk.physical != leaf.physical or chunk.codec not in _CODECS:
                    self._fail(f"the column chunk of {leaf.name} names another column, type or an unknown codec")
        self.groups = groups
        self.columns: tuple[str, ...] = tuple(dict.fromkeys(leaf.path[0] for leaf in self.leaves))
        """The top-level columns, in schema order."""
        # No container the checks above accept is larger: pyarrow's own Thrift reader (which sizes each container
        # before reading its elements) refuses any larger one, wherever it sees it.
        self._containers = max(64, len(elements), len(groups))
        self._file = self._open()

    def _fail(self, problem: str) -> NoReturn:
        raise CorruptDataError(f"{self.where}: {problem}")

    def _open(self) -> pq.ParquetFile:
        """The object opened by pyarrow (which parses the footer again, within the limits checked) after checking
        that pyarrow reads the footer as this module did: everything pyarrow uses to locate and decode pages."""
        try:
            parquet = pq.ParquetFile(
                pa.BufferReader(self.data),
                thrift_string_size_limit=max(len(self.data), 16),
                thrift_container_size_limit=self._containers,
                schema_depth_limit=MAX_SCHEMA_DEPTH,
            )
            metadata, schema = parquet.metadata, parquet.schema
            same = metadata.num_rows == self.num_rows and metadata.num_row_groups == len(self.groups)
            same = same and len(schema) == len(self.leaves)
            for i, leaf in enumerate(self.leaves if same else []):
                column = schema.column(i)
                same = same and column.path == leaf.name and column.physical_type == _PHYSICAL[leaf.physical]
                same = same and column.max_repetition_level == leaf.repeated
            for g, group in enumerate(self.groups if same else []):
                row_group = metadata.row_group(g)
                same = same and row_group.num_rows == group.num_rows and row_group.num_columns == len(group.chunks)
                for j, chunk in enumerate(group.chunks if same else []):
                    theirs = row_group.column(j)
                    dictionary = chunk.dictionary_page_offset
                    same = same and (
                        theirs.path_in_schema == ".".join(chunk.path)
                        and theirs.num_values == chunk.num_values
                        and theirs.total_compressed_size == chunk.compressed
                        and theirs.data_page_offset == chunk.data_page_offset
                        and theirs.has_dictionary_page == (dictionary is not None)
                        and (dictionary is None or theirs.dictionary_page_offset == dictionary)
                        and theirs.compression == _CODECS[chunk.codec][0]
                    )
        except (pa.ArrowException, OSError, ValueError, KeyError, IndexError) as exc:
            raise CorruptDataError(f"{self.where}: not a readable Parquet object ({exc})") from exc
        if not same:
            self._fail("pyarrow reads its footer otherwise than its bytes say (a forged Thrift encoding)")
        return parquet

    def read(self, columns: Sequence[str], *, max_values: Callable[[ParquetLeaf], int], max_bytes: int) -> pa.Table:
        """The named top-level columns that the object holds (others are never decoded), after :meth:`check`."""
        wanted, _ = self.check(columns, max_values=max_values, max_bytes=max_bytes)
        return self._decode(wanted)

    def check(
        self, columns: Sequence[str], *, max_values: Callable[[ParquetLeaf], int], max_bytes: int
    ) -> tuple[list[str], int]:
        """Check every page of the named top-level columns: each leaf holds at most ``max_values(leaf)`` values
        (levels) and all of them decode to at most ``max_bytes``. Returns the columns the object holds of those
        and their estimated decoded bytes."""
        wanted = [c for c in self.columns if c in set(columns)]
        estimate = 0
        for position, leaf in enumerate(self.leaves):
            if leaf.path[0] not in wanted:
                continue
            bound = max_values(leaf)
            values = 0
            for group in self.groups:
                chunk = group.chunks[position]
                if chunk.num_values < 0 or (leaf.repeated == 0 and chunk.num_values != group.num_rows):
                    self._fail(f"column {leaf.name} declares {chunk.num_values} values in {group.num_rows} rows")
                values += chunk.num_values
                if values > bound:
                    self._fail(f"column {leaf.name} declares {values} values or more; at most {bound} may be there")
                estimate += self._chunk_cost(leaf, chunk, max_bytes - estimate) + _ROW_GROUP_BYTES
                if estimate > max_bytes:
                    self._fail(
                        f"columns up to {leaf.name} would decode to {estimate} bytes or more; the records and "
                        f"tokens it may hold allow {max_bytes}"
                    )
        return wanted, estimate

    def _chunk_cost(self, leaf: ParquetLeaf, chunk: _Chunk, budget: int) -> int:
        """The decoded bytes one column chunk's pages declare, checked page by page (as soon as they pass
        ``budget``, the rest is not looked at)."""
        if chunk.num_values == 0:
            return 0  # pyarrow reads a chunk's pages only until it has seen the values its footer declares
        start = chunk.data_page_offset
        if chunk.dictionary_page_offset is not None and 0 < chunk.dictionary_page_offset < start:
            start = chunk.dictionary_page_offset  # where pyarrow starts reading the chunk
        end = start + chunk.compressed
        name = leaf.name
        if start < 4 or chunk.compressed < 0 or end > self.footer_start:
            self._fail(f"column {name}: a chunk of {chunk.compressed} bytes at {start} lies outside the data")
        width = _WIDTH.get(leaf.physical, leaf.type_length)
        if width <= 0:
            self._fail(f"column {name} has values of {width} bytes")
        where = f"{self.where} (page header of column {name})"
        cost = seen = pages = 0
        longest: int | None = None  # longest dictionary entry (its width for fixed-width values)
        position = start
        while position < end:
            page = _page(self.data, position, end, where)
            if page.compressed > end - page.body:
                self._fail(f"column {name}: a page of {page.compressed} bytes runs past its chunk")
            position = page.body + page.compressed
            cost += page.uncompressed  # pyarrow decompresses each page into a buffer of this size
            if cost > budget:
                return cost
            pages += 1
            if page.kind == _DICTIONARY_PAGE:
                if pages > 1:
                    self._fail(f"column {name}: a dictionary page follows other pages")
                if page.encoding not in (_PLAIN, _PLAIN_DICTIONARY):
                    self._fail(f"column {name}: a dictionary page uses {_encoding(page.encoding)}")
                if page.num_values * (4 if leaf.physical == _BYTE_ARRAY else width) > page.uncompressed:
                    self._fail(
                        f"column {name}: a dictionary page declares {page.num_values} entries in "
                        f"{page.uncompressed} bytes"
                    )
                # pyarrow decodes a byte-array dictionary into 16-byte (pointer, length) entries
                cost += page.num_values * (16 if leaf.physical == _BYTE_ARRAY else width)
                longest = self._longest_entry(leaf, chunk, page) if leaf.physical == _BYTE_ARRAY else width
            elif page.kind in (_DATA_PAGE, _DATA_PAGE_V2):
                seen += page.num_values
                if seen > chunk.num_values:
                    self._fail(
                        f"column {name}: its pages hold {seen} values or more, its footer declares {chunk.num_values}"
                    )
                cost += page.num_values * (_LEVEL_BYTES + width)
                cost += self._string_bytes(leaf, page, longest)
            elif page.kind != _INDEX_PAGE:
                self._fail(f"column {name}: a page of unknown type {page.kind}")
        if position != end or seen != chunk.num_values:
            self._fail(
                f"column {name}: its pages hold {seen} values in {position - start} bytes, its footer declares "
                f"{chunk.num_values} values in {chunk.compressed} bytes"
            )
        return cost

    def _string_bytes(self, leaf: ParquetLeaf, page: _Page, longest: int | None) -> int:
        """Bytes of strings (beyond their offsets) a data page decodes to; refuses encodings whose decoded size its
        header does not bound."""
        encoding, physical = page.encoding, leaf.physical
        if encoding in (_PLAIN_DICTIONARY, _RLE_DICTIONARY):
            if longest is None:
                self._fail(f"column {leaf.name}: a dictionary-encoded page without a dictionary page")
            return page.num_values * longest if physical == _BYTE_ARRAY else 0
        allowed = {
            _PLAIN: True,
            _RLE: physical == _BOOLEAN,
            _DELTA_BINARY_PACKED: physical in (_INT32, _INT64),
            _DELTA_LENGTH_BYTE_ARRAY: physical == _BYTE_ARRAY,
            _BYTE_STREAM_SPLIT: physical not in (_BYTE_ARRAY, _BOOLEAN),
        }
        if not allowed.get(encoding, False):
            self._fail(f"column {leaf.name}: a data page uses {_encoding(encoding)}, which routelog does not read")
        return page.uncompressed if physical == _BYTE_ARRAY else 0

    def _longest_entry(self, leaf: ParquetLeaf, chunk: _Chunk, page: _Page) -> int:
        """The longest entry of a byte-array dictionary page."""
        codec = _CODECS[chunk.codec][1] if chunk.codec in _CODECS else None
        raw: bytes = self.data[page.body : page.body + page.compressed]
        if codec is not None:
            try:
                raw = pa.decompress(raw, decompressed_size=page.uncompressed, codec=codec, asbytes=True)
            except (pa.ArrowException, ValueError, OSError) as exc:
                self._fail(f"column {leaf.name}: its dictionary page does not decompress ({exc})")
        if len(raw) < page.uncompressed:
            self._fail(f"column {leaf.name}: its dictionary page holds fewer bytes than it declares")
        position = longest = 0
        unpack = _LENGTH.unpack_from
        try:
            for _ in range(page.num_values):  # each entry: its length (uint32), then its bytes
                (length,) = unpack(raw, position)
                position += 4 + length
                longest = max(longest, length)
        except struct.error:
            self._fail(f"column {leaf.name}: its dictionary page holds fewer entries than it declares")
        if position > len(raw):
            self._fail(f"column {leaf.name}: an entry of its dictionary page runs past the page")
        return longest

    def _decode(self, columns: list[str]) -> pa.Table:
        try:
            with self._file as parquet:
                schema = parquet.schema_arrow
                for name in columns:
                    _check_type(schema.field(name).type, f"{self.where}: column {name!r}")
                # Decoded synchronously on the calling thread: pq.read_table goes through the dataset scanner,
                # whose pool threads can drop the last reference to the Python-backed input while the interpreter
                # is finalizing; the thread then needs the GIL, is killed, and the process aborts ("terminate
                # called without an active exception", apache/arrow#34314; seen at exit once in ~100 CLI runs).
                table = parquet.read(columns=columns, use_threads=False)
        except CorruptDataError:
            raise
        except (pa.ArrowException, OSError, ValueError, KeyError) as exc:
            raise CorruptDataError(f"{self.where}: not a readable Parquet object ({exc})") from exc
        if table.num_rows != self.num_rows:
            self._fail(f"decoded {table.num_rows} rows, the footer declares {self.num_rows}")
        return table


def _encoding(code: int) -> str:
    return _ENCODINGS.get(code, f"encoding {code}")


def _check_type(dtype: pa.DataType, where: str) -> None:
    """Only the types routelog writes (integers, floats, booleans, strings, lists and structs of them): a stored
    Arrow schema cannot make pyarrow build dictionaries, fixed-size lists, extension or view types."""
    t = pa.types
    if t.is_integer(dtype) or t.is_floating(dtype) or t.is_boolean(dtype) or t.is_null(dtype):
        return
    if t.is_string(dtype) or t.is_large_string(dtype) or t.is_binary(dtype) or t.is_large_binary(dtype):
        return
    if t.is_list(dtype) or t.is_large_list(dtype):
        _check_type(dtype.value_type, where)
        return
    if t.is_struct(dtype):
        for i in range(dtype.num_fields):
            _check_type(dtype.field(i).type, where)
        return
    raise CorruptDataError(f"{where} is of type {dtype}, which routelog never writes")
