"""The indexer positions codec (routelog.format.positions): exact round trips of canonical rows by the compiled
coder and its Python twin, the same bytes from both, ranged decodes equal to slices of the whole, every malformed
row refused with its position named, damaged and forged blocks refused quickly without large allocations, and the
size against the synthetic generator's entropy bound."""

from __future__ import annotations

import importlib.util
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routelog.errors import CorruptDataError, InvalidRecordError
from routelog.format import positions, positions_python

COMPILED = positions.IMPLEMENTATION == "compiled"
IMPLEMENTATIONS = ["compiled", "python"] if COMPILED else ["python"]


def canonical_rows(
    rng: np.random.Generator, n: int, k: int, first: int, overlap: float, missing: float
) -> npt.NDArray[np.int32]:
    """Canonical rows: each informative row the one before with about ``1 - overlap`` of its positions swapped
    (the first informative one drawn alone), a share ``missing`` of rows then blanked."""
    rows = np.full((n, k), -1, np.int32)
    prev: npt.NDArray[np.int64] | None = None
    for i in range(n):
        p = first + i
        if p + 1 <= k:
            prev = np.arange(p + 1)
        elif prev is None or len(prev) < k:
            prev = np.sort(rng.choice(p + 1, k, replace=False))
        else:
            candidates = p + 1 - k
            d = min(int(rng.binomial(k, 1 - overlap)), candidates)
            kept = np.delete(prev, rng.choice(k, d, replace=False))
            free = np.setdiff1d(np.arange(p + 1), prev)
            prev = np.sort(np.concatenate([kept, rng.choice(free, d, replace=False)]))
        rows[i, : len(prev)] = prev
    rows[rng.random(n) < missing] = -1
    return rows


def encode(rows: npt.NDArray[Any], first: int, implementation: str, every: int = 256) -> bytes:
    if implementation == "compiled":
        return positions.encode_positions(rows, first, keyframe_every=every)
    positions.check_position_rows(rows, first)
    return positions_python.encode(np.asarray(rows, np.int32), first, every)


def decode(data: bytes, implementation: str, start: int = 0, stop: int | None = None) -> npt.NDArray[np.int32]:
    if implementation == "compiled":
        return positions.decode_positions(data, start=start, stop=stop)
    saved = positions._COMPILED
    positions._COMPILED = None  # the public entry point, running the twin
    try:
        return positions.decode_positions(data, start=start, stop=stop)
    finally:
        positions._COMPILED = saved


def outcome(data: bytes, implementation: str, start: int = 0, stop: int | None = None) -> tuple[str, Any]:
    try:
        return "rows", decode(data, implementation, start, stop).tolist()
    except CorruptDataError as error:
        return "error", str(error)


@st.composite
def blocks(draw: Any) -> tuple[npt.NDArray[np.int32], int, int]:
    k = draw(st.integers(1, 64))
    n = draw(st.integers(0, 300))
    first = draw(st.sampled_from([0, 0, 1, k - 1, k, k + 3, 200]))
    overlap = draw(st.sampled_from([0.0, 0.5, 0.9, 0.95, 1.0]))
    missing = draw(st.sampled_from([0.0, 0.0, 0.02, 0.3, 1.0]))
    every = draw(st.sampled_from([1, 2, 5, 16, 64, 256]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return canonical_rows(rng, n, k, first, overlap, missing), first, every


@given(blocks())
def test_round_trip_exact_and_byte_identical(block: tuple[npt.NDArray[np.int32], int, int]) -> None:
    rows, first, every = block
    data = {name: encode(rows, first, name, every) for name in IMPLEMENTATIONS}
    assert len(set(data.values())) == 1, "the compiled coder and the twin write the same bytes"
    blob = data[IMPLEMENTATIONS[0]]
    assert positions.positions_header(blob) == (rows.shape[0], rows.shape[1], first)
    for name in IMPLEMENTATIONS:
        decoded = decode(blob, name)
        assert decoded.dtype == np.int32 and decoded.shape == rows.shape
        assert np.array_equal(decoded, rows)


@given(blocks(), st.data())
def test_ranged_decode_is_a_slice_of_the_whole(block: tuple[npt.NDArray[np.int32], int, int], data: Any) -> None:
    rows, first, every = block
    blob = encode(rows, first, IMPLEMENTATIONS[0], every)
    n = rows.shape[0]
    for _ in range(4):
        start = data.draw(st.integers(0, n))
        stop = data.draw(st.integers(start, n))
        for name in IMPLEMENTATIONS:
            assert np.array_equal(decode(blob, name, start, stop), rows[start:stop])


def test_random_access_across_keyframes() -> None:
    rng = np.random.default_rng(5)
    rows = canonical_rows(rng, 700, 48, 10, 0.95, 0.01)
    blob = positions.encode_positions(rows, 10, keyframe_every=32)
    for start, stop in [
        (0, 700),
        (31, 33),
        (32, 32),
        (64, 65),
        (699, 700),
        (100, 650),
        *[(int(s), int(s) + 50) for s in rng.integers(0, 650, 10)],
    ]:
        for name in IMPLEMENTATIONS:
            assert np.array_equal(decode(blob, name, start, stop), rows[start:stop]), (start, stop, name)
    with pytest.raises(ValueError, match="not inside"):
        positions.decode_positions(blob, start=5, stop=701)
    with pytest.raises(ValueError, match="not inside"):
        positions.decode_positions(blob, start=6, stop=5)


def test_inputs_of_any_buffer_and_integer_dtype() -> None:
    rows = canonical_rows(np.random.default_rng(1), 90, 16, 3, 0.9, 0.05)
    blob = positions.encode_positions(rows, 3, keyframe_every=20)
    assert positions.encode_positions(rows.astype(np.int64), 3, keyframe_every=20) == blob
    for view in (bytearray(blob), memoryview(blob), memoryview(np.frombuffer(blob, np.uint8))):
        assert np.array_equal(positions.decode_positions(view), rows)
        assert positions.positions_header(view) == (90, 16, 3)
    with pytest.raises(ValueError, match="keyframe_every"):
        positions.encode_positions(rows, 3, keyframe_every=0)
    with pytest.raises(InvalidRecordError, match="integer array"):
        positions.encode_positions(rows.astype(np.float32), 3)
    with pytest.raises(InvalidRecordError, match="k must be"):
        positions.encode_positions(np.zeros((3, 0), np.int32), 0)
    with pytest.raises(InvalidRecordError, match="int32 position"):
        positions.encode_positions(np.full((3, 2), -1, np.int32), 2**31 - 2)
    big = rows.astype(np.int64)
    big[40, 0] = 2**32
    with pytest.raises(InvalidRecordError, match="position 43"):
        positions.encode_positions(big, 3)


def test_edge_shapes() -> None:
    for rows, first in [
        (np.zeros((0, 5), np.int32), 0),
        (np.full((4, 1), -1, np.int32), 0),
        (np.array([[0], [1], [0], [3]], np.int32), 0),  # k = 1: each row a single position
        (np.array([[0, 1, 2]], np.int32), 7),  # a first row coded alone past k
        (np.array([[0, -1, -1], [0, 1, -1], [-1, -1, -1], [0, 1, 2], [0, 1, 3]], np.int32), 0),
    ]:
        for every in (1, 3, 256):
            blob = {name: encode(rows, first, name, every) for name in IMPLEMENTATIONS}
            assert len(set(blob.values())) == 1
            for name in IMPLEMENTATIONS:
                assert np.array_equal(decode(blob[name], name), rows)


MALFORMED = [
    # (row, position, what the message says)
    ([2, 1, 5, -1], 9, "not ascending"),
    ([1, 1, 5, -1], 9, "selected twice"),
    ([1, 2, 10, -1], 9, "past the query's own position 9"),
    ([-3, 2, 4, -1], 9, "only -1 pads"),
    ([1, -1, 5, -1], 9, "-1 at column 1 in the middle"),
    ([1, 2, -1, -1], 9, "holds 2 positions, not min(k, p + 1) = 4"),
    ([0, 1, 2, 3], 2, "more than min(k, p + 1) = 3"),
    ([0, 1, -1, -1], 2, "holds 2 positions, not min(k, p + 1) = 3"),
    ([-1, 3, -1, -1], 5, "-1 at column 0 in the middle"),
]


@pytest.mark.parametrize(("row", "position", "problem"), MALFORMED)
def test_malformed_rows_are_refused_naming_the_position(row: list[int], position: int, problem: str) -> None:
    rows = np.full((6, 4), -1, np.int32)
    index = min(3, position)
    first = position - index
    for i in range(6):
        p = first + i
        count = min(4, p + 1)
        rows[i, :count] = np.arange(count) if p < 4 else np.arange(p - count + 1, p + 1)
    rows[index] = row
    for check in (
        lambda: positions.check_position_rows(rows, first),
        lambda: positions.check_position_rows(rows.astype(np.int64), first),  # the numpy check
        lambda: positions.encode_positions(rows, first),
        lambda: encode(rows, first, "python"),
    ):
        with pytest.raises(InvalidRecordError) as caught:
            check()
        assert caught.value.field == "indexer" and caught.value.sample_id is None
        assert f"row {index} (the query at position {position})" in caught.value.problem
        assert problem in caught.value.problem, caught.value.problem


@given(st.integers(0, 2**32 - 1))
@settings(max_examples=100)
def test_compiled_and_numpy_checks_agree(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k, n, first = int(rng.integers(1, 12)), int(rng.integers(1, 30)), int(rng.integers(0, 20))
    rows = canonical_rows(rng, n, k, first, 0.7, 0.1)
    for _ in range(int(rng.integers(0, 3))):
        rows[rng.integers(n), rng.integers(k)] = rng.integers(-3, first + n + 2)
    found = positions._first_invalid_numpy(rows, first)
    if COMPILED:
        assert positions._COMPILED.first_invalid_row(rows, n, k, first) == found
    if found < 0:
        positions.check_position_rows(rows, first)
    else:
        with pytest.raises(InvalidRecordError, match=f"row {found} "):
            positions.check_position_rows(rows, first)


def _sample_block() -> tuple[npt.NDArray[np.int32], bytes]:
    rows = canonical_rows(np.random.default_rng(3), 120, 12, 0, 0.85, 0.03)
    return rows, positions.encode_positions(rows, 0, keyframe_every=40)


def test_every_truncation_is_refused_alike() -> None:
    _, blob = _sample_block()
    for cut in range(len(blob)):
        results = {name: outcome(blob[:cut], name) for name in IMPLEMENTATIONS}
        assert results[IMPLEMENTATIONS[0]][0] == "error", cut
        assert len({str(r) for r in results.values()}) == 1, results


def test_damaged_blocks_decode_to_canonical_rows_or_are_refused_alike() -> None:
    _, blob = _sample_block()
    rng = np.random.default_rng(11)
    refused = 0
    for _ in range(300):
        damaged = bytearray(blob)
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(len(damaged)))
            damaged[at] ^= 1 << int(rng.integers(8))
        start = int(rng.integers(0, 120))
        stop = int(rng.integers(start, 121))
        results = {name: outcome(bytes(damaged), name, 0, None) for name in IMPLEMENTATIONS}
        assert len({str(r) for r in results.values()}) == 1, results
        kind, value = results[IMPLEMENTATIONS[0]]
        if kind == "rows":
            decoded = np.array(value, np.int32).reshape(-1, positions.positions_header(bytes(damaged))[1])
            positions.check_position_rows(decoded, positions.positions_header(bytes(damaged))[2])
        else:
            refused += 1
            assert value.startswith("indexer positions block: ")
        try:
            n = positions.positions_header(bytes(damaged))[0]
        except CorruptDataError:
            continue
        ranged = {name: outcome(bytes(damaged), name, min(start, n), min(stop, n)) for name in IMPLEMENTATIONS}
        assert len({str(r) for r in ranged.values()}) == 1, ranged
    assert refused > 150


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _header(n: int, k: int, first: int, every: int) -> bytes:
    return bytes([positions_python.MAGIC]) + b"".join(_varint(v) for v in (n, k, first, every))


@pytest.mark.parametrize(
    ("blob", "problem"),
    [
        (b"", "starts with nothing"),
        (b"\x00" + _header(1, 1, 0, 1)[1:] + b"\x00", "not the codec's byte"),
        (_header(2**31 - 1, 2048, 0, 256) + b"\x00" * 64, "table longer than"),
        (_header(2**31 - 1, 2048, 0, 2**31 - 1) + b"\x00" * 64, "cannot hold"),
        (_header(2**31 - 1, 2048, 2, 256), "largest int32 position"),
        (_header(100, 0, 0, 256) + b"\x00", "k is 0"),
        (_header(100, 2**20, 0, 256) + b"\x00", "k is 1048576"),
        (_header(100, 8, 0, 0) + b"\x00", "keyframe interval is 0"),
        (bytes([positions_python.MAGIC]) + b"\xff\xff\xff\xff\xff\x01", "more than 5 bytes"),
        (bytes([positions_python.MAGIC]) + b"\x81\x00", "more bytes than it needs"),
        (bytes([positions_python.MAGIC]) + b"\x85", "ends inside the row count"),
        (_header(10, 4, 0, 5) + _varint(2**30) + b"\x00" * 4, "more than the"),
        (_header(10, 4, 0, 5) + _varint(1) + b"\x00", "keyframe group 1 is empty"),
        (_header(0, 4, 0, 5) + b"\x00", "no rows but 1 bytes"),
        (_header(3, 1, 0, 5) + b"\x00", "codes run past the end"),  # row 1's change count is cut short
        (_header(3, 4, 0, 5) + b"\x02", "padding does not match"),  # a stray bit after the group's rows
        (_header(2, 4, 0, 5) + b"\x00\x00", "padding does not match"),  # a byte more than the bits need
    ],
)
def test_forged_blocks_are_refused_quickly_without_allocating(blob: bytes, problem: str) -> None:
    for name in IMPLEMENTATIONS:
        tracemalloc.start()
        try:
            with pytest.raises(CorruptDataError, match="indexer positions block") as caught:
                decode(blob, name)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert problem in str(caught.value), str(caught.value)
        assert peak < 1 << 20, f"{peak} bytes allocated for a forged block"


def test_forged_counts_in_a_real_block() -> None:
    """Every field of a real block's header set to 2^31 - 1 (and to 0): refused or decoded, never a large
    allocation: what is decoded is at most what the block's bytes justify."""
    _, blob = _sample_block()
    n, k, first, every, pos = positions_python.read_fields(blob)
    for field in range(4):
        for value in (0, 2**31 - 1, 65536, 1):
            fields = [n, k, first, every]
            fields[field] = value
            forged = _header(*fields) + blob[pos:]
            for name in IMPLEMENTATIONS:
                tracemalloc.start()
                try:
                    result = outcome(forged, name)
                    _, peak = tracemalloc.get_traced_memory()
                finally:
                    tracemalloc.stop()
                assert peak < 64 << 20, (field, value, peak)
                if result[0] == "rows":
                    positions.check_position_rows(np.array(result[1], np.int32).reshape(-1, fields[1]), fields[2])


def test_size_within_the_bound_on_the_synthetic_generator() -> None:
    path = Path(__file__).resolve().parent.parent / "tools" / "bench_indexer.py"
    spec = importlib.util.spec_from_file_location("bench_indexer", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows, bound = bench.synthetic_layer(2048, 64, seed=0)
    size = len(positions.encode_positions(rows, 0))
    assert size <= 1.15 * bound, (size, bound)
    assert size <= 0.025 * rows.size * 4


def test_the_benchmark_reports_real_traces() -> None:
    """tools/bench_indexer.py's hook for real rows: the figures of a few layers of any k, checked first."""
    path = Path(__file__).resolve().parent.parent / "tools" / "bench_indexer.py"
    spec = importlib.util.spec_from_file_location("bench_indexer", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rng = np.random.default_rng(2)
    traces = [canonical_rows(rng, 150, k, 0, 0.9, 0.01) for k in (8, 32, 32)]
    report = bench.report_traces(traces, zstd_level=3, repeats=1)
    assert report["rows"] == 450 and report["k"] == [8, 32]
    assert report["encoded_bytes"] < report["baselines"]["zstd-3 raw int32"]["bytes"]
    assert 1.0 < report["ratios"]["size / bound"] < 1.5
    assert {row["goal"] for row in report["verdict"]} >= {"size / bound", "size / raw"}
    with pytest.raises(InvalidRecordError):
        bench.report_traces([traces[0][::-1]])
