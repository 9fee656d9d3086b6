"""The format-2 chunk codec: routing that learns each chunk's expert popularity and repeats (``ranked_gaps``).

Real routing is skewed (some experts take many times their share), and consecutive tokens often keep their set.
Format 1 stores each sorted set as ID gaps, whose distribution ignores both. Per inner chunk and MoE layer this
codec (an array -> bytes codec that compresses its own output; crc32c follows it in the shard):

1. flags rows equal to the row before them (same layer) and keeps only the others ("unique rows");
2. when the layer's expert load is skewed, relabels experts by their popularity rank in the chunk (the most used
   expert becomes 0) and sorts each row's ranks, so the gaps between consecutive members shrink and zstd's
   entropy coder sees a peaked alphabet; the rank -> ID table travels in the chunk (self-contained: any chunk
   decodes alone, and a ranged read needs nothing else). A layer keeps plain ID gaps (the format-1 transform,
   the fastest to decode) unless ranking shrinks the entropy of its gaps by :data:`MIN_GAIN`;
3. stores any row that is not a valid top-k set (the fill value of zarr's edge padding, or data written by
   other tools) verbatim as an exception, so the codec is lossless for every array zarr hands it.

Stored chunk (little-endian): ``u32 n | zstd frame (n bytes) of the gaps section | zstd frame of the rest``::

    gaps section: the unique rows' gaps, [U, K] (uint16 IDs: the low-byte plane, then the high-byte plane)
    the rest:     per layer with repeats, ceil(R/8) bytes repeat bitmap (numpy packbits, big bit order)
                  | per ranked layer, the rank -> ID table, E IDs | per exception, u32 unique-row index, K IDs
                  | trailer: u8 mode per layer (bit 0 ranked, bit 1 has repeats), u32 U, u32 exceptions, u8 version

The codec compresses its own two sections: the gaps alone fill at most zstd's 128 KiB block class, and a byte more
in one frame switches zstd to larger tables and another parse (measured: 11 % larger and 3x slower for E = 64).

Decoding undoes each step with whole-array numpy passes: the gap prefix sums of :mod:`routelog.codec`, one table
lookup and the sorting network for ranked layers, and one gather that re-expands the repeats.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import numpy as np
import numpy.typing as npt
from numcodecs import Zstd

from routelog.codec import IdArray, gaps_from_sorted, sort_rows, sorted_from_gaps

RANKED_CODEC = "routelog.ranked_gaps"
"""The codec's name in ``zarr.json`` and its ``zarr.codecs`` entry point."""
VERSION = 1
MODE_GAPS = 0
MODE_RANKED = 1
"""Layer mode bit: experts relabelled by popularity rank (a table follows); clear: plain ID gaps."""
HAS_REPEATS = 2
"""Layer mode bit: some rows repeat the previous one (the layer's bitmap follows)."""
RANK_BELOW = 0.99
"""A layer is considered for relabelling only when the entropy of its expert load is below this fraction of
log2(E): above it the gaps cannot shrink."""
MIN_GAIN = 0.05
"""...and relabelled only when that makes its gaps this much smaller (compressed): decoding a ranked layer costs a
table lookup and a sort per row (several times the plain gaps' time), worth it only for a real gain."""


class RankedFormatError(ValueError):
    """Payload bytes that do not decode to the chunk's shape (wrapped as corrupt data by callers)."""


def encode(ids: npt.NDArray[Any], num_experts: int, *, level: int = 3, validate: bool = True) -> bytes:
    """The stored bytes of one chunk of IDs ``[layers, rows, K]`` (uint8 or uint16): two zstd frames.

    ``validate=False`` promises that every row is a valid top-k set (routelog's writers checked them, and pad edge
    chunks with repeats), skipping the search for exceptions.
    """
    gaps, tail = _transform(ids, num_experts, validate)
    modes = tail[-(ids.shape[0] + 9) : -9]
    # Without repeats or ranked layers the gaps are near-uniform: zstd's matches cost more than they find there,
    # and level 1 codes them smallest and fastest. Otherwise the better of both levels.
    first = _smaller_frame(gaps, level) if modes.any() else bytes(_zstd(1).encode(gaps))
    return b"".join([len(first).to_bytes(4, "little"), first, bytes(_zstd(level).encode(tail))])


def _transform(ids: npt.NDArray[Any], num_experts: int, validate: bool) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """The two sections of a chunk before compression: the unique rows' gaps, and everything else."""
    layers, rows, k = ids.shape
    dtype = ids.dtype.newbyteorder("<")
    if not validate and dtype.itemsize == 1 and _plain(ids, num_experts):
        # The common case of near-uniform routing: no repeats, no skew: format 1's gaps, one pass for the chunk.
        rest = _trailer(np.zeros(layers, np.uint8), layers * rows, 0)  # every mode 0, all rows unique
        return gaps_from_sorted(np.array(ids, dtype=dtype, order="C")).reshape(-1), rest
    modes = np.zeros(layers, np.uint8)
    bitmaps: list[npt.NDArray[np.uint8]] = []
    tables: list[npt.NDArray[Any]] = []
    exceptions: list[tuple[int, npt.NDArray[Any]]] = []
    streams: list[IdArray] = []
    unique_base = 0
    for j in range(layers):
        layer = np.ascontiguousarray(ids[j], dtype=dtype)
        words = _row_words(layer)
        repeat = np.zeros(rows, dtype=bool)
        if rows > 1:
            repeat[1:] = _rows_equal(layer[1:], layer[:-1]) if words is None else words[1:] == words[:-1]
        if repeat.any():
            modes[j] |= HAS_REPEATS
            bitmaps.append(np.packbits(repeat))
            unique = layer[~repeat] if words is None else words[~repeat].view(dtype).reshape(-1, k)
        else:
            unique = layer.copy() if validate else layer  # only validation writes into it
        if validate:
            bad = _invalid_rows(unique, num_experts)
            if bad.any():
                for i in np.flatnonzero(bad):
                    exceptions.append((unique_base + int(i), unique[i].copy()))
                unique[bad] = np.arange(k, dtype=dtype)  # a valid placeholder; the exception overwrites it
        unique_base += unique.shape[0]
        load = np.bincount(unique[:: max(1, unique.shape[0] // 1024)].ravel(), minlength=num_experts)
        gaps = gaps_from_sorted(unique.copy())
        if unique.shape[0] and _skewed(load):
            order = np.argsort(-np.bincount(unique.ravel(), minlength=num_experts), kind="stable")
            rank_of = np.empty(num_experts, dtype=dtype)
            rank_of[order] = np.arange(num_experts, dtype=dtype)
            ranked_gaps = gaps_from_sorted(sort_rows(rank_of[unique]))
            if _trial_size(ranked_gaps) < (1 - MIN_GAIN) * _trial_size(gaps):
                modes[j] |= MODE_RANKED
                tables.append(order.astype(dtype))
                gaps = ranked_gaps
        streams.append(gaps)
    gaps = np.concatenate(streams) if streams else np.zeros((0, k), dtype)
    if dtype.itemsize == 2:  # byte planes: zstd fits one entropy table per plane
        gaps = np.moveaxis(gaps.view(np.uint8).reshape(*gaps.shape, 2), 2, 0)
    listed = np.zeros((len(exceptions), 4 + k * dtype.itemsize), np.uint8)
    for n, (unique_row, row) in enumerate(exceptions):
        listed[n, :4] = np.frombuffer(np.uint32(unique_row).tobytes(), np.uint8)
        listed[n, 4:] = row.astype(dtype).view(np.uint8)
    tail = [*bitmaps, *(t.view(np.uint8) for t in tables), listed.ravel()]
    return gaps.reshape(-1).view(np.uint8), np.concatenate([*tail, _trailer(modes, unique_base, len(exceptions))])


def _trailer(modes: npt.NDArray[np.uint8], unique: int, exceptions: int) -> npt.NDArray[np.uint8]:
    """The rest section's last bytes: the layer modes, U, the exception count and the version."""
    counts = np.array([unique, exceptions], "<u4").view(np.uint8)
    return np.concatenate([modes, counts, np.array([VERSION], np.uint8)])


def max_stored_nbytes(shape: tuple[int, int, int], itemsize: int, num_experts: int) -> int:
    """The most bytes :func:`encode` can produce for a chunk: both frames at zstd's worst case."""
    return 4 + _zstd_bound(math.prod(shape) * itemsize) + _zstd_bound(_max_rest_nbytes(shape, itemsize, num_experts))


def _max_rest_nbytes(shape: tuple[int, int, int], itemsize: int, num_experts: int) -> int:
    """The largest rest section: every layer with a bitmap and a table, every row an exception, the trailer."""
    layers, rows, k = shape
    return layers * (math.ceil(rows / 8) + num_experts * itemsize) + layers * rows * (4 + k * itemsize) + layers + 9


def _zstd_bound(n: int) -> int:
    return n + (n >> 8) + 64


def decode(
    payload: bytes | memoryview | npt.NDArray[np.uint8],
    shape: tuple[int, int, int],
    dtype: np.dtype[Any],
    num_experts: int,
    out: npt.NDArray[Any] | None = None,
) -> npt.NDArray[Any]:
    """IDs ``shape`` = ``[layers, rows, K]`` from :func:`encode`'s payload, into ``out`` (C-contiguous) when given;
    raises :class:`RankedFormatError`."""
    layers, rows, k = shape
    dtype = np.dtype(dtype).newbyteorder("<")
    stored = np.frombuffer(payload, dtype=np.uint8)
    if stored.size < 4:
        raise RankedFormatError(f"a chunk of {stored.size} bytes")
    first = int(stored[:4].view("<u4")[0])
    if first > stored.size - 4:
        raise RankedFormatError(f"the gaps frame claims {first} bytes of the chunk's {stored.size - 4}")
    data = _decompress(stored[4 + first :], _max_rest_nbytes(shape, dtype.itemsize, num_experts), "tail")
    if data.size < layers + 9 or data[-1] != VERSION:
        raise RankedFormatError(f"unknown chunk payload version {int(data[-1]) if data.size else None}")
    modes = data[-(layers + 9) : -9]
    if (modes & ~np.uint8(MODE_RANKED | HAS_REPEATS)).any():
        raise RankedFormatError(f"unknown layer modes {sorted(set(modes.tolist()))}")
    total, n_exceptions = (int(n) for n in data[-9:-1].view("<u4"))
    if total > layers * rows:
        raise RankedFormatError(f"{total} unique rows in a chunk of {layers} x {rows}")
    reader = _Reader(data[: -(layers + 9)])
    with_repeats = np.flatnonzero(modes & HAS_REPEATS)
    per_layer = math.ceil(rows / 8)
    bitmaps = reader.take(with_repeats.size * per_layer).reshape(with_repeats.size, per_layer)
    repeat = None
    unique_counts = np.full(layers, rows)
    if with_repeats.size:
        repeat = np.zeros((layers, rows), dtype=bool)
        repeat[with_repeats] = np.unpackbits(bitmaps, axis=1, count=rows).astype(bool)
        if rows and repeat[:, 0].any():
            raise RankedFormatError("the first row of a layer is flagged as a repeat")
        unique_counts = rows - repeat.sum(axis=1)
    if int(unique_counts.sum()) != total:
        raise RankedFormatError(f"the repeat bitmaps leave {int(unique_counts.sum())} unique rows, not {total}")
    ranked_layers = np.flatnonzero(modes & MODE_RANKED)
    tables = reader.take(ranked_layers.size * num_experts * dtype.itemsize).view(dtype)
    entry = 4 + k * dtype.itemsize
    listed = reader.take(n_exceptions * entry).reshape(n_exceptions, entry)
    reader.finish()
    target = np.empty(shape, dtype=dtype) if out is None else out
    # Without repeats the unique rows are the chunk: decode straight into the output.
    unique = target.reshape(layers * rows, k) if repeat is None else np.empty((total, k), dtype)
    gap_frame = stored[4 : 4 + first]
    if dtype.itemsize == 2:  # interleave the low and high byte planes back into IDs
        gap_bytes = _decompress(gap_frame, total * k * 2, "gaps", exact=True)
        unique.view(np.uint8).reshape(total, k, 2)[...] = np.moveaxis(gap_bytes.reshape(2, total, k), 0, 2)
    else:
        _decompress(gap_frame, total * k, "gaps", exact=True, out=unique.reshape(-1))
    sorted_from_gaps(unique)
    starts = np.concatenate([[0], np.cumsum(unique_counts)])
    for n, layer in enumerate(ranked_layers):
        table = tables[n * num_experts : (n + 1) * num_experts]
        block = unique[starts[layer] : starts[layer + 1]]
        if block.size and block.max() >= num_experts:
            raise RankedFormatError(f"layer {layer}: a rank outside [0, {num_experts})")
        sort_rows(table[block], out=block)
    if n_exceptions:
        where = listed[:, :4].copy().view("<u4")[:, 0]
        if (where >= total).any():
            raise RankedFormatError("an exception names a row outside the chunk")
        unique[where] = listed[:, 4:].copy().view(dtype).reshape(n_exceptions, k)
    if repeat is None:
        return target
    words = _row_words(unique)
    for j in range(layers):
        index = np.cumsum(~repeat[j]) - 1 + int(starts[j])
        if words is None:
            target[j] = unique[index]
        else:
            target[j] = words[index].view(dtype).reshape(rows, k)
    return target


def _row_words(rows: npt.NDArray[Any]) -> npt.NDArray[Any] | None:
    """A contiguous ``[N, K]`` array as one machine word per row (fast compares and gathers), when one fits."""
    row_bytes = rows.shape[1] * rows.dtype.itemsize
    if row_bytes not in (1, 2, 4, 8) or not rows.flags.c_contiguous:
        return None
    return rows.view(f"<u{row_bytes}").reshape(-1)


def _rows_equal(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
    equal: npt.NDArray[np.bool_] = a[:, 0] == b[:, 0]
    for c in range(1, a.shape[1]):
        equal &= a[:, c] == b[:, c]
    return equal


def _invalid_rows(rows: npt.NDArray[Any], num_experts: int) -> npt.NDArray[np.bool_]:
    """Rows that are not K distinct ascending IDs below ``num_experts``."""
    bad = rows[:, -1] >= num_experts  # the last is the largest once the rows ascend
    for c in range(1, rows.shape[1]):
        bad |= rows[:, c] <= rows[:, c - 1]
    return bad


@cache
def _zstd(level: int) -> Zstd:
    return Zstd(level=level)


def _smaller_frame(data: npt.NDArray[np.uint8], level: int) -> bytes:
    """The smaller of ``level``'s frame and level 1's (a reader decodes either). On near-uniform gaps zstd's match
    finder costs more than it finds, erratically across levels and sizes (measured for E = 64: level 3 +1.5 %,
    level 5 +11 % over level 1); on repetitive routing the higher level's matches win."""
    chosen = bytes(_zstd(level).encode(data))
    if level != 1:
        fast = bytes(_zstd(1).encode(data))
        chosen = fast if len(fast) < len(chosen) else chosen
    return chosen


def _decompress(
    frame: npt.NDArray[np.uint8],
    limit: int,
    what: str,
    *,
    exact: bool = False,
    out: npt.NDArray[Any] | None = None,
) -> npt.NDArray[np.uint8]:
    """One zstd frame (into ``out`` when given), refused before decoding when it declares more than ``limit``
    bytes (or, ``exact``, any other size)."""
    size = frame_content_size(frame)
    if size is None or size > limit or (exact and size != limit):
        expected = f"exactly {limit}" if exact else f"at most {limit}"
        raise RankedFormatError(f"the {what} frame declares {size} bytes, more than a chunk holds ({expected})")
    out = np.empty(size, dtype=np.uint8) if out is None else out.view(np.uint8)
    if size == 0:
        return out
    try:
        written = _zstd(1).decode(frame, out=out)
    except (RuntimeError, ValueError) as exc:
        raise RankedFormatError(f"the {what} frame cannot be decoded ({exc})") from exc
    if np.asarray(written).nbytes != size:
        raise RankedFormatError(f"the {what} frame decodes to {np.asarray(written).nbytes} bytes, not {size}")
    return out


def frame_content_size(frame: npt.NDArray[np.uint8] | memoryview) -> int | None:
    """The decompressed size a zstd frame header declares (RFC 8878 3.1.1.1), or None when it declares none."""
    head = bytes(frame[:18])
    if len(head) < 6 or head[:4] != b"\x28\xb5\x2f\xfd":
        return None
    descriptor = head[4]
    size_flag, single_segment, dict_flag = descriptor >> 6, (descriptor >> 5) & 1, descriptor & 3
    at = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[dict_flag]
    width = (1 if single_segment else 0, 2, 4, 8)[size_flag]
    if width == 0 or len(head) < at + width:
        return None
    value = int.from_bytes(head[at : at + width], "little")
    return value + 256 if width == 2 else value


def _trial_size(gaps: npt.NDArray[Any]) -> int:
    """Compressed size of a layer's gaps at zstd's fastest level: the measure that decides its transform (an
    order-0 entropy estimate misleads on real routing, where long repeated runs leave few bytes to the entropy
    coder: measured on the corpus, ranking cut the gaps' order-0 entropy by half and their zstd size by 2 %)."""
    return len(_zstd(1).encode(np.ascontiguousarray(gaps)))


def _plain(ids: npt.NDArray[Any], num_experts: int) -> bool:
    """No layer of the chunk has a repeated row or a skewed load (checked on a sample of rows): every layer would
    keep plain gaps without repeats."""
    layers, rows, k = ids.shape
    words = _row_words(np.ascontiguousarray(ids).reshape(layers * rows, k))
    if words is None or rows < 2:
        return False
    by_layer = words.reshape(layers, rows)
    if (by_layer[:, 1:] == by_layer[:, :-1]).any():
        return False
    sample = ids[:, :: max(1, rows // 1024)].astype(np.int64) + (np.arange(layers) * num_experts)[:, None, None]
    loads = np.bincount(sample.ravel(), minlength=layers * num_experts).reshape(layers, num_experts)
    return not any(_skewed(load) for load in loads)


def _skewed(load: npt.NDArray[np.int64]) -> bool:
    p = load[load > 0] / load.sum()
    return float(-(p * np.log2(p)).sum()) < RANK_BELOW * math.log2(load.size)


class _Reader:
    """Consumes a payload front to back; every take is bounded by what is left."""

    def __init__(self, data: npt.NDArray[np.uint8]) -> None:
        self.data = data
        self.at = 0

    def take(self, n: int) -> npt.NDArray[np.uint8]:
        if n < 0 or self.at + n > self.data.size:
            raise RankedFormatError(f"chunk payload ends after {self.data.size} bytes; {self.at + n} needed")
        piece = self.data[self.at : self.at + n]
        self.at += n
        return piece

    def finish(self) -> None:
        if self.at != self.data.size:
            raise RankedFormatError(f"chunk payload has {self.data.size - self.at} trailing bytes")
