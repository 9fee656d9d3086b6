"""Appending records to one step of a store and committing them, streaming in the background.

Commit protocol (see ``schemas/FORMAT.md``): a flush uploads the part's data objects under a fresh, unique
directory, then creates ``commits/<writer>.<seq>.json`` exclusively. Readers only follow commit records, so a
writer that dies before its commit leaves orphans (``routelog gc``) but never a half-visible part. No shared
object is ever read, modified and written back, so any number of writers append to a step without coordination.

Streaming: ``append`` validates and canonicalises a record on the caller's thread (so a bad record raises there
and nothing else is affected, at about 1 GB/s of routing); compression, upload and commit run on a background
thread. A bounded queue of parts gives backpressure, so memory stays within about ``(max_pending + 2) x
flush_bytes`` whatever the run length. Parts are flushed by size and by age.

Restart: a writer re-opened with the same id continues its commit sequence and skips records its earlier
incarnation already committed (same sample id and tokens), so re-sending everything after a crash is safe.
"""

from __future__ import annotations

import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from routelog import layout
from routelog.errors import CommitConflictError, DuplicateSampleError, RoutelogError, StepSealedError, StoreError
from routelog.format import CommitRecord, SealRecord, dump_document, parse_document, utc_now
from routelog.part import BuiltPart, PartOptions, build_part, index_from_parquet
from routelog.record import PreparedRecord, Record, prepare_record

if TYPE_CHECKING:
    from routelog.store import Store

DEFAULT_FLUSH_BYTES = 64 << 20
"""Raw-equivalent bytes of routing buffered before a part is written (zarr's >= 1 MB advice, S3's 8-16 MB GETs)."""
DEFAULT_FLUSH_SECONDS = 30.0
"""A part is also written once its oldest record has waited this long."""


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


class StepWriter:
    """Appends records to one step and commits them in parts; a context manager.

    ``append`` validates a record completely before buffering it: a rejected record raises
    :class:`~routelog.errors.InvalidRecordError` and changes nothing. On exit (also after an exception in the
    ``with`` body) the buffered records are committed and the writer waits for the last commit; call
    :meth:`abort` to drop what is not committed instead.
    """

    def __init__(
        self,
        store: Store,
        step: int,
        *,
        writer_id: str | None = None,
        options: PartOptions | None = None,
        flush_bytes: int | None = None,
        flush_seconds: float | None = DEFAULT_FLUSH_SECONDS,
        max_pending: int = 2,
        background: bool = True,
        on_commit: Callable[[CommitRecord, list[str]], None] | None = None,
    ) -> None:
        self.store = store
        self.step = layout.check_step(step)
        self.writer_id = layout.check_writer_id(writer_id or default_writer_id())
        self.options = options or PartOptions()
        self.flush_bytes = flush_bytes or DEFAULT_FLUSH_BYTES
        self.flush_seconds = flush_seconds
        self.on_commit = on_commit
        self._check_not_sealed()
        self.commits: list[CommitRecord] = []
        self.skipped: list[str] = []
        """Sample ids re-sent after a restart and already committed by this writer id (not written again)."""
        self._next_seq, self._committed = self._own_commits()
        self._sample_ids: set[str] = set()
        self._buffer: list[PreparedRecord] = []
        self._buffered_bytes = 0
        self._buffer_since: float | None = None
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._pending = 0
        self._error: WriterError | None = None
        self._closed = False
        self._aborted = False
        self._queue: queue.Queue[_Batch | None] = queue.Queue(maxsize=max(1, max_pending))
        self._worker: threading.Thread | None = None
        if background:
            self._worker = threading.Thread(target=self._run, name=f"routelog-writer-{self.writer_id}", daemon=True)
            self._worker.start()

    # -- restart ---------------------------------------------------------------------------------------------
    def _check_not_sealed(self) -> None:
        if self.store.storage.exists(layout.seal_key(self.step)):
            raise StepSealedError(f"step {self.step} of {self.store.url} is sealed and accepts no more records")

    def _own_commits(self) -> tuple[int, dict[str, tuple[str | None, int]]]:
        """One past this writer id's last commit, and the (token hash, length) of every record it committed."""
        storage = self.store.storage
        names = [
            n
            for n in storage.list(layout.commits_dir(self.step))
            if (parsed := layout.parse_commit_name(n)) is not None and parsed[0] == self.writer_id
        ]
        if not names:
            return 0, {}
        keys = [layout.commit_key(self.step, n) for n in names]
        commits = [parse_document(data, CommitRecord, key) for key, data in storage.read_many(keys).items()]
        indexes = storage.read_many(f"{layout.part_dir(self.step, c.part)}/{layout.INDEX}" for c in commits)
        committed: dict[str, tuple[str | None, int]] = {}
        for data in indexes.values():
            table = index_from_parquet(data)
            for sid, digest, n in zip(
                table.column("sample_id").to_pylist(),
                table.column("token_hash").to_pylist(),
                table.column("n_tokens").to_pylist(),
                strict=True,
            ):
                committed[sid] = (digest, n)
        return max(c.seq for c in commits) + 1, committed

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
            prepared = prepare_record(record, self.store.model_spec, self.step, self.options.topk_order)
            if (prepared.row.token_hash, prepared.row.n_tokens) == self._committed[sid]:
                self.skipped.append(sid)
                return
            raise DuplicateSampleError(
                sid,
                "sample_id",
                f"was committed to step {self.step} by writer {self.writer_id!r} with other tokens",
                "give every record a unique id",
            )
        if sid in self._sample_ids:
            raise DuplicateSampleError(
                sid,
                "sample_id",
                f"already appended to step {self.step}",
                "give every record of a step a unique sample id",
            )
        prepared = prepare_record(record, self.store.model_spec, self.step, self.options.topk_order)
        with self._lock:
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
        sample_ids = [r.row.sample_id for r in batch.records]
        try:
            if self._error is None and not self._aborted:
                commit = self._publish(batch)
                with self._lock:
                    self.commits.append(commit)
                if self.on_commit is not None:
                    self.on_commit(commit, sample_ids)
        except Exception as exc:  # surfaced to the caller at its next call
            error = WriterError(
                f"writer {self.writer_id!r}, step {self.step}, commit {batch.seq}: {exc}; "
                f"{len(sample_ids)} records not committed: {sample_ids[:5]}",
                sample_ids,
            )
            error.__cause__ = exc
            with self._lock:
                self._error = self._error or error
        finally:
            with self._done:
                self._pending -= 1
                self._done.notify_all()

    def _publish(self, batch: _Batch) -> CommitRecord:
        self._check_not_sealed()
        built = build_part(batch.records, self.store.model_spec, self.options)
        commit = publish_part(self.store, self.step, self.writer_id, batch.seq, built)
        self._check_commit_counted(commit, [r.row.sample_id for r in batch.records])
        return commit

    def _check_commit_counted(self, commit: CommitRecord, sample_ids: list[str]) -> None:
        """A step sealed between the check and the commit leaves the commit outside the seal: not accepted."""
        storage = self.store.storage
        key = layout.seal_key(self.step)
        try:
            seal = parse_document(storage.read(key), SealRecord, storage.url_of(key))
        except FileNotFoundError:
            return
        name = layout.commit_name(self.writer_id, commit.seq)
        if name not in seal.commits:
            raise StepSealedError(
                f"step {self.step} was sealed while commit {name} was being written; its records "
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

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def __enter__(self) -> StepWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):
            self.abort()  # KeyboardInterrupt, SystemExit: do not start uploads while the process is going down
        elif exc_type is not None and issubclass(exc_type, RoutelogError) and self._error is exc:
            self._stop()
        else:
            self.close()


def publish_part(store: Store, step: int, writer_id: str, seq: int, built: BuiltPart) -> CommitRecord:
    """Upload a part's objects, then create its commit record exclusively (the part becomes visible)."""
    storage = store.storage
    part = layout.new_part_name(writer_id, seq)
    base = layout.part_dir(step, part)
    storage.write_many({f"{base}/{key}": data for key, data in built.objects.items()})
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
    )
    key = layout.commit_key(step, layout.commit_name(writer_id, seq))
    if not storage.create(key, dump_document(commit)):
        existing = parse_document(storage.read(key), CommitRecord, storage.url_of(key))
        if existing.part != part:
            raise CommitConflictError(
                f"{storage.url_of(key)} already commits part {existing.part!r}: another process is writing "
                f"step {step} under writer id {writer_id!r}. Give every concurrent writer its own id."
            )
    return commit
