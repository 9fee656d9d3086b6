"""The per-chunk passes of the format-2 codec (:mod:`routelog.format.ranked`) and the writer's and reader's row
checks: compiled, or numpy where the compiled ones are not built.

The compiled kernels (``routelog/format/_ckernels.c``) are built by pip from source with the machine's compiler
when routelog is installed, as numcodecs' and zstandard's are: no process compiles anything at run time. Where no
compiler was found the package still installs and :mod:`routelog.format.kernels_numpy` does the same work with
numpy (it decodes every chunk alike, statuses included, and encodes a simpler valid chunk: no ranking, no
dictionaries); ``tests/test_kernels_numpy.py`` proves the two equal on random, forged and golden chunks.
``ROUTELOG_KERNELS=numpy`` in the environment selects the numpy kernels where both exist; :data:`IMPLEMENTATION`
says which a process uses.

Kernels report a damaged payload with a status code instead of raising, and check every index read from a
payload before using it: a forged chunk makes :func:`decode_chunk` return an error, never read or write out of
bounds. Nor does it return a row that is no top-k set (:data:`INVALID_ROW`; :data:`SETS`).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

from routelog import environment

RANK_BELOW: Final = 0.99
"""A layer is considered for relabelling only when the entropy of its expert load (on a sample of at most
:data:`LOAD_SAMPLE` rows, which also gives the popularity order) is below this fraction of log2(E): above it the
gaps cannot shrink."""
LOAD_SAMPLE: Final = 512
MIN_GAIN: Final = 0.05
"""...and relabelled only when that makes its estimated compressed gaps this much smaller: decoding a ranked
layer costs a table lookup and a sort per row, worth it only for a real gain."""
RUN_BYTES: Final = 3.0
"""What the estimate charges for each run of rows zstd copies from earlier in the layer (a match: its offset and
lengths), in bytes. The estimate of a transform's compressed gaps is the order-0 entropy of the gaps of the rows
seen for the first time in their layer (zstd's literals, on a sample of them) plus this per run. It replaces trial
compressions, which cost more than the rest of the codec; the order-0 entropy of all rows misleads where most rows
repeat earlier ones (measured on the corpus: ranking halves that entropy but shrinks the compressed gaps by 2 to
5 %). With 3 bytes the estimate ranks the corpus' layers about as trial compressions did (90 of 416 layers where
they ranked 89; the corpus' sizes within 0.5 %)."""
MAX_MASK_EXPERTS: Final = 1024
"""IDs below this may sort as a bit set (set K bits, scan the words); a sort's result does not depend on how."""
DICTIONARY: Final = 4
"""Layer mode bit (payload version 2): the gaps section holds the layer's distinct rows, most used first, and an
index names each unique row's."""
MAX_ENTRIES: Final = 1 << 16
"""A dictionary's most entries: an index is at most two bytes."""
MATCH_BYTES: Final = 1.4
INDEX_WEIGHT: Final = 0.7
LONG_RUN_BYTES: Final = 4.4
"""The dictionary's cost model, fitted by least squares to trial compressions (``tools/fit_dictionary_model.py``):
every chunk layer of the corpus in record order (286, both models) with and without a dictionary. Choosing by it,
the corpus is within 0.05 % of the better of the two per layer (97 % of the choices agree), and the rows the
corpus' store holds (not in the fit) within 0.01 % (99 %). zstd matches a repeated row for about 1.4 bytes, and it
also matches repeated runs of indices, which the weight below 1 stands for. A layer gets a dictionary when
``INDEX_WEIGHT * index_bits / 8 + LONG_RUN_BYTES * long_runs < MATCH_BYTES * runs``."""
AUTO: Final = 0
NEVER: Final = 1
ALWAYS: Final = 2
"""Whether :func:`encode_chunk` gives layers dictionaries: where they pay, never, or wherever a row repeats."""

OK: Final = 0
UNKNOWN_MODE: Final = 1
SECTION_SIZES: Final = 2
FIRST_ROW_REPEATS: Final = 3
UNIQUE_COUNT: Final = 4
EXCEPTION_RANGE: Final = 5
RANK_RANGE: Final = 6
DICTIONARY_SIZE: Final = 7
DICTIONARY_INDEX: Final = 8
INVALID_ROW: Final = 9
PROBLEMS: Final = {
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
ANY_ROWS: Final = 0
SETS: Final = 1
SETS_OR_FILL: Final = 2
"""Which decoded rows :func:`decode_chunk` accepts (FORMAT.md sections 4 and 5: every stored row names K distinct
IDs in [0, E), ascending in a ``ranked_gaps`` chunk; edge padding is unspecified): any (the codec's own lossless
round trip of rows that are no set), only valid sets (a reader's window, which never covers padding), or also rows
an exception fills with the fill value alone (a whole chunk that zarr-python padded with its fill value)."""
ACCEPT: Final = {"any": ANY_ROWS, "sets": SETS, "sets_or_fill": SETS_OR_FILL}
"""Those rules by the names :data:`routelog.format.ranked.Accept` gives them."""


def compiled_module(name: str) -> ModuleType | None:
    """The compiled extension ``name`` (``routelog.format._ckernels``, ``routelog.audit._ckernels``), or None where
    it was not built or ``ROUTELOG_KERNELS=numpy`` asks for the numpy kernels."""
    if environment.kernels() == "numpy":
        return None
    try:
        return importlib.import_module(name)
    except ImportError:  # built without a compiler: the numpy kernels
        return None


_COMPILED = compiled_module("routelog.format._ckernels")
IMPLEMENTATION: Literal["compiled", "numpy"] = "numpy" if _COMPILED is None else "compiled"
"""Which kernels this process runs: ``"compiled"`` (built at install) or ``"numpy"``."""


def _numpy() -> ModuleType:
    from routelog.format import kernels_numpy

    return kernels_numpy


def encode_chunk(
    ids: npt.NDArray[Any], num_experts: int, dictionaries: int
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], int, int]:
    """The two sections of one chunk ``ids`` ``[L, R, K]`` (uint8 or uint16, native order; each layer's rows
    contiguous, the layers anywhere: a block of a part's array is read in place), as uint8 arrays: the
    gaps section and the rest (:mod:`routelog.format.ranked` has their layout); then the rows the gaps section holds,
    and how many of them repeat an earlier row of their layer (what zstd's matches can find).

    Per layer: repeats of the row before flagged in a bitmap, rows that are no valid set kept as exceptions, the
    expert load of a sample of the rows (a skewed layer's experts relabelled by popularity where that shrinks the
    estimated gaps by :data:`MIN_GAIN`), and a dictionary of the layer's distinct rows where naming them costs less
    than zstd's matches would (``dictionaries``: :data:`AUTO`, :data:`NEVER` or :data:`ALWAYS`).
    """
    if _COMPILED is None:
        result: tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], int, int] = _numpy().encode_chunk(
            ids, None, num_experts, dictionaries
        )
        return result
    gaps, rest, placed, matched = _COMPILED.encode_chunk(ids, num_experts, dictionaries)
    return np.frombuffer(gaps, np.uint8), np.frombuffer(rest, np.uint8), placed, matched


def decode_chunk(
    gap_bytes: npt.NDArray[np.uint8],
    rest: npt.NDArray[np.uint8],
    num_experts: int,
    layers: int,
    rows: int,
    out: npt.NDArray[Any],
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

    ``accept``: which rows the window may hold (:data:`SETS`, :data:`SETS_OR_FILL`: exception rows of
    ``fill_value`` alone too, or :data:`ANY_ROWS`), checked once the window is written (a forged table, gaps that
    pass E or wrap, a dictionary's entry or an exception may make any row). Returns (status, detail): :data:`OK`,
    or what is wrong with the payload (:data:`PROBLEMS`).
    """
    if _COMPILED is None:
        # rows of eight uint8 IDs as words: the compiled kernels' path, whose bytes for damaged rows the numpy one keeps
        words = out.view(np.uint64)[:, :, 0] if out.dtype.itemsize == 1 and out.shape[2] == 8 else None
        found: tuple[int, int] = _numpy().decode_chunk(
            gap_bytes, rest, num_experts, layers, rows, out, words, first_layer, first_row, accept, fill_value
        )
        return found
    status, detail = _COMPILED.decode_chunk(
        gap_bytes, rest, num_experts, layers, rows, out, first_layer, first_row, accept, fill_value
    )
    return int(status), int(detail)


def sort_rows_of_eight(ids: npt.NDArray[Any], out: npt.NDArray[Any], tokens: int, layers: int, largest: int) -> int:
    """Each row of eight uint8 or uint16 IDs sorted ascending: ``ids`` flat in token order ``[tokens, layers, 8]``
    (as engines hand them out), ``out`` flat in layer order ``[layers, tokens, 8]`` (as parts store them). Returns
    the index of the first row, in ``ids``' order (``token * layers + layer``), holding an ID above ``largest`` or a
    repeated ID; -1 when every row is a valid set."""
    if _COMPILED is None:
        bad: int = _numpy().sort_rows_of_eight(ids, out, tokens, layers, ids.dtype.type(largest))
        return int(bad)
    return int(_COMPILED.sort_rows_of_eight(ids, out, tokens, layers, largest))


def first_invalid_row(ids: npt.NDArray[Any], num_experts: int, ascending: bool) -> int:
    """The first row of ``ids`` ``[L, R, K]`` (uint8 or uint16, any strides) that is no valid stored row, as
    ``layer * R + row``, or -1: a row names K distinct IDs below ``num_experts``, strictly ascending when
    ``ascending`` (``sorted_gaps``; the ``none`` transform keeps the engine's score order)."""
    if _COMPILED is None:
        bad: int = _numpy().first_invalid_row(ids, None, num_experts, ascending)
        return int(bad)
    return int(_COMPILED.first_invalid_row(ids, num_experts, ascending))
