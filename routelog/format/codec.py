"""The routing transform: canonical top-k sets as gaps, so a byte-level entropy coder gets near the bound.

A top-k selection is a set for replay. Sorted ascending, a row ``x_0 < x_1 < ... < x_{K-1}`` is stored as
``g_0 = x_0`` and ``g_j = x_j - x_{j-1} - 1``. For uniformly random sets the K+1 spacings of a random K-subset are
exchangeable, so every ``g_j`` has the same distribution: one Huffman table (zstd's literal coder) fits all
columns and the stored size lands within ~4 % of ``log2(C(E, K))`` bits per token-layer.

Speed comes mostly from layout:

* sorting runs a Batcher sorting network as whole-row ``minimum``/``maximum`` passes over a column-major block
  small enough to stay in cache (19 comparator passes for K = 8); validation (range, duplicates) rides along.
  Rows of eight IDs (top-8, the common case) sort faster in a compiled kernel instead
  (:func:`routelog.format.kernels.sort_rows_of_eight`: the same network, in registers), with the same checks, and
  move from the engines' token order to the parts' layer order in the same pass;
* gaps and their inverse run on each row's K lanes packed in machine words (SWAR): the inverse prefix sum is
  three shift-and-add passes for K = 8 uint8, with no per-column loop. Lanes never overflow because every
  partial sum is itself an expert ID.

The transform is recorded as ``transform`` in every commit; ``"none"`` stores IDs in the engine's score order.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from routelog.format import kernels, mapped

Transform = Literal["ranked_context", "ranked_gaps", "sorted_gaps", "none"]
TopkOrder = Literal["sorted", "score"]

IdArray = npt.NDArray[np.unsignedinteger[Any]]

_BLOCK_ROWS = 1 << 16  # rows per sorting block: K x 64 Ki bytes stays in L2
_LITTLE_ENDIAN = sys.byteorder == "little"


def storage_dtype(num_experts: int) -> np.dtype[Any]:
    """uint8 when IDs fit (E <= 256), else uint16."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)


@dataclass(frozen=True)
class RowProblem:
    """The first row of a routing block that breaks the rules."""

    row: int
    """Index of the row in the flattened ``[rows, K]`` input."""
    kind: Literal["out_of_range", "negative", "duplicate", "unordered"]
    """``unordered``: distinct IDs in range that do not ascend where the transform stores ascending sets (only
    decoded rows, from damaged or forged data: a writer sorts them)."""
    values: tuple[int, ...]


@cache
def sorting_network(k: int) -> tuple[tuple[int, int], ...]:
    """Comparator pairs of Batcher's odd-even merge sort for ``k`` inputs (19 pairs for k = 8).

    Built for the next power of two; comparators touching a padding position are dropped, which is valid because
    padding acts as +inf at the end and never moves.
    """
    size = 1
    while size < k:
        size *= 2
    pairs: list[tuple[int, int]] = []
    p = 1
    while p < size:
        step = p
        while step >= 1:
            for j in range(step % p, size - step, 2 * step):
                for i in range(min(step, size - j - step)):
                    if (i + j) // (2 * p) == (i + j + step) // (2 * p):
                        pairs.append((i + j, i + j + step))
            step //= 2
        p *= 2
    return tuple((a, b) for a, b in pairs if b < k)


def layer_major(ids: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``[T, L, K]`` -> a C-contiguous ``[L, T, K]`` copy (rows of K IDs move as whole machine words)."""
    t, layers, k = ids.shape
    src = np.ascontiguousarray(ids)
    row_bytes = k * src.dtype.itemsize
    word = np.dtype(f"<u{row_bytes}") if row_bytes in (1, 2, 4, 8) else np.dtype((np.void, row_bytes))
    moved = np.ascontiguousarray(src.view(word).reshape(t, layers).T)
    return moved.view(src.dtype).reshape(layers, t, k)


def sort_by_layer(ids: npt.NDArray[Any], num_experts: int) -> tuple[IdArray, RowProblem | None]:
    """Each row of ``ids`` ``[T, L, K]`` (token order, as engines hand them out) sorted ascending, in the storage
    dtype and layer order ``[L, T, K]`` (as parts store them), and the first bad row.

    Returns the sorted copy and the first problem (IDs outside ``[0, num_experts)`` or repeated in a row), or
    ``None``; the problem's ``row`` indexes ``ids.reshape(-1, K)`` (``token * L + layer``). The sorted copy is
    meaningless when a problem is returned.
    """
    dtype = storage_dtype(num_experts)
    t, layers, k = ids.shape
    flat = ids.reshape(-1, k)
    problem = _check_before_cast(flat, num_experts, dtype)
    if problem is not None:
        return np.empty((layers, 0, k), dtype), problem
    src = np.ascontiguousarray(ids, dtype=dtype)
    largest = dtype.type(num_experts - 1)
    out = mapped.empty((layers, t, k), dtype)  # a writer holds and frees these by the flush buffer
    if _sorts_compiled(src):
        bad = kernels.sort_rows_of_eight(src.reshape(-1), out.reshape(-1), t, layers, int(largest))
        row = None if bad < 0 else int(bad)
    else:  # (one layer: layer_major returns src itself, which is only read)
        row = _network_sort(layer_major(src).reshape(-1, k), out.reshape(-1, k), largest)
        if row is not None:  # the network stopped at the first bad row in layer order: name the first in token order
            ordered = np.sort(src.reshape(-1, k), axis=1)
            bad = (ordered[:, -1] > largest) | (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
            row = int(np.argmax(bad))
    if row is None:
        return out, None
    values = tuple(int(v) for v in flat[row])
    kind: Literal["out_of_range", "duplicate"] = "out_of_range" if max(values) >= num_experts else "duplicate"
    return out, RowProblem(row, kind, values)


def sort_and_check(rows: npt.NDArray[Any], num_experts: int) -> tuple[IdArray, RowProblem | None]:
    """Sort each row of ``rows`` ``[N, K]`` ascending, in the storage dtype, and find the first bad row (see
    :func:`sort_by_layer`, of which this is the one-layer case)."""
    n, k = rows.shape
    ordered, problem = sort_by_layer(rows.reshape(n, 1, k), num_experts)
    return ordered.reshape(-1, k), problem


def _sorts_compiled(src: IdArray) -> bool:
    """Whether the compiled sort takes ``src`` (C-contiguous, in the storage dtype): rows of eight IDs, where the
    compiled kernels are built (the numpy path is the network below)."""
    return bool(src.shape[-1] == 8 and src.size > 0 and kernels.IMPLEMENTATION == "compiled")


def _network_sort(src: IdArray, out: IdArray, limit: Any) -> int | None:
    """Sort the rows of ``src`` into ``out`` with the sorting network, block by block; with ``limit`` (the largest
    valid ID) stop at the first row holding a larger or a repeated ID and return its index."""
    n, k = src.shape
    network = sorting_network(k)
    block = np.empty((k + 1, min(n, _BLOCK_ROWS)), src.dtype)  # k rows plus one spare
    for start in range(0, n, _BLOCK_ROWS):
        stop = min(start + _BLOCK_ROWS, n)
        y = block[:, : stop - start]
        y[:k] = src[start:stop].T
        # Compare-exchange writes the max in place and the min into the spare row, then the two row buffers
        # swap roles: two passes per comparator instead of three.
        lanes = list(y)
        for a, b in network:
            spare = lanes[k]
            np.minimum(lanes[a], lanes[b], out=spare)
            np.maximum(lanes[a], lanes[b], out=lanes[b])
            lanes[k], lanes[a] = lanes[a], spare
        if limit is not None:
            bad = lanes[k - 1] > limit
            for j in range(1, k):
                bad |= lanes[j] == lanes[j - 1]
            if bad.any():
                return start + int(np.argmax(bad))
        dst = out[start:stop]
        for j in range(k):
            dst[:, j] = lanes[j]
    return None


def _check_before_cast(rows: npt.NDArray[Any], num_experts: int, dtype: np.dtype[Any]) -> RowProblem | None:
    """Range checks that must happen before narrowing: negatives and values the storage dtype would wrap."""
    if rows.size == 0:
        return None
    signed = rows.dtype.kind == "i"
    wider = rows.dtype.itemsize > dtype.itemsize or (signed and rows.dtype.itemsize == dtype.itemsize)
    if signed and rows.min() < 0:
        row = int(np.argmax((rows < 0).any(axis=1)))
        return RowProblem(row, "negative", tuple(int(v) for v in rows[row]))
    if wider and rows.max() >= num_experts:
        row = int(np.argmax((rows >= num_experts).any(axis=1)))
        return RowProblem(row, "out_of_range", tuple(int(v) for v in rows[row]))
    return None


# -- gaps ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Lanes:
    """How a row of K IDs packs into machine words for SWAR arithmetic."""

    word: np.dtype[Any]
    words_per_row: int
    lane_bits: int
    first_ones: Any  # +1 in every lane but lane 0 (first word of a row)
    all_ones: Any  # +1 in every lane (later words of a row); also the prefix-sum multiplier
    lane_one: Any  # +1 in lane 0 only


@cache
def _lanes(k: int, itemsize: int) -> _Lanes | None:
    row_bytes = k * itemsize
    if not _LITTLE_ENDIAN or k == 1:
        return None
    if row_bytes in (2, 4, 8):
        word = np.dtype(f"<u{row_bytes}")
    elif row_bytes % 8 == 0:
        word = np.dtype("<u8")
    else:
        return None
    lanes = word.itemsize // itemsize
    bits = 8 * itemsize
    all_ones = sum(1 << (bits * i) for i in range(lanes))
    return _Lanes(word, row_bytes // word.itemsize, bits, word.type(all_ones - 1), word.type(all_ones), word.type(1))


def gaps_from_sorted(ids: IdArray) -> IdArray:
    """In place: strictly ascending rows ``[..., K]`` -> gaps (``g_0 = x_0``, ``g_j = x_j - x_{j-1} - 1``).

    The last axis must be contiguous; the others may be strided (a slice of a larger block).
    """
    k = ids.shape[-1]
    lanes = _lanes(k, ids.dtype.itemsize)
    if k == 1:
        return ids
    if lanes is None:
        ids[..., 1:] = ids[..., 1:] - ids[..., :-1] - 1
        return ids
    words = ids.view(lanes.word)
    shift = lanes.word.type(lanes.lane_bits)
    top = lanes.word.type(8 * lanes.word.itemsize - lanes.lane_bits)
    carry = words[..., :-1] >> top  # last lane of each word, before it changes
    words -= words << shift
    words[..., 0] -= lanes.first_ones
    if lanes.words_per_row > 1:
        words[..., 1:] -= lanes.all_ones
        words[..., 1:] -= carry
    return ids


def sorted_from_gaps(gaps: IdArray, out: IdArray | None = None) -> IdArray:
    """Gaps ``[..., K]`` -> the ascending IDs they encode (inverse of :func:`gaps_from_sorted`).

    Writes into ``out`` (default: in place). The prefix sum of a row's lanes is one multiplication of its word by
    ``0x0101...01``: lane j of the product is the sum of lanes 0..j, and no lane carries because every partial sum
    is itself an expert ID. The last axis must be contiguous; the others may be strided.
    """
    target = gaps if out is None else out
    k = gaps.shape[-1]
    if k == 1:
        if out is not None:
            out[...] = gaps
        return target
    lanes = _lanes(k, gaps.dtype.itemsize)
    if lanes is None:
        np.add(gaps, _GENERIC_ONES.get(k, gaps.dtype), out=target)
        np.cumsum(target, axis=-1, dtype=target.dtype, out=target)
        return target
    words = gaps.view(lanes.word)
    result = target.view(lanes.word)
    if lanes.words_per_row == 1:
        np.add(words, lanes.first_ones, out=result)
    else:
        np.add(words, lanes.all_ones, out=result)
        result[..., 0] -= lanes.lane_one
    np.multiply(result, lanes.all_ones, out=result)
    top = lanes.word.type(8 * lanes.word.itemsize - lanes.lane_bits)
    for w in range(1, lanes.words_per_row):
        result[..., w] += (result[..., w - 1] >> top) * lanes.all_ones
    return target


class _GenericOnes:
    """``[0, 1, 1, ..., 1]`` rows for the generic (non-SWAR) inverse, cached per (K, dtype)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, str], IdArray] = {}

    def get(self, k: int, dtype: np.dtype[Any]) -> IdArray:
        key = (k, dtype.str)
        if key not in self._cache:
            ones = np.ones(k, dtype=dtype)
            ones[0] = 0
            self._cache[key] = ones
        return self._cache[key]


_GENERIC_ONES = _GenericOnes()


# -- whole transform -------------------------------------------------------------------------------------------
def encode_rows(sorted_rows: IdArray, transform: Transform) -> IdArray:
    """Stored form of validated rows (``sorted_rows`` as returned by :func:`sort_and_check`), in place."""
    if transform == "sorted_gaps":
        return gaps_from_sorted(sorted_rows)
    return sorted_rows


def invalid_row(ids: IdArray, num_experts: int, topk_order: TopkOrder) -> RowProblem | None:
    """The first decoded row of ``ids`` (``[rows, K]`` or layer-major ``[layers, rows, K]``, such as a reader's
    block; the rows' IDs contiguous) that the format forbids, or None: every stored row names K distinct IDs in
    ``[0, num_experts)``, strictly ascending in ``sorted`` order (FORMAT.md section 5). Its ``row`` indexes
    ``ids.reshape(-1, K)``.

    Readers check the rows they hand out, never a chunk's edge padding (its content is unspecified: zarr-python
    and format 1's writers pad with 0). One pass of :func:`routelog.format.kernels.first_invalid_row`."""
    if ids.ndim not in (2, 3) or ids.dtype not in _CHECKED_DTYPES:
        raise ValueError(f"expected [rows, K] or [layers, rows, K] uint8 or uint16 IDs, not {ids.dtype} {ids.shape}")
    rows = ids if ids.ndim == 3 else ids[np.newaxis]
    if rows.size == 0:
        return None
    bad = kernels.first_invalid_row(rows, num_experts, topk_order == "sorted")
    if bad < 0:
        return None
    values = tuple(int(v) for v in rows[bad // rows.shape[1], bad % rows.shape[1]])
    kind: Literal["out_of_range", "duplicate", "unordered"] = "unordered"
    if max(values) >= num_experts:
        kind = "out_of_range"
    elif len(set(values)) < len(values):
        kind = "duplicate"
    return RowProblem(int(bad), kind, values)


_CHECKED_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16))


def decode_rows(stored: IdArray, transform: Transform, out: IdArray | None = None) -> IdArray:
    """IDs from their stored form ``[..., K]``, into ``out`` (default: in place; the last axis contiguous).

    ``ranked_gaps`` chunks decode to IDs in the chunk codec already (:mod:`routelog.format.ranked`)."""
    if transform == "sorted_gaps":
        return sorted_from_gaps(stored, out)
    if out is None:
        return stored
    out[...] = stored
    return out
