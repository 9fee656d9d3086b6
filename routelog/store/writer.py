"""Appending records to one step of a store and committing them, streaming in the background.

Commit protocol (see ``schemas/FORMAT.md`` section 3): a flush uploads the part's data objects under a fresh, unique
directory, then hands the part to a committer (:mod:`routelog.store.committer`), which creates a commit entry naming
it (with any other parts waiting) as the next entry of the step's log (:mod:`routelog.store.steplog`), exclusively.
Readers only follow commits, so a writer that dies before its commit leaves orphans (``routelog gc``) but never a
half-visible part. No shared object is ever read, modified and written back. Each writer has a committer of its own;
writers that share one (``committer=``, in a process or as a Ray actor) commit in a few entries whatever their number,
and one whose shared committer does not answer commits through its own.

Streaming: ``append`` validates and canonicalises a record on the caller's thread (so a bad record raises there and
nothing else is affected, at about 1 GB/s of routing); compression runs on a background thread, upload and commit on
another, so a part is compressed while the one before it is written and made durable (a part that shares rows with
an earlier part of the writer is committed after it, or fails with it). Backpressure is by bytes: ``append`` waits
while the records buffered and the parts not yet written (their raw rows until they are compressed, then their
objects) hold 1 x ``flush_bytes`` (:data:`HELD_FLUSHES`), and a build gives each layer chunk's raw rows back to the
OS once they are compressed, so the writer's memory stays within about 2 x ``flush_bytes`` whatever the run
length, plus the shared-prefix index's budget (:data:`routelog.format.dedup.DEFAULT_BUDGET_BYTES`; it keeps only rows
a record with token ids may share). On local disk a build writes each shard to its file as it compresses it
(:meth:`~routelog.store.storage.Storage.file_sink`; the upload then only makes it durable), and the rows it gives
back count at once: the next records are validated while a part is compressed, and its shard never waits in memory.
Parts are flushed by size and by age. ``encode_threads`` > 1 compresses each part's chunks on that many threads (the
kernels and zstd release the GIL; the objects are byte for byte the same): compression, not the caller's validation,
bounds one writer's throughput, so give it the cores the host can spare (the default, 1, leaves an inference
engine's cores to the engine).

What a writer reports is true at its commit's position in the log, where every entry before it is known to it:

- **committed**: the record is the live copy of its sample id (a reader reads it);
- **already present** (:attr:`StepWriter.already_present`): the step holds a live record of that sample id with the
  same tokens, whichever writer committed it; it is not written again, so re-running an ingest or re-sending
  everything after a crash never duplicates a record (``on_duplicate="error"`` refuses instead). A record found
  present at ``append`` is checked again at its flush: if a drop removed the present copy meanwhile, it is written;
- **not committed** (:class:`WriterError` naming the records): refused (another record of the same sample id with
  other tokens is live), the part failed, or the step was sealed before the commit
  (:class:`~routelog.errors.StepSealedError`; the records may be appended to another step). If the storage never
  answers a create, :class:`~routelog.errors.CommitUndecidedError` says the outcome is unknown (re-sending is safe).

Two live writers racing on one sample id may both commit it: the copy of the lower log position is live and the
later writer reports its own copy as already present (same tokens) or refused (other tokens), never committed.

Errors: a failed part is reported once, at the writer's next call, as :class:`WriterError` naming the records
that were not committed (they may be appended again); the writer stays usable. Only a sealed step ends it.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from types import TracebackType
from typing import Literal, TypedDict, TypeVar

import numpy as np

from routelog.errors import (
    DuplicateSampleError,
    ForkedWriterError,
    InvalidRecordError,
    RoutelogError,
    StepSealedError,
    StoreError,
)
from routelog.format import keys
from routelog.format.dedup import PrefixIndex
from routelog.format.digest import probe_hash
from routelog.format.documents import CommitRecord, ObjectInfo, utc_now
from routelog.format.part import BuiltPart, PartOptions, build_part
from routelog.format.record import PreparedRecord, Record, prepare_record
from routelog.format.shard import ShardSink, SinkFactory
from routelog.store.committer import (
    PRESENT,
    CommitRequest,
    CommitService,
    Committer,
    CommitterUnavailableError,
    LookupReply,
    LookupRequest,
    PartOutcome,
    PartProposal,
    RecordKey,
    verdict,
)
from routelog.store.peers import PeerParts
from routelog.store.root import StoreRoot
from routelog.store.storage import Storage

logger = logging.getLogger(__name__)
_R = TypeVar("_R")

DEFAULT_FLUSH_BYTES = 64 << 20
"""Raw-equivalent bytes of routing buffered before a part is written (zarr's >= 1 MB advice, S3's 8-16 MB GETs)."""
HELD_FLUSHES = 1.0
"""``append`` waits while the buffer and the parts not yet written hold this many flush buffers (unless the buffer
is empty and one part is in the background: a part is still compressed while the one before it is written). A
build's working memory and Python's come on top, so a writer's peak stays within 2 x ``flush_bytes``
(``tools/bench_writers.py`` measures it: with 1.0, one writer peaked at 1.4 x to local disk and 1.55 x to S3, and 4
writers sharing 2 cores at 1.5-1.7 x and 1.7-1.9 x; with 1.5, at 1.8 x and 2.1 x, and 2.0 x and 2.1 x).
Memory is paid for in speed where parts are uploaded from memory (S3): a part's objects wait in memory for their
upload, so the next buffer fills only while the part before it is written. On local disk a build writes its
shards as it compresses them and lets its rows go as it goes, so the next buffer fills during the build: 128
uniform records of 2048 tokens x 48 layers (six 16 MB parts, alternating in one process) took 0.29-0.31 s rather
than 0.37-0.39 s (with 2.0 held from memory, 0.33-0.35 s)."""
DEFAULT_FLUSH_SECONDS = 30.0
"""A part is also written once its oldest record has waited this long."""
MAX_OWN_GROUP = 64
"""Parts a writer commits in one entry of its own when several are ready (they share its rows in order)."""
SHARED_RETRY_SECONDS = 30.0
"""After a shared committer failed to answer, a writer commits through its own this long before trying it again."""
MAX_COMMIT_DELAY = 600.0
"""Seconds after a writer read the step (and chose the parts its shared prefixes point at) past which its commit is
not attempted: ``routelog gc`` may remove uncommitted objects, and parts dropped, older than its grace period,
whose minimum is well above this (see :data:`routelog.store.gc.MIN_GRACE`)."""


def default_writer_id() -> str:
    return f"w{os.getpid()}-{secrets.token_hex(3)}"


def refuse_if_forked(opened_by: int, what: str) -> None:
    """A forked child inherits a writer without its threads (and a writer process without its reader): raise
    :class:`ForkedWriterError` at once rather than wait on them."""
    if os.getpid() != opened_by:
        raise ForkedWriterError(
            f"{what} was opened by process {opened_by}, and this is process {os.getpid()}, forked from it: open a "
            "writer in this process (store.writer(...) or routelog.ProcessWriter)"
        )


class WriterError(StoreError):
    """A background commit failed; the records named were not committed (nothing of them is visible)."""

    def __init__(self, message: str, sample_ids: list[str]) -> None:
        super().__init__(message)
        self.sample_ids = sample_ids


@dataclass
class _Batch:
    seq: int
    records: list[PreparedRecord]
    """Records to write."""
    presumed: list[PreparedRecord] = field(default_factory=list)
    """Records appended while a live record of the same sample id and tokens was known: checked again at the
    flush, written if that record is gone."""
    held: int = 0
    """Bytes of it the writer counts as held: its raw rows until its part is built, then the part's objects."""


@dataclass
class _Outcome:
    """What one flush did, record by record, as of its commit's position in the log."""

    commit: CommitRecord | None = None
    committed: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    """Sample id -> why it is not committed."""
    rewrite: list[PreparedRecord] = field(default_factory=list)
    """Records found present whose present copy a concurrent drop removed: written by a follow-up part."""


@dataclass
class _Staged:
    """A batch decided and built, waiting for its upload and commit."""

    batch: _Batch
    outcome: _Outcome
    """What was decided before the build (records found present or refused)."""
    records: list[PreparedRecord]
    """The records built into the part."""
    built: BuiltPart | None
    """None when no record is left to write."""
    name: str
    started: float
    """When the writer last read the step before the build (its commit must follow within ``max_commit_delay``)."""


_DECIDING_COLUMNS = ("sample_id", "token_hash", "n_tokens")
"""Index columns a writer keeps of the step's records: what it decides duplicates on."""
_REWRITE_ROUNDS = 8
"""Follow-up parts a flush writes for records whose present copy a concurrent drop removed."""


def check_encode_threads(value: object) -> int:
    """``encode_threads`` as given, or :class:`ValueError` when it is not an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"encode_threads must be an int >= 1, got {value!r}")
    return value


def cpus_available() -> int:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def batch_encode_threads(value: int | None) -> int:
    """A batch writer's ``encode_threads`` (``routelog ingest``, ``routelog synth``): as given, checked, or every CPU
    the process may run on."""
    return cpus_available() if value is None else check_encode_threads(value)


class WriterOptions(TypedDict, total=False):
    """The options of a :class:`StepWriter`, as ``Store.writer`` and ``routelog.open_writer`` take them (see the
    writer's parameters for each)."""

    options: PartOptions | None
    flush_bytes: int | None
    flush_seconds: float | None
    max_pending: int
    background: bool
    on_commit: Callable[[CommitRecord, list[str]], None] | None
    max_commit_delay: float
    on_duplicate: Literal["skip", "error"]
    encode_threads: int
    committer: CommitService | None


class StepWriter:
    """Appends records to one step and commits them in parts; a context manager.

    ``append`` validates a record completely before buffering it: a rejected record raises
    :class:`~routelog.errors.InvalidRecordError` and changes nothing. On exit (also after an exception in the
    ``with`` body) the buffered records are committed and the writer waits for the last commit; call
    :meth:`abort` to drop what is not committed instead.
    """

    def __init__(
        self,
        store: StoreRoot,
        step: int,
        *,
        writer_id: str | None = None,
        options: PartOptions | None = None,
        flush_bytes: int | None = None,
        flush_seconds: float | None = DEFAULT_FLUSH_SECONDS,
        max_pending: int = 2,
        background: bool = True,
        on_commit: Callable[[CommitRecord, list[str]], None] | None = None,
        max_commit_delay: float = MAX_COMMIT_DELAY,
        on_duplicate: Literal["skip", "error"] = "skip",
        encode_threads: int = 1,
        committer: CommitService | None = None,
    ) -> None:
        self.store = store
        self.step = keys.check_step(step)
        self.writer_id = keys.check_writer_id(writer_id or default_writer_id())
        self._opened_by = os.getpid()
        """The process whose threads and committer this writer uses (see :meth:`_check_process`)."""
        self.options = options or PartOptions()
        self.flush_bytes = flush_bytes or DEFAULT_FLUSH_BYTES
        self.flush_seconds = flush_seconds
        self.on_commit = on_commit
        self.max_commit_delay = max_commit_delay
        if on_duplicate not in ("skip", "error"):
            raise ValueError(f"on_duplicate must be 'skip' or 'error', got {on_duplicate!r}")
        self.on_duplicate = on_duplicate
        self.encode_threads = check_encode_threads(encode_threads)
        self.commits: list[CommitRecord] = []
        self.already_present: list[str] = []
        """Sample ids appended but already live in the step with the same tokens (not written again)."""
        self.appended = 0
        """Records accepted for writing (new records; ``already_present`` ones are not counted)."""
        self._prefixes = PrefixIndex()
        self._peers = PeerParts(store, self.step, self._prefixes) if self.options.dedup == "step" else None
        self._own = Committer(store, committer_id=self.writer_id, shared=False)
        """The writer's own committer: its commit path, or the fallback of a shared one that does not answer."""
        self._service: CommitService = committer or self._own
        self._shared_failed_at = -math.inf
        self._state = threading.RLock()
        """The shared-prefix index and the peers listed in it: one thread at a time."""
        self._uncommitted: set[str] = set()
        """Keys of this writer's parts that were built and not (or not surely) committed."""
        self._sealed: StepSealedError | None = None
        self._next_seq = self._lookup(LookupRequest(self.step, self.writer_id)).next_seq
        if self._sealed is not None:
            raise self._sealed
        self._sample_ids: set[str] = set()
        self._buffer: list[PreparedRecord] = []
        self._presumed: list[PreparedRecord] = []
        self._buffered_bytes = 0
        self._buffer_since: float | None = None
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._pending = 0
        self._held_bytes = 0
        """Bytes held by the parts handed to the background (see :attr:`_Batch.held`)."""
        self._error: WriterError | None = None
        self._closed = False
        self._aborted = False
        self.max_pending = max(1, max_pending)
        self._queue: queue.Queue[_Batch | None] = queue.Queue()
        self._staged: queue.Queue[_Staged | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._encode_pool = (
            ThreadPoolExecutor(encode_threads, thread_name_prefix=f"routelog-encode-{self.writer_id}")
            if encode_threads > 1
            else None
        )
        if background:
            for target, role in ((self._run_builder, "builder"), (self._run_committer, "committer")):
                thread = threading.Thread(target=target, name=f"routelog-{role}-{self.writer_id}", daemon=True)
                thread.start()
                self._threads.append(thread)

    # -- the step as this writer knows it ---------------------------------------------------------------------------
    def _through(self) -> CommitService:
        """The committer to use now: the shared one, unless it failed to answer in the last
        :data:`SHARED_RETRY_SECONDS` (then the writer's own)."""
        if self._service is not self._own and time.monotonic() - self._shared_failed_at < SHARED_RETRY_SECONDS:
            return self._own
        return self._service

    def _call(self, call: Callable[[CommitService], _R]) -> _R:
        """``call`` on the committer in use; a shared committer that does not answer hands over to the writer's own
        (which reads from the log what became of what was sent)."""
        service = self._through()
        if service is self._own:
            return call(service)
        try:
            return call(service)
        except CommitterUnavailableError as exc:
            self._shared_failed_at = time.monotonic()
            logger.warning(
                "writer %s: the shared committer did not answer (%s); committing directly", self.writer_id, exc
            )
            return call(self._own)

    def _lookup(self, request: LookupRequest) -> LookupReply:
        """Ask the committer about the step; what it says of a seal, and the peers it names, are taken in."""
        reply = self._call(lambda service: service.lookup(request))
        if reply.sealed is not None:
            self._sealed = self._sealed or StepSealedError(reply.sealed)
        if self._peers is not None and self._peers.news(reply.peers, reply.gone):  # (a build holds the index)
            with self._state:
                self._peers.absorb(list(reply.peers), reply.gone)
        return reply

    @property
    def shared_committer(self) -> bool:
        """Whether the writer commits through a shared committer now (not its own): it then reads nothing of the
        step at ``append``, and its flush decides every record."""
        return self._through() is not self._own

    @property
    def buffered_bytes(self) -> int:
        """Raw-equivalent routing bytes waiting for the next part."""
        return self._buffered_bytes

    @property
    def pending_parts(self) -> int:
        """Parts handed to the background uploader and not committed yet."""
        return self._pending

    # -- appending -------------------------------------------------------------------------------------------
    def append(self, record: Record) -> None:
        """Validate and buffer one record; a full buffer is handed to the background uploader (blocking while
        ``max_pending`` parts are already waiting, or while the background holds too many bytes: see the module)."""
        self._check_usable()
        self._wait_for_memory()
        sid = record.sample_id
        if sid in self._sample_ids:
            raise DuplicateSampleError(
                sid,
                "sample_id",
                f"already appended to step {self.step}",
                "give every record of a step a unique sample id",
            )
        prepared = prepare_record(
            record, self.store.model_spec, self.step, self.options.topk_order, self.options.weights_dtype
        )
        present = self._present(prepared)
        with self._lock:
            self._sample_ids.add(sid)
            if present:
                self.already_present.append(sid)
                self._presumed.append(prepared)
            else:
                self.appended += 1
                self._buffer.append(prepared)
            self._buffered_bytes += prepared.raw_nbytes
            if self._buffer_since is None:
                self._buffer_since = time.monotonic()
            full = self._buffered_bytes >= self.flush_bytes
        if full:
            self._submit()

    def _wait_for_memory(self) -> None:
        """Backpressure by bytes: while the buffer and the parts in the background hold :data:`HELD_FLUSHES` x
        ``flush_bytes``, wait for a part to be compressed or written (a part that failed lets its bytes go too).
        With one part in the background, an empty buffer takes the next record: a part is always built while the one
        before it is written."""
        with self._done:
            while (
                self._held_bytes
                and (self._buffered_bytes or self._pending > 1)
                and self._buffered_bytes + self._held_bytes >= HELD_FLUSHES * self.flush_bytes
            ):
                self._done.wait(timeout=1.0)

    def _hold(self, batch: _Batch, nbytes: int) -> None:
        """``batch`` is built (or done, with ``nbytes`` 0): count ``nbytes`` as what it holds now."""
        with self._done:
            self._held_bytes += nbytes - batch.held
            batch.held = nbytes
            self._done.notify_all()

    def _present(self, prepared: PreparedRecord) -> bool:
        """Whether the step holds a live record of this sample id with the same tokens, as this writer last read
        it (the flush checks again); :class:`DuplicateSampleError` when it holds one with other tokens, or with
        ``on_duplicate="error"``, after reading the step again (a drop may have removed it since). A writer of a
        shared committer has read nothing of the step here: its flush decides."""
        if self.shared_committer:
            return False
        sid = prepared.row.sample_id
        key = _key(prepared)
        same = False
        for again in (False, True):
            live = self._lookup(LookupRequest(self.step, self.writer_id, (key,), refresh=again)).live.get(sid)
            if again and self._sealed is not None:  # about to refuse: on the step as it is now
                raise self._sealed
            if live is None:
                return False
            same = live == (key.token_hash, key.n_tokens)
            if same and self.on_duplicate == "skip":
                return True
        raise DuplicateSampleError(
            sid,
            "sample_id",
            f"is already committed to step {self.step}" + ("" if same else " with other tokens"),
            "give every record a unique id" + ("" if same else ", or drop the committed one first (routelog drop)"),
        )

    def _take_buffer(self) -> _Batch | None:
        """Under the lock: the buffered records as the next part (with its commit number)."""
        if not self._buffer and not self._presumed:
            return None
        batch = _Batch(self._next_seq, self._buffer, self._presumed, held=self._buffered_bytes)
        self._next_seq += 1
        self._held_bytes += self._buffered_bytes
        self._buffer, self._presumed, self._buffered_bytes, self._buffer_since = [], [], 0, None
        self._pending += 1
        return batch

    def _submit(self) -> None:
        with self._lock:
            batch = self._take_buffer()
        if batch is None:
            return
        if not self._threads:
            staged = self._stage_or_fail(batch)
            if staged is not None:
                self._complete([staged])
            return
        self._queue.put(batch)
        with self._done:  # backpressure: max_pending parts waiting, one being built or committed
            while self._pending > self.max_pending + 1:
                self._done.wait(timeout=1.0)

    # -- background: a builder thread and a committer thread -------------------------------------------------------
    # The builder decides and compresses part k + 1 while the committer uploads part k, waits for the storage to
    # make it durable and commits it. Part k + 1 may share rows with part k before k is committed: the committer
    # commits parts in order, and fails a part that shares rows with one of this writer's parts that was not
    # committed (its records are reported, never pointed at a part that may vanish).
    def _run_builder(self) -> None:
        try:
            while True:
                try:
                    item = self._queue.get(timeout=self._wait_time())
                except queue.Empty:
                    with self._lock:
                        due = self._buffer_since is not None and self._age() >= (self.flush_seconds or float("inf"))
                        item = self._take_buffer() if due else None
                    if item is None:
                        continue
                if item is None:
                    return
                staged = self._stage_or_fail(item)
                if staged is not None:
                    self._staged.put(staged)
        finally:
            self._staged.put(None)

    def _run_committer(self) -> None:
        """Commit the built parts in order, those that are ready together in one entry."""
        while (staged := self._staged.get()) is not None:
            ready = [staged]
            while len(ready) < MAX_OWN_GROUP:
                try:
                    more = self._staged.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._complete(ready)
                    return
                ready.append(more)
            self._complete(ready)

    def _age(self) -> float:
        return 0.0 if self._buffer_since is None else time.monotonic() - self._buffer_since

    def _wait_time(self) -> float:
        with self._lock:
            if self.flush_seconds is None or self._buffer_since is None:
                return 1.0
            return max(0.01, min(1.0, self.flush_seconds - self._age()))

    def _stage_or_fail(self, batch: _Batch) -> _Staged | None:
        """The batch built as a part, or None when it failed (reported) or the writer was aborted."""
        try:
            if not self._aborted:
                return self._stage(batch, share=True)
        except Exception as exc:  # surfaced to the caller at its next call
            self._fail(batch, exc, _ids([*batch.records, *batch.presumed]))
        self._finished(batch)
        return None

    def _stage(self, batch: _Batch, *, share: bool) -> _Staged:
        """Decide on the step as it is now which records to write, and build them as a part. ``share``: place them
        in the writer's shared-prefix index (parts built out of order, the committer's rewrites, never are)."""
        with self._state:
            started = time.monotonic()  # shared prefixes point at what this lookup saw: the commit must follow soon
            candidates = [*batch.records, *batch.presumed]
            probes = _probes(candidates) if share and self._peers is not None else ()
            reply = self._lookup(LookupRequest(self.step, self.writer_id, tuple(map(_key, candidates)), probes))
            if self._sealed is not None:
                raise self._sealed
            outcome = _Outcome()
            records = []
            for record in candidates:
                found = verdict(_key(record), reply.live.get(record.row.sample_id), self.step, self.on_duplicate)
                if found is None:
                    records.append(record)
                elif found == PRESENT:
                    outcome.present.append(record.row.sample_id)
                else:
                    outcome.refused[record.row.sample_id] = found
            name = keys.new_part_name(self.writer_id, batch.seq)
            staged = _Staged(batch, outcome, records, None, name, started)
            if not records:
                return staged
            options, prefixes = self.options, self._prefixes if share else None
            if not share and options.dedup == "step":
                options = replace(options, dedup="part")
            key = keys.part_dir(self.step, name)
            spec = self.store.model_spec
            storage = self.store.storage
            # On local disk the shards go to their files as they are compressed, and what the build gives back of
            # the records' rows is let go at once: the next records are sorted while this part is compressed.
            sink: SinkFactory | None = None
            on_release: Callable[[int], None] | None = None
            if storage.local:

                def sink(relative: str, capacity: int, start: int) -> ShardSink:
                    return storage.file_sink(f"{key}/{relative}", start)

                def on_release(released: int) -> None:
                    self._hold(batch, max(0, batch.held - released))

            build = partial(
                build_part,
                spec=spec,
                options=options,
                prefixes=prefixes,
                key=key,
                consume=True,
                sink=sink,
                pool=self._encode_pool,
            )
            try:
                staged.built = build(records, on_release=on_release)
            except StoreError:  # the storage failed, not a record: the batch fails with its typed error
                raise
            except Exception:  # append validated these records: find the one that still fails
                staged.records, refused = _isolate_failures(records, self.store, self.options)
                outcome.refused.update(refused)
                if staged.records:
                    staged.built = build(staged.records)
            for record in staged.records:  # the part holds them now
                record.release()
            self._hold(batch, 0 if staged.built is None else staged.built.memory_nbytes)
            return staged

    def _complete(self, ready: list[_Staged]) -> None:
        """Upload and commit built parts (in one entry where the committer can), report what happened to each of
        their records, and write the records a concurrent drop left without their present copy."""
        held = {id(s): [s] for s in ready}  # each part and its follow-ups: what they hold is let go at the end
        origin = {id(s): id(s) for s in ready}
        pending = list(ready)
        try:
            for _ in range(_REWRITE_ROUNDS):
                if not pending:
                    break
                if self._aborted:
                    for staged in pending:
                        self._abandon(staged)
                    return
                if self._sealed is not None:  # learned since the parts were built: their records are not committed
                    for staged in pending:
                        self._abandon(staged)
                        self._fail(staged.batch, self._sealed, _ids([*staged.batch.records, *staged.batch.presumed]))
                    return
                follow: list[_Staged] = []
                for staged, outcome in zip(pending, self._commit(pending), strict=True):
                    if isinstance(outcome, Exception):
                        self._fail(staged.batch, outcome, _ids([*staged.batch.records, *staged.batch.presumed]))
                        continue
                    self._report(staged, outcome)
                    if outcome.rewrite:  # present copies a drop removed meanwhile: written in a part of their own
                        with self._lock:
                            batch = _Batch(self._next_seq, outcome.rewrite)
                            self._next_seq += 1
                        again = self._stage(batch, share=False)
                        origin[id(again)] = origin[id(staged)]
                        held[origin[id(staged)]].append(again)
                        follow.append(again)
                pending = follow
            for staged in pending:
                self._fail(
                    staged.batch,
                    RoutelogError("drops kept removing the copies found present"),
                    _ids(staged.batch.records),
                )
        except Exception as exc:  # surfaced to the caller at its next call
            for staged in pending:
                self._fail(staged.batch, exc, _ids([*staged.batch.records, *staged.batch.presumed]))
        finally:
            for stages in held.values():  # written or given up: free their objects now, not when the next comes
                for done in stages:
                    done.built = None
                self._finished(*(done.batch for done in stages))

    def _report(self, staged: _Staged, outcome: _Outcome) -> None:
        """A part's outcome, told to the caller's counts and callback."""
        if outcome.commit is not None:
            with self._lock:
                self.commits.append(outcome.commit)
            if self.on_commit is not None:
                self.on_commit(outcome.commit, outcome.committed)
        self._settle(outcome)
        if outcome.refused:
            self._fail(staged.batch, RoutelogError("; ".join(outcome.refused.values())), list(outcome.refused))

    def _finished(self, *batches: _Batch) -> None:
        for batch in batches:
            self._hold(batch, 0)
        with self._done:
            self._pending -= 1
            self._done.notify_all()

    def _abandon(self, staged: _Staged) -> None:
        """The part will not be committed: the writer's later parts that share its rows fail with it."""
        if staged.built is None:
            return
        with self._state:
            self._uncommitted.add(keys.part_dir(self.step, staged.name))
            if staged.built.prefix_part is not None:
                self._prefixes.abandon(staged.built.prefix_part)

    def _settle(self, outcome: _Outcome) -> None:
        """Move records between the counts once their fate at the commit's position is known."""
        with self._lock:
            present = set(self.already_present)
            for sid in outcome.present:
                if sid not in present:  # appended as new, found present at the flush
                    self.already_present.append(sid)
                    self.appended -= 1
            moved = {sid for sid in [*outcome.committed, *(r.row.sample_id for r in outcome.rewrite)] if sid in present}
            if moved:  # appended as present, written after all (a drop had removed the present copy)
                self.already_present = [sid for sid in self.already_present if sid not in moved]
                self.appended += len(moved)

    def _fail(self, batch: _Batch, exc: Exception, sample_ids: list[str]) -> None:
        """Record a failed part (or the records refused from it) for the caller's next call."""
        error = WriterError(
            f"writer {self.writer_id!r}, step {self.step}, commit {batch.seq}: {exc}; "
            f"{len(sample_ids)} records not committed: {sample_ids[:5]}",
            sample_ids,
        )
        error.__cause__ = exc
        with self._lock:
            if isinstance(exc, StepSealedError):
                self._sealed = self._sealed or exc
            self._sample_ids.difference_update(sample_ids)  # not committed: they may be appended again
            failed = set(sample_ids)
            self.already_present = [sid for sid in self.already_present if sid not in failed]
            if self._error is None:
                self._error = error
            else:  # several parts failed before the caller looked: report them together
                self._error = WriterError(f"{self._error}; and {error}", [*self._error.sample_ids, *sample_ids])

    def _commit(self, pending: list[_Staged]) -> list[_Outcome | Exception]:
        """Upload the built parts and commit them through the committer, in order and in one request; each part's
        outcome (what happened to each record at its commit's place in the log), or why it was not committed."""
        results: list[_Outcome | Exception | None] = [None] * len(pending)
        proposals: list[tuple[int, PartProposal]] = []
        for i, staged in enumerate(pending):
            if staged.built is None:  # nothing left to write: the records found present are checked again now
                results[i] = self._recheck(staged)
                continue
            try:  # a part built on one that failed to upload fails too (_propose), the others go on
                proposals.append((i, self._propose(staged)))
            except Exception as exc:
                self._abandon(staged)
                results[i] = exc
        if proposals:
            request = CommitRequest(self.step, self.writer_id, tuple(p for _, p in proposals), self.on_duplicate)
            try:
                reply = self._call(lambda service: service.commit(request))
            except Exception as exc:
                for i, _ in proposals:
                    self._abandon(pending[i])
                    results[i] = exc
            else:
                for (i, _), part in zip(proposals, reply.outcomes, strict=True):
                    results[i] = self._taken(pending[i], part)
        return [r if r is not None else RoutelogError("no outcome") for r in results]

    def _propose(self, staged: _Staged) -> PartProposal:
        """Upload a built part (made durable) and what its committer needs to commit it."""
        built = staged.built
        if built is None:  # pragma: no cover - callers pass built parts
            raise TypeError(staged.name)
        base = next((s.part for r in built.rows for s in r.spans if s.part in self._uncommitted), None)
        if base is not None:
            raise StoreError(f"part {staged.name} shares rows with part {base} of this writer, which was not committed")
        infos = upload_part(self.store.storage, self.step, staged.name, built)
        built.objects.clear()  # written and durable: the commit needs only their digests
        self._hold(staged.batch, 0)
        expires_in = staged.started + self.max_commit_delay - time.monotonic()
        return PartProposal(
            part_commit(built, self.writer_id, staged.batch.seq, staged.name, self.step, infos),
            tuple(map(_key, staged.records)),
            tuple(
                _key(r)
                for r in [*staged.batch.records, *staged.batch.presumed]
                if r.row.sample_id in staged.outcome.present
            ),
            expires_in,
        )

    def _taken(self, staged: _Staged, part: PartOutcome) -> _Outcome | Exception:
        """The committer's word on a part, as the writer reports it."""
        try:
            part.raise_error()
        except StoreError as exc:  # not (or not surely) part of the step: never point at it
            self._abandon(staged)
            if isinstance(exc, StepSealedError):
                self._sealed = self._sealed or exc
            return exc
        built = staged.built
        with self._state:
            if built is not None and built.prefix_part is not None:
                self._prefixes.committed(built.prefix_part)
            if self._peers is not None:
                self._peers.own(staged.name)
        return self._outcome(staged, part)

    def _recheck(self, staged: _Staged) -> _Outcome | Exception:
        """A batch with nothing to write: its records found present are checked again on the step as it is now."""
        outcome = staged.outcome
        found = {r.row.sample_id: r for r in [*staged.batch.records, *staged.batch.presumed]}
        keys_ = tuple(_key(found[sid]) for sid in outcome.present)
        reply = self._lookup(LookupRequest(self.step, self.writer_id, keys_))
        present = []
        for key in keys_:
            judged = verdict(key, reply.live.get(key.sample_id), self.step, self.on_duplicate)
            if judged is None:  # a drop removed the present copy: write it after all
                outcome.rewrite.append(found[key.sample_id])
            elif judged == PRESENT:
                present.append(key.sample_id)
            else:
                outcome.refused[key.sample_id] = judged
        outcome.present = present
        return outcome

    def _outcome(self, staged: _Staged, part: PartOutcome) -> _Outcome:
        """The writer's record of a committed part: the committer's verdicts, with the records found present or
        refused before the build."""
        outcome = staged.outcome
        found = {r.row.sample_id: r for r in [*staged.batch.records, *staged.batch.presumed]}
        outcome.commit = part.commit
        outcome.committed = list(part.committed)
        outcome.present = list(part.present)
        outcome.refused.update(part.refused)
        outcome.rewrite = [found[sid] for sid in part.rewrite]
        return outcome

    # -- flushing and closing ----------------------------------------------------------------------------------
    def flush(self) -> list[CommitRecord]:
        """Commit everything appended so far and wait for it; returns the commits this call waited for."""
        self._check_usable()
        before = len(self.commits)
        self._submit()
        self._wait_idle()
        self._raise_error()
        return self.commits[before:]

    def _wait_idle(self) -> None:
        with self._done:
            while self._pending:
                self._done.wait(timeout=1.0)

    def abort(self) -> None:
        """Drop the buffered and queued records (what is committed stays) and stop."""
        self._check_process()
        with self._lock:
            self._buffer, self._buffered_bytes, self._buffer_since = [], 0, None
            self._aborted = True
        self._stop()

    def close(self) -> list[CommitRecord]:
        """Commit what is buffered, wait for the last commit and stop; returns every commit of this writer."""
        self._check_process()
        if not self._closed:
            try:
                if not self._aborted:
                    self._submit()
                    self._wait_idle()
            finally:
                self._stop()
            self._raise_error()
        return self.commits

    def _stop(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._threads:
            self._queue.put(None)  # the builder passes it on to the committer
            for thread in self._threads:
                thread.join()
        if self._encode_pool is not None:
            self._encode_pool.shutdown()

    def _check_process(self) -> None:
        refuse_if_forked(self._opened_by, f"writer {self.writer_id!r} of step {self.step}")

    def _check_usable(self) -> None:
        self._check_process()
        if self._closed:
            raise ValueError(f"writer {self.writer_id!r} of step {self.step} is closed")
        self._raise_error()
        if self._sealed is not None:
            raise self._sealed

    def _raise_error(self) -> None:
        """Report a failed part once; the writer stays usable (except on a sealed step)."""
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def __enter__(self) -> StepWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):
            self.abort()  # KeyboardInterrupt, SystemExit: do not start uploads while the process is going down
        elif exc_type is not None and isinstance(exc, WriterError):
            self._stop()
        else:
            self.close()


def _isolate_failures(
    records: list[PreparedRecord], store: StoreRoot, options: PartOptions
) -> tuple[list[PreparedRecord], dict[str, str]]:
    """When a part fails to build, the records that build on their own, and why each of the others fails: one bad
    record costs only itself, never the good records it shares a part with."""
    good: list[PreparedRecord] = []
    refused: dict[str, str] = {}
    for record in records:
        if record.released:  # the failed build had taken its rows (to let them go as it encoded)
            refused[record.row.sample_id] = (
                f"sample {record.row.sample_id!r} was not stored: its part failed while being encoded; append it again"
            )
            continue
        try:
            build_part([record], store.model_spec, replace(options, dedup="off"))
        except Exception as exc:  # reported to the caller with the sample id
            refused[record.row.sample_id] = f"sample {record.row.sample_id!r} cannot be stored: {exc!r}"
        else:
            good.append(record)
    return good, refused


def upload_part(storage: Storage, step: int, name: str, built: BuiltPart) -> list[ObjectInfo]:
    """Write a part's objects under its fresh directory ``name`` (on local disk durably, see
    :meth:`~routelog.store.storage.Storage.write_many`); returns what its commit lists of them."""
    _check_within_step(built, step)
    infos = built.object_infos()
    base = keys.part_dir(step, name)
    storage.write_many({f"{base}/{key}": data for key, data in built.objects.items()})
    return infos


def part_commit(
    built: BuiltPart, writer_id: str, seq: int, name: str, step: int, infos: list[ObjectInfo]
) -> CommitRecord:
    """The commit document of an uploaded part, but for its place in the log (``position``, ``slot``) and its time:
    the committer's entry gives those."""
    return CommitRecord(
        features=built.features,
        step=step,
        part=name,
        writer_id=writer_id,
        seq=seq,
        created_at=utc_now(),
        n_records=len(built.rows),
        n_tokens=built.n_tokens,
        routing=built.routing,
        objects=infos,
        values=built.values,
        streams=built.streams,
        weights=built.weights,
        digest=built.digest,
        indexer=built.indexer,
    )


def _check_within_step(built: BuiltPart, step: int) -> None:
    """Shared rows stay inside their step (gc decides a step's parts by what its records read)."""
    inside = keys.parts_dir(step) + "/"
    for row in built.rows:
        for span in [*row.spans, *(s for entry in row.streams or [] for s in entry.spans)]:
            if span.part is not None and not span.part.startswith(inside):
                raise InvalidRecordError(
                    row.sample_id,
                    "spans",
                    f"points at rows of another step's part {span.part!r}",
                    "share rows only with records of the same step (this is a routelog bug: please report it)",
                )


def _key(record: PreparedRecord) -> RecordKey:
    return RecordKey(record.row.sample_id, record.row.token_hash, record.row.n_tokens)


def _probes(records: Sequence[PreparedRecord]) -> tuple[int, ...]:
    """Prefix probes of the records that may share a prefix with another writer's (what its digests list)."""
    probes = (probe_hash(np.asarray(r.row.token_ids, dtype=np.int64)) for r in records if r.row.token_ids is not None)
    return tuple(sorted({p for p in probes if p is not None}))


def _ids(records: Sequence[PreparedRecord]) -> list[str]:
    return [r.row.sample_id for r in records]
