"""The indexer positions codec in Python and numpy: the twin of ``routelog/format/_cpositions.c``.

It writes the same bytes as the compiled coder and decodes every block alike, statuses included (the layout is
specified in :mod:`routelog.format.positions`, which runs this module where the compiled one is not built or
``ROUTELOG_KERNELS=numpy`` asks for it). It also holds what both share: the constants, the Rice parameter rule, the
adaptive code of each row's number of changes and the header's parser.

Rows are coded one after the other in Python, each field with numpy: about a hundred times slower than the
compiled coder on rows of 2048 positions, the same result.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from routelog.errors import CorruptDataError

MAGIC: Final = 0xA1
"""The block's first byte: the codec and its version (1)."""
MAX_K: Final = 1 << 16
"""The most positions a row may select (``index_topk``)."""
MAX_POSITION: Final = (1 << 31) - 1
"""Positions are int32: the last row's position, ``first_position + n - 1``, is at most this."""
ESCAPE_ZEROS: Final = 24
"""A change count whose quotient would take this many zero bits is written as 24 zeros and an Exp-Golomb code."""
MAX_GAMMA_ZEROS: Final = 32
"""An Exp-Golomb code with this many leading zeros is refused (no count needs more than 17)."""

OK: Final = 0
TRUNCATED: Final = 1
CHANGES_RANGE: Final = 2
REMOVED_RANGE: Final = 3
ADDED_RANGE: Final = 4
KEYFRAME_RANGE: Final = 5
GROUP_LENGTH: Final = 6
BAD_ARGUMENTS: Final = 7
PROBLEMS: Final = {
    TRUNCATED: "its codes run past the end of its keyframe group",
    CHANGES_RANGE: "its number of changed positions is more than the row or the candidates hold",
    REMOVED_RANGE: "a removed position's rank is past the end of the row before",
    ADDED_RANGE: "an added position is past the query's own position",
    KEYFRAME_RANGE: "a keyframe position is past the query's own position",
    GROUP_LENGTH: "its keyframe group's byte length or zero padding does not match the rows it holds",
    BAD_ARGUMENTS: "the decoder was called with offsets or sizes that do not fit the data",
}
"""What the decoders' statuses mean (each names the row where the problem was found)."""


def rice_parameter(total: int, count: int) -> int:
    """The Rice parameter of a block of ``count`` gaps summing to at most ``total``: Kiely's rule for a geometric
    source of mean ``total / count``, ``r = 1 + floor(log2(0.48125 * (mean + 1/2)))`` and at least 0, in integers
    (the number of t in 0..30 with ``77 * (2 * total + count) >= 320 * count * 2**t``)."""
    if count == 0:
        return 0
    r, left = 0, 77 * (2 * total + count)
    while r < 31 and left >= 320 * count * (1 << r):
        r += 1
    return r


class Changes:
    """The adaptive code of a delta row's number of changes d: a running mean of d (times 16) predicts it, and the
    mean absolute error of the prediction gives the Rice parameter of its zigzagged error (as JPEG-LS does)."""

    __slots__ = ("count", "error_sum", "known", "mean16")

    def __init__(self) -> None:
        self.known = False
        self.mean16 = self.error_sum = self.count = 0

    def start(self, d: int) -> None:
        self.known = True
        self.mean16, self.error_sum, self.count = d << 4, _isqrt(d) + 1, 1

    def predicted(self) -> int:
        return (self.mean16 + 8) >> 4

    def parameter(self) -> int:
        r = 0
        while r < 31 and (self.count << r) < self.error_sum:
            r += 1
        return r

    def update(self, d: int, predicted: int) -> None:
        error = d - predicted
        self.mean16 += error
        self.error_sum += abs(error)
        self.count += 1
        if self.count == 32:
            self.error_sum >>= 1
            self.count >>= 1


def _isqrt(value: int) -> int:
    x = 0
    while (x + 1) * (x + 1) <= value:
        x += 1
    return x


# -- the header ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Header:
    """A block's header: rows ``n`` of ``k`` positions from ``first_position``, keyframe groups of
    ``keyframe_every`` rows, and the byte offsets of the groups in the block (``offsets[g]`` to ``offsets[g + 1]``,
    int64, one more than the groups)."""

    n: int
    k: int
    first_position: int
    keyframe_every: int
    offsets: npt.NDArray[np.int64]


def corrupt(problem: str) -> CorruptDataError:
    return CorruptDataError(f"indexer positions block: {problem}")


def _varint(data: bytes | memoryview, pos: int, what: str) -> tuple[int, int]:
    value = shift = 0
    for i in range(5):
        if pos + i >= len(data):
            raise corrupt(f"the header ends inside {what}")
        byte = data[pos + i]
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            if byte == 0 and i > 0:
                raise corrupt(f"{what} is written with more bytes than it needs")
            return value, pos + i + 1
    raise corrupt(f"{what} takes more than 5 bytes")


def read_fields(data: bytes | memoryview) -> tuple[int, int, int, int, int]:
    """The header's fields (n, k, first_position, keyframe_every) and where the group table starts, each checked
    against the format's limits."""
    if len(data) < 1 or data[0] != MAGIC:
        found = f"0x{data[0]:02x}" if data else "nothing"
        raise corrupt(f"it starts with {found}, not the codec's byte 0x{MAGIC:02x}")
    pos = 1
    n, pos = _varint(data, pos, "the row count")
    k, pos = _varint(data, pos, "k")
    first, pos = _varint(data, pos, "the first position")
    every, pos = _varint(data, pos, "the keyframe interval")
    if not 1 <= k <= MAX_K:
        raise corrupt(f"k is {k}, outside [1, {MAX_K}]")
    if first + n > MAX_POSITION + 1:
        raise corrupt(f"rows from position {first} to {first + n - 1} pass the largest int32 position")
    if not 1 <= every <= MAX_POSITION:
        raise corrupt(f"the keyframe interval is {every}")
    return n, k, first, every, pos


def parse_header(data: bytes | memoryview) -> Header:
    """The header of block ``data``, every count checked against the block's size before anything is allocated for
    it: the group table's entries against the bytes left, the groups' lengths against the body, and the rows
    against the body's bits (every row costs at least one bit but those below position k, which cost none when
    none is missing)."""
    n, k, first, every, pos = read_fields(data)
    groups = -(-n // every)
    stored = max(groups - 1, 0)
    if stored > len(data) - pos:
        raise corrupt(f"its {groups} keyframe groups need a table longer than the {len(data) - pos} bytes left")
    lengths = np.zeros(groups, np.int64)
    if stored:
        window = np.frombuffer(data, np.uint8, min(5 * stored, len(data) - pos), pos)
        ends = np.flatnonzero(window < 0x80)[:stored]
        if len(ends) < stored:
            raise corrupt("the group table is cut short or holds an entry longer than 5 bytes")
        starts = np.concatenate(([0], ends[:-1] + 1))
        sizes = ends - starts + 1
        if (sizes > 5).any():
            raise corrupt("the group table holds an entry longer than 5 bytes")
        if ((window[ends] == 0) & (sizes > 1)).any():
            raise corrupt("the group table holds an entry written with more bytes than it needs")
        used = int(ends[-1]) + 1
        shifts = 7 * (np.arange(used) - np.repeat(starts, sizes))
        lengths[:-1] = np.add.reduceat((window[:used] & 0x7F).astype(np.int64) << shifts, starts)
        pos += used
    body = len(data) - pos
    if stored and int(lengths[:-1].sum()) > body:
        raise corrupt(f"its keyframe groups take {int(lengths[:-1].sum())} bytes, more than the {body} left")
    if groups:
        lengths[-1] = body - int(lengths[:-1].sum())
        if (lengths < 1).any():
            raise corrupt(f"keyframe group {int(np.flatnonzero(lengths < 1)[0])} is empty")
    elif body:
        raise corrupt(f"it holds no rows but {body} bytes after its header")
    determined = min(n, max(0, k - first))
    if n - determined > 8 * body:
        raise corrupt(f"its {body} bytes cannot hold {n} rows")
    offsets = np.empty(groups + 1, np.int64)
    offsets[0] = pos
    np.cumsum(lengths, out=offsets[1:])
    offsets[1:] += pos
    return Header(n, k, first, every, offsets)


# -- encode ----------------------------------------------------------------------------------------------------


def _unary_bits(quotients: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
    bits = np.zeros(int(quotients.sum()) + len(quotients), np.uint8)
    bits[np.cumsum(quotients + 1) - 1] = 1
    return bits


def _low_bits(values: npt.NDArray[np.int64], r: int) -> npt.NDArray[np.uint8]:
    return ((values[:, None] >> np.arange(r)) & 1).astype(np.uint8).ravel()


def _block_bits(values: npt.NDArray[np.int64], r: int) -> list[npt.NDArray[np.uint8]]:
    """A Rice block: the values' low r bits each (least significant first), then their quotients in unary."""
    return [_low_bits(values, r), _unary_bits(values >> r)] if r else [_unary_bits(values)]


def _gaps(values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    return np.diff(values, prepend=-1) - 1


def _fixed_bits(value: int, width: int) -> list[int]:
    return [(value >> i) & 1 for i in range(width)]


def _gamma_bits(value: int) -> list[int]:
    x = value + 1
    length = x.bit_length() - 1
    return [0] * length + [1] + _fixed_bits(x, length)


def _changes_bits(changes: Changes, d: int) -> list[int]:
    if not changes.known:
        changes.start(d)
        return _gamma_bits(d)
    predicted = changes.predicted()
    error = d - predicted
    zigzag = 2 * error if error >= 0 else -2 * error - 1
    r = changes.parameter()
    quotient = zigzag >> r
    bits = (
        [0] * quotient + [1] + _fixed_bits(zigzag, r)
        if quotient < ESCAPE_ZEROS
        else [0] * ESCAPE_ZEROS + _gamma_bits(d)
    )
    changes.update(d, predicted)
    return bits


def varint_bytes(value: int) -> bytes:
    """``value`` as an unsigned LEB128 varint."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _encode_group(rows: npt.NDArray[np.int64], missing: npt.NDArray[np.bool_], first: int) -> bytes:
    """One keyframe group's bytes: rows of int64 positions (the group's, canonical), ``first`` the first's."""
    n, k = rows.shape
    has_missing = bool(missing.any())
    parts: list[Any] = [np.array([has_missing], np.uint8)]
    changes = Changes()
    previous_known = False
    for i in range(n):
        p = first + i
        if has_missing:
            parts.append(np.array([missing[i]], np.uint8))
        if missing[i]:
            previous_known = False
            continue
        if p + 1 <= k:
            previous_known = True
            continue
        row = rows[i]
        if not previous_known:
            m = min(k, p + 1 - k)
            if m == k:
                values = row
            else:
                free = np.ones(p + 1, bool)
                free[row] = False
                values = np.flatnonzero(free)
            parts += _block_bits(_gaps(values), rice_parameter(p + 1 - m, m))
            changes.known = False
            previous_known = True
            continue
        prev = rows[i - 1]
        kept = _members(prev, row)
        removed = np.flatnonzero(~kept)
        added_positions = row[~_members(row, prev)]
        added = added_positions - np.searchsorted(prev, added_positions)
        d = len(removed)
        parts.append(np.array(_changes_bits(changes, d), np.uint8))
        parts += _block_bits(_gaps(removed), rice_parameter(k - d, d))
        parts += _block_bits(_gaps(added), rice_parameter(p + 1 - k - d, d))
    bits = np.concatenate(parts)
    return np.packbits(bits, bitorder="little").tobytes()


def _members(values: npt.NDArray[np.int64], of: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """Which of the ascending ``values`` are in the ascending ``of``."""
    at = np.minimum(np.searchsorted(of, values), len(of) - 1)
    found: npt.NDArray[np.bool_] = of[at] == values
    return found


def encode(rows: npt.NDArray[Any], first_position: int, keyframe_every: int) -> bytes:
    """The block of ``rows`` (``[n, k]``, canonical: the caller checked them and the arguments)."""
    n, k = rows.shape
    rows = rows.astype(np.int64)
    missing = rows[:, 0] == -1 if n else np.zeros(0, bool)
    groups = [
        _encode_group(rows[lo : lo + keyframe_every], missing[lo : lo + keyframe_every], first_position + lo)
        for lo in range(0, n, keyframe_every)
    ]
    head = bytes([MAGIC]) + b"".join(varint_bytes(v) for v in (n, k, first_position, keyframe_every))
    table = b"".join(varint_bytes(len(group)) for group in groups[:-1])
    return head + table + b"".join(groups)


# -- decode ----------------------------------------------------------------------------------------------------


class _StopError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class _Reader:
    """A keyframe group's bits, least significant first in each byte."""

    def __init__(self, data: npt.NDArray[np.uint8]) -> None:
        self.bits = np.unpackbits(data, bitorder="little")
        self.ones = np.flatnonzero(self.bits)
        self.bit_list: list[int] = []  # filled lazily: Python ints for the bit-by-bit reads
        self.pos, self.end = 0, len(self.bits)

    def bit(self) -> int:
        if self.pos >= self.end:
            raise _StopError(TRUNCATED)
        value = int(self.bits[self.pos])
        self.pos += 1
        return value

    def fixed(self, width: int) -> int:
        if self.pos + width > self.end:
            raise _StopError(TRUNCATED)
        chunk = self.bits[self.pos : self.pos + width]
        self.pos += width
        return sum(int(b) << i for i, b in enumerate(chunk))

    def zeros(self, limit: int) -> int:
        """Zero bits up to ``limit``, then a one (not read when ``limit`` zeros came first)."""
        at = int(np.searchsorted(self.ones, self.pos))
        next_one = int(self.ones[at]) if at < len(self.ones) else self.end
        zeros = next_one - self.pos
        if zeros >= limit and self.pos + limit <= self.end:
            self.pos += limit
            return limit
        if next_one >= self.end:
            raise _StopError(TRUNCATED)
        self.pos = next_one + 1
        return zeros

    def gamma(self) -> int:
        zeros = self.zeros(MAX_GAMMA_ZEROS)
        if zeros == MAX_GAMMA_ZEROS:
            raise _StopError(CHANGES_RANGE)
        return ((1 << zeros) | self.fixed(zeros)) - 1

    def changes(self, changes: Changes, limit: int) -> int:
        if not changes.known:
            d = self.gamma()
            if d > limit:
                raise _StopError(CHANGES_RANGE)
            changes.start(d)
            return d
        predicted = changes.predicted()
        r = changes.parameter()
        quotient = self.zeros(ESCAPE_ZEROS)
        if quotient < ESCAPE_ZEROS:
            zigzag = (quotient << r) | self.fixed(r)
            d = predicted - ((zigzag + 1) >> 1) if zigzag & 1 else predicted + (zigzag >> 1)
        else:
            d = self.gamma()
            if d > limit:
                raise _StopError(CHANGES_RANGE)
        if not 0 <= d <= limit:
            raise _StopError(CHANGES_RANGE)
        changes.update(d, predicted)
        return d

    def block(self, m: int, r: int, universe: int, problem: int) -> npt.NDArray[np.int64]:
        """A Rice block of m gaps, as the ascending values below ``universe`` they make."""
        if m == 0:
            return np.zeros(0, np.int64)
        if self.pos + m * r > self.end:
            raise _StopError(TRUNCATED)
        low = (
            (self.bits[self.pos : self.pos + m * r].reshape(m, r).astype(np.int64) << np.arange(r)).sum(axis=1)
            if r
            else np.zeros(m, np.int64)
        )
        start = self.pos + m * r
        at = int(np.searchsorted(self.ones, start))
        if at + m > len(self.ones) or self.ones[at + m - 1] >= self.end:
            raise _StopError(TRUNCATED)
        ends = self.ones[at : at + m]
        quotients = np.diff(ends, prepend=start - 1) - 1
        self.pos = int(ends[-1]) + 1
        if (quotients > (universe >> r)).any():
            raise _StopError(problem)
        values = (quotients << r) | low
        if int(values.sum()) + m > universe:
            raise _StopError(problem)
        return np.cumsum(values + 1) - 1


def decode(
    data: npt.NDArray[np.uint8], header: Header, start: int, stop: int, out: npt.NDArray[np.int32]
) -> tuple[int, int]:
    """Rows ``start..stop-1`` of the block ``data`` (whose ``header`` :func:`parse_header` read) into ``out``
    ``[stop - start, k]``; (status, row): :data:`OK` and -1, or what is wrong and the row where it was found."""
    n, k, first, every, offsets = header.n, header.k, header.first_position, header.keyframe_every, header.offsets
    if start == stop:
        return OK, -1
    at = start
    for g in range(start // every, (stop - 1) // every + 1):
        lo, hi = g * every, min(n, (g + 1) * every)
        last = min(hi, stop)
        reader = _Reader(data[int(offsets[g]) : int(offsets[g + 1])])
        try:
            at = lo
            has_missing = reader.bit()
            changes = Changes()
            prev: npt.NDArray[np.int64] | None = None
            for i in range(lo, last):
                at = i
                p = first + i
                row: npt.NDArray[np.int64] | None
                if has_missing and reader.bit():
                    row = None
                    if i >= start:
                        out[i - start] = -1
                elif p + 1 <= k:
                    row = np.arange(p + 1)
                    if i >= start:
                        out[i - start, : p + 1] = row
                        out[i - start, p + 1 :] = -1
                elif prev is None:
                    m = min(k, p + 1 - k)
                    values = reader.block(m, rice_parameter(p + 1 - m, m), p + 1, KEYFRAME_RANGE)
                    if m == k:
                        row = values
                    else:
                        free = np.ones(p + 1, bool)
                        free[values] = False
                        row = np.flatnonzero(free)
                    changes.known = False
                else:
                    candidates = p + 1 - k
                    d = reader.changes(changes, min(k, candidates))
                    removed = reader.block(d, rice_parameter(k - d, d), k, REMOVED_RANGE)
                    added = reader.block(d, rice_parameter(candidates - d, d), candidates, ADDED_RANGE)
                    kept = np.delete(prev, removed)
                    positions = added + np.searchsorted(prev - np.arange(k), added, side="right")
                    row = np.insert(kept, np.searchsorted(kept, positions), positions)
                if row is not None and p + 1 > k and i >= start:
                    out[i - start] = row
                prev = row
            if last == hi:
                at = hi - 1
                size = int(offsets[g + 1] - offsets[g])
                if (reader.pos + 7) // 8 != size or reader.bits[reader.pos :].any():
                    return GROUP_LENGTH, at
        except _StopError as stopped:
            return stopped.status, at
    return OK, -1
