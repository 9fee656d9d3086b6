"""The format-2 chunk codec: routing that learns each chunk's expert popularity and repeats (``ranked_gaps``).

Real routing is skewed (some experts take many times their share), consecutive tokens often keep their set, and
the same token tends to take the same set wherever it recurs. Format 1 stores each sorted set as ID gaps, whose
distribution ignores all three. Per inner chunk and MoE layer this codec (an array -> bytes codec that compresses
its own output; crc32c follows it in the shard):

1. flags rows equal to the row before them (same layer) and keeps only the others ("unique rows");
2. where sets recur out of order, keeps a **dictionary**: each distinct row once (most used first) and an entry
   index per unique row, when a cost model (in :mod:`routelog.format.kernels`, fitted to trial compressions) says
   the indices cost less than zstd's matches of the repeated rows would. Decoding then maps and sorts each distinct
   row once and gathers the rest (on the Qwen3-MoE-style corpus, where 84 % of the unique rows repeat an earlier
   one: 19 % smaller chunks, decoding 1.35 x faster);
3. when the layer's expert load is skewed, relabels experts by their popularity rank in the chunk (the most used
   expert becomes 0) and sorts each row's ranks, so the gaps between consecutive members shrink and zstd's
   entropy coder sees a peaked alphabet; the rank -> ID table travels in the chunk (self-contained: any chunk
   decodes alone, and a ranged read needs nothing else). A layer keeps plain ID gaps (the format-1 transform,
   the fastest to decode) unless ranking shrinks an estimate of its compressed gaps by ``MIN_GAIN`` (5 %; the
   estimate, in :mod:`routelog.format.kernels`, stands in for trial compressions that cost more than the codec);
4. stores any row that is not a valid top-k set (the fill value of zarr's edge padding, or data written by
   other tools) verbatim as an exception, so the codec encodes every array zarr hands it. Decoding refuses a row
   that is no set (FORMAT.md: every stored row names K distinct IDs in [0, E)), whatever made it (a forged table,
   gaps past E, a dictionary's entry, an exception), except zarr's fill value in an exception row of a whole chunk
   (padding); ``accept="any"`` returns every row as encoded.

Stored chunk (little-endian): ``u32 n | zstd frame (n bytes) of the gaps section | zstd frame of the rest``::

    gaps section: S rows of gaps [S, K]: each layer's unique rows, or its dictionary's entries (uint16 IDs: the
                  low-byte plane, then the high-byte plane)
    the rest:     per layer with repeats, ceil(R/8) bytes repeat bitmap (numpy packbits, big bit order)
                  | per ranked layer, the rank -> ID table, E IDs
                  | per layer with a dictionary, u32 D entries, then an entry index per unique row (low bytes,
                    and high bytes when D > 256)
                  | per exception, u32 unique-row index, K IDs
                  | trailer: u8 mode per layer (bit 0 ranked, bit 1 has repeats, bit 2 dictionary), u32 S,
                    u32 exceptions, u8 payload version (2 with a dictionary, else 1)

The codec compresses its own two sections: the gaps alone fill at most zstd's 128 KiB block class, and a byte more
in one frame switches zstd to larger tables and another parse (measured: 11 % larger and 3x slower for E = 64).
Each frame is compressed once: the gaps at the configured level where rows repeat earlier ones (zstd then finds
matches; :data:`MATCHING`) and at level 1 elsewhere, the rest at level 1.

The per-row work of both directions runs in the kernels of :mod:`routelog.format.kernels` (compiled when routelog
is installed; numpy where no compiler was found): for each layer a pass finds the repeats, checks each row and takes
its gaps, numbers the distinct rows and weighs a dictionary, and, for skewed layers, counts the load, estimates both
transforms and relabels; the sections are assembled there too. Decoding is a pass per layer that takes the prefix
sums, maps and sorts ranked rows (a dictionary's entries once, then gathers its rows), applies exceptions and
expands repeats straight into the output; it checks every count and index the sections give before using them, and
every row it writes: a layer whose rows the decoding proves to be sets (plain gaps whose prefix sums stay below E,
or valid ranks and a table that permutes E) costs a few operations per row, any other (one ID at a time, a failed
proof, exceptions) a pass over its rows. A reader may ask for a window of the chunk (its overlap with a request):
layers outside it are skipped and only the unique rows its rows expand from are decoded. Python here compresses and
decompresses the two frames, refusing a frame that declares more than a chunk can hold before decoding it.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from routelog.format import kernels, zstd_frames
from routelog.format.limits import check_count

RANKED_CODEC = "routelog.ranked_gaps"
"""The codec's name in ``zarr.json`` and its ``zarr.codecs`` entry point."""
VERSION = 2
"""The payload version the encoder writes when some layer keeps a dictionary; chunks without one keep version 1
(the same bytes as before dictionaries), and readers take both."""
MODE_GAPS = 0
MODE_RANKED = 1
"""Layer mode bit: experts relabelled by popularity rank (a table follows); clear: plain ID gaps."""
HAS_REPEATS = 2
"""Layer mode bit: some rows repeat the previous one (the layer's bitmap follows)."""
MATCHING = 0.7
"""The gaps frame takes the configured zstd level when more than this share of the chunk's unique rows repeat an
earlier row of their layer, else level 1 (measured at level 3: chunks of the Qwen3-MoE-style corpus, at 0.73 to
0.92, are 2 to 6 % smaller than at level 1, the DeepSeek-V3-style one's, at 0.5 to 0.73, within 1.5 %; without
such rows level 1 is up to 7 % smaller, and 2 to 5 times as fast)."""

GAPS_MIN_MATCH = 7
"""The shortest match zstd looks for in the gaps frame of rows of at least this many IDs (a plane of the frame
holds K bytes a row): a repeated row is K bytes long, and shorter matches are mostly gap values that coincide,
dearer as matches than as literals. Measured against zstd's own (6 at level 1, 5 at level 3) on 4096-row chunks of
48 layers, top-8 (``tools/bench_codec.py``'s datasets, the 2-core AMD EPYC): skewed routing's gaps frames 0.6 %
smaller and compressed 1.6 x as fast, token-dependent 1.0 % smaller, the DeepSeek-V3-style corpus 1.2 % smaller
and 5 % faster, the Qwen3-MoE-style one 1.1 % larger and 5-15 % faster; uniform routing unchanged."""


class RankedFormatError(ValueError):
    """Payload bytes that do not decode to the chunk's shape (wrapped as corrupt data by callers)."""


Dictionaries = Literal["auto", "never", "always"]
"""Which layers keep a dictionary of their distinct rows: where the estimate says it pays, none (payload version 1,
for readers that predate dictionaries), or every layer where a row repeats an earlier one (tests)."""


def encode(ids: npt.NDArray[Any], num_experts: int, *, level: int = 3, dictionaries: Dictionaries = "auto") -> bytes:
    """The stored bytes of one chunk of IDs ``[layers, rows, K]`` (uint8 or uint16): two zstd frames.

    Every row is checked (in the pass that takes its gaps, at no measurable cost) and a row that is no valid top-k
    set is kept as an exception.
    """
    return b"".join(encode_pieces(ids, num_experts, level=level, dictionaries=dictionaries))


def encode_pieces(
    ids: npt.NDArray[Any], num_experts: int, *, level: int = 3, dictionaries: Dictionaries = "auto"
) -> list[bytes]:
    """:func:`encode`'s bytes in the pieces they join from (the gaps frame's size, both frames), for a caller that
    joins them into a larger object once."""
    gaps, rest, matching = _sections(ids, num_experts, dictionaries)
    # On near-uniform gaps zstd's match finder costs more than it finds, erratically across levels (measured for
    # E = 64: level 3 +1.5 %, level 5 +11 % over level 1); where rows repeat earlier ones, the configured level's
    # larger tables find the matches level 1 forgets (corpus: 4 % smaller at level 3). The rest, mostly repeat
    # bitmaps, is smaller and faster at level 1 (corpus: 1.7 % smaller than at level 3).
    min_match = GAPS_MIN_MATCH if ids.shape[2] >= GAPS_MIN_MATCH else None
    first = zstd_frames.compress(gaps, level if matching else 1, min_match=min_match)
    return [len(first).to_bytes(4, "little"), first, zstd_frames.compress(rest, 1)]


def _sections(
    ids: npt.NDArray[Any], num_experts: int, dictionaries: Dictionaries = "auto"
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], bool]:
    """The two sections of a chunk before compression (the gaps, and everything else), and whether enough of the
    gaps' rows repeat earlier ones for zstd's matches to pay (:data:`MATCHING`)."""
    dtype = _native(ids.dtype)
    if ids.ndim != 3 or ids.shape[2] < 1:
        raise ValueError(f"{RANKED_CODEC} encodes [layers, rows, K >= 1] arrays, not shape {ids.shape}")
    row_bytes = ids.shape[2] * dtype.itemsize
    in_place = ids.strides[1:] == (row_bytes, dtype.itemsize) and (
        ids.shape[0] < 2 or ids.strides[0] >= ids.shape[1] * row_bytes
    )
    if ids.dtype != dtype or not in_place:
        ids = np.ascontiguousarray(ids, dtype=dtype)  # else read in place: each layer's rows contiguous, in order
    policy = {"auto": kernels.AUTO, "never": kernels.NEVER, "always": kernels.ALWAYS}[dictionaries]
    gaps, rest, placed, matched = kernels.encode_chunk(ids, num_experts, policy)
    return gaps, rest, matched > MATCHING * placed


def _native(dtype: npt.DTypeLike) -> np.dtype[Any]:
    """The machine's uint8 or uint16 for chunks of ``dtype`` (the compiled kernels take native integers)."""
    found = _NATIVE.get(dtype)
    if found is not None:
        return found
    dtype = np.dtype(dtype)
    if dtype.kind != "u" or dtype.itemsize > 2:
        raise TypeError(f"{RANKED_CODEC} stores uint8 or uint16 IDs, not {dtype}")
    return np.dtype(np.uint8 if dtype.itemsize == 1 else np.uint16)


_NATIVE: dict[Any, np.dtype[Any]] = {
    key: np.dtype(native) for native in (np.uint8, np.uint16) for key in (native, np.dtype(native))
}


def max_stored_nbytes(shape: tuple[int, int, int], itemsize: int, num_experts: int) -> int:
    """The most bytes :func:`encode` can produce for a chunk: both frames at zstd's worst case."""
    bound = zstd_frames.compress_bound
    return 4 + bound(math.prod(shape) * itemsize) + bound(_max_rest_nbytes(shape, itemsize, num_experts))


def _max_rest_nbytes(shape: tuple[int, int, int], itemsize: int, num_experts: int) -> int:
    """The largest rest section: every layer with a bitmap, a table and a dictionary of two-byte indices, every row
    an exception, the trailer."""
    layers, rows, k = shape
    dictionaries = layers * (4 + 2 * rows)
    exceptions = layers * rows * (4 + k * itemsize)
    return layers * (math.ceil(rows / 8) + num_experts * itemsize) + dictionaries + exceptions + layers + 9


Window = tuple[tuple[int, int], tuple[int, int]]
"""``((first_layer, stop_layer), (first_row, stop_row))``: the part of a chunk to decode."""
Accept = Literal["sets", "sets_or_fill", "any"]
"""Which decoded rows :func:`decode` returns rather than refusing the chunk: valid top-k sets only (K distinct IDs
in [0, E), ascending: FORMAT.md sections 4-5), also rows of the fill value alone that an exception stores (zarr's
edge padding: its content is unspecified, and the zarr codec lists those rows as exceptions), or any row (the
encoder's exceptions keep rows that are no set; a round trip of such arrays)."""


def window_bounds(window: Window | None, layers: int, rows: int) -> tuple[int, int, int, int]:
    """``(first_layer, stop_layer, first_row, stop_row)`` of ``window`` (None: the whole chunk), checked to lie
    inside a chunk of ``layers x rows``."""
    if window is None:
        return 0, layers, 0, rows
    (l0, l1), (r0, r1) = window
    if not (0 <= l0 <= l1 <= layers and 0 <= r0 <= r1 <= rows):
        raise ValueError(f"window {window} is not inside a chunk of {layers} x {rows}")
    return l0, l1, r0, r1


def decode(
    payload: bytes | memoryview | npt.NDArray[np.uint8],
    shape: tuple[int, int, int],
    dtype: np.dtype[Any],
    num_experts: int,
    out: npt.NDArray[Any] | None = None,
    window: Window | None = None,
    *,
    accept: Accept | None = None,
    fill_value: int = 0,
) -> npt.NDArray[Any]:
    """IDs of the chunk ``shape`` = ``[layers, rows, K]`` from :func:`encode`'s payload: all of them, or those of
    ``window`` (layers and rows inside the chunk; the kernel skips the layers outside it and decodes only the
    unique rows its rows expand from), into ``out`` when given (the window's shape, each layer's rows contiguous:
    a reader's block takes its overlap with the chunk in place); raises :class:`RankedFormatError`, also when a
    decoded row is not what ``accept`` allows (:data:`Accept`; checked in the kernel's pass: measured on the 2-core
    AMD EPYC, 4 us of a 4 x 4096 chunk of uniform routing's plain gaps, up to 3 % of its decode, and within noise on
    ranked layers, dictionaries and the corpus' chunks). By default a window must hold valid sets only (a reader's
    window never covers edge padding), and a whole chunk may also hold exception rows of ``fill_value`` alone
    (zarr's fill value in its padding)."""
    # Called once per stored chunk, between two zstd calls and the kernel: plain Python on bytes and ints (numpy
    # scalars and small views cost a microsecond each, a tenth of the per-chunk work around the kernel).
    layers, rows, k = shape
    dtype = _native(dtype)
    l0, l1, r0, r1 = window_bounds(window, layers, rows)
    wanted = (l1 - l0, r1 - r0, k)
    target = np.empty(wanted, dtype=dtype) if out is None else out
    if target.shape != wanted or target.dtype != dtype or (target.size and not target[0].flags.c_contiguous):
        raise ValueError(f"out must be a {dtype} array of shape {wanted} whose layers' rows are contiguous")
    stored = payload.data if isinstance(payload, np.ndarray) else payload  # a uint8 array's bytes, no copy
    if len(stored) < 4:
        raise RankedFormatError(f"a chunk of {len(stored)} bytes")
    first = int.from_bytes(stored[:4], "little")
    if first > len(stored) - 4:
        raise RankedFormatError(f"the gaps frame claims {first} bytes of the chunk's {len(stored) - 4}")
    rest = _decompress(stored[4 + first :], _max_rest_nbytes(shape, dtype.itemsize, num_experts), "tail")
    version = int(rest[-1]) if rest.size else 0  # 0 for an empty section: no payload version
    if rest.size < layers + 9 or not 1 <= version <= VERSION:
        raise RankedFormatError(f"unknown chunk payload version {version}")
    total = int.from_bytes(rest[-9:-5], "little")
    if total > layers * rows:  # compared here first: this runs once a chunk
        check_count(
            total,
            name="the trailer's unique rows",
            at_most=layers * rows,
            where="the chunk",
            expected=f"the unique rows in a chunk of {layers} x {rows}",
            error=RankedFormatError,
        )
    gaps = _decompress(stored[4 : 4 + first], total * k * dtype.itemsize, "gaps", exact=True)
    rule = kernels.ACCEPT[accept or ("sets_or_fill" if window is None else "sets")]
    status, detail = kernels.decode_chunk(gaps, rest, num_experts, layers, rows, target, l0, r0, rule, fill_value)
    if status == kernels.INVALID_ROW:
        layer, row = divmod(detail, r1 - r0)
        raise RankedFormatError(
            f"layer {l0 + layer} row {r0 + row} of the chunk decodes to {target[layer, row].tolist()}: "
            f"{kernels.PROBLEMS[status].format(E=num_experts)}"
        )
    if status != kernels.OK:
        raise RankedFormatError(
            kernels.PROBLEMS[status].format(detail=detail, size=rest.size, total=total, E=num_experts)
        )
    return target


def _decompress(frame: bytes | memoryview, limit: int, what: str, *, exact: bool = False) -> npt.NDArray[np.uint8]:
    try:  # FORMAT.md section 5: both frames declare their size
        return zstd_frames.decompress(frame, limit, what, exact=exact, sized=True)
    except zstd_frames.FrameError as exc:
        raise RankedFormatError(str(exc)) from exc
