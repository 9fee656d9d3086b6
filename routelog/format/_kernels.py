"""Compiled per-chunk passes of the format-2 codec (:mod:`routelog.format.ranked`).

Why compiled: the codec's work is per row (compare a row with the one before it, check it, take its gaps, find
whether it occurred earlier in its layer, relabel and sort its IDs), and numpy can only do that as a dozen
whole-array passes with a temporary per step: several times slower than zstd itself. Here each step is one loop
over a layer's rows that stays in cache.

Rows of eight uint8 IDs (top-8 of at most 256 experts, the common case) are handled as one 64-bit word: equality
is one compare, the gaps are one subtraction (``x - (x << 8) - 0x0101..00``: no lane borrows when the row
ascends, and a borrow shows in the gaps' byte sum, which then differs from the last ID), the inverse prefix sum is
one multiplication by ``0x0101..01`` (lane j of the product is the sum of lanes 0..j), and relabelled rows are
mapped through a byte table, then sorted by a sorting network run over all of a layer's rows at once (the loop
vectorizes; so does the writer's sort of a whole array). Other rows take the same steps one ID at a time (several
times slower per row); both paths write the same bytes (``tests/test_ranked.py`` checks it).

Every kernel is ``nopython`` (no Python objects inside), ``nogil`` (readers and writers may run chunks on several
threads) and ``cache=True``. The first call in a fresh environment compiles (measured on the 2-core development
machine, AMD EPYC: 42 to 56 s for rows of eight uint8 IDs, the writer's sort, encoding and decoding together, 15 to
21 s more for other uint8 rows, 21 to 28 s more for uint16 IDs; an earlier 2-core machine took 19 to 23 s for uint8
IDs; once per machine, numba version and source of this file, cached beside it in ``__pycache__``); a
later process pays about 0.5 s on its first chunk, mostly numba's import and start-up, then loads the cached code.
:mod:`routelog.format.ranked` imports this module on its first chunk, and :func:`routelog.format.codec.sort_and_check`
on the first rows of eight IDs it sorts, so ``import routelog`` never pays for numba. A kernel compiles only the side
of an ``x is None`` test that its argument's type allows (the fast path for words, or the one-ID-at-a-time path),
and hot loops index arrays directly: a slice or row view per row costs reference counting that measured several
times the row's own work.

Kernels report a damaged payload with a status code instead of raising, and check every index read from a payload
before using it: a forged chunk makes :func:`decode_chunk` return an error, never read or write out of bounds. Nor
does it return a row that is no top-k set (:data:`INVALID_ROW`; :data:`SETS`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_F = TypeVar("_F", bound=Callable[..., Any])


def _compiled(*, inline: bool = False) -> Callable[[_F], _F]:
    """numba's ``njit`` with the options of every kernel here (``inline``: numba inlines a small helper into its
    callers, so no per-row call passes arrays). Typed for mypy, which cannot see through numba's decorator."""
    options: dict[str, Any] = {"cache": True, "nogil": True}
    if inline:
        options["inline"] = "always"
    return cast(Callable[[_F], _F], njit(**options))


def _instruction(typer: Callable[..., Any]) -> Callable[..., Any]:
    """numba's ``intrinsic``: ``typer`` gives a call's signature and the code that emits its LLVM instruction."""
    return cast(Callable[..., Any], intrinsic(typer))


RANK_BELOW = 0.99
"""A layer is considered for relabelling only when the entropy of its expert load (on a sample of at most
:data:`LOAD_SAMPLE` rows, which also gives the popularity order) is below this fraction of log2(E): above it the
gaps cannot shrink."""
LOAD_SAMPLE = 512
MIN_GAIN = 0.05
"""...and relabelled only when that makes its estimated compressed gaps this much smaller: decoding a ranked
layer costs a table lookup and a sort per row, worth it only for a real gain."""
RUN_BYTES = 3.0
"""What the estimate charges for each run of rows zstd copies from earlier in the layer (a match: its offset and
lengths), in bytes. The estimate of a transform's compressed gaps is the order-0 entropy of the gaps of the rows
seen for the first time in their layer (zstd's literals, on a sample of them) plus this per run. It replaces trial
compressions, which cost more than the rest of the codec; the order-0 entropy of all rows misleads where most rows
repeat earlier ones (measured on the corpus: ranking halves that entropy but shrinks the compressed gaps by 2 to
5 %). With 3 bytes the estimate ranks the corpus' layers about as trial compressions did (90 of 416 layers where
they ranked 89; the corpus' sizes within 0.5 %)."""
MAX_MASK_EXPERTS = 1024
"""IDs below this sort as a bit set (set K bits, scan the words: no comparisons); larger IDs sort by insertion."""

DICTIONARY = 4
"""Layer mode bit (payload version 2): the gaps section holds the layer's distinct rows, most used first, and an
index names each unique row's (see :func:`_dictionary_pays`)."""
MAX_ENTRIES = 1 << 16
"""A dictionary's most entries: an index is at most two bytes."""
MATCH_BYTES = 1.4
INDEX_WEIGHT = 0.7
LONG_RUN_BYTES = 4.4
"""The dictionary's cost model (:func:`_dictionary_pays`), fitted by least squares to trial compressions
(``tools/fit_dictionary_model.py``): every chunk layer of the corpus in record order (286, both models) with and
without a dictionary. Choosing by it, the corpus is within 0.05 % of the better of the two per layer (97 % of the
choices agree), and the rows the corpus' store holds (not in the fit) within 0.01 % (99 %). zstd matches a
repeated row for about 1.4 bytes, and it also matches repeated runs of indices, which the weight below 1 stands
for."""
TRANSPOSE_ROWS = 2048
"""Rows (of every layer) :func:`sort_rows_of_eight` sorts per block before moving them to layer order: 16 KiB of
uint8 rows, which stay in the first-level cache (measured: blocks of 32 to 256 tokens of 6 or 48 layers within
5 %, 1024 tokens 10 % slower)."""
AUTO, NEVER, ALWAYS = 0, 1, 2
"""Whether :func:`encode_chunk` gives layers dictionaries: where they pay, never, or wherever a row repeats."""

OK = 0
UNKNOWN_MODE = 1
SECTION_SIZES = 2
FIRST_ROW_REPEATS = 3
UNIQUE_COUNT = 4
EXCEPTION_RANGE = 5
RANK_RANGE = 6
DICTIONARY_SIZE = 7
DICTIONARY_INDEX = 8
INVALID_ROW = 9
PROBLEMS = {
    UNKNOWN_MODE: "unknown layer mode {detail}",
    SECTION_SIZES: "the tail's sections take {detail} bytes, not {size}",
    FIRST_ROW_REPEATS: "a repeat bitmap flags the first row of its layer",
    UNIQUE_COUNT: "the repeat bitmaps and dictionaries leave {detail} rows of gaps, not {total}",
    EXCEPTION_RANGE: "exception {detail} names a row outside the chunk",
    RANK_RANGE: "layer {detail}: a rank outside [0, {E})",
    DICTIONARY_SIZE: "layer {detail}: a dictionary with more entries than unique rows, or none for some",
    DICTIONARY_INDEX: "layer {detail}: an index past the end of its dictionary",
    INVALID_ROW: "a row that is no set of distinct ascending IDs in [0, {E})",
}
"""What :func:`decode_chunk`'s status codes mean (``detail``: its second result; ``size``: the rest section's bytes;
``total``: the trailer's rows of gaps; ``E``: the universe), for :class:`routelog.format.ranked.RankedFormatError`
(which names the row of an :data:`INVALID_ROW` itself: ``detail`` is its index in the window, layer-major)."""
ANY_ROWS, SETS, SETS_OR_FILL = 0, 1, 2
"""Which decoded rows :func:`decode_chunk` accepts (FORMAT.md sections 4 and 5: every stored row names K distinct
IDs in [0, E), ascending in a ``ranked_gaps`` chunk; edge padding is unspecified): any (the codec's own lossless
round trip of rows that are no set), only valid sets (a reader's window, which never covers padding), or also rows
an exception fills with the fill value alone (a whole chunk that zarr-python padded with its fill value)."""
ACCEPT = {"any": ANY_ROWS, "sets": SETS, "sets_or_fill": SETS_OR_FILL}
"""Those rules by the names :data:`routelog.format.ranked.Accept` gives them."""

_ONES = np.uint64(0x0101010101010101)
_FIRST_ONES = np.uint64(0x0101010101010100)  # +1 in every lane but lane 0
_EVEN_LANES = np.uint64(0x00FF00FF00FF00FF)
_SUM_16 = np.uint64(0x0001000100010001)
_HASH = np.uint64(0x9E3779B97F4A7C15)
_GATHER_BITS = np.uint64(0x8040201008040201)  # times eight 0/1 lanes: lane c lands at bit 63 - c, no carries


@_instruction
def _popcount(typingctx: Any, word: Any) -> Any:
    """Set bits of a uint64 (one instruction)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.ctpop(args[0])

    return types.uint64(types.uint64), codegen


@_instruction
def _lowest_bit(typingctx: Any, word: Any) -> Any:
    """Index of the lowest set bit of a uint64, 64 for 0 (one instruction)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

    return types.uint64(types.uint64), codegen


# -- rows as words (eight uint8 IDs) ----------------------------------------------------------------------------
@_compiled(inline=True)
def _word_gaps(word: Any) -> Any:
    """The gaps of a row of eight ascending uint8 IDs packed little-endian in a uint64."""
    return word - ((word << np.uint64(8)) + _FIRST_ONES)


@_compiled(inline=True)
def _word_valid(word: Any, gaps: Any, num_experts: int) -> Any:
    """Whether ``word`` holds eight strictly ascending IDs below ``num_experts``, given its :func:`_word_gaps`.

    Without lane borrows the gaps' bytes sum to the last ID minus 7; a borrow (a lane that does not ascend) adds 255
    or 256 to that sum."""
    pairs = (gaps & _EVEN_LANES) + ((gaps >> np.uint64(8)) & _EVEN_LANES)
    total = ((pairs * _SUM_16) >> np.uint64(48)) + np.uint64(7)
    last = word >> np.uint64(56)
    return (total == last) & (last < num_experts)


@_compiled(inline=True)
def _gaps_past(rows: Any, num_experts: int) -> bool:
    """Whether some row of eight uint8 IDs whose gaps are a word of ``rows`` is no set below ``num_experts``: its last
    ID, ``g_0 + sum (g_i + 1)`` = the gaps' byte sum + 7, is at least ``min(E, 256)`` (below 256 no lane of
    :func:`_word_ids` carries, so the IDs ascend). A branch-free loop apart from the one decoding the rows, shifts
    and adds only (measured on the 2-core AMD EPYC, 16 k rows: 4 us, against 6 us folded into the decoding loop and
    8 us with a multiplication for the byte sum; the decoding loop alone takes 4.5 us)."""
    over = np.uint64(0)
    bias = np.uint64(2048 + 7 - min(num_experts, 256))  # bit 11 of a byte sum (at most 8 * 255) plus this: past
    for r in range(rows.size):
        pairs = (rows[r] & _EVEN_LANES) + ((rows[r] >> np.uint64(8)) & _EVEN_LANES)
        quads = pairs + (pairs >> np.uint64(16))
        over |= (((quads + (quads >> np.uint64(32))) & np.uint64(0xFFFF)) + bias) & np.uint64(2048)
    return bool(over)


@_compiled(inline=True)
def _word_ids(gaps: Any) -> Any:
    """Inverse of :func:`_word_gaps`: lane j of the product is lane 0 plus (lane i + 1) for i = 1..j."""
    return (gaps + _FIRST_ONES) * _ONES


@_compiled(inline=True)
def _lane_lookup(lookup: Any, mapped: Any, bit_of: Any) -> None:
    """The tables :func:`_sorted_lanes` maps byte values ``v`` through: ``mapped[v] = lookup[v]`` (256, past any
    ID, where ``v`` is past ``lookup``), and ``bit_of[v]``, that bit of a 64-bit set (0 where it is past 63)."""
    for v in range(256):
        target = int(lookup[v]) if v < lookup.size else 256
        mapped[v] = target
        bit_of[v] = np.uint64(1) << np.uint64(target & 63) if target < 64 else np.uint64(0)


@_compiled(inline=True)
def _network_of_eight(a0: Any, a1: Any, a2: Any, a3: Any, a4: Any, a5: Any, a6: Any, a7: Any) -> tuple[Any, ...]:
    """Eight values sorted ascending by Batcher's network (19 compare-exchanges,
    :func:`routelog.format.codec.sorting_network`), in registers: no branch on the data, so a loop of them
    vectorizes."""
    a0, a1 = min(a0, a1), max(a0, a1)
    a2, a3 = min(a2, a3), max(a2, a3)
    a4, a5 = min(a4, a5), max(a4, a5)
    a6, a7 = min(a6, a7), max(a6, a7)
    a0, a2 = min(a0, a2), max(a0, a2)
    a1, a3 = min(a1, a3), max(a1, a3)
    a4, a6 = min(a4, a6), max(a4, a6)
    a5, a7 = min(a5, a7), max(a5, a7)
    a1, a2 = min(a1, a2), max(a1, a2)
    a5, a6 = min(a5, a6), max(a5, a6)
    a0, a4 = min(a0, a4), max(a0, a4)
    a1, a5 = min(a1, a5), max(a1, a5)
    a2, a6 = min(a2, a6), max(a2, a6)
    a3, a7 = min(a3, a7), max(a3, a7)
    a2, a4 = min(a2, a4), max(a2, a4)
    a3, a5 = min(a3, a5), max(a3, a5)
    a1, a2 = min(a1, a2), max(a1, a2)
    a3, a4 = min(a3, a4), max(a3, a4)
    a5, a6 = min(a5, a6), max(a5, a6)
    return a0, a1, a2, a3, a4, a5, a6, a7


@_compiled(inline=True)
def _sorted_lanes(word: Any, mapped: Any, bit_of: Any, small: bool) -> tuple[bool, Any]:
    """The eight byte lanes of ``word`` mapped through :func:`_lane_lookup`'s tables and sorted ascending, packed,
    and whether they are eight distinct IDs (below 256; below 64 when ``small``).

    ``small``: eight bit sets and eight bit scans, no comparisons. Otherwise Batcher's sorting network for eight
    (19 compare-exchanges, :func:`routelog.format.codec.sorting_network`) on values held in registers."""
    if small:
        bits = np.uint64(0)
        for c in range(8):
            bits |= bit_of[(word >> np.uint64(8 * c)) & np.uint64(255)]
        distinct = _popcount(bits) == 8
        packed = np.uint64(0)
        for c in range(8):  # a fixed eight scans: no branch on where the set ends
            packed |= _lowest_bit(bits) << np.uint64(8 * c)
            bits &= bits - np.uint64(1)
        return distinct, packed
    a0, a1, a2, a3, a4, a5, a6, a7 = _network_of_eight(
        mapped[word & np.uint64(255)],
        mapped[(word >> np.uint64(8)) & np.uint64(255)],
        mapped[(word >> np.uint64(16)) & np.uint64(255)],
        mapped[(word >> np.uint64(24)) & np.uint64(255)],
        mapped[(word >> np.uint64(32)) & np.uint64(255)],
        mapped[(word >> np.uint64(40)) & np.uint64(255)],
        mapped[(word >> np.uint64(48)) & np.uint64(255)],
        mapped[(word >> np.uint64(56)) & np.uint64(255)],
    )
    distinct = (a0 < a1) & (a1 < a2) & (a2 < a3) & (a3 < a4) & (a4 < a5) & (a5 < a6) & (a6 < a7) & (a7 < 256)
    packed = np.uint64(0)
    for c, value in enumerate((a0, a1, a2, a3, a4, a5, a6, a7)):
        packed |= np.uint64(value & 255) << np.uint64(8 * c)
    return distinct, packed


@_compiled(inline=True)
def _pack(values: Any) -> Any:
    """Eight values below 256 as one little-endian word."""
    word = np.uint64(0)
    for c in range(8):
        word |= np.uint64(values[c]) << np.uint64(8 * c)
    return word


@_compiled(inline=True)
def _count_word(word: Any, histogram: Any, offset: int) -> None:
    for c in range(8):
        histogram[offset + int((word >> np.uint64(8 * c)) & np.uint64(255))] += 1


# -- rows one ID at a time --------------------------------------------------------------------------------------
@_compiled(inline=True)
def _mask_bits(num_experts: int) -> int:
    """The width of the bit set :func:`_sort_row` sorts IDs below ``num_experts`` in (0: by insertion)."""
    return 64 * ((num_experts + 63) // 64) if num_experts <= MAX_MASK_EXPERTS else 0


@_compiled(inline=True)
def _sort_row(values: Any, num_bits: int, masks: Any) -> bool:
    """Sort ``values`` (int64) ascending in place; False when two are equal (``values`` is sorted anyway).

    With every value below ``num_bits`` (:func:`_mask_bits`) through the bit sets ``masks`` (zeroed, left zeroed):
    K bit sets and a scan of the words, no data-dependent comparisons; otherwise by insertion."""
    k = values.size
    fits = num_bits > 0
    for c in range(k):
        fits &= values[c] < num_bits
    if fits:
        distinct = True
        for c in range(k):
            v = values[c]
            bit = np.uint64(1) << np.uint64(v & 63)
            distinct &= (masks[v >> 6] & bit) == 0
            masks[v >> 6] |= bit
        if distinct:
            c = 0
            for w in range(num_bits >> 6):
                bits = masks[w]
                masks[w] = 0
                while bits:
                    values[c] = (w << 6) + int(_lowest_bit(bits))
                    c += 1
                    bits &= bits - np.uint64(1)
            return True
        for c in range(k):  # clean the bit sets, then sort the repeated values by insertion
            masks[values[c] >> 6] = 0
    distinct = True
    for c in range(1, k):
        v = values[c]
        i = c
        while i > 0 and values[i - 1] > v:
            values[i] = values[i - 1]
            i -= 1
        values[i] = v
        distinct &= i == 0 or values[i - 1] != v
    return distinct


@_compiled(inline=True)
def _rows_equal(a: Any, i: int, b: Any, j: int) -> bool:
    """Row ``i`` of the 2-D ``a`` equals row ``j`` of ``b``."""
    for c in range(a.shape[1]):  # noqa: SIM110 (a plain loop with an early exit compiles best)
        if a[i, c] != b[j, c]:
            return False
    return True


@_compiled(inline=True)
def _row_hash(rows: Any, i: int, bits: int) -> int:
    """Top ``bits`` of a multiplicative hash of row ``i``, its IDs packed little-endian in 64-bit words (for eight
    uint8 IDs exactly the hash of the row's word, so both paths fill :func:`encode_chunk`'s table alike)."""
    width = 8 * rows.itemsize
    h = np.uint64(0)
    word = np.uint64(0)
    filled = 0
    for c in range(rows.shape[1]):
        word |= np.uint64(rows[i, c]) << np.uint64(filled)
        filled += width
        if filled == 64:
            h = (h ^ word) * _HASH
            word = np.uint64(0)
            filled = 0
    if filled:
        h = (h ^ word) * _HASH
    return int(h >> np.uint64(64 - bits))


@_compiled(inline=True)
def _count_row(rows: Any, i: int, histogram: Any, offset: int) -> None:
    """Histogram of the bytes row ``i`` is stored as: low bytes at ``offset + [0, 256)``, high bytes 256 on."""
    for c in range(rows.shape[1]):
        v = int(rows[i, c])
        histogram[offset + (v & 255)] += 1
        histogram[offset + 256 + ((v >> 8) & 255)] += 1


@_compiled(inline=True)
def _entropy_bits(counts: Any, start: int, stop: int) -> float:
    """Shannon entropy (bits per draw) of the histogram ``counts[start:stop]``, times its total."""
    total = 0
    for b in range(start, stop):
        total += counts[b]
    bits = 0.0
    for b in range(start, stop):
        if counts[b]:
            bits -= counts[b] * math.log2(counts[b] / total)
    return bits


# -- sorting ----------------------------------------------------------------------------------------------------
@_compiled()
def sort_rows_of_eight(ids: Any, out: Any, tokens: int, layers: int, largest: Any) -> int:
    """Each row of eight uint8 or uint16 IDs sorted ascending by :func:`_network_of_eight`: ``ids`` flat in token
    order ``[tokens, layers, 8]`` (as engines hand them out), ``out`` flat in layer order ``[layers, tokens, 8]``
    (as parts store them). Returns the index of the first row, in ``ids``' order (``token * layers + layer``),
    holding an ID above ``largest`` (of the IDs' dtype) or a repeated ID; -1 when every row is a valid set.

    A block of tokens (every layer: contiguous in ``ids``, and small enough for the first-level cache) is sorted
    into a scratch buffer by the vectorized network, then each layer's rows of the block move to their place in
    ``out`` as whole machine words. Measured on the 2-core AMD EPYC for 634 k rows: 1.6-1.7 ms, against 2.6-3.2 ms
    for numpy's transpose followed by the same sort."""
    if layers == 1:
        bad = _sort_flat_rows(ids, out, tokens, largest)
    else:
        block = max(16, TRANSPOSE_ROWS // layers)
        scratch = np.empty(block * layers * 8, ids.dtype)
        scratch_words = scratch.view(np.uint64)
        out_words = out.view(np.uint64)
        bad = np.uint8(0)
        for t0 in range(0, tokens, block):
            n = min(block, tokens - t0)
            bad |= _sort_flat_rows(ids[t0 * layers * 8 : (t0 + n) * layers * 8], scratch, n * layers, largest)
            for j in range(layers):  # a row is one word of eight uint8 IDs, or two of uint16 IDs
                at = j * tokens + t0
                if ids.itemsize == 1:  # a constant per compiled type: the compiler keeps one side
                    row_words = out_words[at : at + n]  # a view per layer: plain indices below (measured 25 % faster)
                    for t in range(n):
                        row_words[t] = scratch_words[t * layers + j]
                else:
                    row_words = out_words[2 * at : 2 * (at + n)]
                    for t in range(n):
                        row_words[2 * t] = scratch_words[2 * (t * layers + j)]
                        row_words[2 * t + 1] = scratch_words[2 * (t * layers + j) + 1]
    if not bad:
        return -1
    for t in range(tokens):  # the rare case: find the first bad row among the sorted ones
        for j in range(layers):
            r = 8 * (j * tokens + t)
            if out[r + 7] > largest:
                return t * layers + j
            for c in range(r, r + 7):
                if out[c] == out[c + 1]:
                    return t * layers + j
    return -1


@_compiled(inline=True)
def _sort_flat_rows(ids: Any, out: Any, n: int, largest: Any) -> Any:
    """The first ``n`` rows of eight values of ``ids`` (uint8 or uint16, flat, in row order) sorted ascending into
    ``out`` (it may be ``ids``); nonzero when a row holds a value above ``largest`` or a repeated one.

    The rows are indexed flat and the network has no branch: the loop vectorizes across rows (measured on 2-core AMD
    EPYC: 3.6 ns per row with the checks; numba's 2-D indexing of the same loop kept it scalar, 15 ns)."""
    bad = np.uint8(0)
    for r in range(n):
        j = 8 * r
        a0, a1, a2, a3, a4, a5, a6, a7 = _network_of_eight(
            ids[j], ids[j + 1], ids[j + 2], ids[j + 3], ids[j + 4], ids[j + 5], ids[j + 6], ids[j + 7]
        )
        # sorted, so a repeat is an equal neighbour (a cheaper vector compare than an ordering)
        repeats = (a0 == a1) | (a1 == a2) | (a2 == a3) | (a3 == a4) | (a4 == a5) | (a5 == a6) | (a6 == a7)
        bad |= np.uint8(repeats | (a7 > largest))
        out[j], out[j + 1], out[j + 2], out[j + 3] = a0, a1, a2, a3
        out[j + 4], out[j + 5], out[j + 6], out[j + 7] = a4, a5, a6, a7
    return bad


# -- checking decoded rows (format 1) ---------------------------------------------------------------------------
@_compiled()
def first_invalid_row(ids: Any, words: Any, num_experts: int, ascending: bool) -> int:
    """The first row of ``ids`` ``[L, R, K]`` (uint8 or uint16, any strides) that is no valid stored row, as
    ``layer * R + row``, or -1: a row names K distinct IDs below ``num_experts``, strictly ascending when
    ``ascending`` (``sorted_gaps``; the ``none`` transform keeps the engine's score order). ``words``: ``ids`` as
    ``[L, R]`` uint64 words (rows of eight uint8 IDs), or None.

    A branch-free pass per layer counts bad rows (a loop that vectorizes: per word a borrow check of its gaps, or in
    score order :func:`_network_of_eight` and a compare of neighbours); only a layer with some looks for which."""
    layers, rows = ids.shape[0], ids.shape[1]
    limit = np.uint64(min(num_experts, 256))
    for j in range(layers):
        invalid = 0
        if words is not None:
            layer = words[j]  # a view: plain indices let the compiler vectorise
            if ascending:
                for r in range(rows):
                    invalid += not _word_valid(layer[r], _word_gaps(layer[r]), num_experts)
            else:
                for r in range(rows):
                    invalid += not _word_set(layer[r], limit)
        else:
            for r in range(rows):
                invalid += not _ids_valid(ids, j, r, num_experts, ascending)
        if invalid:
            for r in range(rows):
                if not _ids_valid(ids, j, r, num_experts, ascending):
                    return int(j * rows + r)
    return -1


@_compiled(inline=True)
def _word_set(word: Any, limit: Any) -> Any:
    """Whether the eight uint8 lanes of ``word``, in any order, are distinct and below ``limit`` (uint64)."""
    a0, a1, a2, a3, a4, a5, a6, a7 = _network_of_eight(
        word & np.uint64(255),
        (word >> np.uint64(8)) & np.uint64(255),
        (word >> np.uint64(16)) & np.uint64(255),
        (word >> np.uint64(24)) & np.uint64(255),
        (word >> np.uint64(32)) & np.uint64(255),
        (word >> np.uint64(40)) & np.uint64(255),
        (word >> np.uint64(48)) & np.uint64(255),
        word >> np.uint64(56),
    )
    return (a0 < a1) & (a1 < a2) & (a2 < a3) & (a3 < a4) & (a4 < a5) & (a5 < a6) & (a6 < a7) & (a7 < limit)


@_compiled(inline=True)
def _ids_valid(ids: Any, j: int, r: int, num_experts: int, ascending: bool) -> bool:
    """Row ``r`` of layer ``j`` of ``ids`` names distinct IDs below ``num_experts`` (strictly ascending ones when
    ``ascending``), one ID at a time."""
    if ascending:
        return _row_valid(ids, j, r, num_experts)
    k = ids.shape[2]
    valid = True
    for c in range(k):
        valid &= int(ids[j, r, c]) < num_experts
        for d in range(c):
            valid &= ids[j, r, c] != ids[j, r, d]
    return valid


# -- encoding ---------------------------------------------------------------------------------------------------
@_compiled()
def encode_chunk(ids: Any, id_words: Any, num_experts: int, dictionaries: int) -> tuple[Any, Any, int, int]:
    """The two sections of one chunk ``ids`` ``[L, R, K]`` (uint8 or uint16, C-contiguous), as uint8 arrays: the
    gaps section and the rest (:mod:`routelog.format.ranked` has their layout); then the rows the gaps section holds,
    and how many of them repeat an earlier row of their layer (what zstd's matches can find).

    ``id_words``: ``ids`` as one uint64 word per row (rows of eight uint8 IDs; the same bytes come out), or None.
    ``dictionaries``: :data:`AUTO` (where the estimate says they pay), :data:`NEVER` or :data:`ALWAYS` (every layer
    with a repeat of an earlier row).
    """
    layers, rows, k = ids.shape
    gaps = np.empty((layers * rows, k), ids.dtype)
    bitmaps = np.zeros((layers, (rows + 7) // 8), np.uint8)
    modes = np.zeros(layers, np.uint8)
    tables = np.empty((layers, num_experts), ids.dtype)
    exceptions = np.empty((layers * rows, 2), np.int64)
    layer_unique = np.zeros(layers, np.int64)
    entries = np.zeros(layers, np.int64)
    indices = np.empty(layers * rows, np.int64)
    placed, n_exceptions, matched = _transform(
        ids,
        id_words,
        num_experts,
        gaps,
        bitmaps,
        modes,
        tables,
        exceptions,
        layer_unique,
        entries,
        indices,
        dictionaries,
    )
    if ids.itemsize == 1:
        section = gaps[:placed].reshape(placed * k).view(np.uint8)
    else:  # byte planes: zstd fits one entropy table per plane
        section = np.empty(2 * placed * k, np.uint8)
        flat = gaps[:placed].reshape(placed * k)
        for i in range(flat.size):
            section[i] = flat[i] & 255
            section[flat.size + i] = flat[i] >> 8
    size = layers + 9 + n_exceptions * (4 + k * ids.itemsize)
    for j in range(layers):
        size += bitmaps.shape[1] * ((modes[j] >> 1) & 1) + num_experts * ids.itemsize * (modes[j] & 1)
        if modes[j] & DICTIONARY:
            size += 4 + layer_unique[j] * (1 + (entries[j] > 256))
    rest = np.empty(size, np.uint8)
    at = 0
    for j in range(layers):
        if modes[j] & 2:
            rest[at : at + bitmaps.shape[1]] = bitmaps[j]
            at += bitmaps.shape[1]
    for j in range(layers):
        if modes[j] & 1:
            for e in range(num_experts):
                at = _put(rest, at, tables[j, e], ids.itemsize)
    numbered = 0
    version = 1  # a chunk without dictionaries stays readable by format-2 readers that predate them
    for j in range(layers):
        if modes[j] & DICTIONARY:
            version = 2
            at = _put(rest, at, entries[j], 4)
            n = layer_unique[j]
            for i in range(n):
                rest[at + i] = indices[numbered + i] & 255
            at += n
            if entries[j] > 256:
                for i in range(n):
                    rest[at + i] = indices[numbered + i] >> 8
                at += n
        numbered += layer_unique[j]
    for n in range(n_exceptions):
        at = _put(rest, at, exceptions[n, 0], 4)
        row = exceptions[n, 1]
        for c in range(k):
            at = _put(rest, at, ids[row // rows, row % rows, c], ids.itemsize)
    rest[at : at + layers] = modes
    at = _put(rest, at + layers, placed, 4)
    at = _put(rest, at, n_exceptions, 4)
    rest[at] = version
    return section, rest, placed, matched


@_compiled(inline=True)
def _put(buffer: Any, at: int, value: Any, nbytes: int) -> int:
    """Write ``value`` little-endian in ``nbytes`` at ``buffer[at]``; return the next position."""
    v = int(value)
    for b in range(nbytes):
        buffer[at + b] = (v >> (8 * b)) & 255
    return at + nbytes


@_compiled(inline=True)
def _get(buffer: Any, at: int, nbytes: int) -> int:
    """The little-endian unsigned integer of ``nbytes`` at ``buffer[at]``."""
    v = 0
    for b in range(nbytes):
        v |= int(buffer[at + b]) << (8 * b)
    return v


@_compiled()
def _transform(
    ids: Any,
    id_words: Any,
    num_experts: int,
    gaps: Any,
    bitmaps: Any,
    modes: Any,
    tables: Any,
    exceptions: Any,
    layer_unique: Any,
    entries: Any,
    indices: Any,
    dictionaries: int,
) -> tuple[int, int, int]:
    """The work of :func:`encode_chunk`, into its arrays:

    * ``gaps`` ``[L * R, K]`` (ids' dtype): its first S rows are the gaps section, layer after layer (a layer's
      unique rows, or the entries of its dictionary);
    * ``bitmaps`` ``[L, ceil(R / 8)]`` uint8, zeroed: the repeat bits (most significant first);
    * ``modes`` ``[L]`` uint8, zeroed: each layer's mode bits (1 ranked, 2 has repeats, 4 dictionary);
    * ``tables`` ``[L, E]`` (ids' dtype): rank -> ID of the ranked layers (row j for layer j);
    * ``exceptions`` ``[L * R, 2]`` int64: (unique row, flat row of ``ids``) of each row that is no valid set. Its
      plain gaps are zeros (IDs 0..K-1, relabelled like any row in a ranked layer): a valid placeholder that the
      exception overwrites;
    * ``layer_unique`` ``[L]``: each layer's unique rows; ``entries`` ``[L]``: its dictionary's entries (0 without
      one); ``indices`` ``[L * R]``: each unique row's dictionary entry, numbered across the chunk's layers.

    Returns S, the number of exceptions, and how many rows of the gaps section repeat an earlier row of their layer.
    """
    layers, rows, k = ids.shape
    hash_bits = 10
    while (1 << hash_bits) < 2 * rows and hash_bits < 16:
        hash_bits += 1
    seen = np.empty(0, np.int64)  # row hash -> its latest unique row (direct mapped), filled when first needed
    if id_words is not None:  # (numba compiles only one side of each such test: its argument's type decides)
        gap_words = gaps.reshape(gaps.size).view(np.uint64)
        seen_words = np.empty(1 << hash_bits, np.uint64)
    counts = np.zeros(num_experts, np.int64)
    rank_of = np.empty(num_experts, np.int64)
    order = np.empty(num_experts, np.int64)
    literals = np.zeros(1024, np.int64)  # byte histograms of first-seen rows' gaps: plain [0, 512), ranked after
    values = np.empty(k, np.int64)
    num_bits = _mask_bits(num_experts)
    masks = np.zeros(max(1, num_bits >> 6), np.uint64)
    mapped = np.empty(256, np.int64)
    bit_of = np.empty(256, np.uint64)
    entry_of = np.empty(rows, np.int64)  # the layer's unique row -> its entry, entries numbered as first seen
    entry_row = np.empty(rows, np.int64)  # entry -> its first unique row
    entry_uses = np.zeros(rows, np.int64)  # entry -> unique rows naming it that no run of repeats covers
    placed = 0
    numbered = 0
    n_exceptions = 0
    matched = 0
    for j in range(layers):
        base = placed
        # 1. Repeats, the other rows' gaps, and rows that are no valid set.
        if id_words is not None:
            unique, n_exceptions = _layer_words(
                id_words, j, rows, num_experts, gap_words, base, numbered, bitmaps, exceptions, n_exceptions
            )
        else:
            unique, n_exceptions = _layer_rows(
                ids, j, num_experts, gaps, base, numbered, bitmaps, exceptions, n_exceptions
            )
        n_unique = unique - base
        layer_unique[j] = n_unique
        placed = unique
        numbered += n_unique
        if n_unique < rows:
            modes[j] |= 2
        if k > num_experts:
            continue  # no valid set exists: every row is an exception
        # 2. The expert load on a sample of the rows: is it skewed, and which experts are most popular?
        counts[:] = 0
        for i in range(base, unique, max(1, n_unique // LOAD_SAMPLE)):
            if id_words is not None:
                word = _word_ids(gap_words[i])
                for c in range(8):
                    counts[int((word >> np.uint64(8 * c)) & np.uint64(255))] += 1
            else:
                _row_ids(gaps, i, values)
                for c in range(k):
                    counts[values[c]] += 1
        total = counts.sum()
        skewed = total > 0 and _entropy_bits(counts, 0, num_experts) < RANK_BELOW * math.log2(num_experts) * total
        if not skewed and n_unique == rows:
            continue  # near-uniform sets, no repeats: plain gaps, and nothing for zstd to match
        if skewed:
            _popularity(counts, rank_of, order)
            if id_words is not None:
                _lane_lookup(rank_of, mapped, bit_of)
            literals[:] = 0
        # 3. Rows seen earlier in the layer (zstd matches them, or a dictionary names them), and for a skewed layer
        # both transforms' literals (the gaps of the rows seen first, on a sample of them).
        if seen.size == 0:  # near-uniform chunks never get here: they skip filling the table
            seen = np.full(1 << hash_bits, -1, np.int64)
        runs = 0
        long_runs = 0
        run_length = 0
        novel = 0
        previous_match = -2
        step = max(1, n_unique // LOAD_SAMPLE)
        first = numbered - n_unique
        for i in range(n_unique):
            at = base + i
            if id_words is not None:  # the table keeps each entry's word too: one lookup, no second load to compare
                h = int((gap_words[at] * _HASH) >> np.uint64(64 - hash_bits))
                earlier = seen[h]
                repeated = earlier >= first and seen_words[h] == gap_words[at]
                seen_words[h] = gap_words[at]
            else:
                h = _row_hash(gaps, at, hash_bits)
                earlier = seen[h]
                repeated = earlier >= first and _rows_equal(gaps, base + earlier - first, gaps, at)
            seen[h] = first + i  # unique rows are numbered across layers: an earlier layer's are below ``first``
            if repeated:
                matched += 1
                entry_of[i] = entry_of[earlier - first]
                if earlier == previous_match + 1:
                    run_length += 1
                    long_runs += run_length == 2
                else:
                    runs += 1
                    run_length = 1
                    entry_uses[entry_of[i]] += 1
                previous_match = earlier
                continue
            entry_of[i] = novel
            entry_row[novel] = at
            entry_uses[novel] = 1
            previous_match = -2
            run_length = 0
            novel += 1
            if not skewed or novel % step:
                continue
            if id_words is not None:
                _count_word(gap_words[at], literals, 0)
                _count_word(_ranked_word(gap_words[at], mapped, bit_of, num_experts <= 64), literals, 512)
            else:
                _count_row(gaps, at, literals, 0)
                _ranked_row(gaps, at, rank_of, num_bits, masks, values)
                for c in range(k):
                    literals[512 + (values[c] & 255)] += 1
                    literals[768 + ((values[c] >> 8) & 255)] += 1
        # 4. A dictionary of the layer's distinct rows when naming them costs less than zstd's matches would.
        if novel < n_unique and novel <= MAX_ENTRIES and dictionaries != NEVER:
            ranks = _ranked_entries(entry_uses, novel)
            if dictionaries == ALWAYS or _dictionary_pays(ranks, entry_uses, runs, long_runs):
                modes[j] |= DICTIONARY
                matched -= n_unique - novel  # the gaps section keeps no repeats of this layer
                _use_dictionary(gaps, base, n_unique, ranks, entry_of, entry_row, indices, first)
                entries[j] = novel
                placed = unique = base + novel
        if not skewed:
            continue
        plain = (_entropy_bits(literals, 0, 256) + _entropy_bits(literals, 256, 512)) * step / 8 + RUN_BYTES * runs
        ranked = (_entropy_bits(literals, 512, 768) + _entropy_bits(literals, 768, 1024)) * step / 8 + RUN_BYTES * runs
        if ranked >= (1 - MIN_GAIN) * plain:
            continue
        # 5. Relabel by popularity rank: the ranked gaps replace the plain ones, in place.
        modes[j] |= 1
        for e in range(num_experts):
            tables[j, e] = order[e]
        if id_words is not None:  # every row is a set (exceptions hold a placeholder): the mapping cannot fail
            relabelled = gap_words[base:unique]
            _map_and_sort_rows(relabelled, rank_of, relabelled.view(np.uint8), num_experts)
            for i in range(relabelled.size):
                relabelled[i] = _word_gaps(relabelled[i])
            continue
        for i in range(base, unique):
            _ranked_row(gaps, i, rank_of, num_bits, masks, values)
            for c in range(k):
                gaps[i, c] = values[c]
    return placed, n_exceptions, matched


@_compiled()
def _dictionary_pays(ranks: Any, entry_uses: Any, runs: int, long_runs: int) -> bool:
    """Whether a layer's unique rows cost less as a dictionary of its distinct rows and an entry index per unique row
    than as zstd's matches of the repeated ones (the entries' own gaps cost the same either way; ``ranks``: each
    entry's, by use). The model (:data:`MATCH_BYTES`, :data:`INDEX_WEIGHT`, :data:`LONG_RUN_BYTES`): a run of
    repeats costs a match without a dictionary; with one, the indices cost the entropy of their byte planes (the
    entries ranked by use, most used first) where no run covers them, and each run longer than a row costs more."""
    n_entries = ranks.size
    planes = np.zeros(512, np.int64)
    for e in range(n_entries):
        planes[ranks[e] & 255] += entry_uses[e]
        planes[256 + (ranks[e] >> 8)] += entry_uses[e]
    index_bits = _entropy_bits(planes, 0, 256) + (_entropy_bits(planes, 256, 512) if n_entries > 256 else 0.0)
    return INDEX_WEIGHT * index_bits / 8 + LONG_RUN_BYTES * long_runs < MATCH_BYTES * runs


@_compiled()
def _ranked_entries(entry_uses: Any, n_entries: int) -> Any:
    """Each entry's rank by descending use, ties by first sight."""
    ranks = np.empty(n_entries, np.int64)
    order = np.empty(n_entries, np.int64)
    _popularity(entry_uses[:n_entries], ranks, order)
    return ranks


@_compiled()
def _use_dictionary(
    gaps: Any,
    base: int,
    n_unique: int,
    ranks: Any,
    entry_of: Any,
    entry_row: Any,
    indices: Any,
    first_index: int,
) -> None:
    """Replace a layer's unique rows ``gaps[base : base + n_unique]`` by its dictionary's entries in ``ranks``'
    order (most used first), and name each unique row's entry in ``indices`` from ``first_index``."""
    n_entries = ranks.size
    entry_gaps = np.empty((n_entries, gaps.shape[1]), gaps.dtype)
    for e in range(n_entries):
        entry_gaps[ranks[e]] = gaps[entry_row[e]]
    gaps[base : base + n_entries] = entry_gaps
    for i in range(n_unique):
        indices[first_index + i] = ranks[entry_of[i]]


@_compiled()
def _layer_words(
    id_words: Any,
    j: int,
    rows: int,
    num_experts: int,
    gap_words: Any,
    unique: int,
    numbered: int,
    bitmaps: Any,
    exceptions: Any,
    n_exceptions: int,
) -> tuple[int, int]:
    """Step 1 of :func:`encode_chunk` for rows as words: gaps of every row at its own position from ``unique`` (a
    loop the compiler vectorises), then, only where needed, the repeats squeezed out and the invalid rows listed
    (numbered from ``numbered``, the unique rows of the layers before)."""
    offset = j * rows
    layer = id_words[offset : offset + rows]  # views: plain indices let the compiler vectorise the loops
    out = gap_words[unique : unique + rows]
    invalid = 0
    for r in range(rows):
        out[r] = _word_gaps(layer[r])
        invalid += not _word_valid(layer[r], out[r], num_experts)
    # Repeats: a flag byte per row (a loop that vectorises), then the bitmap a byte (eight rows) at a time, its
    # flags gathered by one multiplication; a byte of eight repeats keeps no row, one without repeats keeps eight
    # (row by row, a padding layer of repeats took twice as long as a layer without).
    flags = np.zeros(bitmaps.shape[1] * 8, np.uint8)
    repeats = 0
    for r in range(1, rows):
        flags[r] = layer[r] == layer[r - 1]
        repeats += flags[r]
    if repeats:
        packed = flags.view(np.uint64)
        u = 0
        for byte in range(bitmaps.shape[1]):
            bits = (packed[byte] * _GATHER_BITS) >> np.uint64(56)
            bitmaps[j, byte] = bits
            start = byte * 8
            if bits == 255:  # eight repeats: nothing kept
                continue
            if bits == 0 and start + 8 <= rows:  # eight rows kept
                for c in range(8):
                    out[u + c] = out[start + c]
                u += 8
                continue
            for r in range(start, min(rows, start + 8)):
                out[u] = out[r]
                u += 1 - flags[r]
    if invalid:
        u = 0
        for r in range(rows):
            if flags[r]:
                continue
            if not _word_valid(layer[r], _word_gaps(layer[r]), num_experts):
                out[u] = 0
                exceptions[n_exceptions, 0] = numbered + u
                exceptions[n_exceptions, 1] = offset + r
                n_exceptions += 1
            u += 1
    return unique + rows - repeats, n_exceptions


@_compiled()
def _layer_rows(
    ids: Any,
    j: int,
    num_experts: int,
    gaps: Any,
    unique: int,
    numbered: int,
    bitmaps: Any,
    exceptions: Any,
    n_exceptions: int,
) -> tuple[int, int]:
    """Step 1 of :func:`encode_chunk` one ID at a time."""
    rows, k = ids.shape[1], ids.shape[2]
    layer = ids[j]
    numbered -= unique  # a row's number is its position plus this
    for r in range(rows):
        if r > 0 and _rows_equal(layer, r, layer, r - 1):
            bitmaps[j, r >> 3] |= np.uint8(0x80 >> (r & 7))
            continue
        valid = int(layer[r, k - 1]) < num_experts
        gaps[unique, 0] = layer[r, 0]
        for c in range(1, k):
            step = int(layer[r, c]) - int(layer[r, c - 1]) - 1
            valid &= step >= 0
            gaps[unique, c] = step
        if not valid:
            for c in range(k):
                gaps[unique, c] = 0
            exceptions[n_exceptions, 0] = numbered + unique
            exceptions[n_exceptions, 1] = j * rows + r
            n_exceptions += 1
        unique += 1
    return unique, n_exceptions


@_compiled()
def _popularity(counts: Any, rank_of: Any, order: Any) -> None:
    """Experts by descending count, ties by ID (a counting sort: counts are at most the sample's draws): ``order``
    rank -> expert and ``rank_of`` its inverse."""
    most = counts.max()
    starts = np.zeros(most + 2, np.int64)
    for n in counts:
        starts[most - n + 1] += 1
    for i in range(1, most + 2):
        starts[i] += starts[i - 1]
    for e in range(counts.size):
        rank = starts[most - counts[e]]
        starts[most - counts[e]] += 1
        order[rank] = e
        rank_of[e] = rank


@_compiled(inline=True)
def _ranked_word(gaps: Any, mapped: Any, bit_of: Any, small: bool) -> Any:
    """The gaps of the sorted popularity ranks of the row whose plain gaps are ``gaps`` (``mapped`` and ``bit_of``
    from :func:`_lane_lookup` of the ranks; ``small``: fewer than 65 experts)."""
    _, ranks = _sorted_lanes(_word_ids(gaps), mapped, bit_of, small)
    return _word_gaps(ranks)


@_compiled(inline=True)
def _row_ids(gaps: Any, i: int, values: Any) -> None:
    """The IDs whose gaps are row ``i`` of ``gaps``, into ``values``."""
    x = -1
    for c in range(values.size):
        x += int(gaps[i, c]) + 1
        values[c] = x


@_compiled(inline=True)
def _ranked_row(gaps: Any, i: int, rank_of: Any, num_bits: int, masks: Any, values: Any) -> None:
    """The gaps of the sorted popularity ranks of the row whose plain gaps are row ``i`` of ``gaps``, into
    ``values``."""
    k = values.size
    _row_ids(gaps, i, values)
    for c in range(k):
        values[c] = rank_of[values[c]]
    _sort_row(values, num_bits, masks)
    for c in range(k - 1, 0, -1):
        values[c] -= values[c - 1] + 1


@_compiled(inline=True)
def _map_and_sort_rows(source: Any, lookup: Any, out: Any, num_experts: int) -> bool:
    """Rows of eight uint8 values: each row's values (the prefix sums of its gaps word in ``source``) mapped through
    ``lookup`` and sorted, into ``out`` (flat bytes; it may be ``source``'s memory). Two passes, the lookups and
    then the network over all rows (vectorized: measured 7.2 ns per row against 10 ns for a bit set per row, 18 ns
    for a network per row above 64 experts). False, with ``out`` unspecified, when some row's values are no set of
    distinct values below ``num_experts`` (a damaged chunk)."""
    known = min(num_experts, 256)  # values are bytes (uint8 IDs of a larger universe rank below 256)
    lookup_bytes = np.zeros(256, np.uint8)  # once per layer: a byte per lookup keeps the rows' loop narrow
    lookup_bytes[:known] = lookup[:known]
    valid = True
    for i in range(source.size):
        gaps = source[i]
        values = _word_ids(gaps)
        valid &= _word_valid(values, gaps, num_experts)
        j = 8 * i
        for c in range(8):
            out[j + c] = lookup_bytes[(values >> np.uint64(8 * c)) & np.uint64(255)]
    if valid:
        _sort_flat_rows(out, out, source.size, np.uint8(255))
    return valid


# -- decoding ---------------------------------------------------------------------------------------------------
@_compiled()
def decode_chunk(
    gap_bytes: Any,
    rest: Any,
    num_experts: int,
    layers: int,
    rows: int,
    out: Any,
    out_words: Any,
    first_layer: int,
    first_row: int,
    accept: int,
    fill_value: int,
) -> tuple[int, int]:
    """IDs of a window of a ``layers x rows`` chunk into ``out`` ``[Lw, Rw, K]``: the chunk's layers from
    ``first_layer`` and rows from ``first_row`` (the caller checked the window lies inside the chunk; uint8 or
    uint16; each layer's rows contiguous, the layers anywhere: a reader's block takes its overlap with a chunk in
    place). From a chunk's decompressed sections: ``gap_bytes`` (``U * K`` IDs' worth, U from the trailer: the
    caller checked that) and ``rest``. Layers outside the window are skipped, and only the unique rows the
    window's rows expand from are decoded.

    ``out_words``: ``out`` as one uint64 word per row, ``[Lw, Rw]`` (rows of eight uint8 IDs), or None. ``accept``:
    which rows the window may hold (:data:`SETS`, :data:`SETS_OR_FILL`: exception rows of ``fill_value`` alone
    too, or :data:`ANY_ROWS`), checked once the window is written (a forged table, gaps that pass E or wrap, a
    dictionary's entry or an exception may make any row). Returns (status, detail): :data:`OK`, or what is wrong
    with the payload.
    """
    window_layers, window_rows, k = out.shape
    itemsize = out.itemsize
    # The rest section: its parts must add up to its size, and its indices stay inside the chunk.
    trailer = rest.size - layers - 9
    known_modes = 7 if rest[rest.size - 1] >= 2 else 3  # dictionaries came with payload version 2
    n_bitmaps = 0
    n_tables = 0
    for j in range(layers):
        mode = rest[trailer + j]
        if mode & ~known_modes:
            return UNKNOWN_MODE, mode
        n_bitmaps += (mode >> 1) & 1
        n_tables += mode & 1
    total = _get(rest, rest.size - 9, 4)
    n_exceptions = _get(rest, rest.size - 5, 4)
    per_bitmap = (rows + 7) // 8
    tables = n_bitmaps * per_bitmap  # where each part starts
    listed = tables + n_tables * num_experts * itemsize  # then the dictionaries' parts, then the exceptions
    if listed > trailer:
        return SECTION_SIZES, listed + layers + 9
    layer_unique = np.full(layers, rows, np.int64)
    bitmap = 0
    for j in range(layers):
        if rest[trailer + j] & 2:
            if rows and rest[bitmap] & 0x80:
                return FIRST_ROW_REPEATS, j
            for byte in range(per_bitmap):
                bits = np.uint64(rest[bitmap + byte])
                if byte == rows >> 3:  # the last, partial byte: only its first rows % 8 bits are rows
                    bits &= np.uint64((0xFF00 >> (rows & 7)) & 0xFF)
                layer_unique[j] -= int(_popcount(bits))
            bitmap += per_bitmap
    layer_stored = layer_unique.copy()  # rows of the gaps section: unique rows, or a dictionary's entries
    index_at = np.zeros(layers, np.int64)
    largest_dictionary = 0
    for j in range(layers):
        if rest[trailer + j] & DICTIONARY:
            if listed + 4 > trailer:
                return SECTION_SIZES, listed + 4 + layers + 9
            layer_stored[j] = _get(rest, listed, 4)
            if layer_stored[j] > layer_unique[j] or (layer_stored[j] == 0) != (layer_unique[j] == 0):
                return DICTIONARY_SIZE, j
            index_at[j] = listed + 4
            listed += 4 + layer_unique[j] * (1 + (layer_stored[j] > 256))
            largest_dictionary = max(largest_dictionary, layer_stored[j])
    entry = 4 + k * itemsize
    if listed + n_exceptions * entry != trailer:
        return SECTION_SIZES, listed + n_exceptions * entry + layers + 9
    stored = layer_stored.sum()
    if stored != total:
        return UNIQUE_COUNT, stored
    unique = layer_unique.sum()
    for n in range(n_exceptions):
        if _get(rest, listed + n * entry, 4) >= unique:
            return EXCEPTION_RANGE, n
    # The window's rows, layer by layer.
    if out_words is not None:
        gap_words = gap_bytes.view(np.uint64)
        decoded = np.empty(window_rows + 1, np.uint64)  # the unique rows the window expands from
        entry_words = np.empty(largest_dictionary, np.uint64)  # a dictionary's entries
    # Layers whose rows the decoding itself showed to be valid sets; the others are checked once written (below).
    proven = np.zeros(window_layers, np.bool_)
    seen = np.zeros(num_experts, np.uint8)  # a ranked layer's IDs in its table
    num_bits = _mask_bits(num_experts)
    masks = np.zeros(max(1, num_bits >> 6), np.uint64)
    table = np.empty(num_experts, np.int64)
    values = np.empty(k, np.int64)
    high = total * k if itemsize == 2 else 0  # where the high-byte plane starts
    wrap = (1 << (8 * itemsize)) - 1
    stop_row = first_row + window_rows
    u = 0  # the layer's first row in the gaps section
    bitmap = -per_bitmap
    ranked = tables - num_experts * itemsize
    for j in range(layers):
        mode = rest[trailer + j]
        bitmap += per_bitmap if mode & 2 else 0
        ranked += num_experts * itemsize if mode & 1 else 0
        start = u
        u += layer_stored[j]
        jw = j - first_layer
        if jw < 0 or jw >= window_layers or window_rows == 0:
            continue
        bits = rest[bitmap : bitmap + per_bitmap] if mode & 2 else rest[0:0]
        permutation = True  # the table maps ranks to distinct IDs in [0, E): valid ranks give valid rows
        if mode & 1:
            seen[:] = 0
            for e in range(num_experts):
                table[e] = _get(rest, ranked + e * itemsize, itemsize)
                permutation &= table[e] < num_experts and not seen[min(table[e], num_experts - 1)]
                seen[min(table[e], num_experts - 1)] = 1
        n_entries = layer_stored[j] if mode & DICTIONARY else 0
        # The layer's unique rows [lo, hi) that rows [first_row, stop_row) expand from: from the one the first row
        # repeats (when it is a repeat) to the last one at or before the last row.
        starts_repeat = _repeat_bit(bits, first_row)
        lo = first_row - _repeats_before(bits, first_row) - starts_repeat
        hi = stop_row - _repeats_before(bits, stop_row)
        if out_words is not None:
            layer = out_words[jw]  # views: plain indices let the compiler vectorise
            if mode == 0:  # plain, no repeats: straight into the output
                source = gap_words[start + lo : start + hi]
                for r in range(window_rows):
                    layer[r] = _word_ids(source[r])
                proven[jw] = not _gaps_past(source, num_experts)
                continue
            unique_rows = decoded[: hi - lo]
            # the rows of gaps the window needs: a dictionary's entries, every one once (then each unique row's is
            # gathered from them), or the window's unique rows
            rows_of_gaps = entry_words[:n_entries] if n_entries else unique_rows
            first = start if n_entries else start + lo
            status = _decode_words(
                gap_bytes, first, rows_of_gaps, mode & 1, table, num_experts, num_bits, masks, values
            )
            if status < 0:
                return RANK_RANGE, j
            proven[jw] = status == 1 and permutation
            if n_entries and _gather_entries(rest, index_at[j], layer_unique[j], lo, rows_of_gaps, unique_rows):
                return DICTIONARY_INDEX, j
            if not mode & 2:
                layer[:] = unique_rows
                continue
            _expand_repeats(bits, unique_rows, layer, first_row, starts_repeat)
            continue
        next_unique = lo  # one ID at a time: ``values`` holds the row a repeat keeps
        ascending = True  # every row decoded: prefix sums that ascend below E
        for r in range(-starts_repeat, window_rows):
            if r < 0 or not _repeat_bit(bits, first_row + r):
                row = start + next_unique
                if n_entries:
                    e = _entry_index(rest, index_at[j], layer_unique[j], n_entries, next_unique)
                    if e >= n_entries:
                        return DICTIONARY_INDEX, j
                    row = start + e
                status = _decode_row(gap_bytes, row, high, wrap, table, mode & 1, num_experts, num_bits, masks, values)
                if status < 0:
                    return RANK_RANGE, j
                ascending &= status == 1
                next_unique += 1
            if r >= 0:
                for c in range(k):
                    out[jw, r, c] = values[c]
        proven[jw] = ascending and permutation
    from_exceptions = np.zeros((0, 0), np.uint8)
    if n_exceptions:
        from_exceptions = _apply_exceptions(
            rest, trailer, per_bitmap, listed, n_exceptions, layers, rows, out, first_layer, first_row
        )
    if accept != ANY_ROWS:
        fill = fill_value if accept == SETS_OR_FILL else -1
        bad = _first_invalid_row(out, out_words, num_experts, fill, from_exceptions, proven)
        if bad >= 0:
            return INVALID_ROW, bad
    return OK, 0


@_compiled()
def _first_invalid_row(out: Any, out_words: Any, num_experts: int, fill: int, from_exceptions: Any, proven: Any) -> int:
    """The first row of ``out`` ``[Lw, Rw, K]`` (as ``jw * Rw + r``) that is no set of K strictly ascending IDs below
    ``num_experts``, or -1. Layers ``proven`` valid while decoding are skipped unless an exception wrote some row
    (``from_exceptions[jw, r]`` set; empty without exceptions). A row an exception wrote holding only ``fill`` is
    accepted (``fill`` -1: none is): zarr-python's edge padding.

    A branch-free pass per layer counts bad rows (a loop that vectorizes; rows of eight uint8 IDs as words, by
    :func:`_word_valid`); only a layer with some looks for which (and for padding)."""
    window_layers, window_rows, k = out.shape
    for jw in range(window_layers):
        if proven[jw] and (from_exceptions.size == 0 or not from_exceptions[jw].any()):
            continue
        invalid = 0
        if out_words is not None:
            layer = out_words[jw]  # a view: plain indices let the compiler vectorise
            for r in range(window_rows):
                invalid += not _word_valid(layer[r], _word_gaps(layer[r]), num_experts)
        else:
            for r in range(window_rows):
                invalid += not _row_valid(out, jw, r, num_experts)
        if not invalid:
            continue
        for r in range(window_rows):
            if _row_valid(out, jw, r, num_experts):
                continue
            if fill < 0 or from_exceptions.size == 0 or not from_exceptions[jw, r]:
                return int(jw * window_rows + r)
            for c in range(k):
                if out[jw, r, c] != fill:
                    return int(jw * window_rows + r)
    return -1


@_compiled(inline=True)
def _row_valid(out: Any, jw: int, r: int, num_experts: int) -> bool:
    """Row ``r`` of layer ``jw`` of ``out`` holds strictly ascending IDs below ``num_experts``."""
    k = out.shape[2]
    valid = int(out[jw, r, k - 1]) < num_experts
    for c in range(1, k):
        valid &= out[jw, r, c] > out[jw, r, c - 1]
    return valid


@_compiled()  # called once per layer: not inlined, so the sorting network it holds compiles once
def _decode_words(
    gap_bytes: Any,
    first: int,
    out: Any,
    ranked: int,
    table: Any,
    num_experts: int,
    num_bits: int,
    masks: Any,
    values: Any,
) -> int:
    """Rows ``first`` onwards of the gaps section (eight uint8 IDs each) as ID words into all of ``out``: prefix
    sums, and in a ranked layer the ``table``'s IDs sorted. Returns -1 for a rank past the table, 1 when every
    row's values (IDs, or in a ranked layer ranks) are strictly ascending and below ``num_experts``, else 0."""
    source = gap_bytes.view(np.uint64)[first : first + out.size]
    if not ranked:
        for i in range(out.size):
            out[i] = _word_ids(source[i])
        return 0 if _gaps_past(source, num_experts) else 1
    if _map_and_sort_rows(source, table, out.view(np.uint8), num_experts):
        return 1
    # a row of ranks that is no set (damage): row by row, one ID at a time where needed
    mapped = np.empty(256, np.int64)
    bit_of = np.empty(256, np.uint64)
    _lane_lookup(table, mapped, bit_of)
    for i in range(out.size):
        distinct, word = _sorted_lanes(_word_ids(source[i]), mapped, bit_of, num_experts <= 64)
        if not distinct:
            if _decode_row(gap_bytes, first + i, 0, 255, table, True, num_experts, num_bits, masks, values) < 0:
                return -1
            word = _pack(values)
        out[i] = word
    return 0


@_compiled(inline=True)
def _gather_entries(rest: Any, at: int, n_unique: int, lo: int, entries: Any, out: Any) -> bool:
    """``out[i]`` = the entry of unique row ``lo + i`` (:func:`_entry_index`), for all of ``out``; True when an index
    is past ``entries``. Branch-free, so the loop vectorizes: without a high-byte plane the low bytes stand in for it,
    masked off."""
    two_bytes = entries.size > 256
    low = rest[at + lo : at + lo + out.size]
    high = rest[at + n_unique * two_bytes + lo : at + n_unique * two_bytes + lo + out.size]
    high_mask = np.int64(0xFF00 if two_bytes else 0)
    last = np.int64(entries.size - 1)
    largest = np.int64(0)
    for i in range(out.size):
        e = np.int64(low[i]) | ((np.int64(high[i]) << 8) & high_mask)
        largest = max(largest, e)
        out[i] = entries[min(e, last)]
    return bool(largest > last)


@_compiled(inline=True)
def _entry_index(rest: Any, at: int, n_unique: int, n_entries: int, i: int) -> int:
    """Unique row ``i``'s dictionary entry: its index's low byte at ``rest[at + i]``, and with more than 256 entries
    its high byte ``n_unique`` bytes later."""
    e = np.int64(rest[at + i])
    if n_entries > 256:
        e |= np.int64(rest[at + n_unique + i]) << 8
    return int(e)


@_compiled(inline=True)
def _expand_repeats(bits: Any, unique_rows: Any, layer: Any, first_row: int, starts_repeat: int) -> None:
    """Rows ``first_row`` onwards of a layer into ``layer`` (words), from the unique rows they expand from (the
    first one the row before ``first_row``, when ``starts_repeat``) and the layer's repeat bitmap: a repeat keeps
    the row before it. A bitmap byte at a time: eight rows without a repeat copy eight unique rows, the others
    are branch-free (measured: half the time of a row-at-a-time loop, at 13 % to 85 % repeats)."""
    n = layer.size
    last = unique_rows.size - 1  # the counts were checked: ``min`` only keeps damage inside the array
    word = unique_rows[0]
    i = starts_repeat
    r = 0
    while r < n:
        row = first_row + r
        byte = int(bits[row >> 3])
        if row & 7 or r + 8 > n:  # a row before the window's first whole byte, or after its last
            repeat = (byte >> (7 - (row & 7))) & 1
            word = word if repeat else unique_rows[min(i, last)]
            layer[r] = word
            i += 1 - repeat
            r += 1
        elif byte == 0 and i + 8 <= last + 1:
            for c in range(8):
                layer[r + c] = unique_rows[i + c]
            i += 8
            word = unique_rows[i - 1]
            r += 8
        else:  # the step above, unrolled over the byte (one shared loop with a variable count, or the step as a
            # helper returning the row and count, measured 20 to 35 % slower)
            for c in range(8):
                repeat = (byte >> (7 - c)) & 1
                word = word if repeat else unique_rows[min(i, last)]
                layer[r + c] = word
                i += 1 - repeat
            r += 8


@_compiled(inline=True)
def _repeat_bit(bits: Any, row: int) -> int:
    """1 when ``row`` repeats the row before it (its bit in a layer's repeat bitmap ``bits``; none when empty)."""
    if bits.size == 0 or row >> 3 >= bits.size:
        return 0
    return (int(bits[row >> 3]) >> (7 - (row & 7))) & 1


@_compiled(inline=True)
def _repeats_before(bits: Any, row: int) -> int:
    """How many of the rows before ``row`` repeat the row before them (set bits of the bitmap before ``row``'s)."""
    if bits.size == 0:
        return 0
    count = 0
    for byte in range(row >> 3):
        count += int(_popcount(np.uint64(bits[byte])))
    if row & 7 and row >> 3 < bits.size:
        count += int(_popcount(np.uint64(int(bits[row >> 3]) & ((0xFF00 >> (row & 7)) & 0xFF))))
    return count


@_compiled(inline=True)
def _decode_row(
    gap_bytes: Any,
    u: int,
    high: int,
    wrap: int,
    table: Any,
    ranked: bool,
    num_experts: int,
    num_bits: int,
    masks: Any,
    values: Any,
) -> int:
    """Unique row ``u``'s IDs into ``values``, one at a time: the gaps' prefix sums (wrapping in the IDs' width;
    ``high``: where the high-byte plane starts, 0 for uint8), and in a ranked layer the ``table``'s IDs sorted.
    Returns -1 for a rank past the table, 1 when the prefix sums (IDs, or ranks) ascend below ``num_experts`` without
    wrapping (their last one, unwrapped, is below E and the IDs' width), else 0."""
    k = values.size
    x = 0
    last = 0  # the prefix sum, unwrapped
    for c in range(k):
        g = int(gap_bytes[u * k + c])
        if high:
            g |= int(gap_bytes[high + u * k + c]) << 8
        last += g + (c > 0)
        x = (x + g + (c > 0)) & wrap
        values[c] = x
    if ranked:
        for c in range(k):
            if values[c] >= num_experts:
                return -1
            values[c] = table[values[c]]
        _sort_row(values, num_bits, masks)
    return 1 if last < num_experts and last <= wrap else 0


@_compiled()
def _apply_exceptions(
    rest: Any,
    trailer: int,
    per_bitmap: int,
    listed: int,
    n_exceptions: int,
    layers: int,
    rows: int,
    out: Any,
    first_layer: int,
    first_row: int,
) -> Any:
    """Overwrite the exceptions' unique rows (the last listing of a row wins) and the repeats that follow them,
    where they fall in the window ``out`` of the chunk (see :func:`decode_chunk`). Returns which rows of ``out``
    they wrote (uint8 ``[Lw, Rw]``)."""
    window_layers, window_rows, k = out.shape
    itemsize = out.itemsize
    entry = 4 + k * itemsize
    written = np.zeros((window_layers, window_rows), np.uint8)
    exception_of = np.full(rows * layers, -1, np.int64)
    for n in range(n_exceptions):
        exception_of[_get(rest, listed + n * entry, 4)] = n
    u = 0
    bitmap = -per_bitmap
    for j in range(layers):
        repeats = rest[trailer + j] & 2
        bitmap += per_bitmap if repeats else 0
        jw = j - first_layer
        inside = 0 <= jw < window_layers
        listed_row = -1
        for r in range(rows):
            if not (repeats and (rest[bitmap + (r >> 3)] >> (7 - (r & 7))) & 1):
                listed_row = exception_of[u]  # a unique row; a repeat keeps the listing of the row before
                u += 1
            if listed_row >= 0 and inside and first_row <= r < first_row + window_rows:
                written[jw, r - first_row] = 1
                for c in range(k):
                    out[jw, r - first_row, c] = _get(rest, listed + listed_row * entry + 4 + c * itemsize, itemsize)
    return written
