"""Shared prefixes stored once: the routing rows a record shares with a record already in its part.

A GRPO group sends one prompt n times and a multi-turn rollout re-sends its whole history every turn, so most
routing rows of a step repeat. When a record's first tokens **and** their routing equal those of a record already
placed in the same part, its spans point at the earlier rows and only the rest is stored. Equality is checked,
never assumed: without prefix caching, batch-variant numerics can route the same prompt differently, and the shared
prefix then ends at the first token whose routing (or whether it was computed) differs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.codec import IdArray
from routelog.format import Span

MIN_SHARED_TOKENS = 16
"""Shorter shared prefixes are stored again: the spans that point at them would cost about what they save."""
CANDIDATES = 8
"""Earlier records with the same first tokens compared per record (the most recent ones: a group's or a
session's records arrive together)."""


@dataclass(frozen=True)
class Placement:
    """Where a record's routing rows live in the part."""

    spans: list[Span]
    """Spans over the part's rows (``part`` null), shared ones first."""
    first_own_row: int
    """The record's stored rows from this one on are new; the ones before it are shared."""
    shared_tokens: int


class PartRows:
    """The routing rows ``[layers, n, K]`` of a part being built, growing as records are placed."""

    def __init__(self, layers: int, topk: int, dtype: np.dtype[Any], capacity: int = 1024) -> None:
        self._data = np.empty((layers, max(1, capacity), topk), dtype)
        self.n = 0

    def append(self, rows: IdArray) -> int:
        """Add ``rows`` ``[layers, m, K]``; returns the part row of the first one."""
        start, m = self.n, rows.shape[1]
        if start + m > self._data.shape[1]:
            layers, capacity, topk = self._data.shape
            grown = np.empty((layers, max(2 * capacity, start + m), topk), self._data.dtype)
            grown[:, :start] = self._data[:, :start]
            self._data = grown
        self._data[:, start : start + m] = rows
        self.n += m
        return start

    def take(self, rows: npt.NDArray[np.int64]) -> IdArray:
        return self._data[:, rows]

    @property
    def data(self) -> IdArray:
        return self._data[:, : self.n]


@dataclass(frozen=True)
class _Placed:
    tokens: npt.NDArray[np.int64]
    part_row: npt.NDArray[np.int64]
    """Part row of each token's routing, -1 where the token has none."""


class PrefixIndex:
    """The records placed in one part, looked up by their first tokens."""

    def __init__(self, rows: PartRows) -> None:
        self.rows = rows
        self._by_probe: dict[bytes, list[_Placed]] = {}

    def place(self, token_ids: list[int] | None, spans: list[Span], own_rows: IdArray) -> Placement:
        """Place a record (its spans relative to its own stored rows ``own_rows``) and return where its rows go; the
        caller appends ``own_rows[:, first_own_row:]`` to the part at ``rows.n`` afterwards."""
        if token_ids is None or len(token_ids) < MIN_SHARED_TOKENS:  # nothing to compare: stored whole
            shift = self.rows.n
            return Placement([Span(token_start=s.token_start, n_rows=s.n_rows, row=s.row + shift) for s in spans], 0, 0)
        tokens = np.asarray(token_ids, dtype=np.int64)
        local = np.full(tokens.size, -1, dtype=np.int64)
        for span in spans:
            local[span.token_start : span.token_start + span.n_rows] = np.arange(span.row, span.row + span.n_rows)
        shared, source = 0, None
        probe = hashlib.blake2b(tokens[:MIN_SHARED_TOKENS].tobytes(), digest_size=16).digest()
        for earlier in reversed(self._by_probe.get(probe, [])[-CANDIDATES:]):
            length = self._shared_prefix(earlier, tokens, local, own_rows)
            if length > shared:
                shared, source = length, earlier
        if source is None or shared < MIN_SHARED_TOKENS:
            shared = 0
        first_own_row = int((local[:shared] >= 0).sum())
        base = self.rows.n - first_own_row  # own row r (>= first_own_row) lands at part row base + r
        part_row = np.where(local >= 0, local + base, -1)
        if source is not None and shared:
            part_row[:shared] = source.part_row[:shared]
        self._by_probe.setdefault(probe, []).append(_Placed(tokens, part_row))
        return Placement(_spans_of(part_row), first_own_row, shared)

    def _shared_prefix(
        self, earlier: _Placed, tokens: npt.NDArray[np.int64], local: npt.NDArray[np.int64], own_rows: IdArray
    ) -> int:
        """Tokens from the start that are equal, computed (or not) alike, and routed alike in both records."""
        n = min(earlier.tokens.size, tokens.size)
        differs = np.flatnonzero(earlier.tokens[:n] != tokens[:n])
        n = int(differs[0]) if differs.size else n
        mine, theirs = local[:n], earlier.part_row[:n]
        differs = np.flatnonzero((mine >= 0) != (theirs >= 0))
        n = int(differs[0]) if differs.size else n
        routed = np.flatnonzero(mine[:n] >= 0)
        if routed.size:
            same = (self.rows.take(theirs[routed]) == own_rows[:, mine[routed]]).all(axis=(0, 2))
            if not same.all():
                n = int(routed[int(np.argmin(same))])
        return n


def _spans_of(part_row: npt.NDArray[np.int64]) -> list[Span]:
    """Maximal runs of tokens whose routing sits in consecutive part rows."""
    routed = part_row >= 0
    follows = routed[1:] & routed[:-1] & (part_row[1:] == part_row[:-1] + 1)  # token i + 1 continues token i
    starts = np.flatnonzero(routed & ~np.concatenate([[False], follows]))
    stops = np.flatnonzero(routed & ~np.concatenate([follows, [False]])) + 1
    return [
        Span(token_start=int(a), n_rows=int(b - a), row=int(part_row[a])) for a, b in zip(starts, stops, strict=True)
    ]
