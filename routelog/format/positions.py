"""The key positions a DeepSeek Sparse Attention model's lightning indexer selects, coded compactly.

In each indexer layer, the query token at position p (0-based in its sequence) attends to the ``k`` key positions
(``index_topk``, 2048 in DeepSeek-V3.2) among ``0..p`` that the indexer scores highest. routelog stores them per
layer and sequence as **rows** ``int32 [n, k]``, row ``i`` being the query at position ``first_position + i``, in
**canonical form**: the selected positions ascending and distinct, all in ``[0, p]``, ``min(k, p + 1)`` of them,
then ``-1`` up to ``k`` columns. A row with ``p + 1 <= k`` is therefore ``0..p`` (the indexer has nothing to
choose); a **missing** row (a token the engine did not run, such as the last sampled one) is all ``-1``.
:func:`check_position_rows` says whether rows are canonical, naming the first that is not and why.

Adjacent rows of a layer share most of their positions (95 % and more in real models), so each row is coded as
the positions it drops from the row before and the ones it adds; a **keyframe** row every ``keyframe_every`` rows
(and after a missing row) is coded alone, so that any range of rows decodes from the keyframe before it
(:func:`decode_positions` with ``start`` and ``stop``).

Measured (``tools/bench_indexer.py``, rows drawn as the row before with d ~ Binomial(k, 0.05) positions swapped):
k = 2048 over 32k tokens codes in 1.033 x the generator's entropy bound, 2.1 % of the raw int32 rows (the
determined rows below position k cost nothing; the rest is 2.2 %), where zstd-19 of the raw rows takes 2.4 times
more and of their gaps 3.3 times; the compiled coder encodes and decodes some 450 M positions a second on one core
of the (busy) development machine, the Python twin 17 and 29 M.

Block layout (version 1)
------------------------

A block codes the rows of one layer of one sequence. Integers in the header are unsigned LEB128 varints (7 bits a
byte, least significant group first, the high bit set on every byte but the last; at most 5 bytes, none longer
than it needs)::

    u8      0xA1                     the codec and its version
    varint  n                        rows
    varint  k                        1 <= k <= 65536
    varint  first_position           first_position + n <= 2^31
    varint  keyframe_every           E >= 1: rows are coded in groups of E rows, G = ceil(n / E) groups
    varint  length[0..G-2]           each group's bytes but the last's (which takes the rest of the block)
    group[0..G-1]                    each group's bytes

Each **group** is a bit stream, least significant bit of each byte first, padded with zero bits to a whole byte
(its length is exactly the bytes its bits need). Its first bit is 1 when one of its rows is missing. Then each row
``i`` of the group, at position ``p = first_position + i``:

* when the group has a missing row: 1 bit, 1 for a missing row (nothing else follows for it);
* a row with ``p + 1 <= k`` (determined): nothing more;
* a **keyframe** row, one whose row before is not known: the first row of its group, or one after a missing row
  (a determined row counts as known): the set coded alone. With ``m = min(k, p + 1 - k)``, the ``m`` values
  coded are the row's positions when ``k <= p + 1 - k``, else the positions of ``[0, p]`` it lacks; as one
  **Rice block** of their gaps (below) with universe ``p + 1`` and parameter ``rice(p + 1 - m, m)``;
* any other row, a **delta** row, against the row before (both hold k positions): ``d``, the number of positions
  it removes (it adds as many), as the adaptive **d code** below; then the ranks (indices, 0-based) in the row
  before of the positions removed, as a Rice block with universe ``k`` and parameter ``rice(k - d, d)``; then the
  added positions as their ranks among the ``p + 1 - k`` positions of ``[0, p]`` the row before lacks (rank
  ``a`` is position ``a + #{x in row before: x < position}``), as a Rice block with universe ``p + 1 - k`` and
  parameter ``rice(p + 1 - k - d, d)``.

A **Rice block** of m ascending values ``t_0 < ... < t_{m-1}`` below a universe U with parameter r codes their gaps
``v_j = t_j - t_{j-1} - 1`` (``t_{-1} = -1``): first the low r bits of every ``v_j`` (least significant first),
then every quotient ``v_j >> r`` in unary (that many 0 bits, then a 1). A decoder refuses a block whose values
reach U. ``rice(s, m)`` is 0 for m = 0, else the number of ``t >= 0`` (at most 31) with
``77 * (2 * s + m) >= 320 * m * 2^t`` (Kiely's parameter for a geometric source of mean s / m,
``1 + floor(log2(0.48125 * (mean + 1/2)))``).

The **d code** adapts within a group. Its state is unknown at the group's start and after each keyframe row; while
unknown, d is written as an Exp-Golomb code of order 0 (for ``x = d + 1`` of ``L`` bits: ``L - 1`` zero bits, a 1,
then the low ``L - 1`` bits of ``x``, least significant first), and the state becomes ``mean16 = 16 d``,
``error = isqrt(d) + 1``, ``count = 1``. Once known: the prediction is ``P = (mean16 + 8) >> 4``, the error
``e = d - P`` is zigzagged (``z = 2e`` for ``e >= 0``, else ``-2e - 1``) and Rice coded with parameter ``r``, the
least ``r >= 0`` (at most 31) with ``count << r >= error``: ``z >> r`` zero bits, a 1, the low r bits of z. A
quotient of 24 or more is written instead as 24 zero bits and the Exp-Golomb code of d. Then ``mean16 += e``,
``error += |e|``, ``count += 1``, and when count reaches 32 both error and count are halved (rounding down). d must
be at most ``min(k, p + 1 - k)``.

Decoding reads from the group of row ``start`` on; everything decoded is checked before it is used (the ranges
above, every code inside its group, and each group it reads to its end ends where its bits do, with zero padding):
a block that breaks a rule raises :class:`~routelog.errors.CorruptDataError` naming the row. Before anything is
allocated the header is checked against the block's size: the group table against the bytes after it, and the rows
against the body (every row but those below position k costs at least one bit), so that no block makes the
decoder allocate more than ``(8 * len(block) + k) * k`` positions. A reader that knows how many tokens a record
holds and the model's ``index_topk`` should compare them with :func:`positions_header` first.

The compiled coder is ``routelog/format/_cpositions.c``, built by pip with the machine's compiler where one is
found; :mod:`routelog.format.positions_python` writes the same bytes with numpy where not
(``ROUTELOG_KERNELS=numpy`` selects it; :data:`IMPLEMENTATION` says which a process runs).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from routelog.errors import InvalidRecordError
from routelog.format import positions_python
from routelog.format.kernels import compiled_module
from routelog.format.positions_python import MAX_K, MAX_POSITION, PROBLEMS, corrupt, parse_header, read_fields

__all__ = [
    "IMPLEMENTATION",
    "MAX_K",
    "check_position_rows",
    "decode_positions",
    "encode_positions",
    "positions_header",
]

_COMPILED = compiled_module("routelog.format._cpositions")
IMPLEMENTATION: Literal["compiled", "numpy"] = "numpy" if _COMPILED is None else "compiled"
"""Which coder this process runs: ``"compiled"`` (built at install) or ``"numpy"``
(:mod:`routelog.format.positions_python`)."""

FIELD = "indexer"
"""The record field the rows are checked as (in :class:`~routelog.errors.InvalidRecordError`)."""
_FIX = (
    "hand each layer's rows as the indexer selected them in canonical form: per query at position p, its min(k, p+1)"
    " selected key positions ascending and distinct in [0, p], then -1 up to k; a token the engine did not run as"
    " a row of -1"
)
_CHECK_VALUES = 1 << 20
"""Values the numpy check looks at in one pass (bounds its temporaries)."""


def _invalid(problem: str, fix: str = _FIX) -> InvalidRecordError:
    return InvalidRecordError(sample_id=None, field=FIELD, problem=problem, fix=fix)


def _checked_shape(rows: Any, first_position: int) -> npt.NDArray[Any]:
    if not isinstance(rows, np.ndarray) or rows.ndim != 2 or not np.issubdtype(rows.dtype, np.integer):
        what = f"an array of shape {rows.shape} and dtype {rows.dtype}" if isinstance(rows, np.ndarray) else type(rows)
        raise _invalid(f"indexer rows must be a 2-D integer array [n, k], not {what}", "pass int32 rows [n, k]")
    n, k = rows.shape
    if not 1 <= k <= MAX_K:
        raise _invalid(f"rows of {k} positions: k must be in [1, {MAX_K}]", f"pass rows [n, index_topk <= {MAX_K}]")
    if isinstance(first_position, bool) or not isinstance(first_position, int | np.integer) or first_position < 0:
        raise _invalid(f"the first position is {first_position!r}", "pass the first row's position, an int >= 0")
    if int(first_position) + n > MAX_POSITION + 1:
        raise _invalid(
            f"rows from position {first_position} to {int(first_position) + n - 1} pass the largest int32 position",
            "split the sequence",
        )
    return rows


def _row_problem(row: npt.NDArray[Any], p: int) -> str | None:
    """What is wrong with one row at position ``p`` (None when canonical or missing)."""
    values = [int(v) for v in row]
    k = len(values)
    if all(v == -1 for v in values):
        return None
    count = min(k, p + 1)
    for j, v in enumerate(values):
        if v == -1:
            after = next((u for u in values[j + 1 :] if u != -1), None)
            if after is not None:
                return f"-1 at column {j} in the middle of its positions (position {after} follows it)"
            if j != count:
                return f"it holds {j} positions, not min(k, p + 1) = {count}"
            return None
        if j >= count:
            return f"it holds more than min(k, p + 1) = {count} positions (column {j} is {v}, not -1)"
        if v < 0:
            return f"column {j} is {v}: positions are >= 0 and only -1 pads"
        if v > p:
            return f"position {v} at column {j} is past the query's own position {p}"
        if j and v == values[j - 1]:
            return f"position {v} is selected twice (columns {j - 1} and {j})"
        if j and v < values[j - 1]:
            return f"its positions are not ascending ({values[j - 1]} at column {j - 1}, then {v})"
    return None


def _raise_row(rows: npt.NDArray[Any], first_position: int, i: int) -> None:
    p = int(first_position) + i
    problem = _row_problem(rows[i], p)
    if problem is not None:
        raise _invalid(f"row {i} (the query at position {p}): {problem}")


def _first_invalid_numpy(rows: npt.NDArray[Any], first_position: int) -> int:
    n, k = rows.shape
    columns = np.arange(k)
    step = max(1, _CHECK_VALUES // k)
    for lo in range(0, n, step):
        block = rows[lo : lo + step].astype(np.int64)
        p = int(first_position) + lo + np.arange(len(block), dtype=np.int64)
        count = np.minimum(k, p + 1)
        inside = columns[None, :] < count[:, None]
        fine = np.where(inside, (block >= 0) & (block <= p[:, None]), block == -1).all(axis=1)
        fine &= (~inside[:, 1:] | (block[:, 1:] > block[:, :-1])).all(axis=1)
        fine |= (block == -1).all(axis=1)
        if not fine.all():
            return lo + int(np.flatnonzero(~fine)[0])
    return -1


def check_position_rows(rows: npt.NDArray[Any], first_position: int) -> None:
    """Raise :class:`~routelog.errors.InvalidRecordError` (``field="indexer"``, ``sample_id=None``: a caller
    that knows the sample re-raises it with ``problem`` and ``fix``) unless ``rows`` (``[n, k]``, any integer
    dtype) are canonical indexer rows for the queries at positions ``first_position..first_position+n-1``: each
    row either all -1 (missing) or its ``min(k, p + 1)`` positions ascending, distinct, in ``[0, p]`` and then -1.
    The message names the first row that is not, its position, and what is wrong (not ascending, a duplicate, a
    position past p or negative, too few or too many positions, -1 in the middle)."""
    rows = _checked_shape(rows, first_position)
    n, k = rows.shape
    if n == 0:
        return
    bad = -1
    if _COMPILED is not None and rows.dtype == np.int32:
        bad = int(_COMPILED.first_invalid_row(np.ascontiguousarray(rows), n, k, int(first_position)))
    else:
        bad = _first_invalid_numpy(rows, first_position)
    if bad >= 0:
        _raise_row(rows, first_position, bad)
        raise AssertionError(f"row {bad} was found invalid, yet no problem was named")  # the two checks differ


def encode_positions(rows: npt.NDArray[Any], first_position: int, *, keyframe_every: int = 256) -> bytes:
    """The block of one layer's indexer ``rows`` of one sequence: ``[n, k]`` int32 (any integer dtype whose
    values fit), row ``i`` the query at position ``first_position + i``, in canonical form (missing rows of -1
    anywhere). A keyframe every ``keyframe_every`` rows bounds what a ranged decode reads (smaller: faster random
    access, larger blocks; 256 costs about 2 % at k = 2048).

    Raises :class:`~routelog.errors.InvalidRecordError` (as :func:`check_position_rows`) when the rows are not
    canonical, and ValueError for a ``keyframe_every`` below 1.
    """
    rows = _checked_shape(rows, first_position)
    if (
        isinstance(keyframe_every, bool)
        or not isinstance(keyframe_every, int)
        or not 1 <= keyframe_every <= MAX_POSITION
    ):
        raise ValueError(f"keyframe_every must be an int in [1, {MAX_POSITION}], not {keyframe_every!r}")
    n, k = rows.shape
    first = int(first_position)
    if rows.dtype != np.int32:
        check_position_rows(rows, first)  # every value is then in [-1, 2^31): exact in int32
        rows = rows.astype(np.int32)
    if _COMPILED is None:
        check_position_rows(rows, first)
        return positions_python.encode(rows, first, keyframe_every)
    found = _COMPILED.encode(np.ascontiguousarray(rows), n, k, first, keyframe_every)
    if isinstance(found, int):
        _raise_row(rows, first, found)
        raise AssertionError(f"row {found} was found invalid, yet no problem was named")
    data: bytes = found
    return data


def positions_header(data: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """``(n_rows, k, first_position)`` of a block, from its first few bytes (checked against the format's limits,
    not against the rest of the block); :class:`~routelog.errors.CorruptDataError` when they break them."""
    n, k, first, _, _ = read_fields(_byte_view(data)[:32])
    return n, k, first


def _byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("the positions codec reads a contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def decode_positions(
    data: bytes | bytearray | memoryview, *, start: int = 0, stop: int | None = None
) -> npt.NDArray[np.int32]:
    """Rows ``start..stop-1`` (row indices of the block, ``stop`` defaulting to its row count) of block ``data``
    as int32 ``[stop - start, k]`` canonical rows, decoded from the keyframe group holding ``start`` on.

    Raises :class:`~routelog.errors.CorruptDataError` naming what is wrong (and the row) when the block breaks
    the format's rules, before allocating anything its size does not justify; ValueError when ``start`` and
    ``stop`` are not ``0 <= start <= stop <= n``.
    """
    blob = _byte_view(data)
    header = parse_header(blob)
    n, k = header.n, header.k
    stop = n if stop is None else stop
    if not 0 <= start <= stop <= n:
        raise ValueError(f"rows {start}..{stop} are not inside the block's 0..{n}")
    out = np.empty((stop - start, k), np.int32)
    if _COMPILED is None:
        status, row = positions_python.decode(np.frombuffer(blob, np.uint8), header, start, stop, out)
    else:
        status, row = _COMPILED.decode(
            blob, header.offsets, n, k, header.first_position, header.keyframe_every, start, stop, out
        )
    if status:
        raise corrupt(f"row {row} (position {header.first_position + row}): {PROBLEMS[status]}")
    return out
