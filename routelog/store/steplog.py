"""A step's log: every commit, drop, annotation and seal of the step, in an order the storage itself fixes.

Format 3 keeps a step's history as ``steps/<step>/log/<position:010d>.json``. An entry is created exclusively at
the next free position (S3 ``If-None-Match: *``, an atomic link on local disk), after a listing that showed every
position below it taken. So positions are dense, each entry's predecessors existed before it was created, and no
entry can ever appear below one a reader has seen: the order is the storage's, not the writers' clocks. Every
rule of the protocol is stated on that order (``schemas/FORMAT.md`` section 3): a sample id committed twice is
read from its lowest position, a drop removes what precedes it, a seal closes the step to the commits after it.

Stores of formats 1 and 2 keep per-writer documents instead (``commits/``, ``drops/``, ``annotations/``,
``_SEALED.json``). Their documents are read as a prefix of the log, at negative positions, in the order those
formats defined (commits by ``created_at``, the seal after the commits it lists, then drops, then annotations), so
one set of rules reads every store. A format-3 routelog appends to such a step through its log, after creating
:data:`~routelog.format.keys.LEGACY_MARKER` where older readers look, which they refuse.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from routelog.errors import CommitConflictError, CommitUndecidedError, CorruptDataError, StoreError
from routelog.format import keys
from routelog.format.context import MODEL_KEY, model_header_nbytes
from routelog.format.documents import (
    CONTEXT_ESCAPES_FEATURE,
    CONTEXT_FEATURE,
    CONTEXT_LIST_REFERENCES_FEATURE,
    CONTEXT_REFERENCES_FEATURE,
    AnnotationCommit,
    ArchiveRecord,
    CommitGroup,
    CommitRecord,
    DropRecord,
    LogDocument,
    ObjectInfo,
    SealRecord,
    StepLogMarker,
    StoredEntry,
    dump_document,
    parse_document,
    parse_log_document,
)
from routelog.format.part import shard_layout
from routelog.format.spec import ModelSpec
from routelog.store.root import StoreRoot
from routelog.store.storage import Storage, is_transient

_D = TypeVar("_D", CommitGroup, CommitRecord, DropRecord, AnnotationCommit, SealRecord, ArchiveRecord)

APPEND_DEADLINE = 120.0
"""Seconds an append keeps trying positions that other processes take first (each loss is another's progress),
unless the caller gives its own deadline."""
_APPEND_ATTEMPTS = 10_000


@dataclass(frozen=True)
class Entry:
    """One document of a step's history at its position (negative for the documents of formats 1 and 2); each
    commit of a format-4 commit entry is an entry of its own, at the entry's position and its ``slot``."""

    position: int
    key: str
    """The key of the object holding the document (shared by the commits of one commit entry)."""
    doc: LogDocument
    slot: int | None = None
    stored_at: float | None = field(default=None, compare=False)
    """When the storage stored the entry's object (seconds since the epoch, by the storage's clock, from the log's
    listing); None for an entry this process appended and has not listed since, and for formats 1 and 2."""

    @property
    def name(self) -> str:
        """Unique within the step: the document's file name, or ``<position>.<slot>.json`` for a group's commit."""
        return self.doc.name

    @property
    def order(self) -> tuple[int, int]:
        """Where the entry stands in the step's history: its position, then its slot."""
        return self.position, self.slot or 0


class Backoff:
    """How long a process waits before trying a log position again, carried from one append to the next.

    The wait is drawn from a window of ``level`` slots, a slot being the create's own round trip (measured): each
    lost position widens the window by a slot (up to :data:`MAX_LEVEL`), each won one narrows it by a slot rather
    than closing it, so a process that just appended does not jump ahead of those that have been waiting. Chosen in
    ``tools/sim_commits.py`` (writers through their own committers, S3 at 30 ms): restarting at 5 ms on every
    append let the last winners win again (64 writers x 4 parts: append p50 0.29 s but p99 34 s; issue #52 measured
    first parts at 11.8 attempts and up to 100 s, fourth parts at 4.3); a window doubling per loss left the log idle
    (a 93 s drain rather than 33); a linear window capped at 8 slots drained in 33 s with p99 22 s. Many writers
    contending for one log is slow whatever the wait: share a committer (:mod:`routelog.store.committer`)."""

    MAX_LEVEL = 8
    MAX_WAIT = 5.0

    def __init__(self, slot: float = 0.02) -> None:
        self.slot = slot
        self.level = 0

    def wait(self) -> float:
        """Seconds to wait before the next attempt (0 when nothing was lost lately)."""
        if not self.level:
            return 0.0
        return random.uniform(0, min(self.MAX_WAIT, self.slot * self.level))

    def observe(self, seconds: float) -> None:
        """A create took ``seconds``: the slot follows the storage's round trip."""
        self.slot = min(1.0, max(0.001, 0.8 * self.slot + 0.2 * seconds))

    def lost(self) -> None:
        self.level = min(self.level + 1, self.MAX_LEVEL)

    def won(self) -> None:
        self.level = max(0, self.level - 1)


def check_commit(commit: CommitRecord | AnnotationCommit, name: str, step: int, spec: ModelSpec, where: str) -> None:
    """A commit read under ``name`` is the commit of that name, of this step, and of the run's model."""
    if commit.name != name:
        raise CorruptDataError(f"{where}: the document is commit {commit.name}, found under the name {name}")
    if commit.step != step:
        raise CorruptDataError(f"{where}: the commit is for step {commit.step}, found in step {step}")
    if isinstance(commit, AnnotationCommit):
        return
    info = commit.routing
    if (info.num_moe_layers, info.topk, info.num_experts) != (spec.num_moe_layers, spec.topk, spec.num_experts):
        raise CorruptDataError(
            f"{where}: routing of L={info.num_moe_layers}, K={info.topk}, E={info.num_experts} does not match the "
            f"run's model spec (L={spec.num_moe_layers}, K={spec.topk}, E={spec.num_experts})"
        )
    attributes = info.zarr_metadata.get("attributes")
    stamped = attributes.get("routelog") if isinstance(attributes, dict) else None
    moe_layers = stamped.get("moe_layers") if isinstance(stamped, dict) else None
    if moe_layers is not None and moe_layers != list(spec.moe_layers):
        raise CorruptDataError(
            f"{where}: the part was written for MoE layers {moe_layers}, the run's model spec has "
            f"{list(spec.moe_layers)}"
        )
    layout = shard_layout(info)
    for key in layout.shard_keys if info.n_rows else []:
        if object_info(commit, f"{info.path}/{key}", where).size < layout.index_nbytes:
            raise CorruptDataError(f"{where}: the routing shard {key!r} is smaller than its own chunk index")
    if layout.context != (CONTEXT_FEATURE in commit.features):
        raise CorruptDataError(
            f"{where}: routing of transform {info.transform!r} in a commit naming the features {commit.features}: the "
            f"{CONTEXT_FEATURE!r} feature goes with that transform, and only with it"
        )
    for feature in (CONTEXT_ESCAPES_FEATURE, CONTEXT_REFERENCES_FEATURE, CONTEXT_LIST_REFERENCES_FEATURE):
        if feature in commit.features and not layout.context:
            raise CorruptDataError(
                f"{where}: the feature {feature!r} in a commit whose routing has transform {info.transform!r}: it "
                f"goes only with {CONTEXT_FEATURE!r}"
            )
    if layout.context and info.n_rows:
        model = object_info(commit, f"{info.path}/{MODEL_KEY}", where)
        if model.size < model_header_nbytes(info.num_moe_layers):
            raise CorruptDataError(f"{where}: the routing's model is smaller than its own head")


def object_info(commit: CommitRecord | AnnotationCommit, key: str, where: str) -> ObjectInfo:
    """The commit's entry for object ``key``; a commit that does not list an object it needs is damaged."""
    for info in commit.objects:
        if info.key == key:
            return info
    raise CorruptDataError(f"{where}: the commit does not list its object {key!r}")


def _check_entry(doc: StoredEntry, name: str, step: int, spec: ModelSpec, where: str) -> None:
    if isinstance(doc, CommitGroup):
        if doc.name != name or doc.step != step:
            raise CorruptDataError(f"{where}: the document is commit entry {doc.name} of step {doc.step}")
        for commit in doc.commits:
            check_commit(commit, commit.name, step, spec, f"{where} ({commit.part})")
    elif isinstance(doc, (CommitRecord, AnnotationCommit)):
        check_commit(doc, name, step, spec, where)
    elif isinstance(doc, ArchiveRecord):
        if doc.name != name or doc.step != step:
            raise CorruptDataError(f"{where}: the document is archive entry {doc.name} of step {doc.step}")
        for archived in doc.parts:
            check_commit(archived.commit, archived.commit.name, step, spec, f"{where} ({archived.commit.part})")
    elif doc.name != name or doc.step != step:
        raise CorruptDataError(f"{where}: the document is {doc.name} of step {doc.step}")


def expand(position: int, key: str, doc: StoredEntry, stored_at: float | None = None) -> list[Entry]:
    """The entries an object of the log stands for: each commit of a format-4 commit entry, else the document."""
    if isinstance(doc, CommitGroup):
        return [Entry(position, key, commit, commit.slot, stored_at) for commit in doc.commits]
    return [Entry(position, key, doc, stored_at=stored_at)]


class StepLog:
    """The entries of one step read so far, in order; :meth:`refresh` reads those appended since, and
    :meth:`append` creates the next one."""

    def __init__(self, store: StoreRoot, step: int, backoff: Backoff | None = None) -> None:
        self.store = store
        self.step = keys.check_step(step)
        self.entries: list[Entry] = []
        self.next_position = 0
        """The first position no entry read so far holds: where the next entry goes."""
        self.legacy_read = False
        self.backoff = backoff or Backoff()
        self._read_bytes: dict[int, bytes] = {}
        """The objects the last refresh read, by position: an append that lost a position compares its own bytes."""

    @property
    def _legacy_store(self) -> bool:
        return self.store.run.format_version < 3

    # -- reading ---------------------------------------------------------------------------------------------------
    def refresh(self, preloaded: Mapping[int, Sequence[LogDocument]] | None = None) -> list[Entry]:
        """Read the entries appended since the last refresh (every position from :attr:`next_position` on, listed
        from there: never the whole log again); returns them. ``preloaded`` holds documents already read and checked
        elsewhere (a seal's consolidated copies of its commits: a commit entry's commits), by position."""
        new: list[Entry] = []
        if not self.legacy_read:
            self.legacy_read = True
            if self._legacy_store:
                new += self._read_legacy()
        storage = self.store.storage
        preloaded = preloaded or {}
        stored = self.list_positions(after=self.next_position - 1)
        listed = set(stored) | set(preloaded)  # copies stand in for lost files
        positions = sorted(p for p in listed if p >= self.next_position)
        expected = list(range(self.next_position, self.next_position + len(positions)))
        if positions != expected:
            missing = sorted(set(range(self.next_position, positions[-1] + 1)) - set(positions))
            raise CorruptDataError(
                f"step {self.step} of {self.store.url}: log entries {missing[:8]} are missing (entries after them "
                "exist); the history is damaged"
            )
        wanted = [keys.log_key(self.step, p) for p in positions if p not in preloaded]
        raw = storage.read_many(wanted) if wanted else {}
        self._read_bytes = {p: raw[keys.log_key(self.step, p)] for p in positions if p not in preloaded}
        for position in positions:
            key = keys.log_key(self.step, position)
            where = storage.url_of(key)
            if position in preloaded:
                slots = [(doc, getattr(doc, "slot", None)) for doc in preloaded[position]]
                new += [Entry(position, key, doc, slot, stored.get(position)) for doc, slot in slots]
                continue
            doc = parse_log_document(raw[key], where)
            _check_entry(doc, keys.log_name(position), self.step, self.store.model_spec, where)
            new += expand(position, key, doc, stored.get(position))
        self.entries += new
        self.next_position += len(positions)
        return new

    def list_positions(self, after: int = -1) -> dict[int, float]:
        """Positions of the log's entries after ``after`` (every one by default), ascending, each with the time the
        storage stored it."""
        names = self.store.storage.list_after(keys.log_dir(self.step), keys.log_name(after) if after >= 0 else None)
        found = {keys.parse_log_name(name): stored for name, stored in names.items()}
        return {p: found[p] for p in sorted(p for p in found if p is not None)}

    def _read_legacy(self) -> list[Entry]:
        """The documents of formats 1 and 2, as the log's prefix (see the module docs)."""
        storage, step, spec = self.store.storage, self.step, self.store.model_spec
        commits = self._legacy_documents(keys.commits_dir(step), CommitRecord)
        drops = self._legacy_documents(keys.drops_dir(step), DropRecord)
        annotations = self._legacy_documents(keys.annotations_dir(step), AnnotationCommit)
        for key, commit in commits:
            check_commit(commit, key.rsplit("/", 1)[1], step, spec, storage.url_of(key))
        for key, annotation in annotations:
            check_commit(annotation, key.rsplit("/", 1)[1], step, spec, storage.url_of(key))
        for key, drop in drops:
            if drop.name != key.rsplit("/", 1)[1] or drop.step != step:
                raise CorruptDataError(f"{storage.url_of(key)}: the document is drop {drop.name} of step {drop.step}")
        commits.sort(key=lambda item: (item[1].created_at, item[1].name))
        ordered: list[tuple[str, LogDocument]] = list(commits)
        seal = read_seal_marker(self.store, step)
        if seal is not None and seal.position is None:  # a format-1/2 seal: after the commits it lists
            listed = set(seal.commits)
            ordered = [
                *(item for item in commits if item[1].name in listed),
                (keys.seal_key(step), seal),
                *(item for item in commits if item[1].name not in listed),
            ]
        drops.sort(key=lambda item: (item[1].created_at, item[1].name))
        annotations.sort(key=lambda item: (item[1].created_at, item[1].name))
        ordered += [*drops, *annotations]
        return [Entry(i - len(ordered), key, doc) for i, (key, doc) in enumerate(ordered)]

    def _legacy_documents(self, directory: str, model: type[_D]) -> list[tuple[str, _D]]:
        """Every format-1/2 document of ``model`` in ``directory`` (the format-3 marker aside), with its key."""
        storage = self.store.storage
        names = [n for n in storage.list(directory) if keys.parse_commit_name(n) and n != keys.LEGACY_MARKER]
        doc_keys = [f"{directory}/{n}" for n in names]
        raw = storage.read_many(doc_keys)
        return [(key, parse_document(raw[key], model, storage.url_of(key))) for key in doc_keys]

    # -- appending -------------------------------------------------------------------------------------------------
    def append(
        self,
        build: Callable[[int], _D],
        *,
        check: Callable[[Sequence[Entry]], None] | None = None,
        deadline: float | None = None,
    ) -> list[Entry]:
        """Create ``build(position)`` at the next free position and return its entries (one, or a commit entry's
        commits).

        A position another process took first is read (so this log knows every entry before the one it creates)
        and handed to ``check``, which may raise to give up (a seal appeared, say) or rebuild what ``build`` makes;
        then the next position is tried after the log's :class:`Backoff`, until ``deadline`` (``time.monotonic``;
        :data:`APPEND_DEADLINE` seconds from now by default).
        """
        storage = self.store.storage
        if self.next_position == 0 and not self.legacy_read:
            self.refresh()
        deadline = time.monotonic() + APPEND_DEADLINE if deadline is None else deadline
        for _ in range(_APPEND_ATTEMPTS):
            if wait := self.backoff.wait():
                time.sleep(wait)
            position = self.next_position
            if position == 0 and self._legacy_store:
                marker = StepLogMarker(step=self.step)
                storage.create(f"{keys.commits_dir(self.step)}/{keys.LEGACY_MARKER}", dump_document(marker))
            doc = build(position)
            key = keys.log_key(self.step, position)
            data = dump_document(doc)
            started = time.monotonic()
            created = _create(storage, key, data)
            self.backoff.observe(time.monotonic() - started)
            if created:
                self.backoff.won()
                entries = expand(position, key, doc)
                self.entries += entries
                self.next_position = position + 1
                return entries
            new = self.refresh()
            if self._read_bytes.get(position) == data:  # the position holds this very entry: a retry met it
                self.backoff.won()
                return [e for e in new if e.position == position]
            self.backoff.lost()
            if check is not None:
                check(new)
            if time.monotonic() > deadline:
                break
        raise CommitConflictError(
            f"step {self.step} of {self.store.url}: other processes took every log position until the append's "
            "deadline; nothing was appended (retry)"
        )

    # -- views -------------------------------------------------------------------------------------------------------
    def commits(self) -> list[Entry]:
        return [e for e in self.entries if isinstance(e.doc, CommitRecord)]

    def seal(self) -> Entry | None:
        """The step's seal: the first seal entry (a later one can only come from a damaged store)."""
        return next((e for e in self.entries if isinstance(e.doc, SealRecord)), None)


def _create(storage: Storage, key: str, data: bytes) -> bool:
    """:meth:`Storage.create` without its read-back (the append reads the position it found taken with the entries
    it lost to), deciding what an unanswered create did: when every attempt failed, the key is read back; holding
    ``data`` it was created, holding another's document it was not, and absent the outcome stays unknown
    (:class:`CommitUndecidedError`: a delayed request may still land)."""
    try:
        return storage.create(key, data, read_back=False)
    except StoreError as failure:
        if failure.__cause__ is None or not is_transient(failure.__cause__):
            raise  # refused (access, full disk): nothing was created
        try:
            found = storage.read(key)
        except FileNotFoundError:
            raise CommitUndecidedError(
                f"{storage.url_of(key)}: the storage did not confirm the create ({failure}), and the entry is not "
                "there now; it may still appear if a delayed request lands. Sending the same records again is safe."
            ) from failure
        except StoreError:
            raise CommitUndecidedError(
                f"{storage.url_of(key)}: the storage did not confirm the create and cannot be read back ({failure})"
            ) from failure
        return found == data


def read_seal_marker(store: StoreRoot, step: int) -> SealRecord | None:
    """``_SEALED.json``: a format-1/2 seal, or the copy of a format-3 seal entry; None when absent."""
    storage = store.storage
    key = keys.seal_key(step)
    try:
        data = storage.read(key)
    except FileNotFoundError:
        return None
    return parse_seal_marker(data, step, storage.url_of(key))


def parse_seal_marker(data: bytes, step: int, where: str) -> SealRecord:
    seal = parse_document(data, SealRecord, where)
    if seal.step != step:
        raise CorruptDataError(f"{where}: the seal is for step {seal.step}, not {step}")
    if seal.position is None and seal.format_version >= 3:
        raise CorruptDataError(f"{where}: a format-{seal.format_version} seal without a log position")
    return seal
