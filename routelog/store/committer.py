"""Committing the parts of many writers with few appends: the commit path of ``schemas/FORMAT.md`` section 3.

A step's log is ordered by exclusive creates at dense positions, so writers that each create their own entry
contend for one position at a time: with 64 writers on S3 a commit cost 144 requests and a third of the writers
missed their deadline. A :class:`Committer` appends the parts of many writers as *one* commit entry (a group,
format 4): while one entry is being created, the parts that arrive queue up, and the next entry takes them all.
It knows the step from the log it has read and from the records writers send it, and it reads the log again only
when another process took the position it wanted, so a thousand commits cost a few dozen creates.

Every writer commits through a committer:

- its own (the default): it commits the parts it has ready in one entry, and reads the log from where it last read
  it (digests in the entries tell it which indexes to read: only those it collides with);
- one shared by many writers: the writers of a process (pass the same :class:`Committer`), or of a Ray cluster
  (``routelog.ray.start_committer``; the writers then send JSON, never pickled objects). A writer whose shared
  committer does not answer commits through its own, which first finds out from the log what became of the parts it
  had sent (a part is in at most one entry: no appender adds a part an entry it read holds).

A committer decides each record's fate at the commit's place in the log, where it knows every entry before it
(FORMAT.md section 3.7): committed, already present (a live copy with the same tokens precedes it) or refused.
"""

from __future__ import annotations

import itertools
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pydantic import TypeAdapter

from routelog.errors import CommitConflictError, CommitUndecidedError, StepSealedError, StoreError
from routelog.format import keys
from routelog.format.documents import CommitGroup, CommitRecord, utc_now
from routelog.store.directory import Copy, StaleLogError, StepDirectory
from routelog.store.root import StoreRoot
from routelog.store.steplog import Entry

DEFAULT_MAX_GROUP = 1024
"""Parts one commit entry holds at most (a committer shared by more writers appends several entries)."""
MAX_GROUP_BYTES = 32 << 20
"""Bytes of commit documents one entry holds at most (JSON documents are read whole)."""
SHARED_REFRESH_SECONDS = 1.0
"""A shared committer reads the log for lookups at most this often (commits are decided on the complete log in
any case: a create at the next position succeeds only where every entry before it was read)."""
STEPS_KEPT = 8
"""Steps a committer keeps what it knows of (an RL run commits to one or two steps at a time)."""
PRESENT = "present"
""":func:`verdict` of a record whose sample id is live with the same tokens."""
OutcomeError = Literal["sealed", "expired", "undecided", "conflict", "failed", "dependent"]


# -- messages (plain data: they cross processes as JSON) -------------------------------------------------------------
@dataclass(frozen=True)
class RecordKey:
    """What duplicates are decided on: a record's sample id and tokens."""

    sample_id: str
    token_hash: str | None
    n_tokens: int


@dataclass(frozen=True)
class LookupRequest:
    """What a writer asks before it builds a part: are these records' sample ids live, with which tokens; which
    committed parts may share a prefix with them; may it upload at all."""

    step: int
    writer_id: str
    records: tuple[RecordKey, ...] = ()
    probes: tuple[int, ...] = ()
    """Prefix probes of the records (:func:`routelog.format.digest.probe_hash`)."""
    refresh: bool = True
    """Read what the log gained first (a writer's own committer); False: answer from what is known."""


@dataclass(frozen=True)
class LookupReply:
    live: dict[str, tuple[str | None, int]]
    """Sample ids asked that are live: their ``(token_hash, n_tokens)``."""
    peers: tuple[CommitRecord, ...]
    """Commits whose records may start like the records asked (digest hits, and commits without a digest)."""
    gone: tuple[str, ...]
    """Parts no new record may point at (dropped whole, or committed after the seal)."""
    next_seq: int
    """One past the highest part counter the writer committed in the step."""
    sealed: str | None = None
    """Why the step takes no more uploads (sealed, or being sealed); None when it does."""


@dataclass(frozen=True)
class PartProposal:
    """A part uploaded and waiting for its commit."""

    commit: CommitRecord
    """Its commit document, but for ``position``, ``slot`` and ``created_at``: the entry's."""
    records: tuple[RecordKey, ...]
    """The records the part holds."""
    presumed: tuple[RecordKey, ...] = ()
    """Records found present when the part was built (not in it): written by a later part if that copy is gone."""
    expires_in: float = 600.0
    """Seconds from the request on during which the commit may still be created (gc's grace period)."""


@dataclass(frozen=True)
class CommitRequest:
    step: int
    writer_id: str
    parts: tuple[PartProposal, ...]
    """In the writer's order: a part may share rows with the ones before it, so a part not committed fails the
    ones after it (``dependent``)."""
    on_duplicate: Literal["skip", "error"] = "skip"


@dataclass(frozen=True)
class PartOutcome:
    """What became of one part, as of its commit's place in the log."""

    part: str
    commit: CommitRecord | None = None
    """The commit as created (None: not committed)."""
    committed: tuple[str, ...] = ()
    present: tuple[str, ...] = ()
    refused: dict[str, str] = field(default_factory=dict)
    """Sample id -> why it is not committed (another live copy has other tokens)."""
    rewrite: tuple[str, ...] = ()
    """Records presumed present whose present copy a drop removed: to be written by a later part."""
    error: OutcomeError | None = None
    message: str = ""

    def raise_error(self) -> None:
        """The typed error of a part that was not committed (nothing when it was)."""
        if self.error is None:
            return
        if self.error == "sealed":
            raise StepSealedError(self.message)
        if self.error == "undecided":
            raise CommitUndecidedError(self.message)
        if self.error == "conflict":
            raise CommitConflictError(self.message)
        raise StoreError(self.message)


@dataclass(frozen=True)
class CommitReply:
    outcomes: tuple[PartOutcome, ...]


_LOOKUP_REQUEST = TypeAdapter(LookupRequest)
_LOOKUP_REPLY = TypeAdapter(LookupReply)
_COMMIT_REQUEST = TypeAdapter(CommitRequest)
_COMMIT_REPLY = TypeAdapter(CommitReply)


class CommitService(Protocol):
    """What a writer commits through: a :class:`Committer`, or a client of one in another process."""

    @property
    def shared(self) -> bool:
        """Whether other writers commit through it (a writer's own committer is not shared)."""
        ...

    def lookup(self, request: LookupRequest) -> LookupReply: ...

    def commit(self, request: CommitRequest) -> CommitReply: ...


class CommitterUnavailableError(StoreError):
    """A shared committer did not answer (its process is gone, or the call timed out): the writer commits through
    its own committer, which first reads from the log what became of the parts it had sent."""


class JsonCommitter:
    """A committer answering requests that crossed a process boundary as JSON (never pickled objects)."""

    def __init__(self, committer: CommitService) -> None:
        self.committer = committer

    def lookup(self, request: bytes) -> bytes:
        return _LOOKUP_REPLY.dump_json(self.committer.lookup(_LOOKUP_REQUEST.validate_json(request)))

    def commit(self, request: bytes) -> bytes:
        return _COMMIT_REPLY.dump_json(self.committer.commit(_COMMIT_REQUEST.validate_json(request)))


class JsonClient:
    """A :class:`CommitService` in another process, reached by ``call(method, writer_id, request JSON) -> reply
    JSON`` (the writer id lets a transport send each writer to the same one of several committers); a transport
    that gets no answer raises :class:`CommitterUnavailableError`. Always shared."""

    shared = True

    def __init__(self, call: Callable[[Literal["lookup", "commit"], str, bytes], bytes]) -> None:
        self._call = call

    def lookup(self, request: LookupRequest) -> LookupReply:
        return _LOOKUP_REPLY.validate_json(self._call("lookup", request.writer_id, _LOOKUP_REQUEST.dump_json(request)))

    def commit(self, request: CommitRequest) -> CommitReply:
        return _COMMIT_REPLY.validate_json(self._call("commit", request.writer_id, _COMMIT_REQUEST.dump_json(request)))


def verdict(record: RecordKey, live: tuple[str | None, int] | None, step: int, on_duplicate: str) -> str | None:
    """None to write ``record``; :data:`PRESENT` when the live copy of its sample id, ``live`` (its token hash and
    count), has its tokens; otherwise why it is refused."""
    if live is None:
        return None
    sid = record.sample_id
    if (record.token_hash, record.n_tokens) != live:
        return (
            f"sample {sid!r} is committed to step {step} with other tokens by another writer; give every record a "
            "unique id, or drop the committed one first (routelog drop)"
        )
    if on_duplicate == "error":
        return f"sample {sid!r} is already committed to step {step} (on_duplicate='error')"
    return PRESENT


# -- the committer ---------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Ticket:
    """One part waiting in a committer's queue."""

    request: int
    proposal: PartProposal
    deadline: float
    """``time.monotonic()`` past which the commit is not created."""
    on_duplicate: str
    size: int
    """Bytes of its commit document (what an entry may hold is bounded)."""
    outcome: PartOutcome | None = None


class _NothingToAppendError(Exception):
    """Every part of a batch was decided without an entry (committed before, sealed out, expired)."""


class _StepState:
    """A committer's view of one step, and its queue of parts."""

    def __init__(self, store: StoreRoot, step: int) -> None:
        self.directory = StepDirectory(store, step)
        self.known = threading.Lock()
        """Guards the directory's structures (held briefly)."""
        self.log = threading.Lock()
        """One refresh or append of the log at a time."""
        self.queue_changed = threading.Condition()
        self.queue: list[_Ticket] = []
        self.appending = False
        self.refreshed_at = -math.inf
        self.sealing_lock = threading.Lock()
        self.sealing_checked_at = -math.inf
        self.sealing = False


class Committer:
    """Appends the commits of the writers that share it to their steps' logs, many parts per entry (see the module
    docs); thread-safe. ``shared``: other writers than one commit through it; it then reads the log for lookups at
    most every ``refresh_every`` seconds (:data:`SHARED_REFRESH_SECONDS` by default; a writer's own reads it for
    each), and looks for a sealer as often."""

    def __init__(
        self,
        store: StoreRoot,
        *,
        committer_id: str | None = None,
        shared: bool = True,
        max_group: int = DEFAULT_MAX_GROUP,
        refresh_every: float | None = None,
    ) -> None:
        self.store = store
        self.committer_id = keys.check_writer_id(committer_id or f"committer-{secrets.token_hex(4)}")
        self._shared = shared
        self.max_group = max(1, min(max_group, keys.MAX_GROUP_COMMITS))
        self._refresh_every = refresh_every if refresh_every is not None else SHARED_REFRESH_SECONDS if shared else 0.0
        self._steps: OrderedDict[int, _StepState] = OrderedDict()
        self._steps_lock = threading.Lock()
        self._requests = itertools.count()

    @property
    def shared(self) -> bool:
        return self._shared

    def _state(self, step: int) -> _StepState:
        """The step's state (the steps used least recently are forgotten past :data:`STEPS_KEPT`: a step used again
        is read from its log again)."""
        with self._steps_lock:
            state = self._steps.get(step)
            if state is None:
                state = self._steps[step] = _StepState(self.store, keys.check_step(step))
            self._steps.move_to_end(step)
            while len(self._steps) > STEPS_KEPT:
                self._steps.popitem(last=False)
            return state

    # -- lookups -------------------------------------------------------------------------------------------------------
    def lookup(self, request: LookupRequest) -> LookupReply:
        """What ``request`` asks, on the log as this committer knows it (read again first when asked and due)."""
        state = self._state(request.step)
        if not state.directory.log.legacy_read or request.refresh:
            self._refresh(state, since=time.monotonic() - self._refresh_every)
        sealed = self._sealed(state, check=request.refresh)
        wanted = {r.sample_id for r in request.records}
        try:
            with state.known:
                state.directory.live(wanted)
        except StaleLogError:  # a part reclaimed after what this committer last read: the log now says why
            self._refresh(state, since=math.inf)
        with state.known:
            directory = state.directory
            live = directory.live(wanted)
            return LookupReply(
                live={sid: (copy.token_hash, copy.n_tokens) for sid, copy in live.items()},
                peers=tuple(e.doc for e in directory.peers(request.probes) if isinstance(e.doc, CommitRecord)),
                gone=tuple(directory.gone()),
                next_seq=directory.next_seq(request.writer_id),
                sealed=sealed,
            )

    def _refresh(self, state: _StepState, since: float) -> None:
        """Read what the log gained, unless it was read after ``since`` (``time.monotonic``): writers asking at once
        share one read."""
        with state.log:
            if state.directory.log.legacy_read and state.refreshed_at > since:
                return
            state.directory.log.refresh()
            state.refreshed_at = time.monotonic()
            with state.known:
                state.directory.catch_up()

    def _sealed(self, state: _StepState, *, check: bool) -> str | None:
        """Why the step takes no uploads: sealed (its log says so) or being sealed (a sealer's intent exists; looked
        for when ``check``, at most every refresh interval, by one thread for all)."""
        directory = state.directory
        where = f"step {directory.step} of {self.store.url}"
        if directory.seal is not None:
            return f"{where} is sealed and accepts no more records"
        with state.sealing_lock:
            now = time.monotonic()
            if not state.sealing and check and now - state.sealing_checked_at >= self._refresh_every:
                state.sealing = self.store.storage.has(keys.sealing_key(directory.step))
                state.sealing_checked_at = now
        if state.sealing:
            return (
                f"{where} is being sealed and accepts no more records (if the sealer died, finish it: routelog seal "
                f"{self.store.url} --step {directory.step})"
            )
        return None

    # -- commits -------------------------------------------------------------------------------------------------------
    def commit(self, request: CommitRequest) -> CommitReply:
        """Commit the request's parts (with other writers' parts waiting beside them) and say what became of each.

        Errors of the storage come back as outcomes (``failed``, ``undecided``, ``conflict``), never raised: one
        writer's failure is reported to each writer it concerns."""
        state = self._state(request.step)
        start = time.monotonic()
        number = next(self._requests)
        tickets = [
            _Ticket(number, p, start + p.expires_in, request.on_duplicate, len(p.commit.model_dump_json()))
            for p in request.parts
        ]
        with state.queue_changed:
            state.queue += tickets
            while any(t.outcome is None for t in tickets):
                if state.appending:
                    state.queue_changed.wait(timeout=1.0)
                    continue
                state.appending = True
                batch = self._take(state)
                state.queue_changed.release()
                try:
                    self._append(state, batch)
                finally:
                    state.queue_changed.acquire()
                    state.appending = False
                    state.queue_changed.notify_all()
        return CommitReply(tuple(t.outcome for t in tickets if t.outcome is not None))

    def _take(self, state: _StepState) -> list[_Ticket]:
        """The next batch: the oldest waiting parts, as many as an entry holds."""
        batch: list[_Ticket] = []
        nbytes = 0
        while state.queue and len(batch) < self.max_group:
            ticket = state.queue[0]
            if batch and nbytes + ticket.size > MAX_GROUP_BYTES:
                break
            batch.append(state.queue.pop(0))
            nbytes += ticket.size
        return batch

    def _append(self, state: _StepState, batch: list[_Ticket]) -> None:
        """Decide the batch on the complete log and create its entry at the next position; every ticket gets its
        outcome (storage failures included)."""
        directory = state.directory
        decided: dict[int, PartOutcome] = {}
        members: list[_Ticket] = []

        def build(position: int) -> CommitGroup:
            with state.known:
                group = self._decide(directory, batch, position, decided, members)
            if group is None:
                raise _NothingToAppendError
            return group

        def absorb(new: Sequence[Entry]) -> None:
            state.refreshed_at = time.monotonic()
            with state.known:
                directory.catch_up()

        try:
            with state.log:
                if not directory.log.legacy_read:
                    directory.log.refresh()
                    absorb(())
                deadline = max(t.deadline for t in batch)
                entries = directory.log.append(build, check=absorb, deadline=deadline)
                with state.known:
                    for entry, ticket in zip(entries, members, strict=True):
                        directory.learn(entry, _rows(ticket.proposal.records))
                    directory.catch_up()
        except _NothingToAppendError:
            pass
        except Exception as exc:  # the storage failed the entry: each of its parts is reported, never lost
            kind: OutcomeError = (
                "undecided"
                if isinstance(exc, CommitUndecidedError)
                else "conflict"
                if isinstance(exc, CommitConflictError)
                else "failed"
            )
            for ticket in batch:
                outcome = decided.get(id(ticket))
                if outcome is None or ticket in members:  # its entry was not (surely) created
                    outcome = PartOutcome(ticket.proposal.commit.part, error=kind, message=str(exc))
                ticket.outcome = outcome
            return
        for ticket in batch:
            ticket.outcome = decided[id(ticket)]

    def _decide(
        self,
        directory: StepDirectory,
        batch: list[_Ticket],
        position: int,
        decided: dict[int, PartOutcome],
        members: list[_Ticket],
    ) -> CommitGroup | None:
        """The entry for ``batch`` at ``position`` (None when no part goes in), each part's outcome in ``decided``
        (by ticket id) and the tickets of the entry's commits in ``members``: decided on the log read up to
        ``position``, so every entry before it is known."""
        decided.clear()
        members.clear()
        created_at = utc_now()
        now = time.monotonic()
        where = f"step {directory.step} of {self.store.url}"
        live = directory.live(
            {r.sample_id for t in batch for r in (*t.proposal.records, *t.proposal.presumed)}, (position, 0)
        )
        failed: set[int] = set()
        commits: list[CommitRecord] = []
        for ticket in batch:
            proposal = ticket.proposal
            part = proposal.commit.part
            existing = directory.parts.get(part)
            if existing is not None:  # already in an entry (a lost answer, a committer that died): decided there
                directory.learn(existing, _rows(proposal.records))
                at = directory.live({r.sample_id for r in (*proposal.records, *proposal.presumed)}, existing.order)
                decided[id(ticket)] = _records_outcome(ticket, existing, at, directory.step)
                continue
            error: tuple[OutcomeError, str] | None = None
            if ticket.request in failed:
                error = ("dependent", f"part {part} follows a part of its flush that was not committed")
            elif directory.seal is not None:
                error = (
                    "sealed",
                    f"{where} was sealed (log entry {directory.seal.name}) before part {part} could be committed; "
                    "its records are not part of the step",
                )
            elif now > ticket.deadline:
                error = (
                    "expired",
                    f"{where}: part {part} could not be committed within its time after the writer read the step "
                    "(the storage is too slow for gc's grace period); not committed",
                )
            if error is not None:
                failed.add(ticket.request)
                decided[id(ticket)] = PartOutcome(part, error=error[0], message=error[1])
                continue
            slot = len(commits)
            commit = proposal.commit.model_copy(
                update={"step": directory.step, "position": position, "slot": slot, "created_at": created_at}
            )
            entry = Entry(position, keys.log_key(directory.step, position), commit, slot)
            decided[id(ticket)] = _records_outcome(ticket, entry, live, directory.step)
            commits.append(commit)
            members.append(ticket)
        if not commits:
            return None
        return CommitGroup(
            step=directory.step,
            position=position,
            created_at=created_at,
            committer=self.committer_id,
            features=sorted({f for c in commits for f in c.features}),
            commits=commits,
        )


def _records_outcome(ticket: _Ticket, entry: Entry, live: dict[str, Copy], step: int) -> PartOutcome:
    """Each record's fate at ``entry``'s place, given the copies live just before it; the part's own committed
    records become live in ``live`` (for the commits after it in the same entry)."""
    commit = entry.doc
    if not isinstance(commit, CommitRecord):  # pragma: no cover - entries of parts
        raise TypeError(entry.key)
    committed: list[str] = []
    present: list[str] = []
    refused: dict[str, str] = {}
    rewrite: list[str] = []
    for record in ticket.proposal.records:
        found = verdict(record, _tokens(live.get(record.sample_id)), step, ticket.on_duplicate)
        if found is None:
            committed.append(record.sample_id)
            live[record.sample_id] = Copy(entry, record.token_hash, record.n_tokens)
        elif found == PRESENT:
            present.append(record.sample_id)
        else:
            refused[record.sample_id] = found
    for record in ticket.proposal.presumed:
        found = verdict(record, _tokens(live.get(record.sample_id)), step, ticket.on_duplicate)
        if found is None:
            rewrite.append(record.sample_id)
        elif found == PRESENT:
            present.append(record.sample_id)
        else:
            refused[record.sample_id] = found
    return PartOutcome(commit.part, commit, tuple(committed), tuple(present), refused, tuple(rewrite))


def _tokens(copy: Copy | None) -> tuple[str | None, int] | None:
    return None if copy is None else (copy.token_hash, copy.n_tokens)


def _rows(records: Sequence[RecordKey]) -> list[tuple[str, str | None, int]]:
    return [(r.sample_id, r.token_hash, r.n_tokens) for r in records]


__all__ = [
    "CommitReply",
    "CommitRequest",
    "CommitService",
    "Committer",
    "CommitterUnavailableError",
    "JsonClient",
    "JsonCommitter",
    "LookupReply",
    "LookupRequest",
    "PartOutcome",
    "PartProposal",
    "RecordKey",
]
