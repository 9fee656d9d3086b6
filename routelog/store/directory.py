"""What one process knows of a step: the log read so far (only what is new is ever read again), and the protocol's
rules (``schemas/FORMAT.md`` section 3) evaluated for the few sample ids a commit holds.

A writer deciding whether a record is already present, or a committer deciding that for a thousand writers, needs
the copies of *its* sample ids, not the step's whole index. Each format-4 commit carries a digest of its records'
sample ids (:mod:`routelog.format.digest`): a commit whose digest misses a sample id does not hold it, so only the
indexes of the commits a hash matches are read (once each), and the commits this process made itself are known
exactly from what it sent. Format-3 commits carry no digest: their indexes are read the first time a decision needs
them. The rules here are the ones :mod:`routelog.store.history` applies to a whole step at once (content before the
seal, drops remove what precedes them, the first copy not removed is live), applied to one sample id at a time.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

import pyarrow as pa

from routelog.errors import CorruptDataError
from routelog.format.digest import sample_id_hash
from routelog.format.documents import ArchiveRecord, CommitRecord, DropRecord, SealRecord
from routelog.store.history import read_commit_index, read_indexes
from routelog.store.root import StoreRoot
from routelog.store.steplog import Backoff, Entry, StepLog

Order = tuple[int, int]
"""A place in a step's history: log position, then slot (``Entry.order``)."""
_DECIDING_COLUMNS = ("sample_id", "token_hash", "n_tokens")


@dataclass(frozen=True)
class Copy:
    """One committed record of a sample id: the commit holding it and what duplicates are decided on."""

    entry: Entry
    token_hash: str | None
    n_tokens: int

    @property
    def commit(self) -> CommitRecord:
        doc = self.entry.doc
        if not isinstance(doc, CommitRecord):  # pragma: no cover - copies are made of commit entries only
            raise TypeError(self.entry.key)
        return doc


@dataclass(frozen=True)
class _Drop:
    position: int
    sample_ids: frozenset[str]
    parts: frozenset[str]
    writers: frozenset[str]

    def removes(self, sample_id: str, copy: Copy) -> bool:
        commit = copy.commit
        return sample_id in self.sample_ids or commit.part in self.parts or commit.writer_id in self.writers


class StepDirectory:
    """The entries of one step read so far, and the copies of sample ids known from them; not thread-safe (its
    owner serializes access)."""

    def __init__(self, store: StoreRoot, step: int, backoff: Backoff | None = None) -> None:
        self.log = StepLog(store, step, backoff)
        self.seal: Entry | None = None
        """The step's seal (its first seal entry), once read."""
        self.parts: dict[str, Entry] = {}
        """Every committed part (of the content or after the seal) -> its commit's entry."""
        self._copies: dict[str, list[Copy]] = {}
        self._known: set[str] = set()
        """Names of the commit entries whose records are known exactly."""
        self._by_hash: dict[int, list[Entry]] = {}
        self._undigested: list[Entry] = []
        self._probes: dict[int, list[Entry]] = {}
        self._drops: list[_Drop] = []
        self._whole: dict[str, int] = {}
        """Parts dropped whole (by part or writer) or committed after the seal, and the position from which none of
        their records counts (the earliest drop naming them, or their own): no new record may point at them, and no
        decision after that position reads their indexes (gc may have reclaimed them)."""
        self._absorbed = 0
        """Entries of the log taken in so far."""
        self._seqs: dict[str, int] = {}
        """Each writer's highest part counter committed in the step."""
        self._no_digest: list[Entry] = []
        """Commits without a digest (formats 1-3): any may hold a prefix."""
        self._archived: dict[str, tuple[CommitRecord, int]] = {}
        """Commits an archive replaced (their original parts may be reclaimed): the archive part holding their
        records, and where their rows start in its index."""

    @property
    def store(self) -> StoreRoot:
        return self.log.store

    @property
    def step(self) -> int:
        return self.log.step

    @property
    def next_position(self) -> int:
        return self.log.next_position

    # -- keeping up with the log ---------------------------------------------------------------------------------------
    def refresh(self) -> list[Entry]:
        """Read the entries appended since the last refresh (one listing from the last position read)."""
        new = self.log.refresh()
        self.catch_up()
        return new

    def catch_up(self) -> None:
        """Take in every entry the log holds that this directory has not (read by a refresh, or created by an
        append); the commits this process learned exactly (:meth:`learn`) first."""
        entries = self.log.entries[self._absorbed :]
        self._absorbed = len(self.log.entries)
        where = self.store.storage.url_of
        for entry in entries:
            doc = entry.doc
            if isinstance(doc, CommitRecord):
                self.parts[doc.part] = entry
                self._seqs[doc.writer_id] = max(doc.seq, self._seqs.get(doc.writer_id, -1))
                if doc.digest is None:
                    self._no_digest.append(entry)
                if self.seal is not None and entry.position > self.seal.position:
                    self._whole.setdefault(doc.part, entry.position)
                probes = doc.prefix_probes(where(entry.key))
                for probe in probes.tolist() if probes is not None else ():
                    self._probes.setdefault(int(probe), []).append(entry)
                if entry.name in self._known:
                    continue
                hashes = doc.sample_id_hashes(where(entry.key))
                if hashes is None:
                    self._undigested.append(entry)
                    continue
                for value in hashes.tolist():
                    self._by_hash.setdefault(int(value), []).append(entry)
            elif isinstance(doc, DropRecord):
                drop = _Drop(entry.position, frozenset(doc.sample_ids), frozenset(doc.parts), frozenset(doc.writers))
                self._drops.append(drop)
                for part, commit_entry in self.parts.items():
                    commit = commit_entry.doc
                    if (
                        commit_entry.position < drop.position
                        and isinstance(commit, CommitRecord)
                        and (part in drop.parts or commit.writer_id in drop.writers)
                    ):
                        self._whole.setdefault(part, drop.position)
            elif isinstance(doc, SealRecord) and self.seal is None:
                self.seal = entry
            elif isinstance(doc, ArchiveRecord):
                counts = {e.name: e.doc.n_records for e in self.log.entries if isinstance(e.doc, CommitRecord)}
                for archived in doc.parts:
                    start = 0
                    for name in archived.replaces:
                        self._archived[name] = (archived.commit, start)
                        start += counts.get(name, 0)

    def learn(self, entry: Entry, records: Iterable[tuple[str, str | None, int]]) -> None:
        """The records ``(sample_id, token_hash, n_tokens)`` of a commit this process made or sent: known exactly,
        so its index is never read."""
        if entry.name in self._known:
            return
        self._known.add(entry.name)
        for sample_id, token_hash, n_tokens in records:
            self._copies.setdefault(sample_id, []).append(Copy(entry, token_hash, n_tokens))

    # -- the rules, for a few sample ids -------------------------------------------------------------------------------
    def live(self, sample_ids: Collection[str], before: Order | None = None) -> dict[str, Copy]:
        """The live copy of each of ``sample_ids`` that has one, in the step as it was just before ``before`` (the
        whole log read so far when None): among the commits of the content before that point, the first copy that
        no drop before that point removed. Reads the indexes of the commits whose digests match (once each)."""
        self._resolve(sample_ids, before)
        out = {}
        for sample_id in sample_ids:
            copy = self._winner(sample_id, before)
            if copy is not None:
                out[sample_id] = copy
        return out

    def _resolve(self, sample_ids: Collection[str], before: Order | None) -> None:
        """Know exactly every commit that may hold one of ``sample_ids`` at ``before``: those without a digest, and
        those whose digest holds one of their hashes (but for parts removed whole by then)."""

        def counts(entry: Entry) -> bool:
            since = self._whole.get(_part(entry))
            return since is None or (before is not None and since >= before[0])

        wanted = {e.name: e for e in self._undigested if counts(e)}
        for sample_id in sample_ids:
            for entry in self._by_hash.get(sample_id_hash(sample_id), ()):
                if entry.name not in self._known and counts(entry):
                    wanted[entry.name] = entry
        if not wanted:
            return
        originals = [e for e in wanted.values() if e.name not in self._archived]
        tables = read_indexes(self.store, self.step, originals, _raise_missing if before is not None else _index_gone)
        self._undigested = [e for e in self._undigested if e.name not in wanted]
        archive_indexes: dict[str, pa.Table] = {}
        for entry in wanted.values():
            if entry.name in self._archived:  # read from the archive part that holds its records now
                source, start = self._archived[entry.name]
                if source.part not in archive_indexes:
                    archive_indexes[source.part] = read_commit_index(self.store, self.step, source)
                tables[entry.name] = archive_indexes[source.part].slice(start, _commit(entry).n_records)
        for name, table in tables.items():
            columns = table.select(list(_DECIDING_COLUMNS)).to_pydict()
            rows = zip(columns["sample_id"], columns["token_hash"], columns["n_tokens"], strict=True)
            self.learn(wanted[name], rows)

    def _winner(self, sample_id: str, before: Order | None) -> Copy | None:
        for copy in sorted(self._copies.get(sample_id, ()), key=lambda c: c.entry.order):
            entry = copy.entry
            if before is not None and entry.order >= before:
                return None
            if self.seal is not None and entry.position > self.seal.position:
                return None  # commits after the seal are not part of the step
            limit = before[0] if before is not None else None
            removed = any(
                entry.position < d.position and (limit is None or d.position < limit) and d.removes(sample_id, copy)
                for d in self._drops
            )
            if not removed:
                return copy
        return None

    # -- what writers share prefixes with ------------------------------------------------------------------------------
    def peers(self, probes: Iterable[int]) -> list[Entry]:
        """Commits of the content, not dropped whole, that may hold a record starting like one of ``probes``: those
        whose digests list one, and those without a digest."""
        found: dict[str, Entry] = {}
        for probe in probes:
            for entry in self._probes.get(probe, ()):
                found[entry.name] = entry
        for entry in self._no_digest:
            found[entry.name] = entry
        usable = (e for e in found.values() if _part(e) not in self._whole and e.name not in self._archived)
        return sorted(usable, key=lambda e: e.order)

    def gone(self) -> list[str]:
        """Parts no new record may point at: dropped whole, committed after the seal, or replaced by an archive."""
        replaced = {part for part, e in self.parts.items() if e.name in self._archived}
        return sorted(set(self._whole) | replaced)

    def next_seq(self, writer_id: str) -> int:
        """One past the highest part counter ``writer_id`` committed in the step (a writer id used again goes on)."""
        return 1 + self._seqs.get(writer_id, -1)


def _part(entry: Entry) -> str:
    return _commit(entry).part


def _commit(entry: Entry) -> CommitRecord:
    doc = entry.doc
    if not isinstance(doc, CommitRecord):  # pragma: no cover - callers pass commit entries
        raise TypeError(entry.key)
    return doc


class StaleLogError(Exception):
    """A commit's index is missing, and the log was read a while ago: gc may have reclaimed the part after a drop
    or an archive this directory has not read yet. Read the log again and ask again; missing then, it is damage."""


def _index_gone(entry: Entry, where: str) -> None:
    raise StaleLogError(where)


def _raise_missing(entry: Entry, where: str) -> None:
    doc = entry.doc
    part = doc.part if isinstance(doc, CommitRecord) else entry.name
    raise CorruptDataError(f"{where}: the index of part {part!r} is missing (its commit lists it)")
