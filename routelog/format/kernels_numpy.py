"""The numpy path of the format-2 codec's kernels (:mod:`routelog.format.ranked`), for where the compiled ones
are not built (:mod:`routelog.format.kernels` picks).

Same functions, signatures and results as the numba kernels (:mod:`routelog.format._kernels`, which document the
encoding): :func:`decode_chunk` decodes every chunk they decode, to the same IDs, and reports a damaged or forged
one with the same status and detail, after the same checks in the same order (it never reads or writes outside its
arrays, and allocates at most in proportion to the chunk); :func:`first_invalid_row` and :func:`sort_rows_of_eight`
return what theirs return. :func:`encode_chunk` writes a simpler chunk that both decoders read back exactly: no
layer is ranked or keeps a dictionary (payload version 1), repeats and exceptions as the compiled encoder keeps them.

Each step is a numpy pass over a layer's rows (slower than the compiled loops, which keep a row in registers, but
no Python loop per row or per ID). Rows of eight uint8 IDs decoded into a caller's ``out_words`` follow the
compiled kernel's word arithmetic: a damaged chunk's gaps whose prefix sums pass 255 carry into the next ID there
(and a damaged ranked row is judged by those IDs), where one ID at a time wraps each ID alone. Valid chunks decode
alike either way; only damaged ones can tell the two apart, so this module keeps both.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.format.kernels import (
    ACCEPT,
    ALWAYS,
    ANY_ROWS,
    AUTO,
    DICTIONARY,
    DICTIONARY_INDEX,
    DICTIONARY_SIZE,
    EXCEPTION_RANGE,
    FIRST_ROW_REPEATS,
    INVALID_ROW,
    NEVER,
    OK,
    PROBLEMS,
    RANK_RANGE,
    SECTION_SIZES,
    SETS,
    SETS_OR_FILL,
    UNIQUE_COUNT,
    UNKNOWN_MODE,
)

__all__ = [
    "ACCEPT",
    "ALWAYS",
    "ANY_ROWS",
    "AUTO",
    "DICTIONARY",
    "DICTIONARY_INDEX",
    "DICTIONARY_SIZE",
    "EXCEPTION_RANGE",
    "FIRST_ROW_REPEATS",
    "INVALID_ROW",
    "NEVER",
    "OK",
    "PROBLEMS",
    "RANK_RANGE",
    "SECTION_SIZES",
    "SETS",
    "SETS_OR_FILL",
    "UNIQUE_COUNT",
    "UNKNOWN_MODE",
    "decode_chunk",
    "encode_chunk",
    "first_invalid_row",
    "sort_rows_of_eight",
]

Array = npt.NDArray[Any]

_ONES = np.uint64(0x0101010101010101)
_FIRST_ONES = np.uint64(0x0101010101010100)  # +1 in every lane but lane 0
_EVEN_LANES = np.uint64(0x00FF00FF00FF00FF)
_SUM_16 = np.uint64(0x0001000100010001)  # times four 16-bit lanes: their sum in the top lane
_HASH = np.uint64(0x9E3779B97F4A7C15)
_WORD = np.dtype("<u8")  # a row of eight uint8 IDs, lane c in byte c whatever the machine's byte order


# -- rows ---------------------------------------------------------------------------------------------------------
@functools.cache
def _network(k: int) -> tuple[tuple[int, int], ...]:
    """Batcher's comparator pairs for ``k`` values (imported on first use: :mod:`routelog.format.codec` may come to
    import this module)."""
    from routelog.format.codec import sorting_network

    return sorting_network(k)


def _sorted_rows(values: Array) -> Array:
    """Each row of ``values`` ``[n, K]`` sorted ascending, as a new array: the sorting network as whole-column
    ``minimum``/``maximum`` passes (measured: 4x faster than ``np.sort(axis=1)`` on 4096 rows of eight)."""
    n, k = values.shape
    if k == 1 or n == 0:
        return values.copy()
    block = np.empty((k + 1, n), values.dtype)  # K columns and a spare one
    block[:k] = values.T
    lanes = list(block)
    for a, b in _network(k):  # the min goes to the spare column, which then takes the place of column a
        spare = lanes[k]
        np.minimum(lanes[a], lanes[b], out=spare)
        np.maximum(lanes[a], lanes[b], out=lanes[b])
        lanes[k], lanes[a] = lanes[a], spare
    return np.stack(lanes[:k], axis=1)


def _ascending_below(rows: Array, num_experts: int) -> npt.NDArray[np.bool_]:
    """Per row of ``rows`` ``[n, K]``: strictly ascending IDs, the last below ``num_experts``. Contiguous rows of
    eight uint8 IDs as words: their gaps' bytes sum to the last ID minus 7 unless a lane borrows (the compiled
    ``_word_valid``; measured on 4096 rows: 30 us, columns compared one by one 42 us, as one 2-D compare 160 us)."""
    n, k = rows.shape
    if rows.dtype == np.uint8 and k == 8 and rows.strides[1] == 1 and (n < 2 or rows.strides[0] == 8):
        words = rows.view(_WORD).reshape(n)
        gaps = words - ((words << 8) + _FIRST_ONES)
        pairs = (gaps & _EVEN_LANES) + ((gaps >> 8) & _EVEN_LANES)
        last = words >> 56
        word_valid: npt.NDArray[np.bool_] = (((pairs * _SUM_16) >> 48) + 7 == last) & (last < num_experts)
        return word_valid
    valid: npt.NDArray[np.bool_] = rows[:, -1] < num_experts
    for c in range(1, k):
        valid &= rows[:, c] > rows[:, c - 1]
    return valid


def _row_words(rows: Array) -> npt.NDArray[np.uint64]:
    """Each row's bytes (zero-padded to whole words) as uint64 words ``[n, W]``: rows compare as W words."""
    n, k = rows.shape
    nbytes = k * rows.itemsize
    width = -(-nbytes // 8)
    padded = np.zeros((n, 8 * width), np.uint8)
    padded[:, :nbytes] = np.ascontiguousarray(rows).view(np.uint8).reshape(n, nbytes)
    return padded.view(np.uint64)


def _get(buffer: Array, at: int, nbytes: int) -> int:
    """The little-endian unsigned integer of ``nbytes`` at ``buffer[at]``."""
    return int.from_bytes(buffer[at : at + nbytes].tobytes(), "little")


def _little_endian(planes: Array, itemsize: int) -> Array:
    """Integers from their bytes: ``planes`` ``[..., itemsize]`` uint8, least significant first, as int64."""
    value = planes[..., 0].astype(np.int64)
    for b in range(1, itemsize):
        value |= planes[..., b].astype(np.int64) << (8 * b)
    return value


class _Gaps:
    """The gaps section as rows ``[S, K]`` of the IDs' dtype (uint16: a low-byte plane, then a high-byte plane)."""

    def __init__(self, gap_bytes: Array, total: int, k: int, itemsize: int) -> None:
        self.low = gap_bytes[: total * k].reshape(total, k)
        # The compiled kernel reads a high plane only when there are rows (``high = total * K``, 0 otherwise)
        self.high = gap_bytes[total * k : 2 * total * k].reshape(total, k) if itemsize == 2 and total else None

    def rows(self, index: slice | Array) -> Array:
        """Rows ``index`` (a slice or row numbers), a new C-contiguous array of the IDs' dtype."""
        if self.high is None:
            return np.ascontiguousarray(self.low[index])
        ids: Array = self.low[index].astype(np.uint16) | (self.high[index].astype(np.uint16) << 8)
        return ids


def _prefix_sums(gaps: Array) -> Array:
    """One ID at a time: each row's values ``x_c = g_0 + sum_{i<=c} (g_i + 1)``, wrapping in the IDs' width as the
    compiled kernel's ``& wrap`` does (numpy's sums of unsigned arrays wrap).

    Contiguous rows of eight uint8 gaps take the words' arithmetic (:func:`_word_lanes`; measured 3x faster), exact
    where the last value, the gaps' byte sum + 7, stays below 256; the other rows (damage) are summed again."""
    n, k = gaps.shape
    step = np.ones(k, gaps.dtype)
    step[0] = 0
    if gaps.dtype != np.uint8 or k != 8 or not gaps.flags.c_contiguous:
        values: Array = np.cumsum(gaps + step, axis=1, dtype=gaps.dtype)
        return values
    values = _word_lanes(gaps)
    words = gaps.view(_WORD).reshape(n)
    pairs = (words & _EVEN_LANES) + ((words >> 8) & _EVEN_LANES)
    wrapped = np.flatnonzero((pairs * _SUM_16) >> 48 >= 256 - 7)
    if wrapped.size:
        values[wrapped] = np.cumsum(gaps[wrapped] + step, axis=1, dtype=np.uint8)
    return values


def _word_lanes(gaps: Array) -> Array:
    """Rows of eight uint8 gaps ``[n, 8]`` (C-contiguous) decoded as the compiled words are: the gaps word plus one
    in lanes 1-7, times ``0x0101..01``, modulo 2**64 (a lane whose prefix sum passes 255 carries into the next)."""
    words = gaps.view(_WORD).reshape(-1)
    ids = ((words + _FIRST_ONES) * _ONES).astype(_WORD, copy=False)  # arrays wrap silently, like the kernel
    return ids.view(np.uint8).reshape(-1, 8)


# -- decoding -----------------------------------------------------------------------------------------------------
def decode_chunk(
    gap_bytes: Array,
    rest: Array,
    num_experts: int,
    layers: int,
    rows: int,
    out: Array,
    out_words: Array | None,
    first_layer: int,
    first_row: int,
    accept: int,
    fill_value: int,
) -> tuple[int, int]:
    """IDs of a window of a ``layers x rows`` chunk into ``out`` ``[Lw, Rw, K]`` (the chunk's layers from
    ``first_layer``, rows from ``first_row``), from its decompressed sections; returns (status, detail) as
    :func:`routelog.format._kernels.decode_chunk` does, with the same preconditions (the caller checked the window,
    that ``rest`` holds a trailer of a known payload version, that the trailer's S is at most ``layers * rows`` and
    that ``gap_bytes`` holds S rows).

    ``out_words``: ``out`` as uint64 words (rows of eight uint8 IDs), or None; only whether it is given matters, for
    the arithmetic of damaged rows (see the module's docstring).
    """
    window_layers, window_rows, k = out.shape
    itemsize = out.itemsize
    as_words = out_words is not None and itemsize == 1 and k == 8
    # The rest section: its parts must add up to its size, and its indices stay inside the chunk.
    trailer = rest.size - layers - 9
    modes = [int(m) for m in rest[trailer : trailer + layers]]
    known_modes = 7 if rest[rest.size - 1] >= 2 else 3  # dictionaries came with payload version 2
    for mode in modes:
        if mode & ~known_modes:
            return UNKNOWN_MODE, mode
    total = _get(rest, rest.size - 9, 4)
    n_exceptions = _get(rest, rest.size - 5, 4)
    per_bitmap = (rows + 7) // 8
    tables = sum(m >> 1 & 1 for m in modes) * per_bitmap  # where each part starts
    listed = tables + sum(m & 1 for m in modes) * num_experts * itemsize
    if listed > trailer:
        return SECTION_SIZES, listed + layers + 9
    repeat_bits: list[Array | None] = [None] * layers  # the rows' repeat flags (uint8 0/1) of layers with a bitmap
    layer_unique = [rows] * layers
    bitmap = 0
    for j, mode in enumerate(modes):
        if mode & 2:
            if rows and rest[bitmap] & 0x80:
                return FIRST_ROW_REPEATS, j
            flags = np.unpackbits(rest[bitmap : bitmap + per_bitmap], count=rows)  # the last byte's padding left out
            repeat_bits[j] = flags
            layer_unique[j] -= int(np.count_nonzero(flags))
            bitmap += per_bitmap
    layer_stored = list(layer_unique)  # rows of the gaps section: unique rows, or a dictionary's entries
    index_at = [0] * layers
    for j, mode in enumerate(modes):
        if mode & DICTIONARY:
            if listed + 4 > trailer:
                return SECTION_SIZES, listed + 4 + layers + 9
            entries = _get(rest, listed, 4)
            if entries > layer_unique[j] or (entries == 0) != (layer_unique[j] == 0):
                return DICTIONARY_SIZE, j
            layer_stored[j] = entries
            index_at[j] = listed + 4
            listed += 4 + layer_unique[j] * (1 + (entries > 256))
    entry = 4 + k * itemsize
    if listed + n_exceptions * entry != trailer:
        return SECTION_SIZES, listed + n_exceptions * entry + layers + 9
    stored = sum(layer_stored)
    if stored != total:
        return UNIQUE_COUNT, stored
    unique = sum(layer_unique)
    listing = rest[listed:trailer].reshape(n_exceptions, entry)
    exception_rows = _little_endian(listing[:, :4], 4)
    beyond = np.flatnonzero(exception_rows >= unique)
    if beyond.size:
        return EXCEPTION_RANGE, int(beyond[0])
    # The window's rows, layer by layer.
    gaps = _Gaps(gap_bytes, total, k, itemsize)
    stop_row = first_row + window_rows
    start = 0  # the layer's first row in the gaps section
    ranked = tables
    for j, mode in enumerate(modes):
        layer_start = start
        start += layer_stored[j]
        table_at = ranked
        ranked += num_experts * itemsize if mode & 1 else 0
        jw = j - first_layer
        if jw < 0 or jw >= window_layers or window_rows == 0:
            continue
        table = None
        if mode & 1:
            table = _little_endian(rest[table_at : table_at + num_experts * itemsize].reshape(-1, itemsize), itemsize)
        bits = repeat_bits[j]
        # The layer's unique rows [lo, hi) that rows [first_row, stop_row) expand from: from the one the first row
        # repeats (when it is a repeat) to the last one at or before the last row.
        starts_repeat = 0
        lo, hi = first_row, stop_row
        if bits is not None:
            starts_repeat = int(bits[first_row])
            lo = first_row - int(np.count_nonzero(bits[:first_row])) - starts_repeat
            hi = stop_row - int(np.count_nonzero(bits[:stop_row]))
        if mode & DICTIONARY:
            found = _dictionary_rows(
                gaps,
                rest,
                layer_start,
                layer_stored[j],
                index_at[j],
                layer_unique[j],
                lo,
                hi,
                table,
                num_experts,
                as_words,
            )
        else:
            found = _unique_rows(gaps, slice(layer_start + lo, layer_start + hi), table, num_experts, as_words)
        if isinstance(found, int):
            return found, j
        if bits is None:
            out[jw] = found
            continue
        # A repeat keeps the row before it: row r takes the unique row counted by the non-repeats up to it.
        nonrepeat = 1 - bits[first_row:stop_row].astype(np.int64)
        out[jw] = found[np.cumsum(nonrepeat) - 1 + starts_repeat]
    written = None
    if n_exceptions:
        exception_ids = _little_endian(listing[:, 4:].reshape(n_exceptions, k, itemsize), itemsize)
        written = _apply_exceptions(
            exception_rows, exception_ids, layer_unique, repeat_bits, out, first_layer, first_row
        )
    if accept != ANY_ROWS:
        # Every row is checked: the compiled kernel skips layers its decoding proved valid, which hold no bad row
        fill = fill_value if accept == SETS_OR_FILL else -1
        bad = _first_invalid(out, num_experts, fill, written)
        if bad >= 0:
            return INVALID_ROW, bad
    return OK, 0


def _unique_rows(
    gaps: _Gaps, index: slice | Array, table: Array | None, num_experts: int, as_words: bool
) -> Array | int:
    """The IDs of gaps rows ``index`` (plain, or ranks mapped through ``table`` and sorted), or :data:`RANK_RANGE`
    where a rank is past the table (the compiled kernel's test, by its arithmetic: ``as_words``, or one ID at a
    time)."""
    rows = gaps.rows(index)
    if as_words:
        return _word_rows(rows, table, num_experts)
    values = _prefix_sums(rows)
    if table is None:
        return values
    if (values >= num_experts).any():
        return RANK_RANGE
    return _sorted_rows(table[values].astype(values.dtype))


def _word_rows(gaps: Array, table: Array | None, num_experts: int) -> Array | int:
    """:func:`_unique_rows` for rows of eight uint8 IDs as the compiled kernel's words decode them
    (``_decode_words``): rows of ranks that are all sets below E map through the table and sort; otherwise a row
    whose ranks (as words, carries included) map to eight distinct IDs (below 64 where E <= 64, else below 256) is
    those IDs sorted, and any other row is decoded one ID at a time (a rank past the table: :data:`RANK_RANGE`)."""
    lanes = _word_lanes(gaps)
    if table is None:
        return lanes
    limit = min(num_experts, 256)
    last = gaps.sum(axis=1, dtype=np.int64) + 7  # the ranks' last prefix sum, unwrapped
    if (last < limit).all():  # every row a set of ranks below E: no lane carries, the ranks are exact
        lookup = np.zeros(256, np.uint8)
        lookup[:limit] = table[:limit]
        return _sorted_rows(lookup[lanes])
    mapped = np.full(256, 256, np.int64)  # past the table: no ID
    mapped[:limit] = table[:limit]
    targets = _sorted_rows(mapped[lanes])
    distinct = _ascending_below(targets, 64 if num_experts <= 64 else 256)
    result = targets.astype(np.uint8)  # distinct rows hold bytes; the others are replaced below
    damaged = np.flatnonzero(~distinct)
    if damaged.size:
        values = _prefix_sums(gaps[damaged])
        if (values >= num_experts).any():
            return RANK_RANGE
        result[damaged] = _sorted_rows(table[values]).astype(np.uint8)
    return result


def _dictionary_rows(
    gaps: _Gaps,
    rest: Array,
    layer_start: int,
    n_entries: int,
    index_at: int,
    n_unique: int,
    lo: int,
    hi: int,
    table: Array | None,
    num_experts: int,
    as_words: bool,
) -> Array | int:
    """The IDs of a dictionary layer's unique rows ``[lo, hi)``, each its entry's, or the error the compiled kernel
    reports first: as words, every entry is decoded (:data:`RANK_RANGE`), then the indices checked
    (:data:`DICTIONARY_INDEX`); one ID at a time, unique row by unique row, its index then its ranks."""
    low = rest[index_at + lo : index_at + hi].astype(np.int64)
    index = low
    if n_entries > 256:
        index = low | (rest[index_at + n_unique + lo : index_at + n_unique + hi].astype(np.int64) << 8)
    past = index >= n_entries
    if as_words:
        entries = _unique_rows(gaps, slice(layer_start, layer_start + n_entries), table, num_experts, True)
        if isinstance(entries, int):
            return entries
        if past.any():
            return DICTIONARY_INDEX
        return entries[index]
    safe = np.minimum(index, n_entries - 1)  # rows with a bad index are not decoded (their error comes first)
    rows = gaps.rows(layer_start + safe)
    values = _prefix_sums(rows)
    if table is None:
        if past.any():
            return DICTIONARY_INDEX
        return values
    rank_past = (values >= num_experts).any(axis=1) & ~past
    if past.any() or rank_past.any():
        first_past = int(np.argmax(past)) if past.any() else past.size
        first_rank = int(np.argmax(rank_past)) if rank_past.any() else past.size
        return DICTIONARY_INDEX if first_past < first_rank else RANK_RANGE
    return _sorted_rows(table[values].astype(values.dtype))


def _apply_exceptions(
    exception_rows: Array,
    exception_ids: Array,
    layer_unique: list[int],
    repeat_bits: list[Array | None],
    out: Array,
    first_layer: int,
    first_row: int,
) -> npt.NDArray[np.bool_]:
    """Overwrite the exceptions' unique rows (the last listing of a row wins) and the repeats that follow them, where
    they fall in the window ``out``; returns which rows of ``out`` they wrote ``[Lw, Rw]``."""
    window_layers, window_rows, _ = out.shape
    written = np.zeros((window_layers, window_rows), np.bool_)
    if not out.size:
        return written
    exception_of = np.full(sum(layer_unique), -1, np.int64)
    np.maximum.at(exception_of, exception_rows, np.arange(exception_rows.size))  # the latest listing, in any order
    numbered = np.concatenate([[0], np.cumsum(layer_unique)])  # unique rows are numbered across layers
    stop_row = first_row + window_rows
    for jw in range(window_layers):
        j = first_layer + jw
        bits = repeat_bits[j]
        if bits is None:
            unique = np.arange(first_row, stop_row)
        else:  # a repeat keeps the listing of the unique row before it
            unique = np.cumsum(1 - bits[:stop_row].astype(np.int64))[first_row:] - 1
        listing = exception_of[numbered[j] + unique]
        hit = listing >= 0
        written[jw] = hit
        out[jw, hit] = exception_ids[listing[hit]]
    return written


def _first_invalid(out: Array, num_experts: int, fill: int, written: npt.NDArray[np.bool_] | None) -> int:
    """The first row of ``out`` ``[Lw, Rw, K]`` (as ``jw * Rw + r``) that is no set of K strictly ascending IDs below
    ``num_experts``, except a row an exception ``written`` holding only ``fill`` (-1: none is), or -1."""
    window_layers, window_rows, _ = out.shape
    padding_fits = written is not None and 0 <= fill <= np.iinfo(out.dtype).max
    for jw in range(window_layers):
        bad = ~_ascending_below(out[jw], num_experts)
        if not bad.any():
            continue
        if padding_fits and written is not None:
            bad &= ~(written[jw] & (out[jw] == fill).all(axis=1))
        if bad.any():
            return int(jw * window_rows + int(np.argmax(bad)))
    return -1


# -- checking decoded rows (format 1) -----------------------------------------------------------------------------
def first_invalid_row(ids: Array, words: Array | None, num_experts: int, ascending: bool) -> int:
    """The first row of ``ids`` ``[L, R, K]`` (uint8 or uint16, any strides) that is no valid stored row, as
    ``layer * R + row``, or -1: K distinct IDs below ``num_experts``, strictly ascending when ``ascending``.
    ``words`` (the rows as uint64 words, or None) is not needed here: the same rows give the same answer."""
    layers, rows = ids.shape[0], ids.shape[1]
    for j in range(layers):
        layer = ids[j]
        valid = _ascending_below(layer if ascending else _sorted_rows(layer), num_experts)
        if not valid.all():
            return int(j * rows + int(np.argmin(valid)))
    return -1


# -- sorting ------------------------------------------------------------------------------------------------------
def sort_rows_of_eight(ids: Array, out: Array, tokens: int, layers: int, largest: Any) -> int:
    """Each row of eight IDs sorted ascending: ``ids`` flat in token order ``[tokens, layers, 8]``, into ``out`` flat
    in layer order ``[layers, tokens, 8]``. Returns the first row, in ``ids``' order (``token * layers + layer``),
    holding an ID above ``largest`` or a repeated ID; -1 when every row is a valid set."""
    n = tokens * layers
    ordered = _sorted_rows(ids[: n * 8].reshape(n, 8))
    out[: n * 8].reshape(layers, tokens, 8)[...] = ordered.reshape(tokens, layers, 8).transpose(1, 0, 2)
    bad = (ordered[:, 7] > largest) | (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
    return int(np.argmax(bad)) if bad.any() else -1


# -- encoding -----------------------------------------------------------------------------------------------------
def encode_chunk(
    ids: Array, id_words: Array | None, num_experts: int, dictionaries: int
) -> tuple[Array, Array, int, int]:
    """The two sections of one chunk ``ids`` ``[L, R, K]`` (uint8 or uint16) as uint8 arrays (the gaps section and
    the rest), the rows the gaps section holds, and how many of them equal an earlier one of their layer (exactly
    but for hash collisions of rows over eight bytes; the compiled encoder's count, by a hash table, can be lower).

    Plain gaps only: no layer is ranked or keeps a dictionary (``dictionaries`` is ignored), so the payload is
    version 1. Repeats of the row before are flagged, and rows that are no valid set are exceptions (their gaps
    zeros), as the compiled encoder does. ``id_words`` (the rows as words, or None) is not needed.
    """
    layers, rows, k = ids.shape
    dtype = ids.dtype
    modes = np.zeros(layers, np.uint8)
    sections: list[Array] = []
    bitmaps: list[Array] = []
    exception_rows: list[Array] = []
    exception_ids: list[Array] = []
    numbered = 0  # unique rows of the layers before
    matched = 0
    for j in range(layers):
        layer = ids[j]
        words = _row_words(layer)
        repeat = np.zeros(rows, np.bool_)
        if rows > 1:
            repeat[1:] = (words[1:] == words[:-1]).all(axis=1)
        if repeat.any():
            modes[j] = 2
            bitmaps.append(np.packbits(repeat))
            layer, words = layer[~repeat], words[~repeat]
        gaps = np.empty(layer.shape, dtype)
        gaps[:, :1] = layer[:, :1]
        gaps[:, 1:] = layer[:, 1:] - layer[:, :-1] - 1  # wraps on rows that do not ascend: those are exceptions
        invalid = np.flatnonzero(~_ascending_below(layer, num_experts))
        gaps[invalid] = 0  # a valid placeholder that the exception overwrites
        exception_rows.append(numbered + invalid)
        exception_ids.append(layer[invalid])
        if invalid.size:
            words = _row_words(gaps)
        # Unique rows equal to an earlier one: distinct rows counted on sorted keys, the compiled ``_row_hash`` of
        # their words untruncated (one to one for rows of up to eight bytes; longer ones may collide, a rare undercount)
        keys = words[:, 0] * _HASH
        for w in range(1, words.shape[1]):
            keys = (keys ^ words[:, w]) * _HASH
        ordered = np.sort(keys)
        matched += int(np.count_nonzero(ordered[1:] == ordered[:-1]))
        numbered += len(layer)
        sections.append(gaps)
    flat = np.concatenate(sections).reshape(-1) if sections else np.empty(0, dtype)
    section = flat.view(np.uint8).copy() if ids.itemsize == 1 else np.concatenate([flat & 255, flat >> 8])
    listed = np.concatenate(exception_rows).astype("<u4")
    entry = np.dtype([("row", "<u4"), ("ids", f"<u{ids.itemsize}", (k,))])
    exceptions = np.empty(listed.size, entry)
    exceptions["row"] = listed
    exceptions["ids"] = np.concatenate(exception_ids) if exception_ids else np.empty((0, k), dtype)
    trailer = np.empty(9, np.uint8)
    trailer[:4] = np.frombuffer(numbered.to_bytes(4, "little"), np.uint8)
    trailer[4:8] = np.frombuffer(listed.size.to_bytes(4, "little"), np.uint8)
    trailer[8] = 1  # payload version 1: no dictionaries
    rest = np.concatenate([*bitmaps, exceptions.view(np.uint8).reshape(-1), modes, trailer]).astype(np.uint8)
    return section.astype(np.uint8, copy=False), rest, numbered, matched
