"""Appending records to one step of a store and committing them, streaming in the background.

Commit protocol (see ``schemas/FORMAT.md``): a flush uploads the part's data objects under a fresh, unique
directory, then creates ``commits/<writer>.<seq>.json`` exclusively. Readers only follow commit records, so a
writer that dies before its commit leaves orphans (``routelog gc``) but never a half-visible part. No shared
object is ever read, modified and written back, so any number of writers append to a step without coordination.

Streaming: ``append`` validates and canonicalises a record on the caller's thread (so a bad record raises there
and nothing else is affected, at about 1 GB/s of routing); compression, upload and commit run on a background
thread. A bounded queue of parts gives backpressure, so memory stays within about ``(max_pending + 2) x
flush_bytes`` plus the shared-prefix index's budget (:data:`routelog.dedup.DEFAULT_BUDGET_BYTES`) whatever the run
length. Parts are flushed by size and by age.

Idempotence: a writer learns at its start which records the step already holds (from the step's index) and skips
a record whose sample id is already committed with the same tokens, whichever writer committed it, so re-running
an ingest or re-sending everything after a crash never commits a record twice (``on_duplicate="error"`` refuses
instead). A writer re-opened with the same id continues its commit sequence. Two live writers racing on one sample
id may both commit it: readers then read the earliest commit's record (see :class:`~routelog.reader.StepSnapshot`).

Sealing: after its commit's exclusive create a writer checks the seal fence (see :mod:`routelog.seal`), so it
reports a commit as done only if every reader of the step, sealed or not, will see it.

Errors: a failed part is reported once, at the writer's next call, as :class:`WriterError` naming the records
that were not committed (they may be appended again); the writer stays usable. Only a sealed step ends it.
"""

from __future__ import annotations

import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Literal, TypedDict

from routelog import keys
from routelog.dedup import PrefixIndex
from routelog.errors import (
    CommitConflictError,
    CommitUndecidedError,
    DuplicateSampleError,
    RoutelogError,
    StepSealedError,
    StoreError,
)
from routelog.format import CommitRecord, dump_document, parse_document, utc_now
from routelog.part import BuiltPart, PartOptions, build_part
from routelog.peers import PeerParts
from routelog.reader import StepSnapshot, read_seal
from routelog.record import PreparedRecord, Record, prepare_record
from routelog.root import StoreRoot

DEFAULT_FLUSH_BYTES = 64 << 20
"""Raw-equivalent bytes of routing buffered before a part is written (zarr's >= 1 MB advice, S3's 8-16 MB GETs)."""
DEFAULT_FLUSH_SECONDS = 30.0
"""A part is also written once its oldest record has waited this long."""
MAX_COMMIT_DELAY = 600.0
"""Seconds after a part's upload started past which its commit is not attempted (the part is uploaded again under a
fresh name): ``routelog gc`` may remove uncommitted objects older than its grace period, whose minimum is well
above this (see :data:`routelog.gc.MIN_GRACE`)."""
DEFAULT_SEAL_WAIT = 300.0
"""Seconds a writer whose commit met a seal in progress waits for the seal to learn whether it was included."""
_UPLOAD_ATTEMPTS = 3


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


class WriterOptions(TypedDict, total=False):
    """The options of a :class:`StepWriter`, as ``Store.writer`` and ``routelog.open_writer`` take them (see the
    writer's parameters for each)."""

    options: PartOptions | None
    flush_bytes: int | None
    flush_seconds: float | None
    max_pending: int
    background: bool
    on_commit: Callable[[CommitRecord, list[str]], None] | None
    seal_wait: float
    max_commit_delay: float
    on_duplicate: Literal["skip", "error"]


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
        seal_wait: float = DEFAULT_SEAL_WAIT,
        max_commit_delay: float = MAX_COMMIT_DELAY,
        on_duplicate: Literal["skip", "error"] = "skip",
    ) -> None:
        self.store = store
        self.step = keys.check_step(step)
        self.writer_id = keys.check_writer_id(writer_id or default_writer_id())
        self.options = options or PartOptions()
        self.flush_bytes = flush_bytes or DEFAULT_FLUSH_BYTES
        self.flush_seconds = flush_seconds
        self.on_commit = on_commit
        self.seal_wait = seal_wait
        self.max_commit_delay = max_commit_delay
        self._check_not_sealed()
        if on_duplicate not in ("skip", "error"):
            raise ValueError(f"on_duplicate must be 'skip' or 'error', got {on_duplicate!r}")
        self.on_duplicate = on_duplicate
        self.commits: list[CommitRecord] = []
        self.already_present: list[str] = []
        """Sample ids appended but already committed in the step with the same tokens (not written again)."""
        self.appended = 0
        """Records accepted for writing (new records; ``already_present`` ones are not counted)."""
        self._next_seq = self._next_commit_seq()
        self._committed = self._step_records()
        self._prefixes = PrefixIndex()
        self._peers = PeerParts(store, self.step, self._prefixes)
        self._sample_ids: set[str] = set()
        self._buffer: list[PreparedRecord] = []
        self._buffered_bytes = 0
        self._buffer_since: float | None = None
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._pending = 0
        self._error: WriterError | None = None
        self._sealed: StepSealedError | None = None
        self._closed = False
        self._aborted = False
        self._queue: queue.Queue[_Batch | None] = queue.Queue(maxsize=max(1, max_pending))
        self._worker: threading.Thread | None = None
        if background:
            self._worker = threading.Thread(target=self._run, name=f"routelog-writer-{self.writer_id}", daemon=True)
            self._worker.start()

    # -- restart ---------------------------------------------------------------------------------------------
    def _check_not_sealed(self) -> None:
        """Refuse to upload into a step that is sealed or being sealed (its commits would be refused)."""
        storage = self.store.storage
        if storage.exists(keys.seal_key(self.step)):
            raise StepSealedError(f"step {self.step} of {self.store.url} is sealed and accepts no more records")
        if storage.exists(keys.sealing_key(self.step)):
            raise StepSealedError(
                f"step {self.step} of {self.store.url} is being sealed and accepts no more records (if the sealer "
                f"died, finish it: routelog seal {self.store.url} --step {self.step})"
            )

    def _next_commit_seq(self) -> int:
        """One past this writer id's last commit in the step (a restarted writer continues its sequence)."""
        seqs = [
            parsed[1]
            for n in self.store.storage.list(keys.commits_dir(self.step))
            if (parsed := keys.parse_commit_name(n)) is not None and parsed[0] == self.writer_id
        ]
        return max(seqs, default=-1) + 1

    def _step_records(self) -> dict[str, tuple[str | None, int]]:
        """The (token hash, length) of every live record the step holds now."""
        snapshot = StepSnapshot.load(self.store, self.step)
        return {
            sid: (digest, n)
            for sid, digest, n in zip(
                snapshot.index.column("sample_id").to_pylist(),
                snapshot.index.column("token_hash").to_pylist(),
                snapshot.index.column("n_tokens").to_pylist(),
                strict=True,
            )
        }

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
        """Validate and buffer one record; a full buffer is handed to the background uploader (blocking only
        while ``max_pending`` parts are already waiting)."""
        self._check_usable()
        sid = record.sample_id
        if sid in self._committed:
            prepared = prepare_record(
                record, self.store.model_spec, self.step, self.options.topk_order, self.options.weights_dtype
            )
            same = (prepared.row.token_hash, prepared.row.n_tokens) == self._committed[sid]
            if same and self.on_duplicate == "skip":
                self.already_present.append(sid)
                return
            raise DuplicateSampleError(
                sid,
                "sample_id",
                f"is already committed to step {self.step}" + ("" if same else " with other tokens"),
                "give every record a unique id" + ("" if same else ", or drop the committed one first (routelog drop)"),
            )
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
        with self._lock:
            self.appended += 1
            self._sample_ids.add(sid)
            self._buffer.append(prepared)
            self._buffered_bytes += prepared.raw_nbytes
            if self._buffer_since is None:
                self._buffer_since = time.monotonic()
            full = self._buffered_bytes >= self.flush_bytes
        if full:
            self._submit()

    def _take_buffer(self) -> _Batch | None:
        """Under the lock: the buffered records as the next part (with its commit number)."""
        if not self._buffer:
            return None
        batch = _Batch(self._next_seq, self._buffer)
        self._next_seq += 1
        self._buffer, self._buffered_bytes, self._buffer_since = [], 0, None
        self._pending += 1
        return batch

    def _submit(self) -> None:
        with self._lock:
            batch = self._take_buffer()
        if batch is None:
            return
        if self._worker is None:
            self._process(batch)
        else:
            self._queue.put(batch)  # backpressure: waits while max_pending parts are queued

    # -- background ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._wait_time())
            except queue.Empty:
                with self._lock:
                    due = self._buffer_since is not None and self._age() >= (self.flush_seconds or float("inf"))
                    batch = self._take_buffer() if due else None
                if batch is not None:
                    self._process(batch)
                continue
            if item is None:
                return
            self._process(item)

    def _age(self) -> float:
        return 0.0 if self._buffer_since is None else time.monotonic() - self._buffer_since

    def _wait_time(self) -> float:
        with self._lock:
            if self.flush_seconds is None or self._buffer_since is None:
                return 1.0
            return max(0.01, min(1.0, self.flush_seconds - self._age()))

    def _process(self, batch: _Batch) -> None:
        try:
            if self._sealed is None and not self._aborted:
                commit, refused = self._publish(batch)
                if commit is not None:
                    with self._lock:
                        self.commits.append(commit)
                    if self.on_commit is not None:
                        self.on_commit(
                            commit, [r.row.sample_id for r in batch.records if r.row.sample_id not in refused]
                        )
                if refused:
                    self._fail(batch, RoutelogError("; ".join(refused.values())), list(refused))
        except Exception as exc:  # surfaced to the caller at its next call
            self._fail(batch, exc, [r.row.sample_id for r in batch.records])
        finally:
            with self._done:
                self._pending -= 1
                self._done.notify_all()

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
            if self._error is None:
                self._error = error
            else:  # several parts failed before the caller looked: report them together
                self._error = WriterError(f"{self._error}; and {error}", [*self._error.sample_ids, *sample_ids])

    def _publish(self, batch: _Batch) -> tuple[CommitRecord | None, dict[str, str]]:
        """Build, upload and commit a part; returns the commit (None if nothing was left to commit) and the records
        refused while building, by sample id, with the reason."""
        self._check_not_sealed()
        records: list[PreparedRecord] = batch.records
        refused: dict[str, str] = {}
        if self.options.dedup == "step":
            self._peers.refresh()
        spec = self.store.model_spec
        try:
            built = build_part(records, spec, self.options, self._prefixes)
        except Exception:  # append validated these records: find the one that still fails
            records, refused = _isolate_failures(records, self.store, self.options)
            if not records:
                return None, refused
            built = build_part(records, spec, self.options, self._prefixes)
        try:
            commit = publish_part(
                self.store, self.step, self.writer_id, batch.seq, built, max_commit_delay=self.max_commit_delay
            )
            self._confirm_commit(commit, [r.row.sample_id for r in records])
        except BaseException:  # not (or not surely) part of the step: never point at it
            if built.prefix_part is not None:
                self._prefixes.abandon(built.prefix_part)
            raise
        if built.prefix_part is not None:
            self._prefixes.committed(built.prefix_part, keys.part_dir(self.step, commit.part))
        self._peers.seen(commit.name)
        return commit, refused

    def _confirm_commit(self, commit: CommitRecord, sample_ids: list[str]) -> None:
        """The seal fence: a commit is done unless a seal in progress may have listed the step before it."""
        storage = self.store.storage
        if not storage.exists(keys.sealing_key(self.step)):
            return  # any seal starts after this moment, so it lists this commit
        deadline = time.monotonic() + self.seal_wait
        delay = 0.05
        while True:
            seal = read_seal(self.store, self.step)
            if seal is not None:
                break
            if time.monotonic() >= deadline:
                raise CommitUndecidedError(
                    f"commit {commit.name} landed while step {self.step} was being sealed, and the seal did not "
                    f"finish within {self.seal_wait:.0f} s: its records are part of the step only if the seal "
                    f"lists them. Finish the seal (routelog seal {self.store.url} --step {self.step}), then check "
                    f"with routelog ls: {sample_ids[:5]}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
        if commit.name not in seal.commits:
            raise StepSealedError(
                f"step {self.step} was sealed while commit {commit.name} was being written; its records "
                f"are not part of the step: {sample_ids[:5]}"
            )

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
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()

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
        try:
            build_part([record], store.model_spec, replace(options, dedup="off"))
        except Exception as exc:  # reported to the caller with the sample id
            refused[record.row.sample_id] = f"sample {record.row.sample_id!r} cannot be stored: {exc!r}"
        else:
            good.append(record)
    return good, refused


def publish_part(
    store: StoreRoot,
    step: int,
    writer_id: str,
    seq: int,
    built: BuiltPart,
    *,
    max_commit_delay: float = MAX_COMMIT_DELAY,
) -> CommitRecord:
    """Upload a part's objects, then create its commit record exclusively (the part becomes visible).

    The create is only attempted within ``max_commit_delay`` seconds of the upload's start; a slower upload is
    repeated under a fresh part name, so ``routelog gc`` (whose grace period is longer) never collects a part
    that is about to be committed.
    """
    storage = store.storage
    key = keys.commit_key(step, keys.commit_name(writer_id, seq))
    for _ in range(_UPLOAD_ATTEMPTS):
        started = time.monotonic()
        part = keys.new_part_name(writer_id, seq)
        base = keys.part_dir(step, part)
        storage.write_many({f"{base}/{name}": data for name, data in built.objects.items()})
        if time.monotonic() - started <= max_commit_delay:
            break
    else:
        raise StoreError(
            f"step {step}, commit {writer_id}.{seq:08d}: uploading the part took longer than {max_commit_delay:.0f} s "
            f"{_UPLOAD_ATTEMPTS} times; not committed (the storage is too slow for gc's grace period)"
        )
    commit = CommitRecord(
        step=step,
        part=part,
        writer_id=writer_id,
        seq=seq,
        created_at=utc_now(),
        n_records=len(built.rows),
        n_tokens=built.n_tokens,
        routing=built.routing,
        objects=built.object_infos(),
        values=built.values,
        streams=built.streams,
        weights=built.weights,
    )
    if not storage.create(key, dump_document(commit)):
        existing = parse_document(storage.read(key), CommitRecord, storage.url_of(key))
        if existing.part != part:
            raise CommitConflictError(
                f"{storage.url_of(key)} already commits part {existing.part!r}: another process is writing "
                f"step {step} under writer id {writer_id!r}. Give every concurrent writer its own id."
            )
    return commit
