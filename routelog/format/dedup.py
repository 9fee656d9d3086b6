"""Shared prefixes stored once: the routing rows a record shares with a record already stored in its step.

A GRPO group sends one prompt n times and a multi-turn rollout re-sends its whole history every turn, so most
routing rows of a step repeat. When a record's first tokens **and** their routing (and routing weights, when
recorded) equal those of a record placed earlier, its spans point at the earlier rows and only the rest is stored.
Equality is checked, never assumed: without prefix caching, batch-variant numerics can route the same prompt
differently, and the shared prefix then ends at the first token whose routing (or whether it was computed) differs.

The earlier record may sit in the part being built, in a part this writer committed before, or in a part another
writer committed to the step (:mod:`routelog.store.peers` registers those): spans then name that part. A part is only
referenced once committed. Memory is bounded: rows kept for comparison (earlier parts' rows, rows fetched from
other writers' parts) and the candidates' token ids count against a budget, and the oldest parts are forgotten
first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from routelog.format.codec import IdArray
from routelog.format.digest import MIN_SHARED_TOKENS, prefix_probe
from routelog.format.documents import Span
from routelog.format.row_blocks import RowBlocks, consecutive
from routelog.format.weights import WeightsDtype, from_storage, missing

CANDIDATES = 8
"""Earlier records with the same first tokens compared per record (the most recent ones: a group's or a
session's records arrive together)."""
DEFAULT_BUDGET_BYTES = 64 << 20
"""Bytes of earlier parts' rows and candidates' token ids a writer keeps to compare against."""

WeightRows = npt.NDArray[Any]
"""Stored-form routing weights ``[layers, m, K]`` (see :mod:`routelog.format.weights`)."""


class RowSource(Protocol):
    """Where a part's rows can be read back for comparison."""

    def take(self, rows: npt.NDArray[np.int64]) -> tuple[IdArray, WeightRows | None]:
        """IDs ``[layers, len(rows), K]`` of the given part rows, and their stored weights (None: no weights)."""
        ...

    @property
    def nbytes(self) -> int:
        """Memory held for comparisons (counted against the budget)."""
        ...


@dataclass(frozen=True)
class Placement:
    """Where a record's routing rows live."""

    spans: list[Span]
    """Spans over the part's rows (``part`` null) and over earlier parts (``part`` naming them), in token order."""
    first_own_row: int
    """The record's stored rows from this one on are new; the ones before it are shared."""
    shared_tokens: int


class PartRows:
    """The routing rows ``[layers, n, K]`` of a part being built (and their weights, once a record has some),
    growing as records are placed. The records' own arrays are kept, not copied (:class:`RowBlocks`)."""

    def __init__(
        self,
        layers: int,
        topk: int,
        dtype: np.dtype[Any],
        weights_dtype: WeightsDtype = "bfloat16",
    ) -> None:
        self.ids = RowBlocks(layers, topk, dtype)
        self.weights: RowBlocks | None = None
        self.weights_dtype: WeightsDtype = weights_dtype

    @property
    def n(self) -> int:
        return self.ids.n

    def append(self, rows: IdArray, weights: WeightRows | None = None) -> int:
        """Add ``rows`` ``[layers, m, K]`` (and their stored weights); returns the part row of the first one."""
        start = self.ids.append(rows)
        if weights is not None and self.weights is None:  # the first weights: earlier rows have none (NaN)
            self.weights = RowBlocks(rows.shape[0], rows.shape[2], weights.dtype)
            self.weights.append(missing((rows.shape[0], start, rows.shape[2]), self.weights_dtype))
        if self.weights is not None:
            self.weights.append(missing(rows.shape, self.weights_dtype) if weights is None else weights)
        return start

    def take(self, rows: npt.NDArray[np.int64]) -> tuple[IdArray, WeightRows | None]:
        return self.ids.take(rows), None if self.weights is None else self.weights.take(rows)

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + (0 if self.weights is None else self.weights.nbytes)


@dataclass
class _Part:
    """A part whose rows candidates point at."""

    source: RowSource
    key: str
    """``steps/<step>/parts/<name>``: what spans pointing at its rows name."""
    committed: bool
    """False while its writer builds, uploads and commits it (only its own later parts may point at it then)."""


@dataclass(frozen=True)
class _Placed:
    """A candidate: a record's tokens and where each token's routing row is."""

    tokens: npt.NDArray[np.int64]
    part: npt.NDArray[np.int32]
    """Part id holding each token's row, -1 where the token has none."""
    row: npt.NDArray[np.int64]
    parts: frozenset[int]


@dataclass
class PrefixIndex:
    """Records placed so far, looked up by their first tokens; lives as long as its writer's step."""

    budget_bytes: int = DEFAULT_BUDGET_BYTES
    _parts: OrderedDict[int, _Part] = field(default_factory=OrderedDict)
    _by_probe: dict[bytes, list[_Placed]] = field(default_factory=dict)
    _ids: dict[str, int] = field(default_factory=dict)
    _building: dict[int, PartRows] = field(default_factory=dict)
    """Parts being built, whose rows grow as records are placed."""
    _next_id: int = 0
    _token_bytes: int = 0
    _candidates_in: dict[int, int] = field(default_factory=dict)
    """How many candidates point at rows of each part."""

    # -- parts --------------------------------------------------------------------------------------------------
    def begin_part(self, rows: PartRows, key: str) -> int:
        """Register the part being built as ``key``; its records are placed with :meth:`place`. The writer's later
        parts may point at its rows before it is committed: they are committed after it, and fail with it
        (:meth:`abandon`)."""
        part = self._add(rows, key, committed=False)
        self._building[part] = rows
        return part

    def part_id(self, key: str) -> int | None:
        """The id of the part ``key``, if it is registered (and not forgotten)."""
        return self._ids.get(key)

    def add_committed(self, source: RowSource, key: str) -> int:
        """Register a committed part (another writer's) whose records :meth:`add_record` will list."""
        return self._add(source, key, committed=True)

    def placed(self, part: int) -> bool:
        """Every record of the part is placed. Whether the index keeps its rows to compare against: not when no
        candidate points at them (its records carry no token ids), so the build may let them go as it encodes."""
        rows = self._building.pop(part)
        if self._candidates_in.get(part):
            return True
        self._parts[part].source = PartRows(rows.ids.layers, rows.ids.topk, rows.ids.dtype)
        return False

    def committed(self, part: int) -> None:
        """The part was committed: it is kept until the budget or a drop forgets it, while a candidate points at
        its rows (a part of records without token ids has nothing to share: its rows are let go at once)."""
        self._parts[part].committed = True
        if not self._candidates_in.get(part):
            self._forget({part})
        self.evict()

    def abandon(self, part: int) -> None:
        """The part was not committed: forget it and every record placed in it."""
        self._forget({part})

    def forget(self, keys: Iterable[str]) -> None:
        """Committed parts that a drop removed whole: never point at them again (``routelog gc`` may reclaim them),
        nor at the records whose rows they hold."""
        parts = {self._ids[key] for key in keys if key in self._ids}
        if parts:
            self._forget(parts)

    def _add(self, source: RowSource, key: str, *, committed: bool) -> int:
        part, self._next_id = self._next_id, self._next_id + 1
        self._parts[part] = _Part(source, key, committed)
        self._ids[key] = part
        return part

    # -- records ----------------------------------------------------------------------------------------------
    def add_record(
        self,
        token_ids: npt.NDArray[np.int64],
        part: npt.NDArray[np.int32],
        row: npt.NDArray[np.int64],
        parts: frozenset[int],
    ) -> None:
        """List a committed record as a candidate: for each token, the part id and row of its routing (-1: none),
        and the ids in ``part``. The caller calls :meth:`evict` once it has listed a commit's records."""
        if token_ids.size >= MIN_SHARED_TOKENS:
            self._list(_Placed(token_ids, part, row, parts))

    def place(
        self,
        part: int,
        token_ids: list[int] | None,
        spans: list[Span],
        own_rows: IdArray,
        own_weights: WeightRows | None = None,
    ) -> Placement:
        """Place a record of the part being built (its spans relative to its own stored rows ``own_rows``) and
        return where its rows go; the caller appends ``own_rows[:, first_own_row:]`` to the part afterwards."""
        current = self._building[part]
        base_row = current.n
        if token_ids is None or len(token_ids) < MIN_SHARED_TOKENS:  # nothing to compare: stored whole
            return Placement(
                [Span(token_start=s.token_start, n_rows=s.n_rows, row=s.row + base_row) for s in spans], 0, 0
            )
        tokens = np.asarray(token_ids, dtype=np.int64)
        local = np.full(tokens.size, -1, dtype=np.int64)
        for span in spans:
            local[span.token_start : span.token_start + span.n_rows] = np.arange(span.row, span.row + span.n_rows)
        # The longest shared prefix wins, the most recent candidate among equals. A candidate's equal tokens bound
        # what it can share (routing only shortens it), so routing is compared from the longest token match down
        # and only while a candidate could still win: in a GRPO group every earlier sample shares the same prompt,
        # and only the first of them is compared row by row.
        candidates = [
            earlier
            for earlier in reversed(self._by_probe.get(prefix_probe(tokens), [])[-CANDIDATES:])
            if earlier.parts <= self._parts.keys()  # else it points at a forgotten part
        ]
        bounds = [_equal_prefix(earlier.tokens, tokens) for earlier in candidates]
        best, source = (0, -len(candidates)), None  # (shared tokens, -recency rank)
        for rank in sorted(range(len(candidates)), key=lambda i: -bounds[i]):
            if (bounds[rank], -rank) <= best:
                continue
            length = self._shared_prefix(candidates[rank], bounds[rank], local, own_rows, own_weights)
            if (length, -rank) > best:
                best, source = (length, -rank), candidates[rank]
        shared = best[0]
        if source is None or shared < MIN_SHARED_TOKENS:
            shared = 0
        first_own_row = int((local[:shared] >= 0).sum())
        own = local >= 0
        where = np.where(own, part, -1).astype(np.int32)
        row = np.where(own, local - first_own_row + base_row, -1)  # own row r (>= first_own_row) lands there
        if source is not None and shared:
            where[:shared], row[:shared] = source.part[:shared], source.row[:shared]
        self._list(_placed(tokens, where, row))
        return Placement(self._spans_of(where, row, part), first_own_row, shared)

    def _shared_prefix(
        self,
        earlier: _Placed,
        n: int,
        local: npt.NDArray[np.int64],
        own_rows: IdArray,
        own_weights: WeightRows | None,
    ) -> int:
        """Of the first ``n`` tokens (equal in both records), those from the start that are computed (or not) alike
        and routed alike in both."""
        mine = local[:n]
        differs = np.flatnonzero((mine >= 0) != (earlier.part[:n] >= 0))
        n = int(differs[0]) if differs.size else n
        routed = np.flatnonzero(mine[:n] >= 0)
        if not routed.size:
            return n
        their_parts = earlier.part[routed]
        same = np.ones(routed.size, dtype=bool)
        parts = _distinct(their_parts)
        for part_id in parts:
            on_part = slice(None) if len(parts) == 1 else their_parts == part_id
            their_ids, their_weights = self._parts[part_id].source.take(earlier.row[routed[on_part]])
            mine_rows = consecutive(mine[routed[on_part]])
            same[on_part] = (their_ids == own_rows[:, mine_rows]).all(axis=(0, 2))
            same[on_part] &= _same_weights(their_weights, None if own_weights is None else own_weights[:, mine_rows])
        if not same.all():
            n = int(routed[int(np.argmin(same))])
        return n

    def _spans_of(self, where: npt.NDArray[np.int32], row: npt.NDArray[np.int64], current: int) -> list[Span]:
        """Maximal runs of tokens whose routing sits in consecutive rows of one part."""
        routed = where >= 0
        follows = routed[1:] & routed[:-1] & (where[1:] == where[:-1]) & (row[1:] == row[:-1] + 1)
        starts = np.flatnonzero(routed & ~np.concatenate([[False], follows]))
        stops = np.flatnonzero(routed & ~np.concatenate([follows, [False]])) + 1
        spans = []
        for a, b in zip(starts, stops, strict=True):
            part = int(where[a])
            key = None if part == current else self._parts[part].key
            spans.append(Span(token_start=int(a), n_rows=int(b - a), row=int(row[a]), part=key))
        return spans

    # -- memory -------------------------------------------------------------------------------------------------
    def _list(self, placed: _Placed) -> None:
        self._by_probe.setdefault(prefix_probe(placed.tokens), []).append(placed)
        self._token_bytes += placed.tokens.nbytes + placed.part.nbytes + placed.row.nbytes
        for part in placed.parts:
            self._candidates_in[part] = self._candidates_in.get(part, 0) + 1

    @property
    def nbytes(self) -> int:
        return self._token_bytes + sum(p.source.nbytes for p in self._parts.values())

    def evict(self) -> None:
        """Forget the oldest committed parts (and the records pointing at them) while over the budget; parts not
        committed yet are never forgotten."""
        while self.nbytes > self.budget_bytes:
            oldest = next((p for p, entry in self._parts.items() if entry.committed), None)
            if oldest is None:
                return
            self._forget({oldest})

    def _forget(self, parts: set[int]) -> None:
        for part in parts:
            self._building.pop(part, None)
            entry = self._parts.pop(part, None)
            if entry is not None:
                self._ids.pop(entry.key, None)
        listed = [p for placed in self._by_probe.values() for p in placed if not p.parts & parts]
        self._by_probe, self._token_bytes, self._candidates_in = {}, 0, {}
        for placed in listed:
            self._list(placed)


def _placed(tokens: npt.NDArray[np.int64], part: npt.NDArray[np.int32], row: npt.NDArray[np.int64]) -> _Placed:
    return _Placed(tokens, part, row, frozenset(int(p) for p in np.unique(part[part >= 0])))


def _equal_prefix(a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]) -> int:
    """How many tokens from the start are equal in both."""
    n = min(a.size, b.size)
    differs = np.flatnonzero(a[:n] != b[:n])
    return int(differs[0]) if differs.size else n


def _distinct(parts: npt.NDArray[np.int32]) -> list[int]:
    """The part ids in ``parts``; one look when all rows sit in one part (the common case)."""
    first = int(parts[0])
    return [first] if (parts == first).all() else [int(p) for p in np.unique(parts)]


def _same_weights(theirs: WeightRows | None, mine: WeightRows | None) -> npt.NDArray[np.bool_]:
    """Per row: both carry the same stored weights (bit for bit), or neither carries any."""
    if theirs is None and mine is None:
        return np.array(True)
    if theirs is None or mine is None:  # one side carries none: equal only where the other's are all missing
        return _all_missing(theirs if mine is None else mine)
    if theirs.dtype != mine.dtype:
        return np.asarray((_as_float(theirs) == _as_float(mine)).all(axis=(0, 2)))
    width = np.dtype(f"u{theirs.dtype.itemsize}")
    return np.asarray((theirs.view(width) == mine.view(width)).all(axis=(0, 2)))


def _all_missing(weights: WeightRows | None) -> npt.NDArray[np.bool_]:
    return np.array(True) if weights is None else np.asarray(np.isnan(_as_float(weights)).all(axis=(0, 2)))


def _as_float(stored: WeightRows) -> npt.NDArray[np.float32]:
    return from_storage(stored, "bfloat16" if stored.dtype == np.uint16 else "float32")
