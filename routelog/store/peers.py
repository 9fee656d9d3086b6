"""Other writers' committed records of a step, as candidates for shared prefixes (:mod:`routelog.format.dedup`).

A GRPO group's samples or a session's turns may reach different inference workers, so a prefix can repeat across
writers. Before a writer builds a part it asks its committer which committed parts may hold a record starting like
one of its own (their digests list the probe of its first tokens, :mod:`routelog.format.digest`), and lists the
records of those it has not listed yet as candidates (token ids and where each token's routing row lives); the rows
themselves are fetched only when a record's first tokens match, and compared before they are shared. Parts dropped
whole (and commits after a seal) are forgotten: no later part points at them (``routelog gc`` may be reclaiming
them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from routelog.errors import CorruptDataError, RoutelogError
from routelog.format import keys
from routelog.format.codec import IdArray
from routelog.format.dedup import PrefixIndex, WeightRows
from routelog.format.digest import MIN_SHARED_TOKENS
from routelog.format.documents import CommitRecord
from routelog.format.index_rows import RecordSpans, RowTokens, part_row_tokens, record_spans
from routelog.format.row_blocks import consecutive
from routelog.store.blocks import BlockRequest, ReadCache, fetch_blocks
from routelog.store.history import read_indexes
from routelog.store.root import StoreRoot
from routelog.store.steplog import Entry

_CACHED_RANGES = 4
"""Row ranges of one part kept decoded (a group's samples compare against the same prompt rows in turn)."""


class StoredPart:
    """A committed part's routing rows, fetched by ranged reads when a comparison needs them."""

    def __init__(self, store: StoreRoot, part_key: str, commit: CommitRecord, tokens: RowTokens | None = None) -> None:
        """``tokens``: the token id of each of its rows, where its routing is context-coded (decoding needs them)."""
        self.store, self.part_key, self.commit = store, part_key, commit
        self._tokens = tokens
        self._cache: OrderedDict[tuple[int, int], tuple[IdArray, WeightRows | None]] = OrderedDict()
        self._index_cache = ReadCache()

    def take(self, rows: npt.NDArray[np.int64]) -> tuple[IdArray, WeightRows | None]:
        lo, hi = int(rows.min()), int(rows.max()) + 1
        if not 0 <= lo < hi <= self.commit.routing.n_rows:
            raise RoutelogError(f"{self.part_key}: rows [{lo}, {hi}) outside its {self.commit.routing.n_rows} rows")
        cached = next(((a, b) for a, b in self._cache if a <= lo and hi <= b), None)
        if cached is None:
            chunk_rows = self.commit.routing.chunk_rows
            lo, hi = lo // chunk_rows * chunk_rows, min(-(-hi // chunk_rows) * chunk_rows, self.commit.routing.n_rows)
            layers = (0, self.commit.routing.num_moe_layers)
            requests = [BlockRequest.of(self.part_key, self.commit, layers, (lo, hi))]
            if self.commit.weights is not None:
                requests.append(BlockRequest.of(self.part_key, self.commit, layers, (lo, hi), weights=True))
            blocks = fetch_blocks(self.store.storage, requests, self._index_cache, row_tokens=self._row_tokens)
            cached = (lo, hi)
            self._cache[cached] = (blocks[0], blocks[1] if len(blocks) > 1 else None)
            while len(self._cache) > _CACHED_RANGES:
                self._cache.popitem(last=False)
        self._cache.move_to_end(cached)
        ids, weights = self._cache[cached]
        at = consecutive(rows - cached[0])
        return ids[:, at], None if weights is None else weights[:, at]

    def _row_tokens(self, part_key: str) -> RowTokens:
        if self._tokens is None:
            raise RoutelogError(f"{part_key}: its context-coded routing needs its rows' token ids")
        return self._tokens

    @property
    def nbytes(self) -> int:
        return sum(ids.nbytes + (0 if w is None else w.nbytes) for ids, w in self._cache.values())


class PeerParts:
    """Keeps a writer's :class:`~routelog.format.dedup.PrefixIndex` aware of the step's parts committed by others
    that may share a prefix with what it writes (those its committer names: digest hits)."""

    def __init__(self, store: StoreRoot, step: int, prefixes: PrefixIndex) -> None:
        self.store, self.step, self.prefixes = store, step, prefixes
        self._listed: set[str] = set()
        """Parts whose records were listed, or that are this writer's own."""
        self._gone: set[str] = set()
        """Parts forgotten (dropped whole, or after the seal)."""

    def own(self, part: str) -> None:
        """``part`` is this writer's: its rows are in the index already."""
        self._listed.add(part)

    def news(self, commits: Sequence[CommitRecord], gone: Sequence[str]) -> bool:
        """Whether ``commits`` or ``gone`` hold anything :meth:`absorb` has not taken in yet."""
        return any(c.part not in self._listed for c in commits) or any(p not in self._gone for p in gone)

    def absorb(self, commits: Sequence[CommitRecord], gone: Iterable[str]) -> None:
        """List the records of ``commits`` not listed before (their indexes are read, together), and forget the
        parts ``gone`` (dropped whole, or refused by a seal: no new record may point at them)."""
        new = [c for c in commits if c.part not in self._listed]
        entries = [Entry(c.position if c.position is not None else -1, _where(self.step, c), c, c.slot) for c in new]
        tables = read_indexes(self.store, self.step, entries, _missing)
        for entry in entries:
            commit = entry.doc
            if not isinstance(commit, CommitRecord):  # pragma: no cover - made of commits above
                raise TypeError(entry.key)
            self._listed.add(commit.part)
            table = tables[entry.name]
            if "token_ids" in table.schema.names:
                where = self.store.storage.url_of(keys.part_dir(self.step, commit.part))
                records = record_spans(table, MIN_SHARED_TOKENS, where)  # checks the token ids and spans first
                tokens = None
                if commit.routing.transform == "ranked_context":
                    tokens = part_row_tokens(table, commit.routing.n_rows)
                self._list(commit, records, tokens)
        if new:
            self.prefixes.evict()
        forgotten = [part for part in gone if part not in self._gone]
        self._gone.update(forgotten)
        self.prefixes.forget(keys.part_dir(self.step, part) for part in forgotten)

    def _list(self, commit: CommitRecord, records: list[RecordSpans], row_tokens: RowTokens | None) -> None:
        """``records``: the part's records with token ids enough to share; ``row_tokens``: the token id of each of
        the part's rows, where its routing is context-coded."""
        own_key = keys.part_dir(self.step, commit.part)
        ids: dict[str, int | None] = {}
        for record in records:
            span_parts: list[int] = []
            for key in record.parts:
                name = key or own_key
                if name not in ids:
                    ids[name] = self.prefixes.part_id(name)
                    if ids[name] is None and name == own_key:  # its own rows: registered once a record needs them
                        source = StoredPart(self.store, own_key, commit, row_tokens)
                        ids[name] = self.prefixes.add_committed(source, own_key)
                known = ids[name]
                if known is None:
                    break  # points at a part this writer does not know: not a candidate
                span_parts.append(known)
            else:
                self._add(record, span_parts)

    def _add(self, record: RecordSpans, span_parts: list[int]) -> None:
        """List ``record``, whose spans lie in the parts ``span_parts`` (prefix-index ids)."""
        n = record.tokens.size
        part = np.full(n, -1, np.int32)
        where = np.full(n, -1, np.int64)
        for part_id, start, count, row in zip(
            span_parts, record.token_starts.tolist(), record.n_rows.tolist(), record.rows.tolist(), strict=True
        ):
            part[start : start + count] = part_id
            where[start : start + count] = np.arange(row, row + count)
        self.prefixes.add_record(record.tokens.copy(), part, where, frozenset(span_parts))


def _where(step: int, commit: CommitRecord) -> str:
    """The key of the document a commit was read from (what errors name)."""
    if commit.position is None:
        return keys.commit_key(step, commit.name)
    return keys.log_key(step, commit.position)


def _missing(entry: Entry, where: str) -> None:
    raise CorruptDataError(f"{where}: the index of part {entry.doc.part!r} is missing (its commit lists it)")  # type: ignore[union-attr]
