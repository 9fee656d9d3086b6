"""The ``ranked_context`` chunk codec (store format revisions 3.1 to 3.4): a model each part stores once, chunks
coded by it.

Routing in trained MoE models repeats itself across a part far more than within one chunk: the same token tends to
take the same few sets wherever it recurs, a set in one layer tends to follow the same sets in the layer below, and
a layer's sets recur across tokens. Format 2 (:mod:`routelog.format.ranked`) codes each 4096-row chunk alone and
never looks at the token ids stored beside the routing. Here a part stores, per layer, a **model**:

* the layer's **list**: every set its rows use at least :data:`LIST_MIN_USES` times in the part, those its rows
  name by their place in the list (no candidate names them) most often first (:func:`by_list_coding`);
* each token id's **candidates**: the listed sets its rows take at least twice, most used first (at most
  :data:`MAX_TOKEN_CANDIDATES`);
* where the layer below is in the same chunk, each listed set of the layer below's candidates: the listed sets that
  follow it at least twice in the same row (at most :data:`MAX_BELOW_CANDIDATES`).

A chunk layer's rows are then coded one after the other, each as the first of these that names its set: one of
its row below's candidates, one of its token's, its place in the list (Elias-gamma), or an escape: a set the model
does not list, coded beside the decisions (below). Each decision is a bit of a binary range
coder whose probability adapts within the chunk layer and starts at one half in each: a chunk decodes alone, given
its part's model and the token ids of its rows (which the part's index holds).

The escaped rows are sets the part uses once, so no repeat is there for a dictionary coder to find; what they share
is the layer's expert popularity. A chunk of version 2 (revision 3.2) codes each layer's escaped rows with the same
range coder: a bit per expert, in the layer's order (its experts by how often the model's list names them), with a
context per (place in the order, experts found so far), stopping when the row's K are found. Probabilities adapt as
counts would, so the coder learns the layer's popularity within the chunk layer; any stream decodes to valid sets.
On token-dependent routing over a 150k vocabulary (issue #33) escapes are 63 % of the rows, and this codes them in
3.8 bytes a row against format 2's 4.1. The price is speed: a decision per expert until the row's last (54 a row
there, 4-6 ns each). Version 1 (revision 3.1) kept escapes as a format-2 chunk; writers still use it past
:data:`ESCAPE_MAX_EXPERTS` experts, and for chunks whose layers list nothing (uniform routing, every row an escape:
1.02 x the entropy bound coded, 1.04 x as format 2, at a tenth of its speed). A model's lists are distinct sets
too: a model of version 2 codes each the same way, in expert-ID order (the lists are what the escapes' order is
taken from), 6-8 % smaller than as a format-2 chunk.

Most escapes of real routing are not new sets, though: they are a set the row's token or row below usually takes
with an expert or two changed (on the DeepSeek-V3-style corpus, 70 % of them share 5 or more of their 8 experts with
a candidate of theirs). A chunk of version 3 (revision 3.3) codes each escaped row against a **reference**, the
candidate sharing most experts with it (where one shares at least half): which candidate, which of its experts the
row keeps, then the ones it adds in the layer's order; rows without one are coded alone, as version 2 codes every
row. The decoder knows each escaped row's candidates from its token and row below, as the decisions did. Measured
(``tools/bench_codec.py``'s corpora, the same models): chunks 11 % smaller than of version 2 on the DeepSeek-V3-style
corpus, 5 % on the Qwen3-MoE-style one; on token-dependent routing, whose escapes are drawn afresh rather than near
a candidate, within 0.1 %. A model of version 3 (revision 3.3) codes its lists the same way: each listed set against
the earlier set of its list that shares most experts with it (among the
:data:`~routelog.format.context_python.LIST_WINDOW` before it), coded as
the distance back (Elias-gamma) and the experts kept and added, or alone. On the DeepSeek-V3-style corpus 69 % of
the listed sets are an expert away from an earlier one, and the lists take 21 % fewer bytes.

A third of that corpus' escapes have no candidate sharing more than half their experts, yet a listed set shares 6
or 7 of their 8. A chunk of version 4 (revision 3.4) lets such a row take any listed set as its reference, named by
its place in the list (Elias-gamma). The writer searches the list's first
:data:`~routelog.format.context_python.LIST_SEARCH` sets and takes the one sharing most where what its bits would
cost (a dry run of the coder, its contexts as they stand) is below the row's alone: taken on overlap alone, listed
references made token-dependent routing's escapes (drawn afresh, near a popular set by chance) 2.8 % larger. A model
of version 4 range-codes its candidate tables too (key gaps, counts, candidates: Elias-gamma and unary with counted
contexts) instead of zstd over byte planes. Measured on the DeepSeek-V3-style corpus: chunks 3.4 % smaller, models
4.9 % smaller; token-dependent routing's chunks within 0.1 %.

Measured on the corpus (issue #33, B per routed token-layer, every byte of the model counted, chunks of version 1):
Qwen3-MoE-style 0.41, DeepSeek-V3-style 0.89, against format 2's 0.71 and 1.39 and zstd-19 of the whole array's
0.46 and 0.80.

Stored model (``routing/model``, little-endian): ``b"RLSM"``, u8 version (1; 2 where its lists are range-coded as
escapes are, in expert-ID order; 3 where each listed set is coded against an earlier one; 4 where its candidate
tables are range-coded too), three zero bytes, u32 L, u64 end offset of each layer's section (from the object's
start), u32 crc32c of those bytes; then each layer's section: u32 S (listed sets), u32 T (token keys), u32 B (below
keys), u32 n and the list ``[S, K]`` in n bytes (version 1: a format-2 chunk ``[1, S, K]``; versions 2 to 4: a
range-coded stream; none when S is 0), u32 m and m bytes of candidate tables: in version 4 a range-coded stream
(FORMAT.md section 5.1), in the others a zstd frame holding the integers: T token-id deltas (the first from 0) as
u32, T candidate counts as u8, the token candidates (list indices) as u32, B below keys' deltas (indices in the
layer below's list), B counts, the below candidates; each u32 array as its four byte planes (all low bytes first);
then u32 crc32c of the section. Stored chunk of version 1: u8 version 1, u32 U (the escape
rows' chunk has U rows per layer), u32 stream bytes per layer of the chunk, the streams, then (when U > 0) the
format-2 chunk ``[L, U, K]`` of each layer's escapes in row order, its unused rows padding. Of version 2, 3 or 4:
u8 version, u32 stream bytes per layer, u32 escape-stream bytes per layer, the streams, the escape streams.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import google_crc32c
import numpy as np
import numpy.typing as npt

from routelog.format import context_python, ranked, zstd_frames
from routelog.format.kernels import compiled_module
from routelog.format.limits import MAX_ZSTD_EXPANSION, check_count, most_decisions

MAX_TOKEN_CANDIDATES = context_python.MAX_TOKEN_CANDIDATES
"""Candidates a token may have in one layer's model (readers refuse more)."""
MAX_BELOW_CANDIDATES = context_python.MAX_BELOW_CANDIDATES
"""Candidates a set of the layer below may have."""
LIST_MIN_USES = 3
"""Uses in the part that put a set in the layer's list (writers' choice; a reader takes any model). Measured with
escapes of version 3 (``tools/bench_codec.py``'s archive): at 2, a set used twice costs its place in the list and
two indices, about what two escapes against their references cost; at 3 the DeepSeek-V3-style corpus' routing is
1.8 % smaller, the Qwen3-MoE-style one's 1.8 %, token-dependent routing over 150k tokens 0.8 % larger; at 4 and 5
the first grows again."""
CANDIDATE_MIN_USES = 2
"""Uses in the part that make a listed set a candidate under a token or a set below (writers' choice)."""
CONTEXT_CODEC = "routelog.ranked_context"
"""The codec's name in ``zarr.json``."""
MAGIC = b"RLSM"
MODEL_VERSION = 1
"""Models whose lists are format-2 chunks (revision 3.1; still written where E > :data:`ESCAPE_MAX_EXPERTS`)."""
MODEL_VERSION_CODED_LISTS = 2
"""Models whose lists are range-coded as escapes are, in expert-ID order (revision 3.2)."""
MODEL_VERSION_REFERENCED_LISTS = 3
"""Models whose listed sets are range-coded in expert-ID order, each against an earlier set of its list or alone
(revision 3.3)."""
MODEL_VERSION_CODED_TABLES = 4
"""Models of version 3 whose candidate tables are range-coded too (revision 3.4)."""
CODED_MODEL_VERSIONS = (MODEL_VERSION_CODED_LISTS, MODEL_VERSION_REFERENCED_LISTS, MODEL_VERSION_CODED_TABLES)
"""The model versions whose lists are range-coded (at most :data:`ESCAPE_MAX_EXPERTS` experts)."""
CHUNK_VERSION = 1
"""Chunks whose escapes are a format-2 chunk (revision 3.1; still written where E > :data:`ESCAPE_MAX_EXPERTS`)."""
CHUNK_VERSION_CODED_ESCAPES = 2
"""Chunks whose escapes are range-coded too, a stream per layer (revision 3.2)."""
CHUNK_VERSION_REFERENCED = 3
"""Chunks whose escapes are range-coded against a reference each, the candidate sharing most experts with them
(revision 3.3)."""
CHUNK_VERSION_LIST_REFERENCES = 4
"""Chunks of version 3 whose escapes may take any listed set as their reference too (revision 3.4)."""
CODED_VERSIONS = (CHUNK_VERSION_CODED_ESCAPES, CHUNK_VERSION_REFERENCED, CHUNK_VERSION_LIST_REFERENCES)
"""The chunk versions whose escapes are range-coded streams (at most :data:`ESCAPE_MAX_EXPERTS` experts)."""
ESCAPE_MAX_EXPERTS = 1024
"""The most experts a version-2 chunk may have (each escaped row costs up to E decisions)."""
MAX_TOKEN = context_python.MAX_TOKEN
MODEL_LEVEL = 19
"""zstd level of a stored model's integers and list (written once per part, read once per reader)."""

_COMPILED = compiled_module("routelog.format._ccontext")
IMPLEMENTATION = "numpy" if _COMPILED is None else "compiled"
"""Which passes this process runs: compiled (built at install) or Python (:mod:`routelog.format.context_python`)."""


class ContextFormatError(ValueError):
    """A model or chunk whose bytes do not decode (wrapped as corrupt data by callers)."""


@dataclass(frozen=True)
class LayerModel:
    """One layer's part of a model (see the module), with the lookups coding takes: the compiled passes' hash table
    of the token keys, made here, and the Python passes' containers, made when first asked for."""

    sets: npt.NDArray[Any]
    """The list, ``[S, K]`` sets in the storage dtype."""
    token_keys: npt.NDArray[np.int64]
    """Token ids with candidates, ascending."""
    token_offsets: npt.NDArray[np.uint32]
    """Key ``i``'s candidates are ``token_candidates[token_offsets[i]:token_offsets[i + 1]]``."""
    token_candidates: npt.NDArray[np.uint32]
    below_offsets: npt.NDArray[np.uint32]
    """Per set of the layer below's list (``[S_below + 1]``; ``[0]`` where the layer has no layer below in its
    chunk), where its candidates start in ``below_candidates``."""
    below_candidates: npt.NDArray[np.uint32]
    token_table: npt.NDArray[np.uint32] = field(init=False, repr=False, compare=False)
    """Open addressing over the token keys (a slot holds a key's position + 1; 0: empty), for the compiled passes."""
    _python: list[context_python.Tables] = field(default_factory=list, init=False, repr=False, compare=False)
    _orders: dict[int, npt.NDArray[np.uint16]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        table = np.zeros(_table_size(self.token_keys.size), np.uint32)
        if _COMPILED is not None:
            _COMPILED.hash_keys(self.token_keys, table)
        object.__setattr__(self, "token_table", table)

    @property
    def n_sets(self) -> int:
        return int(self.sets.shape[0])

    def _tables(self) -> tuple[Any, ...]:
        return (
            self.token_keys,
            self.token_table,
            self.token_offsets,
            self.token_candidates,
            self.below_offsets,
            self.below_candidates,
        )

    def python_tables(self) -> context_python.Tables:
        if not self._python:
            self._python.append(
                context_python.Tables(
                    self.n_sets,
                    self.token_keys,
                    self.token_offsets,
                    self.token_candidates,
                    self.below_offsets,
                    self.below_candidates,
                )
            )
        return self._python[0]

    def escape_order(self, num_experts: int) -> npt.NDArray[np.uint16]:
        """The order the layer's escaped rows are coded in: the experts by how often the listed sets name them,
        most first, ties by ID (no bytes stored: the list says which experts the layer uses most)."""
        if num_experts not in self._orders:
            uses = np.bincount(self.sets.reshape(-1).astype(np.int64), minlength=num_experts)[:num_experts]
            self._orders[num_experts] = np.argsort(-uses, kind="stable").astype(np.uint16)
        return self._orders[num_experts]

    @property
    def nbytes(self) -> int:
        """Memory the model holds (its arrays and lookup table)."""
        return int(sum(array.nbytes for array in self._tables()) + self.sets.nbytes)


def _table_size(keys: int) -> int:
    return 1 << max(1, math.ceil(math.log2(2 * keys))) if keys else 0


# -- building a model ----------------------------------------------------------------------------------------------
def build_layer(
    rows: npt.NDArray[Any], tokens: npt.NDArray[np.int64], below: npt.NDArray[np.int32] | None, below_sets: int
) -> tuple[LayerModel, npt.NDArray[np.int32]]:
    """One layer's model from its rows in the part ``[N, K]`` (sorted sets, storage dtype), each row's token id
    (-1: none) and, where the layer below is in the same chunk, each row's set in the layer below's list (-1: not
    listed) and that list's size. Returns the model and each row's set in the list (-1: an escape)."""
    n, k = rows.shape
    rows = np.ascontiguousarray(rows)
    ids, first = _distinct(rows.view(np.uint8).reshape(n, k * rows.dtype.itemsize))
    uses = np.bincount(ids, minlength=first.size) if n else np.zeros(0, np.int64)
    listed = np.flatnonzero(uses >= LIST_MIN_USES)
    order = listed[np.lexsort((first[listed], -uses[listed]))]
    place = np.full(first.size, -1, np.int32)
    place[order] = np.arange(order.size, dtype=np.int32)
    index = place[ids] if n else np.zeros(0, np.int32)
    sets = rows[first[order]]
    token_keys, token_offsets, token_candidates = _candidates(tokens, index, order.size, MAX_TOKEN_CANDIDATES)
    below_offsets = np.zeros(1, np.uint32)
    below_candidates = np.zeros(0, np.uint32)
    if below is not None:
        keys, offsets, below_candidates = _candidates(below.astype(np.int64), index, order.size, MAX_BELOW_CANDIDATES)
        counts = np.zeros(below_sets, np.int64)
        counts[keys] = np.diff(offsets.astype(np.int64))
        below_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
    model = LayerModel(sets, token_keys, token_offsets, token_candidates, below_offsets, below_candidates)
    return model, index


def _candidates(
    keys: npt.NDArray[np.int64], index: npt.NDArray[np.int32], sets: int, most: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint32], npt.NDArray[np.uint32]]:
    """The (key, listed set) pairs of the rows used at least :data:`CANDIDATE_MIN_USES` times, at most ``most`` per
    key, most used first (then first used): the keys ascending, their offsets and the sets."""
    chosen = (keys >= 0) & (index >= 0)
    pairs = keys[chosen] * max(sets, 1) + index[chosen]
    ids, first = _distinct(pairs.view(np.uint8).reshape(-1, 8))
    uses = np.bincount(ids, minlength=first.size) if pairs.size else np.zeros(0, np.int64)
    kept = np.flatnonzero(uses >= CANDIDATE_MIN_USES)
    pair = pairs[first[kept]]
    key, candidate = pair // max(sets, 1), pair % max(sets, 1)
    order = np.lexsort((first[kept], -uses[kept], key))
    key, candidate = key[order], candidate[order]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if key.size else np.zeros(0, np.int64)
    lengths = np.diff(np.r_[starts, key.size])
    rank = np.arange(key.size) - np.repeat(starts, lengths)
    offsets = np.concatenate([[0], np.cumsum(np.minimum(lengths, most))]).astype(np.uint32)
    return key[starts], offsets, candidate[rank < most].astype(np.uint32)


def _distinct(items: npt.NDArray[np.uint8]) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]:
    """Rows of bytes numbered in the order they first appear, and where each first appears."""
    n, width = items.shape
    if _COMPILED is None or n == 0:
        return context_python.distinct(np.ascontiguousarray(items).view(np.dtype((np.void, width))).reshape(-1))
    ids = np.empty(n, np.int32)
    first = np.empty(n, np.int64)
    found = _COMPILED.distinct(np.ascontiguousarray(items).reshape(-1), width, ids, first)
    return ids, first[:found]


# -- coding chunks ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerChunkPlan:
    """One layer chunk of a part's array planned for coding: its layers' models, each row's set in its layer's
    list ``[L, N]`` (-1: an escape), and each layer's decision streams, one per row chunk."""

    models: list[LayerModel]
    index: npt.NDArray[np.int32]
    streams: list[list[bytes]]
    chunk_rows: int
    tokens: npt.NDArray[np.int64]
    """Each row's token id (-1: none)."""


def plan_layers(rows: npt.NDArray[Any], tokens: npt.NDArray[np.int64], chunk_rows: int) -> LayerChunkPlan:
    """Build the models of a layer chunk's layers from their rows in the part ``[L, N, K]`` (sorted sets) and the
    rows' token ids, and code their decisions chunk by chunk. A layer keeps the candidates of the sets below it only
    where they save more bytes in its streams than they take in its model (where routing follows the token rather
    than the layer below, they cost more than they save). Each list is put in the order of :func:`by_list_coding`."""
    models: list[LayerModel] = []
    indexes: list[npt.NDArray[np.int32]] = []
    streams: list[list[bytes]] = []
    for j in range(rows.shape[0]):
        below = indexes[-1] if j else None
        built, built_index = build_layer(rows[j], tokens, below, models[-1].n_sets if j else 0)
        by_token = _token_hits(built, built_index, tokens)  # the same with candidates below and without
        model, index = _reordered(built, built_index, by_token | _below_hits(built, built_index, below))
        coded = _layer_streams(model, index, tokens, below, chunk_rows)
        if model.below_candidates.size:
            without = dataclasses.replace(
                built, below_offsets=np.zeros_like(built.below_offsets), below_candidates=_NO_CANDIDATES
            )
            alone, alone_index = _reordered(without, built_index, by_token)
            coded_alone = _layer_streams(alone, alone_index, tokens, below, chunk_rows)
            saved = sum(map(len, coded_alone)) - sum(map(len, coded))
            if saved <= _below_nbytes(model, alone):
                model, index, coded = alone, alone_index, coded_alone
        models.append(model)
        indexes.append(index)
        streams.append(coded)
    index = np.stack(indexes) if indexes else np.zeros((0, 0), np.int32)
    return LayerChunkPlan(models, index, streams, chunk_rows, tokens)


_NO_CANDIDATES = np.zeros(0, np.uint32)


def by_list_coding(
    model: LayerModel, index: npt.NDArray[np.int32], tokens: npt.NDArray[np.int64], below: npt.NDArray[np.int32] | None
) -> tuple[LayerModel, npt.NDArray[np.int32]]:
    """The model with its list reordered, and the rows' indices into it: the sets the rows name by their place in
    the list (no candidate of theirs) most often first, the rest in the order they had (most used first). The
    Elias-gamma code of a place is shorter the nearer the front; a set its rows mostly reach through a candidate
    need not be near it (measured: DeepSeek-V3-style corpus' decision streams 1.5 % smaller)."""
    return _reordered(model, index, _token_hits(model, index, tokens) | _below_hits(model, index, below))


def _token_hits(
    model: LayerModel, index: npt.NDArray[np.int32], tokens: npt.NDArray[np.int64]
) -> npt.NDArray[np.bool_]:
    """Which rows' sets are among their token's candidates."""
    at = _key_positions(model.token_keys, tokens)
    return _candidate_hits(at, model.token_offsets, model.token_candidates, index)


def _below_hits(
    model: LayerModel, index: npt.NDArray[np.int32], below: npt.NDArray[np.int32] | None
) -> npt.NDArray[np.bool_]:
    """Which rows' sets are among their row below's candidates (none without a layer below)."""
    if below is None:
        return np.zeros(index.size, bool)
    keys = model.below_offsets.size - 1  # the keys below are every index of the layer below's list
    at = np.where(below < keys, below, -1).astype(np.int64)
    return _candidate_hits(at, model.below_offsets, model.below_candidates, index)


def _reordered(
    model: LayerModel, index: npt.NDArray[np.int32], hit: npt.NDArray[np.bool_]
) -> tuple[LayerModel, npt.NDArray[np.int32]]:
    """:func:`by_list_coding` given which rows a candidate reaches (``hit``)."""
    if not model.n_sets:
        return model, index
    n = model.n_sets
    by_place = np.bincount(index[(index >= 0) & ~hit], minlength=n)
    order = np.lexsort((np.arange(n), -by_place))
    moved = np.empty(n, np.uint32)
    moved[order] = np.arange(n, dtype=np.uint32)
    reordered = LayerModel(
        model.sets[order],
        model.token_keys,
        model.token_offsets,
        moved[model.token_candidates],
        model.below_offsets,
        moved[model.below_candidates],
    )
    return reordered, np.where(index >= 0, moved[np.maximum(index, 0)].astype(np.int32), np.int32(-1))


def _key_positions(keys: npt.NDArray[np.int64], rows_keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Each row's key's position in ``keys`` (ascending), -1 where it is none of them: through a table over the
    keys' range where that is small (a vocabulary), else a binary search."""
    if not keys.size:
        return np.full(rows_keys.size, -1, np.int64)
    largest = int(keys[-1])
    if largest < _DENSE_KEYS:
        table = np.full(largest + 2, -1, np.int64)
        table[keys] = np.arange(keys.size)
        return table[np.clip(rows_keys, -1, largest + 1)]
    at = np.minimum(np.searchsorted(keys, rows_keys), keys.size - 1)
    return np.where(keys[at] == rows_keys, at, -1)


_DENSE_KEYS = 1 << 22
"""Token keys below this are looked up through a table (32 MiB at most)."""


def _candidate_hits(
    at: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.uint32],
    candidates: npt.NDArray[np.uint32],
    index: npt.NDArray[np.int32],
) -> npt.NDArray[np.bool_]:
    """Which rows' sets (``index``) are among the candidates of their key, at its position ``at`` (-1: none) in a
    table whose key ``i`` has ``candidates[offsets[i]:offsets[i + 1]]``."""
    hit = np.zeros(index.size, bool)
    if _COMPILED is not None:  # in one pass (numpy's loop over the candidates' ranks was a tenth of a write)
        contiguous = (np.ascontiguousarray(a) for a in (offsets, candidates, index))
        _COMPILED.candidate_hits(np.ascontiguousarray(at, np.int64), *contiguous, hit.view(np.uint8))
        return hit
    keyed = at >= 0
    if not candidates.size or not keyed.any():
        return hit
    rows = np.flatnonzero(keyed)
    start = offsets[at[rows]].astype(np.int64)
    count = offsets[at[rows] + 1].astype(np.int64) - start
    wanted = index[rows]
    for i in range(int(count.max())):
        has = count > i
        hit[rows[has]] |= candidates[start[has] + i] == wanted[has]
    return hit


def _layer_streams(
    model: LayerModel,
    index: npt.NDArray[np.int32],
    tokens: npt.NDArray[np.int64],
    below: npt.NDArray[np.int32] | None,
    chunk_rows: int,
) -> list[bytes]:
    n = index.size
    return [
        _encode_layer(
            index[r0 : r0 + chunk_rows],
            model,
            tokens[r0 : r0 + chunk_rows],
            _NO_ROWS if below is None else below[r0 : r0 + chunk_rows],
        )
        for r0 in range(0, max(n, 1), chunk_rows)
    ]


def _below_nbytes(model: LayerModel, alone: LayerModel) -> int:
    """What a layer's below candidates add to its stored model: its range-coded tables (model version 4) with them
    and without (for a model of version 1, with its tables through zstd, a close estimate)."""
    return len(_encode_tables(model)) - len(_encode_tables(alone))


def chunk_pieces(
    plan: LayerChunkPlan,
    row_chunk: int,
    rows: npt.NDArray[Any],
    num_experts: int,
    level: int = 3,
    version: int | None = None,
) -> list[bytes]:
    """The stored bytes of the plan's row chunk ``row_chunk``, in pieces: ``rows`` are its rows ``[L, R, K]`` (the
    array's, no padding). ``version``: 4 (escapes range-coded against candidates or listed sets), 3 (against
    candidates), 2 (range-coded alone) or 1 (escapes in a format-2 chunk at zstd ``level``); by default version 4
    where :func:`codes_escapes` and a layer of the chunk lists a set. Where none does (uniform routing: nothing
    recurs, every row escapes) the range coder would save 2 % of the bytes at a tenth of format 2's speed, so the
    chunk stays version 1."""
    r0 = row_chunk * plan.chunk_rows
    index = plan.index[:, r0 : r0 + rows.shape[1]]
    streams = [layer[row_chunk] for layer in plan.streams]
    if version is None:
        coded = codes_escapes(num_experts) and any(model.n_sets for model in plan.models)
        version = CHUNK_VERSION_LIST_REFERENCES if coded else CHUNK_VERSION
    if version in CODED_VERSIONS:
        tokens = plan.tokens[r0 : r0 + rows.shape[1]]
        return _assemble_coded(rows, index, streams, plan.models, num_experts, tokens, version)
    return _assemble(rows, index, streams, num_experts, level)


def codes_escapes(num_experts: int) -> bool:
    """Whether a writer codes a chunk's escapes with the range coder (version 2) for this many experts."""
    return num_experts <= ESCAPE_MAX_EXPERTS


def _assemble_coded(
    rows: npt.NDArray[Any],
    index: npt.NDArray[np.int32],
    streams: Sequence[bytes],
    models: Sequence[LayerModel],
    num_experts: int,
    tokens: npt.NDArray[np.int64],
    version: int,
) -> list[bytes]:
    """A chunk of ``version`` 2, 3 or 4: each layer's decisions, then each layer's escaped rows as a range-coded
    stream, alone or against references (``tokens``: the rows' token ids)."""
    escapes = []
    for j in range(rows.shape[0]):
        escaped = index[j] < 0
        order = models[j].escape_order(num_experts)
        if version == CHUNK_VERSION_CODED_ESCAPES:
            escapes.append(_encode_escapes(rows[j][escaped], order, num_experts))
        else:
            below = index[j - 1][escaped] if j else _NO_ROWS
            lists = version == CHUNK_VERSION_LIST_REFERENCES
            escaped_rows = rows[j][escaped]
            escapes.append(
                _encode_referenced(escaped_rows, order, num_experts, models[j], tokens[escaped], below, lists)
            )
    head = bytearray([version])
    for stream in [*streams, *escapes]:
        head += len(stream).to_bytes(4, "little")
    return [bytes(head), *streams, *escapes]


def _stream(encode: Callable[[npt.NDArray[np.uint8]], int], rows: int, k: int, num_experts: int) -> bytes:
    """A counted coder's stream of ``rows`` rows, written by ``encode`` into a buffer it returns the bytes written to
    (-1: too small): first room for 4 bytes an ID, far more than a stream takes; then the bound, every bit at its
    dearest (15 bits) for every expert of every row, never reached."""
    return _written(encode, rows * k * 4 + 64, rows * num_experts * 2 + 64)


def _written(encode: Callable[[npt.NDArray[np.uint8]], int], first: int, bound: int) -> bytes:
    """What ``encode`` writes into a buffer of ``first`` bytes, or where that is too small (it returns -1) of
    ``bound``."""
    out = np.empty(first, np.uint8)
    written = encode(out)
    if written < 0:
        out = np.empty(bound, np.uint8)
        written = encode(out)
    return out[:written].tobytes()


def _encode_escapes(rows: npt.NDArray[Any], order: npt.NDArray[np.uint16], num_experts: int) -> bytes:
    rows = np.ascontiguousarray(rows)
    if _COMPILED is None:
        return context_python.encode_escapes(rows, order.tolist(), num_experts)
    n, k = rows.shape
    flat = rows.reshape(-1)
    return _stream(lambda out: int(_COMPILED.encode_escapes(flat, k, num_experts, order, out)), n, k, num_experts)


def _decode_escapes(
    stream: npt.NDArray[np.uint8], out: npt.NDArray[Any], order: npt.NDArray[np.uint16], num_experts: int
) -> None:
    if _COMPILED is None:
        context_python.decode_escapes(stream.tobytes(), out, order.tolist(), num_experts)
    else:
        _COMPILED.decode_escapes(stream, out.shape[1], num_experts, order, out.reshape(-1))


def _encode_list(sets: npt.NDArray[Any], num_experts: int) -> bytes:
    sets = np.ascontiguousarray(sets)
    order = _id_order(num_experts)
    if _COMPILED is None:
        return context_python.encode_list(sets, order.tolist(), num_experts)
    n, k = sets.shape
    flat = sets.reshape(-1)
    return _stream(lambda out: int(_COMPILED.encode_list(flat, k, num_experts, order, out)), n, k, num_experts)


def _decode_list(stream: npt.NDArray[np.uint8], out: npt.NDArray[Any], num_experts: int) -> int:
    """A version-3 list into ``out``: the set whose reference lies before the list's start, or -1."""
    order = _id_order(num_experts)
    if _COMPILED is None:
        _, stopped = context_python.decode_list(stream.tobytes(), out, order.tolist(), num_experts)
    else:
        _, stopped = _COMPILED.decode_list(stream, out.shape[1], num_experts, order, out.reshape(-1))
    return int(stopped)


def _encode_referenced(
    rows: npt.NDArray[Any],
    order: npt.NDArray[np.uint16],
    num_experts: int,
    model: LayerModel,
    tokens: npt.NDArray[np.int64],
    below: npt.NDArray[np.int32],
    lists: bool,
) -> bytes:
    rows, tokens, below = (np.ascontiguousarray(a) for a in (rows, tokens, below))
    if _COMPILED is None:
        return context_python.encode_referenced(
            rows, order.tolist(), num_experts, model.sets, model.python_tables(), tokens, below, lists
        )
    n, k = rows.shape
    sets = np.ascontiguousarray(model.sets).reshape(-1)
    args = (rows.reshape(-1), k, num_experts, order, sets, tokens, below, *model._tables())
    return _stream(lambda out: int(_COMPILED.encode_referenced(*args, out, lists)), n, k, num_experts)


def _decode_referenced(
    stream: npt.NDArray[np.uint8],
    out: npt.NDArray[Any],
    order: npt.NDArray[np.uint16],
    num_experts: int,
    model: LayerModel,
    tokens: npt.NDArray[np.int64],
    below: npt.NDArray[np.int32],
    lists: bool,
) -> None:
    tokens, below = np.ascontiguousarray(tokens), np.ascontiguousarray(below)
    if _COMPILED is None:
        tables = model.python_tables()
        context_python.decode_referenced(
            stream.tobytes(), out, order.tolist(), num_experts, model.sets, tables, tokens, below, lists
        )
    else:
        sets = np.ascontiguousarray(model.sets).reshape(-1)
        _COMPILED.decode_referenced(
            stream, out.shape[1], num_experts, order, sets, tokens, below, *model._tables(), out.reshape(-1), lists
        )


def _assemble(
    rows: npt.NDArray[Any], index: npt.NDArray[np.int32], streams: Sequence[bytes], num_experts: int, level: int
) -> list[bytes]:
    layers, _, k = rows.shape
    escapes = [rows[j][index[j] < 0] for j in range(layers)]
    most = max((e.shape[0] for e in escapes), default=0)
    head = bytearray([CHUNK_VERSION])
    head += most.to_bytes(4, "little")
    for stream in streams:
        head += len(stream).to_bytes(4, "little")
    pieces = [bytes(head), *streams]
    if most:
        block = np.empty((layers, most, k), rows.dtype)
        for j, escaped in enumerate(escapes):
            block[j, : escaped.shape[0]] = escaped
            block[j, escaped.shape[0] :] = escaped[-1] if escaped.shape[0] else np.arange(k, dtype=rows.dtype)
        pieces += ranked.encode_pieces(block, num_experts, level=level)
    return pieces


_NO_ROWS = np.zeros(0, np.int32)


def _encode_layer(
    index: npt.NDArray[np.int32], model: LayerModel, tokens: npt.NDArray[np.int64], below: npt.NDArray[np.int32]
) -> bytes:
    index = np.ascontiguousarray(index)
    tokens = np.ascontiguousarray(tokens)
    below = np.ascontiguousarray(below)
    if _COMPILED is None:
        return context_python.encode_layer(index, model.python_tables(), tokens, below)
    out = np.empty(index.size * 72 + 16, np.uint8)
    written = _COMPILED.encode_layer(index, model.n_sets, tokens, below, *model._tables(), out)
    if written < 0:  # pragma: no cover - the bound above holds for every model a reader accepts
        raise ValueError("encode_layer: the stream outgrew its bound")
    return out[:written].tobytes()


def decode_chunk(
    payload: bytes | memoryview | npt.NDArray[np.uint8],
    shape: tuple[int, int, int],
    dtype: np.dtype[Any],
    num_experts: int,
    tokens: npt.NDArray[np.int64],
    models: Sequence[LayerModel],
    out: npt.NDArray[Any] | None = None,
    window: ranked.Window | None = None,
) -> npt.NDArray[Any]:
    """The rows of a chunk of ``shape`` ``[L, R, K]`` (the array's rows it holds, no padding), or of its
    ``window``, from :func:`chunk_pieces`' bytes, the rows' token ids and the layers' models; into ``out`` when
    given (each layer's rows contiguous). Raises :class:`ContextFormatError` on bytes that do not decode."""
    layers, n, k = shape
    l0, l1, r0, r1 = ranked.window_bounds(window, layers, n)
    target = np.empty((l1 - l0, r1 - r0, k), dtype) if out is None else out
    data = np.frombuffer(payload, np.uint8) if not isinstance(payload, np.ndarray) else payload
    version = int(data[0]) if data.size else None
    if version in CODED_VERSIONS:
        if not codes_escapes(num_experts):
            raise ContextFormatError(
                f"a version-{version} chunk of {num_experts} experts (at most {ESCAPE_MAX_EXPERTS})"
            )
        head = 1 + 8 * layers
        sizes = np.frombuffer(data[1:head].tobytes(), "<u4").astype(np.int64) if data.size >= head else None
        if sizes is None or head + int(sizes.sum()) != data.size:
            raise ContextFormatError("the chunk's streams do not add up to its bytes")
        ends = head + np.cumsum(sizes)
    elif version == CHUNK_VERSION:
        head = 5 + 4 * layers
        if data.size < head:
            raise ContextFormatError("a short chunk")
        most = int.from_bytes(data[1:5].tobytes(), "little")
        if most > n:  # compared here first: this runs once a chunk
            check_count(
                most,
                name="U (escaped rows a layer)",
                at_most=n,
                where="the chunk",
                expected=f"the chunk's {n} rows",
                error=ContextFormatError,
            )
        sizes = np.frombuffer(data[5:head].tobytes(), "<u4").astype(np.int64)
        ends = head + np.cumsum(sizes)
        streams_end = int(ends[-1]) if layers else head
        if streams_end > data.size or (most and streams_end == data.size):
            raise ContextFormatError("the chunk's streams and escapes do not add up to its bytes")
    else:
        raise ContextFormatError(f"unknown chunk version {version}")
    index = np.empty((l1, r1), np.int32)
    for j in range(l1):
        stream = data[ends[j] - sizes[j] : ends[j]]
        below = index[j - 1] if j else _NO_ROWS
        status, row = _decode_layer(stream, models[j], tokens[:r1], below, index[j])
        if status != context_python.OK:
            problem = "names no listed set" if status == context_python.INDEX_RANGE else "has no end"
            raise ContextFormatError(f"layer {j} row {row}: the stream's index {problem}")
    escaped = index[l0:l1] < 0
    before = escaped[:, :r0].sum(axis=1)
    needed = escaped.sum(axis=1)
    escapes: list[npt.NDArray[Any]] = []
    if version in CODED_VERSIONS:
        for j in range(l0, l1):
            found = np.empty((int(needed[j - l0]), k), dtype)
            if found.size:
                stream = data[ends[layers + j] - sizes[layers + j] : ends[layers + j]]
                order = models[j].escape_order(num_experts)
                if version == CHUNK_VERSION_CODED_ESCAPES:
                    _decode_escapes(stream, found, order, num_experts)
                else:
                    here = escaped[j - l0]  # the layer's escaped rows up to r1, in row order
                    below = index[j - 1][here] if j else _NO_ROWS
                    try:
                        lists = version == CHUNK_VERSION_LIST_REFERENCES
                        _decode_referenced(
                            stream, found, order, num_experts, models[j], tokens[:r1][here], below, lists
                        )
                    except ValueError as exc:
                        raise ContextFormatError(f"layer {j}'s escapes: {exc}") from exc
            escapes.append(found)
    elif needed.size and needed.max():
        if needed.max() > most:
            raise ContextFormatError(f"the streams escape {int(needed.max())} rows of a layer, the chunk stores {most}")
        try:
            block = ranked.decode(
                data[streams_end:], (layers, most, k), dtype, num_experts, window=((l0, l1), (0, int(needed.max())))
            )
        except ranked.RankedFormatError as exc:
            raise ContextFormatError(f"the escapes: {exc}") from exc
        escapes = [block[j, : needed[j]] for j in range(l1 - l0)]
    for j in range(l1 - l0):
        model = models[l0 + j]
        rows_index = index[l0 + j, r0:r1]
        escaped_here = int(needed[j] - before[j])
        if escaped_here == r1 - r0 and escaped_here:  # every row escapes (no set recurs: uniform routing)
            target[j] = escapes[j][before[j] :]
            continue
        layer = target[j]
        rest = escapes[j][before[j] :] if escaped_here else model.sets[:0]
        if _COMPILED is not None and layer.flags.c_contiguous and model.sets.dtype == rest.dtype == layer.dtype:
            try:  # the listed set or next escape of each row in one pass (numpy's take and masks: a tenth of it)
                _COMPILED.place_rows(
                    np.ascontiguousarray(rows_index),
                    np.ascontiguousarray(model.sets).reshape(-1),
                    np.ascontiguousarray(rest).reshape(-1),
                    layer.reshape(-1),
                    k,
                )
            except ValueError as exc:  # pragma: no cover - the streams' indices and escapes were checked above
                raise ContextFormatError(f"layer {l0 + j}: {exc}") from exc
            continue
        if model.n_sets:
            np.take(model.sets, np.maximum(rows_index, 0), axis=0, out=target[j])
        if escaped_here:
            target[j][rows_index < 0] = escapes[j][before[j] :]
    return target


def _decode_layer(
    stream: npt.NDArray[np.uint8],
    model: LayerModel,
    tokens: npt.NDArray[np.int64],
    below: npt.NDArray[np.int32],
    index: npt.NDArray[np.int32],
) -> tuple[int, int]:
    if _COMPILED is None:
        return context_python.decode_layer(stream.tobytes(), model.python_tables(), tokens, below, index)
    status, row = _COMPILED.decode_layer(stream, model.n_sets, tokens, below, *model._tables(), index)
    return int(status), int(row)


# -- the stored model ------------------------------------------------------------------------------------------------
def encode_model(
    layers: Sequence[LayerModel], num_experts: int, level: int = MODEL_LEVEL, version: int | None = None
) -> bytes:
    """The stored model object of an array's layers (see the module) of ``version``: by default 3 (each listed set
    range-coded against an earlier one) where :func:`codes_escapes`, else 1 (its lists format-2 chunks)."""
    if version is None:
        version = MODEL_VERSION_CODED_TABLES if codes_escapes(num_experts) else MODEL_VERSION
    sections = [_encode_section(model, num_experts, level, version) for model in layers]
    head = bytearray(MAGIC + bytes([version, 0, 0, 0]) + len(layers).to_bytes(4, "little"))
    end = model_header_nbytes(len(layers))
    for section in sections:
        end += len(section)
        head += end.to_bytes(8, "little")
    head += int(google_crc32c.value(bytes(head))).to_bytes(4, "little")
    return bytes(head) + b"".join(sections)


def model_header_nbytes(layers: int) -> int:
    """Bytes of a model's head (magic, version, layers, section ends, checksum): a reader fetches it first."""
    return 12 + 8 * layers + 4


def _encode_section(model: LayerModel, num_experts: int, level: int, version: int) -> bytes:
    below_keys = np.flatnonzero(np.diff(model.below_offsets.astype(np.int64)))
    sets = b""
    if model.n_sets and version in (MODEL_VERSION_REFERENCED_LISTS, MODEL_VERSION_CODED_TABLES):
        sets = _encode_list(model.sets, num_experts)
    elif model.n_sets and version == MODEL_VERSION_CODED_LISTS:  # distinct sets, range-coded as escapes, ID order
        sets = _encode_escapes(model.sets, _id_order(num_experts), num_experts)
    elif model.n_sets:
        sets = b"".join(ranked.encode_pieces(np.ascontiguousarray(model.sets[None]), num_experts, level=level))
    if version == MODEL_VERSION_CODED_TABLES:
        frame = _encode_tables(model)
    else:
        integers = _integers(model)
        frame = zstd_frames.compress(integers, level) if integers else b""
    body = b"".join(
        [
            model.n_sets.to_bytes(4, "little"),
            model.token_keys.size.to_bytes(4, "little"),
            below_keys.size.to_bytes(4, "little"),
            len(sets).to_bytes(4, "little"),
            sets,
            len(frame).to_bytes(4, "little"),
            frame,
        ]
    )
    return body + int(google_crc32c.value(body)).to_bytes(4, "little")


def _integers(model: LayerModel) -> bytes:
    """A section's integers before compression (see the module)."""
    below_counts = np.diff(model.below_offsets.astype(np.int64))
    below_keys = np.flatnonzero(below_counts)
    return b"".join(
        [
            _planes(np.diff(model.token_keys, prepend=0)),
            np.diff(model.token_offsets.astype(np.int64)).astype(np.uint8).tobytes(),
            _planes(model.token_candidates),
            _planes(np.diff(below_keys, prepend=0)),
            below_counts[below_keys].astype(np.uint8).tobytes(),
            _planes(model.below_candidates),
        ]
    )


def _planes(values: npt.NDArray[Any]) -> bytes:
    """u32 values as their four byte planes, low bytes first (zstd then sees the mostly-zero high planes apart)."""
    return np.ascontiguousarray(values.astype("<u4").view(np.uint8).reshape(-1, 4).T).tobytes()


def _from_planes(data: npt.NDArray[np.uint8], count: int) -> npt.NDArray[np.int64]:
    return np.ascontiguousarray(data[: 4 * count].reshape(4, count).T).view("<u4").reshape(-1).astype(np.int64)


def _id_order(num_experts: int) -> npt.NDArray[np.uint16]:
    return np.arange(num_experts, dtype=np.uint16)


class ModelHead(NamedTuple):
    """A model object's head, checked: its version and each layer section's end offset."""

    version: int
    ends: npt.NDArray[np.int64]


def read_model_head(head: bytes | memoryview, layers: int, size: int, num_experts: int) -> ModelHead:
    """The version and each layer section's end offset of a model object of ``size`` bytes, from its head
    (:func:`model_header_nbytes` bytes), checked: magic, version (2 and 3 only where :func:`codes_escapes`), layers,
    checksum, ascending ends inside it."""
    head = bytes(head)
    expected = model_header_nbytes(layers)
    if len(head) != expected or head[:4] != MAGIC:
        raise ContextFormatError("not a routelog set model")
    if head[4] not in (MODEL_VERSION, *CODED_MODEL_VERSIONS):
        raise ContextFormatError(f"unknown set model version {head[4]}")
    if head[4] in CODED_MODEL_VERSIONS and not codes_escapes(num_experts):
        raise ContextFormatError(
            f"a version-{head[4]} set model of {num_experts} experts (at most {ESCAPE_MAX_EXPERTS})"
        )
    if google_crc32c.value(head[:-4]) != int.from_bytes(head[-4:], "little"):
        raise ContextFormatError("the set model's head fails its checksum")
    if int.from_bytes(head[8:12], "little") != layers:
        raise ContextFormatError(f"the set model holds {int.from_bytes(head[8:12], 'little')} layers, not {layers}")
    ends = np.frombuffer(head[12:-4], "<u8").astype(np.int64)
    starts = np.r_[expected, ends[:-1]]
    if (ends < starts + 20).any() or (layers and ends[-1] != size):
        raise ContextFormatError("the set model's sections do not tile the object")
    return ModelHead(head[4], ends)


def decode_section(
    data: bytes | memoryview,
    layer: int,
    rows: int,
    topk: int,
    dtype: np.dtype[Any],
    num_experts: int,
    below_sets: int | None,
    version: int = MODEL_VERSION,
) -> LayerModel:
    """One layer's model from its section's bytes (checksum included) in a model of ``version``, checked before
    use: at most ``rows`` sets and token keys (the array's rows: a set is listed for two rows at least), and no more
    than the section's bytes can code (:func:`_check_section_counts`), valid sets, ascending keys, counts within the
    limits, candidates inside the list. ``below_sets``: the layer below's list size where the layer has one in its
    chunk, else None."""
    section = np.frombuffer(data, np.uint8)
    where = f"layer {layer}'s model"
    if section.size < 24 or google_crc32c.value(section[:-4].tobytes()) != int.from_bytes(
        section[-4:].tobytes(), "little"
    ):
        raise ContextFormatError(f"{where} fails its checksum")
    n_sets, n_keys, n_below, sets_nbytes = (int(n) for n in np.frombuffer(section[:16].tobytes(), "<u4"))
    at = 16 + sets_nbytes
    if at + 4 > section.size - 4:
        raise ContextFormatError(f"{where}: its sections pass its end")
    frame_nbytes = int.from_bytes(section[at : at + 4].tobytes(), "little")
    if at + 4 + frame_nbytes != section.size - 4:
        raise ContextFormatError(f"{where}: its sections do not add up to its bytes")
    _check_section_counts(
        (n_sets, n_keys, n_below), rows, below_sets, (sets_nbytes, frame_nbytes), topk * dtype.itemsize, version, where
    )
    sets = np.zeros((0, topk), dtype)
    if n_sets and version == MODEL_VERSION_CODED_LISTS:  # any stream decodes to valid sets
        sets = np.empty((n_sets, topk), dtype)
        _decode_escapes(section[16:at], sets, _id_order(num_experts), num_experts)
    elif n_sets and version in (MODEL_VERSION_REFERENCED_LISTS, MODEL_VERSION_CODED_TABLES):
        sets = np.empty((n_sets, topk), dtype)
        stopped = _decode_list(section[16:at], sets, num_experts)
        if stopped >= 0:
            raise ContextFormatError(f"{where}'s list: set {stopped} refers to a set before the list's start")
    elif n_sets:
        try:
            sets = ranked.decode(section[16:at], (1, n_sets, topk), dtype, num_experts, accept="sets")[0]
        except ranked.RankedFormatError as exc:
            raise ContextFormatError(f"{where}'s list: {exc}") from exc
    frame = section[at + 4 : at + 4 + frame_nbytes]
    if version == MODEL_VERSION_CODED_TABLES:
        return _decode_tables(frame, sets, n_keys, n_below, below_sets, where)
    bound = n_keys * (5 + 4 * MAX_TOKEN_CANDIDATES) + n_below * (5 + 4 * MAX_BELOW_CANDIDATES)
    integers = np.zeros(0, np.uint8)
    if frame_nbytes:
        try:
            integers = zstd_frames.decompress(frame, bound, "set model", sized=True)
        except zstd_frames.FrameError as exc:
            raise ContextFormatError(f"{where}: {exc}") from exc
    reader = _Integers(integers, where)
    keys = np.cumsum(reader.planes(n_keys))
    counts = reader.bytes(n_keys)
    candidates = reader.planes(int(counts.sum()))
    below_keys = np.cumsum(reader.planes(n_below))
    below_counts = reader.bytes(n_below)
    below_candidates = reader.planes(int(below_counts.sum()))
    reader.done()
    if (
        (keys.size and (keys[-1] > MAX_TOKEN or (np.diff(keys) < 1).any()))
        or (counts < 1).any()
        or (counts > MAX_TOKEN_CANDIDATES).any()
        or (candidates >= n_sets).any()
        or (below_keys.size and (below_keys[-1] >= (below_sets or 0) or (np.diff(below_keys) < 1).any()))
        or (below_counts < 1).any()
        or (below_counts > MAX_BELOW_CANDIDATES).any()
        or (below_candidates >= n_sets).any()
    ):
        raise ContextFormatError(f"{where}: keys out of order, counts or candidates outside their limits")
    below_offsets = np.zeros(1, np.uint32)
    if below_sets is not None:
        dense = np.zeros(below_sets, np.int64)
        dense[below_keys] = below_counts
        below_offsets = np.concatenate([[0], np.cumsum(dense)]).astype(np.uint32)
    return LayerModel(
        sets,
        keys.astype(np.int64),
        np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32),
        candidates.astype(np.uint32),
        below_offsets,
        below_candidates.astype(np.uint32),
    )


_TABLE_ENTRY_NBYTES = 9
"""The least a token key (or a key below) takes among a zstd-coded section's integers: its delta (4 bytes), its count
(1) and one candidate (4)."""


def _check_section_counts(
    counts: tuple[int, int, int],
    rows: int,
    below_sets: int | None,
    nbytes: tuple[int, int],
    set_nbytes: int,
    version: int,
    where: str,
) -> None:
    """A section's head, checked before anything is allocated or decoded for it: its sets ``S``, token keys ``T``
    and keys below ``B`` (``counts``) within the array's ``rows`` (a set is listed for two rows at least; a key is a
    row's token), the layer below's list, and what the list's and the tables' bytes (``nbytes``) can code
    (:func:`~routelog.format.limits.most_decisions`): a listed set, distinct from the others, decodes to
    ``set_nbytes`` (``K`` IDs) from a zstd frame (model version 1), or codes a 1 in a range-coded list (all but one:
    only one set codes as 0s alone); a key decodes to :data:`_TABLE_ENTRY_NBYTES` from a zstd frame (versions 1 to
    3), or codes a decision in a range-coded table (version 4; keys at the end of the tables, each one past the key
    before with the first listed set as its only candidate, code only 0s: the bound allows 6400 of them)."""
    n_sets, n_keys, n_below = counts
    list_nbytes, tables_nbytes = nbytes
    if version == MODEL_VERSION:
        most_sets = list_nbytes * MAX_ZSTD_EXPANSION // set_nbytes
        sets_coded = f"a zstd-coded list of {list_nbytes} bytes, {set_nbytes} bytes a set"
    else:
        most_sets = 1 + most_decisions(list_nbytes)
        sets_coded = f"a range-coded list of {list_nbytes} bytes, a decision a set"
    if version == MODEL_VERSION_CODED_TABLES:
        most_keys = most_decisions(tables_nbytes)
        keys_coded = f"range-coded tables of {tables_nbytes} bytes, a decision a key"
    else:
        most_keys = tables_nbytes * MAX_ZSTD_EXPANSION // _TABLE_ENTRY_NBYTES
        keys_coded = f"zstd-coded tables of {tables_nbytes} bytes, {_TABLE_ENTRY_NBYTES} bytes a key"
    fields = [
        ("S (sets listed)", n_sets, min(rows, most_sets), f"the array's {rows} rows, and {sets_coded}"),
        ("T (token keys)", n_keys, min(rows, most_keys), f"the array's {rows} rows, and {keys_coded}"),
        (
            "B (keys below)",
            n_below,
            min(below_sets or 0, most_keys),
            f"the {below_sets or 0} sets below, and {keys_coded}",
        ),
    ]
    for name, value, at_most, expected in fields:
        check_count(value, name=name, at_most=at_most, where=where, expected=expected, error=ContextFormatError)


def _encode_tables(model: LayerModel) -> bytes:
    """A layer's candidate tables, range-coded (model version 4)."""
    below_sets = model.below_offsets.size - 1
    tables = (model.token_keys, model.token_offsets, model.token_candidates, model.below_offsets)
    if _COMPILED is None:
        keys, offsets, candidates, below_offsets = (t.tolist() for t in tables)
        below_candidates = model.below_candidates.tolist()
        return context_python.encode_tables(
            keys, offsets, candidates, below_offsets, below_candidates, model.n_sets, below_sets
        )
    values = model.token_keys.size + model.token_candidates.size + below_sets + model.below_candidates.size
    arrays = [np.ascontiguousarray(t) for t in (*tables, model.below_candidates)]
    # first room for about 60 bits a value, far more than they take; then the bound: 65 decisions of 15 bits a value
    return _written(
        lambda out: int(_COMPILED.encode_tables(*arrays, model.n_sets, below_sets, out)),
        8 * values + 64,
        128 * values + 64,
    )


def _decode_tables(
    frame: npt.NDArray[np.uint8], sets: npt.NDArray[Any], n_keys: int, n_below: int, below_sets: int | None, where: str
) -> LayerModel:
    """A layer's model from its list and its range-coded candidate tables (model version 4), checked as they are
    read: keys ascending up to the largest token id, counts within their limits (by construction), candidates in the
    list, as many sets below with candidates as the section's head says."""
    below = -1 if below_sets is None else below_sets
    n_sets = sets.shape[0]
    if _COMPILED is None:
        status, *found = context_python.decode_tables(frame.tobytes(), n_keys, n_sets, below, n_below)
        keys = np.asarray(found[0], np.int64)
        token_offsets, token_candidates, below_offsets, below_candidates = (np.asarray(f, np.uint32) for f in found[1:])
    else:
        keys = np.empty(n_keys, np.int64)
        token_offsets = np.empty(n_keys + 1, np.uint32)
        token_candidates = np.empty(n_keys * MAX_TOKEN_CANDIDATES, np.uint32)
        below_offsets = np.empty(max(below, 0) + 1, np.uint32)
        below_candidates = np.empty(max(below, 0) * MAX_BELOW_CANDIDATES, np.uint32)
        status = _COMPILED.decode_tables(
            frame, n_sets, below, n_below, keys, token_offsets, token_candidates, below_offsets, below_candidates
        )
        if status == context_python.OK:
            token_candidates = token_candidates[: token_offsets[-1]]
            below_candidates = below_candidates[: below_offsets[-1]]
    if status == context_python.TABLE_KEYS_BELOW:
        raise ContextFormatError(f"{where}: its head and its tables disagree on the sets below with candidates")
    if status != context_python.OK:
        raise ContextFormatError(f"{where}: a token key, a candidate or a count past its limit")
    return LayerModel(sets, keys, token_offsets, token_candidates, below_offsets, below_candidates)


class _Integers:
    """Reads a section's integer arrays in order, refusing to read past the end or to leave bytes unread."""

    def __init__(self, data: npt.NDArray[np.uint8], where: str) -> None:
        self.data, self.at, self.where = data, 0, where

    def _take(self, n: int) -> npt.NDArray[np.uint8]:
        if self.at + n > self.data.size:
            raise ContextFormatError(f"{self.where}: its integers end early")
        piece = self.data[self.at : self.at + n]
        self.at += n
        return piece

    def planes(self, count: int) -> npt.NDArray[np.int64]:
        return _from_planes(self._take(4 * count), count)

    def bytes(self, count: int) -> npt.NDArray[np.int64]:
        return self._take(count).astype(np.int64)

    def done(self) -> None:
        if self.at != self.data.size:
            raise ContextFormatError(f"{self.where}: {self.data.size - self.at} bytes after its integers")


# -- what a part's rows are ------------------------------------------------------------------------------------------
MODEL_KEY = "model"
"""The model object's key in its array's directory (``routing/model``)."""

SpanTuple = tuple[int, int, int, "str | None"]
"""A span as ``(token_start, n_rows, row, part)``."""


def row_tokens(
    records: Iterable[tuple[Sequence[int] | npt.NDArray[Any] | None, Iterable[SpanTuple]]], n_rows: int
) -> npt.NDArray[np.int64]:
    """The token id of each row of a part's array ``[n_rows]`` from its records' token ids and spans (every record
    of the part, in index order): a row takes the token of the records whose spans in their own part (``part``
    null) cover it, -1 where none has token ids. Records sharing rows have equal tokens (a writer shares rows only
    after comparing them), so the order does not matter; writer and readers derive the same tokens."""
    out = np.full(n_rows, -1, np.int64)
    for token_ids, spans in records:
        if token_ids is None:
            continue
        ids = np.asarray(token_ids, np.int64)
        for token_start, count, row, part in spans:
            if part is None and row + count <= n_rows and token_start + count <= ids.size:
                out[row : row + count] = ids[token_start : token_start + count]
    return out


def max_chunk_nbytes(layers: int, rows: int, topk: int, itemsize: int, num_experts: int) -> int:
    """The most bytes :func:`chunk_pieces` can produce for a chunk of ``layers x rows`` (its head, every stream at
    its bound, the escapes at theirs: a format-2 chunk, or a stream of at most 2 bytes an expert of every row)."""
    streams = layers * (rows * 72 + 16)
    escapes = ranked.max_stored_nbytes((layers, rows, topk), itemsize, num_experts)
    if codes_escapes(num_experts):
        escapes = max(escapes, layers * (rows * num_experts * 2 + 64))
    return 5 + 8 * layers + streams + escapes
