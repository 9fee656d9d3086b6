"""What a step holds: its log (:mod:`routelog.store.steplog`) evaluated by the protocol's rules.

The rules (``schemas/FORMAT.md`` section 3), all stated on log positions, never on clocks:

- **content**: the commits before the step's first seal entry (all commits when unsealed); a commit after the seal
  is not part of the step.
- **drops**: a drop removes, among the commits before it, the records of the sample ids it names and every record
  of the parts and writers it names (a part is then *dropped whole*). Commits after it are untouched: a sample id
  written again after its drop is live.
- **winners**: of the records of one sample id that no drop removed, the one of the lowest position is live; the
  others are *shadowed*. A later commit never changes what a reader read.
- **annotations**: an annotation gives values to the live record of each of its sample ids when that record was
  committed before it (and has the token hash the values were computed on).
- **as of T**: the same rules on the entries created by ``T``; a part those entries need that gc has reclaimed
  since is reported (:class:`~routelog.errors.HistoryReclaimedError`), never read as an empty step.

:class:`StepHistory` reads a step's entries and the Parquet indexes of its commits (each checked against the
SHA-256 its commit lists, or the seal's consolidated copy) and refreshes incrementally, so writers, sealers and
droppers decide on exactly what precedes their own entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from routelog.errors import CorruptDataError, HistoryReclaimedError
from routelog.format import keys
from routelog.format.arrow import bool_array, numeric_array, string_array, to_numpy
from routelog.format.documents import (
    INDEX_SCHEMA,
    AnnotationCommit,
    ArchiveRecord,
    CommitRecord,
    Consolidated,
    DropRecord,
    IndexRow,
    LogDocument,
    SealRecord,
    as_utc,
    load_json,
    validate_document,
)
from routelog.format.part import index_from_parquet
from routelog.store.root import StoreRoot
from routelog.store.steplog import Entry, StepLog, check_commit, object_info, parse_seal_marker
from routelog.store.storage import check_digest

COMMIT_COLUMN = "_commit"
"""Column added to a step's index: the position of the row's commit in the view's ``commits``."""


def dropped_whole(commit: CommitRecord, drops: Iterable[DropRecord]) -> bool:
    """Whether one of ``drops`` removes the whole part (by part name or by its writer)."""
    return any(commit.part in d.parts or commit.writer_id in d.writers for d in drops)


@dataclass
class StepView:
    """A step's entries evaluated: its content, what is live, dropped and shadowed."""

    seal: Entry | None
    commits: list[Entry]
    """Commit entries that are the step's content and not dropped whole, in log order."""
    whole_dropped: list[Entry]
    """Commit entries of the content dropped whole: none of their records is read, but live records' shared
    prefixes may still point at their rows."""
    refused: list[Entry]
    """Commit entries after the seal: never part of the step."""
    drops: list[Entry]
    annotations: list[Entry]
    stored: pa.Table
    """Every index row of :attr:`commits` (removed and shadowed ones too), plus :data:`COMMIT_COLUMN`."""
    live: npt.NDArray[np.bool_]
    """Rows of :attr:`stored` a reader reads."""
    removed: npt.NDArray[np.bool_]
    """Rows a drop removed by sample id."""
    sources: list[CommitRecord] = field(default_factory=list)
    """Where each of :attr:`commits` has its records stored: its own part's commit, or the archive part that holds
    them once the step is archived (FORMAT.md section 3.15)."""
    archive: Entry | None = None
    """The archive entry the view reads through (the last one it holds), if any."""
    archive_indexes: dict[str, pa.Table] = field(default_factory=dict)
    """The whole index of each archive part of :attr:`archive`, by part name."""

    @property
    def shadowed(self) -> npt.NDArray[np.bool_]:
        return ~self.live & ~self.removed

    @property
    def index(self) -> pa.Table:
        """The live rows (the stored table itself when every row is: filtering copies every column, the step's
        token ids included, 0.18 s of opening a step of 10M tokens)."""
        return self.stored if self.live.all() else self.stored.filter(bool_array(self.live))

    def live_records(self) -> dict[str, tuple[str | None, int, int]]:
        """``{sample_id: (token_hash, n_tokens, position of its commit)}`` of the live records."""
        live = self.index
        positions = np.array([e.position for e in self.commits], dtype=np.int64)
        commit_of = to_numpy(live.column(COMMIT_COLUMN))
        return {
            sid: (digest, int(n), int(positions[c]))
            for sid, digest, n, c in zip(
                live.column("sample_id").to_pylist(),
                live.column("token_hash").to_pylist(),
                live.column("n_tokens").to_pylist(),
                commit_of,
                strict=True,
            )
        }


@dataclass
class StepHistory:
    """The entries of a step and the indexes of its commits, read so far; :meth:`refresh` reads what is new."""

    log: StepLog
    as_of: datetime | None = None
    tables: dict[str, pa.Table] = field(default_factory=dict)
    """Index of each commit read so far, by its entry's name (commits dropped whole are not read)."""
    columns: Sequence[str] | None = None
    """Index columns kept (all when None): a writer keeps what it decides on, not every token id of the step."""
    archive_tables: dict[str, pa.Table] = field(default_factory=dict)
    """Index of each archive part read so far (every column), by part name."""
    _archived_rows: dict[str, dict[str, tuple[CommitRecord, pa.Table]]] = field(
        default_factory=dict, init=False, repr=False
    )
    """What :meth:`_archived` made of each archive entry read so far (checked once), by entry name."""

    @classmethod
    def read(
        cls, store: StoreRoot, step: int, *, as_of: datetime | None = None, columns: Sequence[str] | None = None
    ) -> StepHistory:
        """The step's history now, or as it was at ``as_of`` (the entries the storage held then)."""
        history = cls(StepLog(store, step), None if as_of is None else as_utc(as_of), columns=columns)
        history.refresh()
        return history

    @property
    def store(self) -> StoreRoot:
        return self.log.store

    @property
    def step(self) -> int:
        return self.log.step

    def refresh(self) -> tuple[list[Entry], dict[str, pa.Table]]:
        """Read the entries appended since the last call and the indexes the view needs; returns the new entries
        and the full indexes read for them (a writer's shared-prefix search lists them)."""
        missing: CorruptDataError | None = None
        try:
            preloaded, consolidated = self._consolidated() if not self.log.entries else ({}, {})
        except _ConsolidatedGoneError as exc:  # reclaimed after an archive (checked below), or lost
            preloaded, consolidated, missing = {}, {}, exc.error
        new = self.log.refresh(preloaded)
        if missing is not None and not any(isinstance(e.doc, ArchiveRecord) for e in self.log.entries):
            raise missing
        sorted_ = _sort(self._entries())
        replaced = _replaced(sorted_.archive)
        needed = [e for e in sorted_.commits if e.name not in self.tables and e.name not in replaced]
        read = {e.name: consolidated[e.name] for e in needed if e.name in consolidated}
        read.update(self._read_indexes([e for e in needed if e.name not in read]))
        for key, table in read.items():
            self.tables[key] = table if self.columns is None else table.select(list(self.columns))
        return new, read

    def _entries(self) -> list[Entry]:
        """The entries that count: all of them, or those the storage held at :attr:`as_of`.

        As of T the log is its prefix up to the last entry the storage stored by T, by the storage's own timestamps:
        an entry is created only after every earlier position exists, so positions order them and a writer whose
        clock runs hours behind cannot place its entry in the past (an entry whose time is unknown, a file lost
        after the seal whose copy stands in, counts when a later one does). Documents of formats 1 and 2 have no
        position: their writers' times decide."""
        if self.as_of is None:
            return self.log.entries
        when = self.as_of.timestamp()
        last = max(
            (e.position for e in self.log.entries if e.stored_at is not None and e.stored_at <= when), default=-1
        )
        kept = [e for e in self.log.entries if e.position >= 0 and e.position <= last]
        return [e for e in self.log.entries if e.position < 0 and _created_at(e) <= self.as_of] + kept

    def view(self) -> StepView:
        """Evaluate the entries (see the module docs)."""
        sorted_ = _sort(self._entries())
        archived = self._archived(sorted_)
        if self.as_of is not None:
            self._check_kept([e for e in sorted_.commits if e.name not in archived])
        stored = _stored_index(self, sorted_.commits, archived)
        removed = _removed_by_sample(stored, sorted_.commits, sorted_.drops)
        view = StepView(
            sorted_.seal,
            sorted_.commits,
            sorted_.whole,
            sorted_.refused,
            sorted_.drops,
            sorted_.annotations,
            stored,
            _winners(stored, removed),
            removed,
            [archived[e.name][0] if e.name in archived else _commit(e) for e in sorted_.commits],
            sorted_.archive,
            {name: self.archive_tables[name] for name in _archive_parts(sorted_.archive)},
        )
        if self.as_of is not None:
            self._check_kept(self._span_targets(view))
        return view

    def _archived(self, sorted_: _Sorted) -> dict[str, tuple[CommitRecord, pa.Table]]:
        """For each commit the view's archive entry replaces: the archive part holding its records, and its rows
        of that part's index (read and checked here once per part)."""
        entry = sorted_.archive
        if entry is None:
            return {}
        if entry.name in self._archived_rows:  # the commits it replaces are fixed (the step is sealed)
            return self._archived_rows[entry.name]
        archive = _archive(entry)
        where = self.store.storage.url_of(entry.key)
        if sorted_.seal is None or entry.position < sorted_.seal.position:
            raise CorruptDataError(f"{where}: an archive entry before the step's seal (an archive follows the seal)")
        if archive.seal != sorted_.seal.name:
            raise CorruptDataError(f"{where}: the archive names seal {archive.seal}, the step's is {sorted_.seal.name}")
        content = {e.name: e for e in [*sorted_.commits, *sorted_.whole]}
        missing = [e.name for e in sorted_.commits if e.name not in _replaced(entry)]
        if missing:
            raise CorruptDataError(f"{where}: the archive does not hold the records of commits {missing[:8]}")
        unread = [p.commit for p in archive.parts if p.commit.part not in self.archive_tables]
        for commit in unread:
            self.archive_tables[commit.part] = read_commit_index(self.store, self.step, commit)
        out: dict[str, tuple[CommitRecord, pa.Table]] = {}
        for archived in archive.parts:
            source, table = archived.commit, self.archive_tables[archived.commit.part]
            unknown = [name for name in archived.replaces if name not in content]
            if unknown:
                raise CorruptDataError(f"{where}: the archive replaces {unknown[:8]}, which are not the step's commits")
            logical = [_commit(content[name]) for name in archived.replaces]
            counts = np.array([c.n_records for c in logical], dtype=np.int64)
            if int(counts.sum()) != table.num_rows:
                raise CorruptDataError(
                    f"{where}: archive part {source.part!r} indexes {table.num_rows} records, the commits it replaces "
                    f"hold {int(counts.sum())}"
                )
            if (source.n_records, source.n_tokens) != (int(counts.sum()), sum(c.n_tokens for c in logical)):
                raise CorruptDataError(
                    f"{where}: archive part {source.part!r} says {source.n_records} records of {source.n_tokens} "
                    "tokens, not those of the commits it replaces"
                )
            if pc.count_distinct(table.column("sample_id")).as_py() != table.num_rows:
                raise CorruptDataError(f"{where}: archive part {source.part!r} indexes one sample id twice")
            commit_of = np.repeat(np.arange(len(logical), dtype=np.int32), counts)
            as_stored = [c.model_copy(update={"routing": source.routing, "streams": source.streams}) for c in logical]
            check_index(
                table.append_column(COMMIT_COLUMN, numeric_array(commit_of, np.int32)), as_stored, self.step, where
            )
            bounds = np.concatenate([[0], np.cumsum(counts)])
            for i, commit in enumerate(logical):
                rows = table.slice(int(bounds[i]), int(counts[i]))
                out[commit.name] = (source, rows if self.columns is None else rows.select(list(self.columns)))
        self._archived_rows[entry.name] = out
        return out

    def _span_targets(self, view: StepView) -> list[Entry]:
        """Commits whose parts the live records' shared prefixes read rows of (gc keeps them only while a live
        record of the current step reads them: an as-of view may reach a part reclaimed since)."""
        spans = pc.list_flatten(view.index.column("spans").combine_chunks())
        names = set(pc.unique(spans.field("part").drop_null()).to_pylist()) if len(spans) else set()
        parts = {keys.part_dir(self.step, e.doc.part): e for e in self.log.entries if isinstance(e.doc, CommitRecord)}
        return [parts[name] for name in sorted(names) if name in parts]

    def _check_kept(self, commits: Sequence[Entry]) -> None:
        """An as-of view reads parts a drop removed whole, or that an archive replaced since: gc may have reclaimed
        them (it deletes a part's index first, so a part whose index is there is whole)."""
        later = [e for e in self.log.entries if isinstance(e.doc, DropRecord)]
        archived = {n for e in self.log.entries if isinstance(e.doc, ArchiveRecord) for n in _replaced(e)}
        storage = self.store.storage
        for entry in commits:
            commit = _commit(entry)
            gone = entry.name in archived or dropped_whole(commit, _drops_after(later, entry.position))
            if gone and not storage.exists(f"{keys.part_dir(self.step, commit.part)}/{keys.INDEX}"):
                self._missing_index(entry, storage.url_of(entry.key))

    # -- reading indexes -----------------------------------------------------------------------------------------------
    def _read_indexes(self, commits: Sequence[Entry]) -> dict[str, pa.Table]:
        """The index of each commit, checked against its commit (SHA-256, counts, spans), by entry name."""
        return read_indexes(self.store, self.step, commits, self._missing_index)

    def _missing_index(self, entry: Entry, where: str) -> None:
        """A commit's index is gone: reclaimed by gc after a drop (an as-of view reaching back past it), or lost."""
        commit = _commit(entry)
        later = _drops_after(self.log.entries, entry.position)
        archived = any(entry.name in _replaced(e) for e in self.log.entries if isinstance(e.doc, ArchiveRecord))
        if self.as_of is not None and archived:
            raise HistoryReclaimedError(
                f"step {self.step} of {self.store.url} as of {self.as_of.isoformat()} reads part {commit.part!r}, "
                "which an archive of the step replaced and gc has reclaimed since: this view of the step's history "
                "is no longer stored (as-of views reach back to what gc's grace period keeps)"
            )
        if self.as_of is not None and dropped_whole(commit, later):
            raise HistoryReclaimedError(
                f"step {self.step} of {self.store.url} as of {self.as_of.isoformat()} holds part {commit.part!r}, "
                "which a later drop removed and gc has reclaimed since: this view of the step's history is no "
                "longer stored (as-of views reach back to what gc's grace period keeps)"
            )
        raise CorruptDataError(f"{where}: the index of part {commit.part!r} is missing (its commit lists it)")

    def _consolidated(self) -> tuple[dict[int, list[LogDocument]], dict[str, pa.Table]]:
        """A sealed step's seal, commits and indexes from ``_SEALED.json`` (the copy of the seal entry) and the
        seal's consolidated objects: three GETs and the log's listing whatever the number of parts, when the view
        can use them (a format-3 seal that counts as of :attr:`as_of`). Returns the documents by position, and the
        indexes by entry key. (``routelog verify`` checks the copy against the entry.)"""
        storage = self.store.storage
        try:
            marker = storage.read(keys.seal_key(self.step))
        except FileNotFoundError:
            return {}, {}
        seal = parse_seal_marker(marker, self.step, storage.url_of(keys.seal_key(self.step)))
        if seal.position is None or seal.consolidated is None:
            return {}, {}
        seal_key = keys.log_key(self.step, seal.position)
        if self.as_of is not None and storage.modified(seal_key) > self.as_of.timestamp():
            return {}, {}  # the seal came later: the view is read entry by entry
        try:
            commits, index, entry = read_consolidated(self.store, self.step, seal, seal.consolidated, seal_key)
        except CorruptDataError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                raise _ConsolidatedGoneError(exc) from exc
            raise
        if entry != marker:
            raise CorruptDataError(
                f"step {self.step} of {self.store.url}: {keys.SEAL} differs from the seal entry {seal.name} it copies"
            )
        by_position: dict[int, list[LogDocument]] = {seal.position: [seal]}
        for commit in commits:  # format-1/2 commits of the step (no position) are read where they are
            if commit.position is not None:
                if commit.position >= seal.position:
                    raise CorruptDataError(
                        f"the seal of step {self.step} lists {commit.name}, which does not precede it"
                    )
                by_position.setdefault(commit.position, []).append(commit)
        commit_of = to_numpy(index.column(COMMIT_COLUMN))
        order = np.argsort(commit_of, kind="stable")
        grouped = index.take(numeric_array(order)).drop_columns([COMMIT_COLUMN])
        bounds = np.searchsorted(commit_of[order], np.arange(len(commits) + 1))
        tables = {}
        for i, commit in enumerate(commits):
            if bounds[i + 1] > bounds[i]:
                rows = grouped.slice(int(bounds[i]), int(bounds[i + 1] - bounds[i]))
                tables[commit.name] = rows
        return by_position, tables


class _ConsolidatedGoneError(Exception):
    """A seal's consolidated objects are missing: gc reclaims them once an archive of the step is past its grace
    (the step is then read entry by entry); without an archive, ``error`` is the damage to report."""

    def __init__(self, error: CorruptDataError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True)
class _Sorted:
    """A step's entries by what the rules make of them."""

    seal: Entry | None
    drops: list[Entry]
    annotations: list[Entry]
    commits: list[Entry]
    """The content's commits not dropped whole."""
    whole: list[Entry]
    """The content's commits dropped whole."""
    refused: list[Entry]
    """Commits after the seal."""
    archive: Entry | None = None
    """The last archive entry."""


def _sort(entries: Sequence[Entry]) -> _Sorted:
    seal = next((e for e in entries if isinstance(e.doc, SealRecord)), None)
    drops = [e for e in entries if isinstance(e.doc, DropRecord)]
    commits: list[Entry] = []
    whole: list[Entry] = []
    refused: list[Entry] = []
    for entry in entries:
        if not isinstance(entry.doc, CommitRecord):
            continue
        if seal is not None and entry.position > seal.position:
            refused.append(entry)
        elif dropped_whole(entry.doc, _drops_after(drops, entry.position)):
            whole.append(entry)
        else:
            commits.append(entry)
    annotations = [e for e in entries if isinstance(e.doc, AnnotationCommit)]
    archive = next((e for e in reversed(entries) if isinstance(e.doc, ArchiveRecord)), None)
    return _Sorted(seal, drops, annotations, commits, whole, refused, archive)


def _archive(entry: Entry) -> ArchiveRecord:
    if not isinstance(entry.doc, ArchiveRecord):  # pragma: no cover - callers pass archive entries
        raise TypeError(f"{entry.key} is not an archive")
    return entry.doc


def _replaced(entry: Entry | None) -> set[str]:
    """Names of the commits an archive entry replaces (none without one)."""
    return set() if entry is None else {name for p in _archive(entry).parts for name in p.replaces}


def _archive_parts(entry: Entry | None) -> list[str]:
    return [] if entry is None else [p.commit.part for p in _archive(entry).parts]


def _drops_after(entries: Sequence[Entry], position: int) -> list[DropRecord]:
    return [e.doc for e in entries if isinstance(e.doc, DropRecord) and e.position > position]


def _created_at(entry: Entry) -> datetime:
    doc = entry.doc
    return doc.sealed_at if isinstance(doc, SealRecord) else doc.created_at


def _commit(entry: Entry) -> CommitRecord:
    if not isinstance(entry.doc, CommitRecord):  # pragma: no cover - callers pass commit entries
        raise TypeError(f"{entry.key} is not a commit")
    return entry.doc


def _stored_index(
    history: StepHistory, commits: Sequence[Entry], archived: Mapping[str, tuple[CommitRecord, pa.Table]]
) -> pa.Table:
    tables = []
    for i, entry in enumerate(commits):
        table = archived[entry.name][1] if entry.name in archived else history.tables.get(entry.name)
        if table is None:  # an as-of view reaching a part no refresh read: read it now
            table = history._read_indexes([entry])[entry.name]
            history.tables[entry.name] = table
        tables.append(table.append_column(COMMIT_COLUMN, numeric_array(np.full(table.num_rows, i), np.int32)))
    schema = INDEX_SCHEMA if history.columns is None else pa.schema([INDEX_SCHEMA.field(c) for c in history.columns])
    empty = pa.Table.from_batches([], schema=schema).append_column(COMMIT_COLUMN, numeric_array([], np.int32))
    try:
        return pa.concat_tables([empty, *tables], promote_options="permissive")
    except pa.ArrowException as exc:
        where = f"step {history.step} of {history.store.url}"
        raise CorruptDataError(f"{where}: a part's index has columns of the wrong type ({exc})") from exc


def _removed_by_sample(stored: pa.Table, commits: Sequence[Entry], drops: Sequence[Entry]) -> npt.NDArray[np.bool_]:
    """Rows whose sample id a drop after their commit names."""
    removed = np.zeros(stored.num_rows, dtype=bool)
    by_sample = [(d.position, d.doc.sample_ids) for d in drops if isinstance(d.doc, DropRecord) and d.doc.sample_ids]
    if not by_sample or not stored.num_rows:
        return removed
    positions = np.array([e.position for e in commits], dtype=np.int64)[to_numpy(stored.column(COMMIT_COLUMN))]
    sample_ids = stored.column("sample_id")
    for position, named_ids in by_sample:
        named = to_numpy(pc.is_in(sample_ids, value_set=string_array(named_ids)))
        removed |= named & (positions < position)
    return removed


def _winners(stored: pa.Table, removed: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
    """Of the rows no drop removed, the first of each sample id (rows are in log order)."""
    live = np.zeros(stored.num_rows, dtype=bool)
    candidates = np.flatnonzero(~removed)
    if not candidates.size:
        return live
    codes = pc.dictionary_encode(stored.column("sample_id").take(numeric_array(candidates))).combine_chunks().indices
    _, first = np.unique(to_numpy(codes), return_index=True)
    live[candidates[first]] = True
    return live


# -- checks shared by readers and verify ----------------------------------------------------------------------------
def read_indexes(
    store: StoreRoot, step: int, commits: Sequence[Entry], on_missing: Callable[[Entry, str], None]
) -> dict[str, pa.Table]:
    """The index of each commit entry, fetched together and checked against its commit (SHA-256, counts, spans),
    by entry name; ``on_missing(entry, where)`` raises for an index that is not there."""
    storage = store.storage
    wanted: dict[str, tuple[Entry, str]] = {}
    for entry in commits:
        commit = _commit(entry)
        key = f"{keys.part_dir(step, commit.part)}/{keys.INDEX}"
        wanted[key] = (entry, storage.url_of(entry.key))
    if not wanted:
        return {}
    try:
        raw = storage.read_many(wanted)
    except FileNotFoundError:
        raw = {}
        for key, (entry, where) in wanted.items():
            try:
                raw.update(storage.read_many([key]))
            except FileNotFoundError:
                on_missing(entry, where)
                raise
    out = {}
    for key, (entry, _) in wanted.items():
        commit = _commit(entry)
        info = object_info(commit, keys.INDEX, storage.url_of(entry.key))
        check_digest(raw[key], info.size, info.sha256, f"{storage.url_of(key)} (listed by commit {commit.name})")
        table = parquet_index(raw[key], storage.url_of(key), commit.n_records, commit.n_tokens, len(commit.streams))
        check_index(
            table.append_column(COMMIT_COLUMN, numeric_array(np.zeros(table.num_rows), np.int32)),
            [commit],
            step,
            storage.url_of(key),
        )
        out[entry.name] = table
    return out


def read_commit_index(store: StoreRoot, step: int, commit: CommitRecord) -> pa.Table:
    """One commit's part index, read alone and checked against its commit (a part dropped whole, whose rows live
    records may still read: its context-coded routing decodes with its rows' token ids)."""
    storage = store.storage
    key = f"{keys.part_dir(step, commit.part)}/{keys.INDEX}"
    where = storage.url_of(key)
    try:
        data = storage.read(key)
    except FileNotFoundError as exc:
        raise CorruptDataError(f"{where}: the index commit {commit.name} lists is missing") from exc
    info = object_info(commit, keys.INDEX, where)
    check_digest(data, info.size, info.sha256, f"{where} (listed by commit {commit.name})")
    return parquet_index(data, where, commit.n_records, commit.n_tokens, len(commit.streams))


def parquet_index(data: bytes, where: str, n_records: int, n_tokens: int, n_streams: int) -> pa.Table:
    """A part's (or a seal's) Parquet index, bounded by the records, tokens and streams its owner vouches for
    before anything is decoded."""
    try:
        table = index_from_parquet(data, max_records=n_records, max_tokens=n_tokens, max_streams=n_streams, where=where)
    except CorruptDataError:
        raise
    except (pa.ArrowException, OSError) as exc:
        raise CorruptDataError(f"{where}: unreadable Parquet index ({exc})") from exc
    missing = [name for name, f in IndexRow.model_fields.items() if f.is_required() and name not in table.schema.names]
    if missing:
        raise CorruptDataError(f"{where}: the index lacks the columns {missing}")
    return table


def check_index(index: pa.Table, commits: Sequence[CommitRecord], step: int, where: str) -> None:
    """The rows agree with their commits: counts, token totals, step, unique sample ids per part, and own spans
    inside the part's rows."""
    commit_of = to_numpy(index.column(COMMIT_COLUMN))
    if commit_of.size and (commit_of.min() < 0 or commit_of.max() >= len(commits)):
        raise CorruptDataError(f"{where}: a row names a commit the step does not have")
    counts = np.bincount(commit_of, minlength=len(commits)) if len(commits) else np.zeros(0, np.int64)
    n_tokens = to_numpy(index.column("n_tokens")).astype(np.int64)
    tokens = np.bincount(commit_of, weights=n_tokens, minlength=len(commits)) if len(commits) else counts
    for i, commit in enumerate(commits):
        if counts[i] != commit.n_records or int(tokens[i]) != commit.n_tokens:
            raise CorruptDataError(
                f"{where}: part {commit.part!r} indexes {int(counts[i])} records of {int(tokens[i])} tokens, its "
                f"commit says {commit.n_records} records of {commit.n_tokens} tokens"
            )
    steps = to_numpy(index.column("step"))
    if steps.size and (steps != step).any():
        raise CorruptDataError(f"{where}: index rows of step {int(steps[steps != step][0])} in step {step}")
    if index.num_rows:  # (commit, sample id) pairs are distinct: sample ids as codes, one integer per pair
        codes = to_numpy(pc.dictionary_encode(index.column("sample_id").combine_chunks()).indices).astype(np.int64)
        pairs = commit_of.astype(np.int64) * (int(codes.max()) + 1) + codes
        if np.unique(pairs).size != index.num_rows:
            raise CorruptDataError(f"{where}: a part indexes one sample id twice")
    limits = np.array([c.routing.n_rows for c in commits], dtype=np.int64)
    _check_span_rows(index.column("spans").combine_chunks(), commit_of, limits, commits, where)
    if "streams" not in index.schema.names:
        return
    streams = index.column("streams").combine_chunks()
    entries = pc.list_flatten(streams)
    if len(entries) == 0:
        return
    entry_commit = np.repeat(commit_of, to_numpy(pc.list_value_length(streams), fill=0))
    names = entries.field("name").to_pylist()
    for i, name in enumerate(names):
        if name not in commits[int(entry_commit[i])].streams:
            raise CorruptDataError(
                f"{where}: a record has rows of stream {name!r}, part {commits[int(entry_commit[i])].part!r} holds none"
            )
    stream_limits = np.array(
        [commits[int(c)].streams[n].n_rows for c, n in zip(entry_commit, names, strict=True)], dtype=np.int64
    )
    _check_span_rows(entries.field("spans"), np.arange(len(names)), stream_limits, None, where)


def _check_span_rows(
    spans: pa.Array,
    owner_of_row: npt.NDArray[np.int64] | npt.NDArray[np.int32],
    limits: npt.NDArray[np.int64],
    commits: Sequence[CommitRecord] | None,
    where: str,
) -> None:
    """Own spans (``part`` null) end within their array's rows; ``owner_of_row[i]`` indexes ``limits``."""
    flat = pc.list_flatten(spans)
    if len(flat) == 0:
        return
    owner = np.repeat(owner_of_row, to_numpy(pc.list_value_length(spans), fill=0))
    own = to_numpy(pc.is_null(flat.field("part")))
    ends = to_numpy(flat.field("row")) + to_numpy(flat.field("n_rows"))
    past = own & (ends > limits[owner])
    if past.any():
        bad = int(np.argmax(past))
        part = f" of part {commits[int(owner[bad])].part!r}" if commits is not None else ""
        raise CorruptDataError(
            f"{where}: a span{part} reaches row {int(ends[bad])}, past the array's {int(limits[owner[bad]])} rows"
        )


def read_consolidated(
    store: StoreRoot, step: int, seal: SealRecord, consolidated: Consolidated, entry_key: str
) -> tuple[list[CommitRecord], pa.Table, bytes]:
    """The seal's consolidated commit records (in the seal's order) and index (with :data:`COMMIT_COLUMN`), each
    checked against the SHA-256 the seal lists and against each other; and the bytes of the seal's log entry
    (``entry_key``), fetched in the same batch."""
    storage = store.storage
    base = keys.step_dir(step)
    owner = f"the seal of step {step}"
    commits_key, index_key = f"{base}/{consolidated.commits.key}", f"{base}/{consolidated.index.key}"
    try:
        data = storage.read_many([commits_key, index_key, entry_key])
    except FileNotFoundError as exc:
        raise CorruptDataError(
            f"step {step} of {store.url}: the seal entry or a consolidated object of {owner} is missing"
        ) from exc
    for key, info in ((commits_key, consolidated.commits), (index_key, consolidated.index)):
        check_digest(data[key], info.size, info.sha256, f"{storage.url_of(key)} (listed by {owner})")
    where = storage.url_of(commits_key)
    try:
        docs = load_json(data[commits_key], where)
    except ValueError as exc:
        raise CorruptDataError(str(exc)) from None
    if not isinstance(docs, list) or len(docs) != len(seal.commits):
        raise CorruptDataError(f"{where}: not a list of the {len(seal.commits)} commit records the seal names")
    commits = [validate_document(doc, CommitRecord, f"{where} [{i}]") for i, doc in enumerate(docs)]
    for name, commit in zip(seal.commits, commits, strict=True):
        check_commit(commit, name, step, store.model_spec, f"{where} ({name})")
    index = parquet_index(
        data[index_key],
        storage.url_of(index_key),
        seal.n_records,
        sum(c.n_tokens for c in commits),
        max((len(c.streams) for c in commits), default=0),
    )
    if COMMIT_COLUMN not in index.schema.names:
        raise CorruptDataError(f"{storage.url_of(index_key)}: the consolidated index lacks {COMMIT_COLUMN!r}")
    _check_consolidated(index, commits, seal, step, storage.url_of(index_key))
    return commits, index, data[entry_key]


def _check_consolidated(
    index: pa.Table, commits: Sequence[CommitRecord], seal: SealRecord, step: int, where: str
) -> None:
    """A format-3 consolidated index holds the whole index of every listed commit not dropped whole before the seal
    (none of the others), and the seal's counts are its totals."""
    commit_of = to_numpy(index.column(COMMIT_COLUMN))
    present = np.zeros(len(commits), dtype=bool)
    if commit_of.size:
        if commit_of.min() < 0 or commit_of.max() >= len(commits):
            raise CorruptDataError(f"{where}: a row names a commit the seal does not list")
        present[np.unique(commit_of)] = True
    held = [c for c, p in zip(commits, present, strict=True) if p]
    renumber = np.cumsum(present) - 1
    check_index(
        index.set_column(
            index.schema.get_field_index(COMMIT_COLUMN),
            COMMIT_COLUMN,
            numeric_array(renumber[commit_of], np.int32),
        ),
        held,
        step,
        where,
    )
    if seal.n_records != index.num_rows or seal.n_tokens != sum(c.n_tokens for c in held):
        raise CorruptDataError(
            f"{where}: the seal says {seal.n_records} records of {seal.n_tokens} tokens, its index holds "
            f"{index.num_rows} records of {sum(c.n_tokens for c in held)} tokens"
        )
