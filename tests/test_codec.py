"""The routing transform: sorting network, validation, gaps and their inverse (FORMAT.md, "Routing transform")."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from routelog.format.codec import (
    RowProblem,
    decode_rows,
    encode_rows,
    gaps_from_sorted,
    invalid_row,
    layer_major,
    sort_and_check,
    sort_by_layer,
    sorted_from_gaps,
    sorting_network,
    storage_dtype,
)


@st.composite
def topk_rows(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    """Rows of K distinct expert IDs (FORMAT.md: a row names K distinct experts in [0, E))."""
    experts = draw(st.integers(2, 1024))
    k = draw(st.integers(1, min(16, experts)))
    n = draw(st.integers(1, 200))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    rows = np.stack([rng.choice(experts, size=k, replace=False) for _ in range(n)])
    dtype = draw(st.sampled_from([np.int64, np.int32, np.uint16] + ([np.uint8] if experts <= 256 else [])))
    return rows.astype(dtype), experts


@pytest.mark.parametrize("k", range(1, 17))
def test_sorting_network_sorts_every_zero_one_input(k: int) -> None:
    # 0-1 principle: a comparator network sorts all inputs iff it sorts all 2^k binary inputs.
    network = sorting_network(k)
    for bits in itertools.product((0, 1), repeat=k):
        values = list(bits)
        for a, b in network:
            if values[a] > values[b]:
                values[a], values[b] = values[b], values[a]
        assert values == sorted(bits)


def test_sorting_network_for_eight_has_nineteen_comparators() -> None:
    assert len(sorting_network(8)) == 19


@given(topk_rows())
def test_sort_and_check_sorts_valid_rows_without_complaint(case: tuple[np.ndarray, int]) -> None:
    rows, experts = case
    ordered, problem = sort_and_check(rows, experts)
    assert problem is None
    assert ordered.dtype == storage_dtype(experts)
    np.testing.assert_array_equal(ordered, np.sort(rows.astype(np.int64), axis=1))


@given(topk_rows())
def test_gaps_round_trip(case: tuple[np.ndarray, int]) -> None:
    rows, experts = case
    ordered, _ = sort_and_check(rows, experts)
    stored = encode_rows(ordered.copy(), "sorted_gaps")
    if rows.shape[1] > 1:
        assert (stored[:, 1:] < experts).all()
    back = decode_rows(stored.copy(), "sorted_gaps")
    np.testing.assert_array_equal(back, ordered)
    out = np.empty_like(stored)
    decode_rows(stored, "sorted_gaps", out=out)
    np.testing.assert_array_equal(out, ordered)


@pytest.mark.parametrize(("experts", "k"), [(128, 8), (384, 8), (64, 6), (256, 16), (1024, 16), (2, 2), (300, 1)])
def test_gap_inverse_works_on_strided_blocks(experts: int, k: int) -> None:
    rng = np.random.default_rng(experts * k)
    rows = np.stack([rng.choice(experts, size=k, replace=False) for _ in range(240)])
    ordered, _ = sort_and_check(rows, experts)
    gaps = gaps_from_sorted(ordered.copy()).reshape(12, 20, k)
    big = np.full((12, 40, k), 7, dtype=gaps.dtype)
    big[:, 10:30] = gaps
    sorted_from_gaps(big[:, 10:30])
    np.testing.assert_array_equal(big[:, 10:30].reshape(-1, k), ordered)
    assert (big[:, :10] == 7).all()
    assert (big[:, 30:] == 7).all()


def test_uniform_gaps_share_one_distribution() -> None:
    # The spacings of a uniform random K-subset are exchangeable: every gap column has the same mean.
    rng = np.random.default_rng(0)
    rows = np.stack([rng.choice(128, size=8, replace=False) for _ in range(20000)])
    ordered, _ = sort_and_check(rows, 128)
    gaps = gaps_from_sorted(ordered).astype(np.float64)
    means = gaps.mean(axis=0)
    assert np.allclose(means, (128 - 8) / 9, rtol=0.03)


@pytest.mark.parametrize(
    ("row", "experts", "kind"),
    [
        ([1, 2, 2, 5], 8, "duplicate"),
        ([1, 2, 3, 8], 8, "out_of_range"),
        ([1, -1, 3, 4], 8, "negative"),
        ([0, 1, 2, 300], 256, "out_of_range"),  # would wrap to 44 in uint8
        ([0, 1, 2, -1], 256, "negative"),  # would wrap to 255, a valid expert
    ],
)
def test_sort_and_check_names_the_first_bad_row(row: list[int], experts: int, kind: str) -> None:
    rows = np.array([[0, 1, 2, 3], row, [4, 5, 6, 7]], dtype=np.int64)
    _, problem = sort_and_check(rows, experts)
    assert problem is not None
    assert problem.row == 1
    assert problem.kind == kind
    assert problem.values == tuple(row)


@pytest.mark.parametrize("experts", [8, 9, 63, 64, 65, 128, 255, 256, 257, 384, 65536])
def test_compiled_sort_agrees_with_the_network(experts: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows of eight IDs (uint8, or uint16 past 256 experts) sort in the compiled kernel; every answer must be the
    # numpy network's: the sorted rows, and the first bad row (a repeat, or an ID past the universe) at any lane.
    from routelog.format import codec

    rng = np.random.default_rng(experts)
    dtype = storage_dtype(experts)
    rows = np.stack([rng.choice(experts, size=8, replace=False) for _ in range(3000)]).astype(dtype)
    cases: list[tuple[np.ndarray, int | None]] = [(rows, None)]
    for lane in range(8):
        repeated = rows.copy()
        repeated[1700 + lane, lane] = repeated[1700 + lane, (lane + 3) % 8]
        repeated[2500] = repeated[2500, 0]  # a later bad row: the first one is named
        cases.append((repeated, 1700 + lane))
        for extreme in (np.argmax, np.argmin):  # a repeated largest or smallest ID: the top or bottom pair
            ends = rows.copy()
            at = int(extreme(ends[1200 + lane]))
            ends[1200 + lane, lane if lane != at else (lane + 1) % 8] = ends[1200 + lane, at]
            cases.append((ends, 1200 + lane))
        if experts + lane <= np.iinfo(dtype).max:  # an ID past the universe that still fits the storage dtype
            past = rows.copy()
            past[900 + lane, lane] = experts + lane
            cases.append((past, 900 + lane))
    for case, first_bad in cases:
        assert codec._sorts_compiled(case)
        fast, fast_problem = sort_and_check(case, experts)
        with monkeypatch.context() as patch:
            patch.setattr(codec, "_sorts_compiled", lambda src: False)
            slow, slow_problem = sort_and_check(case, experts)
        assert fast_problem == slow_problem
        assert (slow_problem.row if slow_problem else None) == first_bad
        if first_bad is None:
            np.testing.assert_array_equal(fast, slow)


def test_the_compiled_sort_takes_rows_of_eight_ids_wherever_they_lie() -> None:
    from routelog.format import codec

    rows = np.tile(np.arange(8, dtype=np.uint8)[::-1], (16, 1))
    assert codec._sorts_compiled(rows)
    assert not codec._sorts_compiled(rows[:, :6])
    assert codec._sorts_compiled(rows.astype(np.uint16))  # IDs of more than 256 experts
    buffer = np.zeros(16 * 8 + 8, np.uint8)
    unaligned = buffer[1 : 1 + 16 * 8].reshape(16, 8)
    unaligned[...] = rows
    assert codec._sorts_compiled(unaligned)  # indexed byte by byte: no word alignment needed
    ordered, problem = sort_and_check(unaligned, 64)
    assert problem is None
    np.testing.assert_array_equal(ordered, np.tile(np.arange(8, dtype=np.uint8), (16, 1)))


def test_layer_major_is_the_transpose() -> None:
    rng = np.random.default_rng(1)
    for dtype, k in [(np.uint8, 8), (np.uint16, 8), (np.uint8, 6), (np.int64, 4), (np.uint8, 1)]:
        ids = rng.integers(0, 200, size=(37, 5, k)).astype(dtype)
        moved = layer_major(ids)
        assert moved.flags.c_contiguous
        np.testing.assert_array_equal(moved, ids.transpose(1, 0, 2))


@given(topk_rows(), st.integers(1, 7))
def test_sort_by_layer_is_the_sorted_transpose(case: tuple[np.ndarray, int], layers: int) -> None:
    rows, experts = case
    layers = min(layers, rows.shape[0])
    tokens = rows.shape[0] // layers
    ids = rows[: tokens * layers].reshape(tokens, layers, -1)
    original = ids.copy()
    ordered, problem = sort_by_layer(ids, experts)
    assert problem is None
    assert ordered.dtype == storage_dtype(experts) and ordered.flags.c_contiguous
    np.testing.assert_array_equal(ordered, np.sort(ids.astype(np.int64), axis=2).transpose(1, 0, 2))
    np.testing.assert_array_equal(ids, original)  # the caller's array is only read


@pytest.mark.parametrize(("experts", "layers", "tokens"), [(64, 6, 1000), (128, 48, 300), (300, 5, 700), (16, 3, 5)])
def test_sort_by_layer_names_the_first_bad_row_in_token_order(
    experts: int, layers: int, tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled sort (rows of eight) and the numpy network both name the input's first bad row: token by token,
    each token's layers in order (not the layer order they sort into)."""
    from routelog.format import codec

    rng = np.random.default_rng(experts * layers)
    dtype = storage_dtype(experts)
    ids = np.argsort(rng.random((tokens, layers, experts)), axis=2)[:, :, :8].astype(dtype)
    ordered, problem = sort_by_layer(ids, experts)  # several blocks of tokens (TRANSPOSE_ROWS) where tokens allow
    assert problem is None
    np.testing.assert_array_equal(ordered, np.sort(ids, axis=2).transpose(1, 0, 2))
    later_token_earlier_layer = (tokens - 1, 0)
    first = (tokens // 2, layers - 1)
    for token, layer in (later_token_earlier_layer, first):
        ids[token, layer, 3] = ids[token, layer, 5]
    for compiled in (True, False):
        with monkeypatch.context() as patch:
            if not compiled:
                patch.setattr(codec, "_sorts_compiled", lambda src: False)
            _, problem = sort_by_layer(ids, experts)
        assert problem is not None and problem.kind == "duplicate"
        assert problem.row == first[0] * layers + first[1]
        assert problem.values == tuple(int(v) for v in ids[first])
    ids[first] = np.arange(8)
    ids[later_token_earlier_layer] = np.arange(8)
    ids[1, 2, 7] = experts if experts <= np.iinfo(dtype).max else ids[1, 2, 7]
    if ids[1, 2, 7] == experts:
        _, problem = sort_by_layer(ids, experts)
        assert problem is not None and (problem.row, problem.kind) == (layers + 2, "out_of_range")


@pytest.mark.parametrize(("experts", "k", "dtype"), [(64, 8, np.uint8), (64, 5, np.uint8), (300, 8, np.uint16)])
@pytest.mark.parametrize("order", ["sorted", "score"])
def test_invalid_row_names_the_first_decoded_row_that_is_no_set(experts: int, k: int, dtype: type, order: str) -> None:
    """FORMAT.md section 5: every stored row names K distinct IDs in [0, E), strictly ascending in ``sorted`` order.
    The check for decoded format-1 rows (rows of eight uint8 IDs as words, others one ID at a time) finds the first
    row, layer-major, that breaks it, in a whole chunk or in a window of a larger block."""
    rng = np.random.default_rng(experts + k)
    rows = np.argsort(rng.random((3 * 40, experts)), axis=1)[:, :k]  # score order
    if order == "sorted":
        rows = np.sort(rows, axis=1)
    ids = rows.astype(dtype).reshape(3, 40, k)
    ids[0, 0] = np.arange(experts - k, experts)[:: 1 if order == "sorted" else -1]  # the largest IDs: valid
    block = np.zeros((5, 60, k), dtype)  # zeros around the window (no set: like format 1's edge padding)
    window = block[1:4, 10:50]
    window[...] = ids
    assert invalid_row(ids, experts, order) is None  # type: ignore[arg-type]
    assert invalid_row(window, experts, order) is None  # type: ignore[arg-type]
    assert invalid_row(ids[2], experts, order) is None  # type: ignore[arg-type]
    past = np.arange(experts - k + 1, experts + 1)  # ends at E
    repeated = np.sort(ids[1, 39])
    repeated[1] = repeated[0]
    cases = [(2, 7, past, "out_of_range"), (1, 39, repeated, "duplicate"), (0, 5, np.zeros(k), "duplicate")]
    if order == "sorted":
        cases.append((0, 3, ids[0, 3][::-1], "unordered"))  # a valid set in score order
    else:
        cases += [(1, 2, past[::-1], "out_of_range"), (2, 0, np.roll(repeated, 2), "duplicate")]
    for j, r, row, kind in cases:
        for target in (ids.copy(), block.copy()[1:4, 10:50]):
            target[j, r] = row
            target[2, 39] = past  # a later bad row
            problem = invalid_row(target, experts, order)  # type: ignore[arg-type]
            assert problem == RowProblem(j * 40 + r, kind, tuple(int(v) for v in row)), (j, r, kind)
    assert invalid_row(block, experts, order) == RowProblem(0, "duplicate", (0,) * k)  # type: ignore[arg-type]
    if order == "score":
        assert invalid_row(np.sort(ids, axis=2)[:, :, ::-1], experts, "sorted").kind == "unordered"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="uint8 or uint16"):
        invalid_row(ids.astype(np.int64), experts, order)  # type: ignore[arg-type]
