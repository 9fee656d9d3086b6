"""Appending records to one step of a store and committing them, streaming in the background.

Commit protocol (see ``schemas/FORMAT.md`` section 3): a flush uploads the part's data objects under a fresh, unique
directory, then creates the part's commit as the next entry of the step's log (:mod:`routelog.store.steplog`),
exclusively. Readers only follow commits, so a writer that dies before its commit leaves orphans (``routelog gc``) but
never a half-visible part. No shared object is ever read, modified and written back, so any number of writers append to
a step without coordination.

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
from typing import Literal, TypedDict

import pyarrow as pa

from routelog.errors import DuplicateSampleError, InvalidRecordError, RoutelogError, StepSealedError, StoreError
from routelog.format import keys
from routelog.format.dedup import PrefixIndex
from routelog.format.documents import INDEX_SCHEMA, CommitRecord, ObjectInfo, SealRecord, utc_now
from routelog.format.part import BuiltPart, PartOptions, build_part
from routelog.format.record import PreparedRecord, Record, prepare_record
from routelog.format.shard import ShardSink, SinkFactory
from routelog.store.history import StepHistory
from routelog.store.peers import PeerParts
from routelog.store.root import StoreRoot
from routelog.store.steplog import Entry, StepLog
from routelog.store.storage import Storage

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
MAX_COMMIT_DELAY = 600.0
"""Seconds after a writer read the step (and chose the parts its shared prefixes point at) past which its commit is
not attempted: ``routelog gc`` may remove uncommitted objects, and parts dropped, older than its grace period,
whose minimum is well above this (see :data:`routelog.store.gc.MIN_GRACE`)."""


def default_writer_id() -> str:
    return f"w{os.getpid()}-{secrets.token_hex(3)}"


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


_PRESENT = "present"
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
    ) -> None:
        self.store = store
        self.step = keys.check_step(step)
        self.writer_id = keys.check_writer_id(writer_id or default_writer_id())
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
        self._history = StepHistory(StepLog(store, self.step), columns=_DECIDING_COLUMNS)
        self._state = threading.RLock()
        """The step as this writer knows it (log, live records, shared-prefix index): one thread at a time."""
        self._uncommitted: set[str] = set()
        """Keys of this writer's parts that were built and not (or not surely) committed."""
        self._live: dict[str, tuple[str | None, int, int]] = {}
        self._sealed: StepSealedError | None = None
        self._evaluated = -1
        self._refresh()
        self._check_not_sealed()
        self._next_seq = 1 + max(
            (_commit(e).seq for e in self._history.log.commits() if _commit(e).writer_id == self.writer_id), default=-1
        )
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
    def _refresh(self) -> None:
        """Read the step's new log entries (and the indexes of new commits); other writers' parts become shared-
        prefix candidates, parts dropped whole stop being ones."""
        with self._state:
            _, tables = self._history.refresh()
            if len(self._history.log.entries) == self._evaluated:  # nothing new (appends read entries too)
                return
            self._evaluated = len(self._history.log.entries)
            view = self._history.view()
            self._live = view.live_records()  # replaced, never changed in place: appends read it without the lock
            if self._peers is not None:
                self._peers.absorb(view, tables)
            if view.seal is not None:
                self._sealed = self._sealed or StepSealedError(
                    f"step {self.step} of {self.store.url} is sealed and accepts no more records"
                )

    def _check_not_sealed(self) -> None:
        """Refuse to upload into a step that is sealed or being sealed (its commits would be refused)."""
        if self._sealed is not None:
            raise self._sealed
        storage = self.store.storage
        if storage.exists(keys.seal_key(self.step)):
            raise StepSealedError(f"step {self.step} of {self.store.url} is sealed and accepts no more records")
        if storage.exists(keys.sealing_key(self.step)):
            raise StepSealedError(
                f"step {self.step} of {self.store.url} is being sealed and accepts no more records (if the sealer "
                f"died, finish it: routelog seal {self.store.url} --step {self.step})"
            )

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
        """Whether the step holds a live record of this sample id with the same tokens (as this writer last read
        it; the flush checks again); :class:`DuplicateSampleError` when it holds one with other tokens, or with
        ``on_duplicate="error"``, after reading the step again (a drop may have removed it since)."""
        sid = prepared.row.sample_id
        for again in (False, True):
            if again:  # about to refuse: on the step as it is now
                self._refresh()
                if self._sealed is not None:
                    raise self._sealed
            known = self._live.get(sid)
            if known is None:
                return False
            same = (prepared.row.token_hash, prepared.row.n_tokens) == known[:2]
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
                self._complete(staged)
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
        while (staged := self._staged.get()) is not None:
            self._complete(staged)

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
            self._check_not_sealed()
            started = time.monotonic()  # shared prefixes point at what this refresh saw: the commit must follow soon
            self._refresh()
            if self._sealed is not None:
                raise self._sealed
            outcome = _Outcome()
            records = []
            for record in [*batch.records, *batch.presumed]:
                verdict = self._verdict(record, self._live.get(record.row.sample_id))
                if verdict is None:
                    records.append(record)
                elif verdict == _PRESENT:
                    outcome.present.append(record.row.sample_id)
                else:
                    outcome.refused[record.row.sample_id] = verdict
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

    def _complete(self, staged: _Staged) -> None:
        """Upload and commit a built part, report what happened to each of its records, and write the records a
        concurrent drop left without their present copy."""
        batch = staged.batch
        stages = [staged]  # and the follow-up parts': what they hold is let go at the end
        try:
            for _ in range(_REWRITE_ROUNDS):
                if self._aborted:
                    self._abandon(staged)
                    break
                if self._sealed is not None:  # learned since the part was built: its records are not committed
                    self._abandon(staged)
                    self._fail(batch, self._sealed, _ids([*batch.records, *batch.presumed]))
                    break
                outcome = self._commit(staged)
                if outcome.commit is not None:
                    with self._lock:
                        self.commits.append(outcome.commit)
                    if self.on_commit is not None:
                        self.on_commit(outcome.commit, outcome.committed)
                self._settle(outcome)
                if outcome.refused:
                    self._fail(batch, RoutelogError("; ".join(outcome.refused.values())), list(outcome.refused))
                if not outcome.rewrite:
                    break
                with self._lock:  # present copies a drop removed meanwhile: written in a part of their own
                    batch = _Batch(self._next_seq, outcome.rewrite)
                    self._next_seq += 1
                staged = self._stage(batch, share=False)
                stages.append(staged)
            else:
                self._fail(batch, RoutelogError("drops kept removing the copies found present"), _ids(batch.records))
        except Exception as exc:  # surfaced to the caller at its next call
            self._fail(batch, exc, _ids([*batch.records, *batch.presumed]))
        finally:
            for done in stages:  # its objects are written or given up: free them now, not when the next comes
                done.built = None
            self._finished(*(done.batch for done in stages))

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

    def _commit(self, staged: _Staged) -> _Outcome:
        """Upload and commit a built part; the outcome says what happened to each record at the commit's position
        in the log (see the module docs)."""
        built = staged.built
        if built is None:  # nothing left to write: decide on the log as it is now
            with self._state:
                self._refresh()
                return self._decided(staged, self._history.log.next_position)
        try:
            base = next((s.part for r in built.rows for s in r.spans if s.part in self._uncommitted), None)
            if base is not None:
                raise StoreError(
                    f"part {staged.name} shares rows with part {base} of this writer, which was not committed"
                )
            infos = upload_part(self.store.storage, self.step, staged.name, built)
            built.objects.clear()  # written and durable: the commit needs only their digests
            self._hold(staged.batch, 0)
            with self._state:
                entry = commit_part(
                    self._history.log,
                    self.writer_id,
                    staged.batch.seq,
                    staged.name,
                    built,
                    infos,
                    started=staged.started,
                    max_commit_delay=self.max_commit_delay,
                )
        except BaseException:  # not (or not surely) part of the step: never point at it
            self._abandon(staged)
            raise
        with self._state:
            staged.outcome.commit = _commit(entry)
            self._history.tables[entry.key] = _deciding_table(built)
            if built.prefix_part is not None:
                self._prefixes.committed(built.prefix_part)
            self._refresh()  # every entry before this commit is known now: decide on them
            return self._decided(staged, entry.position)

    def _decided(self, staged: _Staged, position: int) -> _Outcome:
        """Under the state lock: the fate of the staged records, on the log read up to ``position`` (where their
        commit is, or would be)."""
        outcome = staged.outcome
        winners = self._live
        for record in staged.records:
            sid = record.row.sample_id
            winner = winners.get(sid)
            if winner is not None and winner[2] == position:
                outcome.committed.append(sid)
                continue
            verdict = self._verdict(record, winner)  # an earlier copy is live: this one is shadowed, never read
            if verdict == _PRESENT:
                outcome.present.append(sid)
            elif verdict is not None:
                outcome.refused[sid] = verdict
        found = {r.row.sample_id: r for r in [*staged.batch.records, *staged.batch.presumed]}
        for sid in list(outcome.present):
            winner = winners.get(sid)
            if winner is None or winner[2] >= position:  # a drop removed the present copy: write it after all
                outcome.present.remove(sid)
                outcome.rewrite.append(found[sid])
            elif (verdict := self._verdict(found[sid], winner)) not in (None, _PRESENT):
                outcome.present.remove(sid)
                outcome.refused[sid] = verdict
        return outcome

    def _verdict(self, record: PreparedRecord, live: tuple[str | None, int, int] | None) -> str | None:
        """None to write ``record``; :data:`_PRESENT` when the live record ``live`` of its sample id has its tokens;
        otherwise why it is refused."""
        if live is None:
            return None
        sid = record.row.sample_id
        if (record.row.token_hash, record.row.n_tokens) != live[:2]:
            return (
                f"sample {sid!r} is committed to step {self.step} with other tokens by another writer; give every "
                "record a unique id, or drop the committed one first (routelog drop)"
            )
        if self.on_duplicate == "error":
            return f"sample {sid!r} is already committed to step {self.step} (on_duplicate='error')"
        return _PRESENT

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
        with self._lock:
            self._buffer, self._buffered_bytes, self._buffer_since = [], 0, None
            self._aborted = True
        self._stop()

    def close(self) -> list[CommitRecord]:
        """Commit what is buffered, wait for the last commit and stop; returns every commit of this writer."""
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

    def _check_usable(self) -> None:
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


def commit_part(
    log: StepLog,
    writer_id: str,
    seq: int,
    name: str,
    built: BuiltPart,
    infos: list[ObjectInfo],
    *,
    started: float,
    max_commit_delay: float = MAX_COMMIT_DELAY,
) -> Entry:
    """Create the commit of an uploaded part as the next entry of the step's log (the part becomes visible);
    returns the entry.

    The create is only attempted within ``max_commit_delay`` seconds of ``started`` (the writer's last read of the
    step, whose parts the part's shared prefixes may point at), so ``routelog gc`` (whose grace period is longer)
    never collects a part that is about to be committed, nor one that a commit is about to point at. Raises
    :class:`~routelog.errors.StepSealedError` when a seal precedes the position the commit would take.
    """
    step = log.step
    deadline = started + max_commit_delay

    def no_seal(new: Sequence[Entry]) -> None:
        sealed = next((e for e in new if isinstance(e.doc, SealRecord)), None)
        if sealed is not None:
            raise StepSealedError(
                f"step {step} of {log.store.url} was sealed (log entry {sealed.name}) before part {name} could be "
                "committed; its records are not part of the step"
            )
        if time.monotonic() > deadline:
            raise StoreError(
                f"step {step}: part {name} could not be committed within {max_commit_delay:.0f} s of reading the "
                "step (the storage is too slow for gc's grace period); not committed"
            )

    def commit(position: int) -> CommitRecord:
        return CommitRecord(
            features=built.features,
            step=step,
            part=name,
            writer_id=writer_id,
            seq=seq,
            position=position,
            created_at=utc_now(),
            n_records=len(built.rows),
            n_tokens=built.n_tokens,
            routing=built.routing,
            objects=infos,
            values=built.values,
            streams=built.streams,
            weights=built.weights,
        )

    no_seal([e for e in log.entries if isinstance(e.doc, SealRecord)])
    return log.append(commit, check=no_seal)


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


def _commit(entry: Entry) -> CommitRecord:
    if not isinstance(entry.doc, CommitRecord):  # pragma: no cover - callers pass commit entries
        raise TypeError(f"{entry.key} is not a commit")
    return entry.doc


def _deciding_table(built: BuiltPart) -> pa.Table:
    """The columns a writer decides on, of a part it built (so it never reads its own index back)."""
    schema = pa.schema([INDEX_SCHEMA.field(name) for name in _DECIDING_COLUMNS])
    return pa.Table.from_pylist([r.model_dump(include=set(_DECIDING_COLUMNS)) for r in built.rows], schema=schema)


def _ids(records: Sequence[PreparedRecord]) -> list[str]:
    return [r.row.sample_id for r in records]
