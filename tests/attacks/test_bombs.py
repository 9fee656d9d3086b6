"""Sizes read from storage or a payload are bounded before anything is allocated; hostile input gets a typed error.

Each bomb claims far more than it holds (a chunk of 2**31 rows, a record of 2**31 tokens, a 32 KB zstd frame of
1 GiB, an ``.npy`` header of 10**12 elements, JSON nested 100 000 deep); the peak memory a refusal allocates is
measured with ``tracemalloc`` and must stay a small multiple of the bytes actually present.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tracemalloc
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from numcodecs import Zstd

import routelog
from routelog.engines import sglang, vllm
from routelog.errors import (
    CorruptDataError,
    FormatVersionError,
    GcRefusedError,
    IngestError,
    ModelSpecError,
)
from routelog.format import keys
from routelog.format.documents import IndexRow, RoutingArrayInfo, Segment, Span, StreamSpans
from routelog.format.parquet_limits import decoded_budget
from routelog.format.part import index_from_parquet, index_to_parquet, shard_layout
from routelog.format.shard import _crc
from routelog.format.spec import ModelSpec
from routelog.format.values import LOGPROB_INFER, VALUES_OBJECT, values_from_parquet
from routelog.ingest import load_arrays, read_records
from routelog.store.gc import collect_garbage
from routelog.store.storage import Storage
from routelog.store.verify import verify_store
from tests.attacks.kit import (
    SPEC,
    assert_same,
    build_store,
    commit_keys,
    entry_keys,
    read_commit,
    read_everything,
    write_commit,
)

PEAK_LIMIT = 32 << 20
"""Bytes any single refusal below may allocate (the stores and payloads are a few KB to 1 MB)."""


@pytest.fixture(autouse=True, scope="module")
def _tracing_stopped_at_the_end() -> Iterator[None]:
    """tracemalloc runs from the first refusal measured to the end of the module. Started and stopped around every
    refusal, a worker of ``pytest -n 2`` crashed (a segfault in a thread with no Python frame) in about one run of
    this module in four; started once, in none of eight."""
    yield
    if tracemalloc.is_tracing():
        tracemalloc.stop()


@contextmanager
def bounded_allocation() -> Iterator[None]:
    if not tracemalloc.is_tracing():
        tracemalloc.start()
    start, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    yield
    _, peak = tracemalloc.get_traced_memory()
    peak -= start  # what the refusal allocated above what was live before it
    assert peak < PEAK_LIMIT, f"allocated {peak} bytes to refuse a bomb"


def _first_commit(storage: Storage) -> tuple[str, dict[str, Any]]:
    key = commit_keys(storage)[0]
    return key, read_commit(storage, key)


def _replace_object(storage: Storage, commit_key: str, commit: dict[str, Any], name: str, data: bytes) -> None:
    """Overwrite one object of a part and re-list it in the commit, so only the bomb itself is wrong."""
    storage.write(f"{keys.part_dir(0, commit['part'])}/{name}", data)
    for obj in commit["objects"]:
        if obj["key"] == name:
            obj.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    write_commit(storage, commit_key, commit)


# -- storage-side bombs ----------------------------------------------------------------------------------------------
def _first_index(storage: Storage) -> tuple[str, dict[str, Any], pa.Table]:
    """The first commit's key, the commit and its part's index table."""
    key, commit = _first_commit(storage)
    return key, commit, pq.read_table(io.BytesIO(storage.read(f"{keys.part_dir(0, commit['part'])}/{keys.INDEX}")))


def _replace_index(storage: Storage, key: str, commit: dict[str, Any], rows: list[Any], schema: pa.Schema) -> None:
    """The first commit's index rewritten as ``rows`` (and re-listed in the commit)."""
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), sink)
    _replace_object(storage, key, commit, keys.INDEX, sink.getvalue())


def _unsealed_store_with_first_commit(url: str, field: str, value: Any) -> None:
    """A store whose first commit document has ``field`` (dotted) set to ``value``."""
    build_store(url, sealed=False)
    storage = routelog.open_store(url).storage
    key, commit = _first_commit(storage)
    *path, last = field.split(".")
    target = commit
    for name in path:
        target = target[name]
    target[last] = value
    write_commit(storage, key, commit)


def test_a_commit_claiming_huge_chunks_is_refused(memory_url: str) -> None:
    _unsealed_store_with_first_commit(memory_url, "routing.chunk_rows", 2**31)
    with bounded_allocation(), pytest.raises(CorruptDataError, match="chunk"):
        read_everything(memory_url)


def test_an_index_row_claiming_two_billion_tokens_is_refused(memory_url: str) -> None:
    build_store(memory_url, sealed=False)
    storage = routelog.open_store(memory_url).storage
    key, commit, table = _first_index(storage)
    rows = table.to_pylist()
    rows[0]["n_tokens"] = rows[0]["prompt_len"] = 2**31 - 1 - rows[0]["response_len"]
    rows[0]["token_ids"] = None
    commit["n_tokens"] = sum(r["n_tokens"] for r in rows)
    _replace_index(storage, key, commit, rows, table.schema)
    with (
        bounded_allocation(),
        pytest.raises(CorruptDataError, match=r"n_tokens|less than or equal|tokens in \d+ records"),
    ):
        read_everything(memory_url)


@pytest.mark.parametrize("token_type", ["int32", "int64"])
def test_an_index_row_whose_token_ids_disagree_with_its_length_is_refused(memory_url: str, token_type: str) -> None:
    """Token ids are checked as one array on the fast path (int32 lists) and by the model otherwise (any other
    type): a list one token short is refused by both, naming the sample."""
    build_store(memory_url, sealed=False)
    storage = routelog.open_store(memory_url).storage
    key, commit, table = _first_index(storage)
    rows = table.to_pylist()
    before = routelog.open_store(memory_url).step(0)
    other = next(sid for sid in before.sample_ids if sid != rows[0]["sample_id"])
    other_tokens = before.info(other).token_ids
    assert other_tokens is not None and len(other_tokens) > 1
    rows[0]["token_ids"] = list(range(rows[0]["n_tokens"] - 1))
    schema = table.schema
    if token_type == "int64":
        where = schema.get_field_index("token_ids")
        schema = schema.set(where, pa.field("token_ids", pa.list_(pa.int64())))
    _replace_index(storage, key, commit, rows, schema)
    snapshot = routelog.open_store(memory_url).step(0)
    assert (snapshot._rows._tokens is not None) == (token_type == "int32")  # which path checks them
    with pytest.raises(CorruptDataError, match=f"(?s){rows[0]['sample_id']!r}.*token_ids for n_tokens"):
        snapshot.info(rows[0]["sample_id"])
    assert snapshot.info(other).token_ids == other_tokens  # the other records still read, their token ids whole


def test_a_zstd_frame_expanding_to_a_gibibyte_is_refused(memory_url: str) -> None:
    build_store(memory_url, sealed=False)
    storage = routelog.open_store(memory_url).storage
    key, commit = _first_commit(storage)
    info = RoutingArrayInfo.model_validate(commit["routing"])
    layout_ = shard_layout(info)
    name = f"{info.path}/{layout_.shard_key()}"
    shard = storage.read(f"{keys.part_dir(0, commit['part'])}/{name}")
    bomb = bytes(Zstd(level=1).encode(np.zeros(1 << 30, dtype=np.uint8)))
    piece = bomb + _crc(bomb)
    n = layout_.index_nbytes
    index = np.frombuffer(shard[: n - 4], dtype="<u8").reshape(-1, 2).copy()
    first_offset, first_size = int(index[0, 0]), int(index[0, 1])
    rest = shard[first_offset + first_size :]
    index[1:, 0] += len(piece) - first_size
    index[0] = (n, len(piece))
    body = index.tobytes()
    forged = body + _crc(body) + piece + rest
    _replace_object(storage, key, commit, name, forged)
    assert len(bomb) < 64 << 10
    with bounded_allocation(), pytest.raises(CorruptDataError):
        read_everything(memory_url)
    assert not verify_store(routelog.open_store(memory_url)).ok


@pytest.mark.parametrize("document", ["seal", "commit", "annotation", "run"])
def test_json_nested_a_hundred_thousand_deep_is_refused(memory_url: str, document: str) -> None:
    build_store(memory_url, sealed=document == "seal")
    storage = routelog.open_store(memory_url).storage
    documents = {
        "seal": keys.seal_key(0),
        "commit": _first_commit(storage)[0],
        "annotation": entry_keys(storage, "routelog.annotation")[0],
        "run": keys.RUN_DOCUMENT,
    }
    storage.write(documents[document], b'{"format_version": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    with bounded_allocation(), pytest.raises(CorruptDataError, match="nested"):
        read_everything(memory_url)


def test_features_of_the_wrong_type_are_corruption_everywhere(memory_url: str) -> None:
    _unsealed_store_with_first_commit(memory_url, "features", 5)
    with pytest.raises(CorruptDataError, match="features"):
        read_everything(memory_url)
    assert any("features" in p for p in verify_store(routelog.open_store(memory_url)).problems)
    assert any("features" in d for d in collect_garbage(routelog.open_store(memory_url), 0, force=True).damaged)
    with pytest.raises(GcRefusedError):
        collect_garbage(routelog.open_store(memory_url), 0, delete=True, force=True)


def test_a_newer_commit_inside_a_v1_seal_is_refused(memory_url: str) -> None:
    build_store(memory_url)
    storage = routelog.open_store(memory_url).storage
    seal = json.loads(storage.read(keys.seal_key(0)))
    info = seal["consolidated"]["commits"]
    commits_key = f"{keys.step_dir(0)}/{info['key']}"
    docs = json.loads(storage.read(commits_key))
    docs[0]["format_version"] = 2
    docs[0]["features"] = ["dedup-spans-v9"]
    data = json.dumps(docs).encode()
    storage.write(commits_key, data)
    info.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    storage.write(keys.seal_key(0), json.dumps(seal).encode())
    with pytest.raises(FormatVersionError):
        read_everything(memory_url)


# -- payload and spec bombs -------------------------------------------------------------------------------------------
def _npy_with_header(shape: tuple[int, ...], dtype: str, body: bytes) -> bytes:
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": dtype, "fortran_order": False, "shape": shape})
    return header.getvalue() + body


def _vllm_line(routed: Any, **choice: Any) -> dict[str, Any]:
    return {
        "request": {},
        "response": {
            "id": "cmpl-bomb",
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "token_ids": [4, 5], "routed_experts": routed, **choice}],
        },
    }


def test_an_npy_header_declaring_a_trillion_elements_is_refused() -> None:
    raw = _npy_with_header((10**12, 6, 4), "|u1", b"\x00" * 96)
    response = _vllm_line(base64.b64encode(raw).decode())["response"]
    with bounded_allocation(), pytest.raises(IngestError, match=r"cmpl-bomb.*header declares"):
        vllm.records_from_http(response, SPEC)


def test_an_npz_member_declaring_2_to_the_40_bytes_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "batch.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("routed_experts.npy", _npy_with_header((2**40,), "<i2", b"\x00" * 64))
    with bounded_allocation(), pytest.raises(IngestError, match=r"header declares|holds"):
        load_arrays(path)


def test_an_sglang_prompt_of_three_hundred_million_tokens_with_four_rows_is_refused() -> None:
    routed = base64.b64encode(np.zeros((4, 6, 4), "<i4").tobytes()).decode()
    response = {
        "meta_info": {"id": "rid-bomb", "routed_experts": routed, "prompt_tokens": 3 * 10**8},
        "output_ids": [1],
    }
    with bounded_allocation(), pytest.raises(IngestError, match="rid-bomb"):
        sglang.records_from_http(response, SPEC)


def test_a_moe_layer_freq_of_four_billion_entries_is_refused() -> None:
    with bounded_allocation(), pytest.raises(ModelSpecError, match="entries"):
        ModelSpec.from_megatron(num_layers=4, num_moe_experts=8, moe_router_topk=2, moe_layer_freq="[0]*4000000000")


def _routes(rows: int, dtype: str = "|u1") -> str:
    ids = np.tile(np.arange(4, dtype=np.uint8), (rows, 6, 1))
    buffer = io.BytesIO()
    np.save(buffer, ids.astype(dtype))
    return base64.b64encode(buffer.getvalue()).decode()


MALFORMED: dict[str, tuple[str, Any]] = {
    # name: (engine, JSONL line)
    "choices not a list": ("vllm", {"response": {"id": "r1", "choices": {"0": {}}}}),
    "a choice not an object": ("vllm", {"response": {"id": "r2", "choices": ["routed"]}}),
    "prompt_start a string": ("vllm", {**_vllm_line(_routes(4)), "request": {"routed_experts_prompt_start": "abc"}}),
    "prompt_start negative": ("vllm", {**_vllm_line(_routes(4)), "request": {"routed_experts_prompt_start": -3}}),
    "token ids beyond int64": ("vllm", _vllm_line(_routes(4), token_ids=[10**20, 5])),
    "token ids as floats": ("vllm", _vllm_line(_routes(4), token_ids=[4.5, 5])),
    "token ids nested": ("vllm", _vllm_line(_routes(4), token_ids=[[4], [5]])),
    "token ids a string": ("vllm", _vllm_line(_routes(4), token_ids="4 5")),
    "routed experts a number": ("vllm", _vllm_line(7)),
    "routed experts ragged lists": ("vllm", _vllm_line([[[0, 1, 2, 3]] * 6, [[0, 1, 2]] * 6])),
    "routed experts floats": ("vllm", _vllm_line([[[0.5, 1, 2, 3]] * 6] * 4)),
    "routed experts booleans": ("vllm", _vllm_line([[[True, False, True, False]] * 6] * 4)),
    "routed experts object npy": ("vllm", _vllm_line(_routes(4, "|O"))),
    "choice index a string": ("vllm", _vllm_line(_routes(4), index="zero")),
    "meta_info a string": ("sglang", {"response": {"meta_info": "routed", "output_ids": [1]}}),
    "response a number": ("sglang", {"response": 12}),
    "output_ids of strings": ("sglang", {"response": {"meta_info": {"routed_experts": "AAAA"}, "output_ids": ["a"]}}),
    "start_len a float": (
        "sglang",
        {
            "request": {"input_ids": [1], "routed_experts_start_len": 0.5},
            "response": {"meta_info": {"routed_experts": "AAAA"}},
        },
    ),
    "sgl_ext a list": ("sglang", {"response": {"id": "c", "prompt_token_ids": [1], "choices": [{"sgl_ext": []}]}}),
    "a line that is a list of numbers": ("sglang", [1, 2, 3]),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_payloads_get_an_ingest_error_naming_the_line(tmp_path: Path, case: str) -> None:
    engine, line = MALFORMED[case]
    path = tmp_path / "payloads.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(IngestError) as info:
        list(read_records(engine, [path], SPEC))  # type: ignore[arg-type]
    assert f"{path}:1" in str(info.value)


def test_a_payload_nested_a_hundred_thousand_deep_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(IngestError, match="nested"):
        list(read_records("vllm", [path], SPEC))


# -- Parquet bombs: index.parquet and values.parquet are bounded by their commit before pyarrow decodes them ---------
# A Thrift compact-protocol codec (a struct is a list of [field id, compact type, value]) and a rewriter of a Parquet
# file's page headers and footer, so a test can make any declaration lie while every offset stays consistent.
Thrift = list[list[Any]]


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _uvarint(value: int) -> bytes:
    out = bytearray()
    while True:
        if value < 0x80:
            out.append(value)
            return bytes(out)
        out.append(value & 0x7F | 0x80)
        value >>= 7


def _decode_value(data: bytes, pos: int, kind: int) -> tuple[Any, int]:
    if kind in (1, 2):
        return kind == 1, pos
    if kind == 3:
        return data[pos], pos + 1
    if kind in (4, 5, 6):
        raw, pos = _varint(data, pos)
        return (raw >> 1) ^ -(raw & 1), pos
    if kind == 7:
        return data[pos : pos + 8], pos + 8
    if kind == 8:
        n, pos = _varint(data, pos)
        return data[pos : pos + n], pos + n
    if kind in (9, 10):
        header = data[pos]
        pos += 1
        size, element = header >> 4, header & 0x0F
        if size == 15:
            size, pos = _varint(data, pos)
        items = []
        for _ in range(size):
            if element in (1, 2):
                items.append(data[pos] == 1)
                pos += 1
            else:
                item, pos = _decode_value(data, pos, element)
                items.append(item)
        return (element, items), pos
    if kind == 12:
        return _decode_struct(data, pos)
    raise ValueError(f"Thrift type {kind}")


def _decode_struct(data: bytes, pos: int) -> tuple[Thrift, int]:
    fields: Thrift = []
    last = 0
    while True:
        header = data[pos]
        pos += 1
        if header == 0:
            return fields, pos
        kind, delta = header & 0x0F, header >> 4
        if delta:
            last += delta
        else:
            raw, pos = _varint(data, pos)
            last = (raw >> 1) ^ -(raw & 1)
        value, pos = _decode_value(data, pos, kind)
        fields.append([last, kind, value])


def _encode_value(kind: int, value: Any) -> bytes:
    if kind == 3:
        return bytes([value])
    if kind in (4, 5, 6):
        return _uvarint((value << 1) ^ (value >> 63))
    if kind == 7:
        return bytes(value)
    if kind == 8:
        return _uvarint(len(value)) + bytes(value)
    if kind in (9, 10):
        element, items = value
        header = (
            bytes([len(items) << 4 | element]) if len(items) < 15 else bytes([0xF0 | element]) + _uvarint(len(items))
        )
        if element in (1, 2):
            return header + bytes(1 if item else 2 for item in items)
        return header + b"".join(_encode_value(element, item) for item in items)
    if kind == 12:
        return _encode_struct(value)
    raise ValueError(f"Thrift type {kind}")


def _encode_struct(fields: Thrift) -> bytes:
    out = bytearray()
    last = 0
    for field_id, kind, value in fields:
        if kind is None:  # raw bytes, verbatim
            out += value
            continue
        wire = (1 if value else 2) if kind in (1, 2) else kind
        if 0 < field_id - last <= 15:
            out.append((field_id - last) << 4 | wire)
        else:
            out.append(wire)
            out += _uvarint((field_id << 1) ^ (field_id >> 63))
        last = field_id
        if kind not in (1, 2):
            out += _encode_value(kind, value)
    out.append(0)
    return bytes(out)


def _get(fields: Thrift, field_id: int) -> Any:
    return next((value for fid, _, value in fields if fid == field_id), None)


def _set(fields: Thrift, field_id: int, value: Any, kind: int = 6) -> None:
    for field in fields:
        if field[0] == field_id:
            field[2] = value
            return
    fields.append([field_id, kind, value])
    fields.sort(key=lambda f: f[0])


PageEdit = Callable[[str, Thrift], None]
"""Called with each page header of the named leaf column (``token_ids.list.element``) to change it in place."""


def _forge_parquet(
    data: bytes, pages: dict[str, PageEdit] | None = None, footer: Callable[[Thrift], None] | None = None
) -> bytes:
    """``data`` with page headers and footer fields changed; offsets and chunk sizes follow the new headers."""
    length = int.from_bytes(data[-8:-4], "little")
    meta, _ = _decode_struct(data, len(data) - 8 - length)
    out = bytearray(b"PAR1")
    for group in _get(meta, 4)[1]:
        for chunk in _get(group, 1)[1]:
            column = _get(chunk, 3)
            name = ".".join(part.decode() for part in _get(column, 3)[1])
            data_offset, dict_offset = _get(column, 9), _get(column, 11)
            # pyarrow writes a chunk of no values with data_page_offset 0, after its dictionary page
            start = dict_offset if dict_offset and (dict_offset < data_offset or not data_offset) else data_offset
            end, pos, new_start, first_data = start + _get(column, 7), start, len(out), True
            while pos < end:
                header, body = _decode_struct(data, pos)
                if _get(header, 1) != 2 and first_data:
                    _set(column, 9, len(out))
                    first_data = False
                size = _get(header, 3)
                if pages and name in pages:
                    pages[name](name, header)
                out += _encode_struct(header) + data[body : body + size]
                pos = body + size
            if dict_offset is not None:
                _set(column, 11, new_start)
            _set(column, 7, len(out) - new_start)
            _set(chunk, 2, new_start)
        group[:] = [f for f in group if f[0] not in (5, 6)]  # the row group's own offset and size: optional
    if footer is not None:
        footer(meta)
    encoded = _encode_struct(meta)
    return bytes(out) + encoded + len(encoded).to_bytes(4, "little") + b"PAR1"


def _chunk_meta(meta: Thrift, name: str) -> Thrift:
    """The footer's ColumnMetaData of leaf column ``name`` (first row group)."""
    for chunk in _get(_get(meta, 4)[1][0], 1)[1]:
        column = _get(chunk, 3)
        if ".".join(part.decode() for part in _get(column, 3)[1]) == name:
            return column
    raise KeyError(name)


_POOLS: list[Any] = []
"""Proxy pools of :func:`arrow_allocation`, kept alive: a buffer freed into a destroyed pool crashes the process."""


@contextmanager
def arrow_allocation(limit: int) -> Iterator[Any]:
    """pyarrow's allocations inside the block go through a fresh pool whose peak must stay under ``limit``."""
    previous = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(previous)
    _POOLS.append(pool)
    pa.set_memory_pool(pool)
    try:
        yield pool
    finally:
        pa.set_memory_pool(previous)
    assert pool.max_memory() <= limit, f"pyarrow allocated {pool.max_memory()} bytes"


BOMB_TOKENS = 1 << 23
"""Twice the tokens a record may hold: refused by the format's own limit even where no commit bounds the read."""


def _table(data: bytes) -> pa.Table:
    return pq.read_table(io.BytesIO(data))


def _written(table: pa.Table, **options: Any) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, **{"compression": "zstd", **options})
    return sink.getvalue()


def _first_list_replaced(table: pa.Table, name: str, first: pa.Array) -> pa.Table:
    """``table`` whose first row's list in column ``name`` holds ``first``."""
    column = table.column(name).combine_chunks()
    head = pa.ListArray.from_arrays(pa.array([0, len(first)], pa.int32()), first, type=column.type)
    return table.set_column(table.schema.get_field_index(name), name, pa.concat_arrays([head, column.slice(1)]))


def _long_token_list(data: bytes) -> bytes:
    table = _table(data)
    return _written(_first_list_replaced(table, "token_ids", pa.array(np.zeros(BOMB_TOKENS, np.int32))))


def _footer_hiding_the_token_list(data: bytes) -> bytes:
    """The footer declares the token ids the commit vouches for; the page holds ``BOMB_TOKENS`` of them."""
    declared = _get(
        _chunk_meta(
            _decode_struct(data, len(data) - 8 - int.from_bytes(data[-8:-4], "little"))[0], "token_ids.list.element"
        ),
        5,
    )
    return _forge_parquet(
        _long_token_list(data), footer=lambda meta: _set(_chunk_meta(meta, "token_ids.list.element"), 5, declared)
    )


def _huge_extra(data: bytes) -> bytes:
    table = _table(data)
    extra = pa.array(["x" * (1 << 25)] + [None] * (table.num_rows - 1), pa.string())
    return _written(table.set_column(table.schema.get_field_index("extra"), "extra", extra))


def _long_segment_list(data: bytes) -> bytes:
    table = _table(data)
    segment = table.column("segments").combine_chunks().flatten()[0]
    return _written(_first_list_replaced(table, "segments", pa.array([segment.as_py()] * 100_000, segment.type)))


def _repeated_rows(data: bytes) -> bytes:
    table = _table(data)
    return _written(pa.concat_tables([table] + [table.slice(0, 1)] * 100_000).combine_chunks())


def _dictionary_of_two_billion(data: bytes) -> bytes:
    def edit(_: str, header: Thrift) -> None:
        if _get(header, 1) == 2:  # the dictionary page
            _set(_get(header, 7), 1, 2**31 - 1, 5)

    return _forge_parquet(data, pages={"sample_id": edit})


def _page_of_two_gibibytes(data: bytes) -> bytes:
    def edit(_: str, header: Thrift) -> None:
        _set(header, 2, 2**31 - 1, 5)  # uncompressed_page_size

    return _forge_parquet(data, pages={"sample_id": edit})


def _delta_byte_array(data: bytes) -> bytes:
    """Prefix-shared strings decode to (value count x longest value) bytes: an encoding routelog never writes."""
    return _written(_table(data), use_dictionary=False, column_encoding={"sample_id": "DELTA_BYTE_ARRAY"})


INDEX_BOMBS: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    # name: (forgery of the part's index.parquet, what the refusal names)
    "a token list of 8 Mi ids": (_long_token_list, "token_ids"),
    "a footer hiding a page of 8 Mi token ids": (_footer_hiding_the_token_list, "token_ids.*footer declares"),
    "an extra text of 32 MiB": (_huge_extra, "extra"),
    "100 000 segments": (_long_segment_list, "segments"),
    "100 000 copies of a row": (_repeated_rows, "rows"),
    "a dictionary page of 2**31 entries": (_dictionary_of_two_billion, "sample_id: a dictionary page declares"),
    "a page of 2 GiB decompressed": (_page_of_two_gibibytes, "would decode to"),
    "prefix-shared strings (DELTA_BYTE_ARRAY)": (_delta_byte_array, "DELTA_BYTE_ARRAY"),
}


def _planted_index(url: str, forge: Callable[[bytes], bytes]) -> tuple[bytes, dict[str, Any]]:
    """A store whose first part's index is ``forge`` d and re-listed (size, SHA-256) in its commit: only the bounds
    can stop it. Returns the forged bytes and the commit."""
    build_store(url, sealed=False)
    storage = routelog.open_store(url).storage
    key, commit = _first_commit(storage)
    data = forge(storage.read(f"{keys.part_dir(0, commit['part'])}/{keys.INDEX}"))
    _replace_object(storage, key, commit, keys.INDEX, data)
    return data, commit


@pytest.mark.parametrize("bomb", sorted(INDEX_BOMBS))
def test_a_forged_index_is_refused_by_its_commits_counts_before_decoding(memory_url: str, bomb: str) -> None:
    forge, problem = INDEX_BOMBS[bomb]
    data, commit = _planted_index(memory_url, forge)
    assert len(data) < 1 << 20
    with bounded_allocation(), arrow_allocation(0), pytest.raises(CorruptDataError, match=problem):
        index_from_parquet(
            data, max_records=commit["n_records"], max_tokens=commit["n_tokens"], max_streams=len(commit["streams"])
        )


@pytest.mark.parametrize("bomb", sorted(INDEX_BOMBS))
def test_a_forged_index_is_refused_by_every_reader(memory_url: str, bomb: str) -> None:
    _planted_index(memory_url, INDEX_BOMBS[bomb][0])
    with bounded_allocation(), arrow_allocation(PEAK_LIMIT), pytest.raises(CorruptDataError):
        read_everything(memory_url)
    assert not verify_store(routelog.open_store(memory_url)).ok


def test_unknown_index_columns_are_never_decoded(memory_url: str) -> None:
    expected = build_store(memory_url, sealed=False)
    storage = routelog.open_store(memory_url).storage
    key, commit = _first_commit(storage)
    original = storage.read(f"{keys.part_dir(0, commit['part'])}/{keys.INDEX}")
    table = _table(original)
    zeros = pa.array(np.zeros(BOMB_TOKENS, np.int32))
    lists = pa.ListArray.from_arrays(
        pa.array([0, BOMB_TOKENS] + [BOMB_TOKENS] * (table.num_rows - 1), pa.int32()), zeros
    )
    data = _written(table.append_column("later_column", lists))
    _replace_object(storage, key, commit, keys.INDEX, data)
    with arrow_allocation(1 << 20):
        read = index_from_parquet(data, max_records=commit["n_records"], max_tokens=commit["n_tokens"])
    assert read.equals(_table(original).select(read.column_names))
    assert "later_column" not in read.column_names
    assert_same(read_everything(memory_url), expected)


VALUES_BOMBS: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "a value list of 8 Mi floats": (
        lambda data: _written(
            _first_list_replaced(_table(data), LOGPROB_INFER, pa.array(np.zeros(BOMB_TOKENS, np.float32)))
        ),
        LOGPROB_INFER,
    ),
    "100 000 copies of a row": (_repeated_rows, "rows"),
    "a footer hiding a page of 8 Mi floats": (
        lambda data: _forge_parquet(
            _written(_first_list_replaced(_table(data), LOGPROB_INFER, pa.array(np.zeros(BOMB_TOKENS, np.float32)))),
            footer=lambda meta: _set(_chunk_meta(meta, f"{LOGPROB_INFER}.list.element"), 5, 1),
        ),
        r"its footer declares 1\b",
    ),
}


def _planted_values(url: str, forge: Callable[[bytes], bytes]) -> tuple[bytes, dict[str, Any]]:
    build_store(url, sealed=False)
    storage = routelog.open_store(url).storage
    key, commit = _first_commit(storage)
    data = forge(storage.read(f"{keys.part_dir(0, commit['part'])}/{VALUES_OBJECT}"))
    _replace_object(storage, key, commit, VALUES_OBJECT, data)
    return data, commit


@pytest.mark.parametrize("bomb", sorted(VALUES_BOMBS))
def test_a_forged_values_object_is_refused_by_its_commits_counts_before_decoding(memory_url: str, bomb: str) -> None:
    forge, problem = VALUES_BOMBS[bomb]
    data, commit = _planted_values(memory_url, forge)
    declared = [c["name"] for c in commit["values"]["columns"]]
    assert len(data) < 1 << 20
    with bounded_allocation(), arrow_allocation(0), pytest.raises(CorruptDataError, match=problem):
        values_from_parquet(
            data,
            declared,
            VALUES_OBJECT,
            declared=declared,
            max_records=commit["n_records"],
            max_tokens=commit["n_tokens"],
        )


@pytest.mark.parametrize("bomb", sorted(VALUES_BOMBS))
def test_a_forged_values_object_is_refused_by_every_reader(memory_url: str, bomb: str) -> None:
    _planted_values(memory_url, VALUES_BOMBS[bomb][0])
    with bounded_allocation(), arrow_allocation(PEAK_LIMIT), pytest.raises(CorruptDataError):
        read_everything(memory_url)


def test_a_footer_declaring_a_billion_schema_fields_is_refused_before_pyarrow_parses_it() -> None:
    # FileMetaData: version 2, then a schema list claiming 2**30 structs followed by 64 bytes
    footer = bytes([0x15, 0x04, 0x19, 0xFC]) + _uvarint(1 << 30) + bytes(64)
    data = b"PAR1" + footer + len(footer).to_bytes(4, "little") + b"PAR1"
    with bounded_allocation(), arrow_allocation(0), pytest.raises(CorruptDataError, match="schema declares"):
        index_from_parquet(data, max_records=1, max_tokens=1)


GOLDEN = sorted((Path(__file__).parents[1] / "fixtures").glob("golden-v*/*/steps/*/commits/*.json"))


@pytest.mark.parametrize("commit_path", GOLDEN, ids=lambda p: "/".join(p.parts[i] for i in (-6, -5, -3, -1)))
def test_every_golden_index_reads_within_its_commits_bounds(commit_path: Path) -> None:
    commit = json.loads(commit_path.read_text())
    data = (commit_path.parents[1] / "parts" / commit["part"] / keys.INDEX).read_bytes()
    counts = {"max_records": commit["n_records"], "max_tokens": commit["n_tokens"]}
    streams = len(commit.get("streams") or {})
    with arrow_allocation(decoded_budget(commit["n_records"], commit["n_tokens"])):
        table = index_from_parquet(data, **counts, max_streams=streams)
    assert table.equals(_table(data).select(table.column_names))
    if commit["n_records"]:
        with pytest.raises(CorruptDataError, match="rows"):
            index_from_parquet(data, max_records=commit["n_records"] - 1, max_tokens=commit["n_tokens"])
    levels = sum(len(ids) if ids else 1 for ids in table.column("token_ids").to_pylist())
    if levels > commit["n_records"]:  # the token ids are stored: a part of no tokens cannot hold them
        with pytest.raises(CorruptDataError, match="token_ids"):
            index_from_parquet(data, max_records=commit["n_records"], max_tokens=0, max_streams=streams)


@pytest.mark.parametrize(
    "options",
    [
        {"data_page_version": "2.0"},
        {"compression": "none"},
        {"compression": "snappy"},
        {"compression": "gzip"},
        {"compression": "brotli"},
        {"compression": "lz4"},
        {"use_dictionary": False},
        {"row_group_size": 1},
        {"data_page_size": 64, "write_batch_size": 8},
    ],
    ids=lambda options: ",".join(f"{k}={v}" for k, v in options.items()),
)
def test_bounded_reads_accept_every_layout_pyarrow_writes(options: dict[str, Any]) -> None:
    commit_path = next(p for p in GOLDEN if json.loads(p.read_text())["n_records"] > 2)
    commit = json.loads(commit_path.read_text())
    table = _table((commit_path.parents[1] / "parts" / commit["part"] / keys.INDEX).read_bytes())
    data = _written(table, **options)
    read = index_from_parquet(data, max_records=commit["n_records"], max_tokens=commit["n_tokens"], max_streams=0)
    assert read.equals(table.select(read.column_names))


def _footer_of(data: bytes) -> tuple[Thrift, int]:
    """The decoded FileMetaData and where it starts."""
    start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    return _decode_struct(data, start)[0], start


def test_a_footer_that_pyarrow_reads_otherwise_than_its_bytes_say_is_refused(memory_url: str) -> None:
    """Thrift's generated reader reads a list's elements as their IDL type whatever type the list declares: a list
    of ``encodings`` declared as one string hides, from a reader that honours the declaration, the fields pyarrow
    then reads from that string's bytes. Here they point ``token_ids`` at a chunk of 8 Mi ids that the visible
    fields do not name; a reader checking only what it parsed would let pyarrow decode it."""
    benign, commit = _planted_index(memory_url, lambda data: data)
    bomb = _long_token_list(benign)
    bomb_column = _chunk_meta(_footer_of(bomb)[0], "token_ids.list.element")
    meta, body_end = _footer_of(benign)
    bomb_start = _get(bomb_column, 11) or _get(bomb_column, 9)
    hidden_chunk = bomb[bomb_start : bomb_start + _get(bomb_column, 7)]

    def zigzag(value: int) -> bytes:
        return _uvarint(value << 1)

    # field ids 5, 7, 9, 11 (i64) after field 2: deltas 3, 2, 2, 2
    hidden = b"".join(
        bytes([delta << 4 | 6]) + zigzag(value)
        for delta, value in (
            (3, _get(bomb_column, 5)),
            (2, _get(bomb_column, 7)),
            (2, body_end + _get(bomb_column, 9) - bomb_start),
            (2, body_end),
        )
    )
    column = _chunk_meta(meta, "token_ids.list.element")
    column.append([None, None, bytes([0x09]) + zigzag(2) + bytes([0x18]) + _uvarint(len(hidden)) + hidden])
    footer = _encode_struct(meta)
    forged = benign[:body_end] + hidden_chunk + footer + len(footer).to_bytes(4, "little") + b"PAR1"
    parquet = pq.ParquetFile(io.BytesIO(forged))
    leaf = next(i for i in range(parquet.metadata.num_columns) if parquet.schema.column(i).path.startswith("token_ids"))
    assert parquet.metadata.row_group(0).column(leaf).num_values == BOMB_TOKENS  # pyarrow would decode the hidden chunk
    with bounded_allocation(), arrow_allocation(1 << 20), pytest.raises(CorruptDataError, match="pyarrow reads"):
        index_from_parquet(forged, max_records=commit["n_records"], max_tokens=commit["n_tokens"])


def test_an_empty_index_reads_with_no_records_and_no_tokens() -> None:
    assert index_from_parquet(index_to_parquet([]), max_records=0, max_tokens=0).num_rows == 0


def test_rows_listing_more_streams_than_their_part_holds_are_refused() -> None:
    rows = [
        IndexRow(
            sample_id=f"s{i}",
            step=0,
            prompt_len=3,
            response_len=5,
            n_tokens=8,
            spans=[Span(token_start=0, n_rows=8, row=8 * i)],
            segments=[Segment(start=0, end=8)],
            streams=[StreamSpans(name=name, spans=[Span(token_start=0, n_rows=8, row=8 * i)]) for name in ("a", "b")],
        )
        for i in range(3)
    ]
    data = index_to_parquet(rows)
    read = index_from_parquet(data, max_records=3, max_tokens=24, max_streams=2)
    assert [IndexRow.model_validate(r) for r in read.to_pylist()] == rows
    with pytest.raises(CorruptDataError, match=r"streams\.list\.element\.name declares 6 values"):
        index_from_parquet(data, max_records=3, max_tokens=24, max_streams=1)
