"""Appending records to one step of a store and committing them.

Commit protocol (see ``schemas/FORMAT.md``): a flush uploads the part's data objects under a fresh, unique
directory, then creates ``commits/<writer>.<seq>.json`` exclusively. Readers only follow commit records, so a
writer that dies before its commit leaves orphans (``routelog gc``) but never a half-visible part. No shared
object is ever read, modified and written back.
"""

from __future__ import annotations

import os
import secrets
from types import TracebackType
from typing import TYPE_CHECKING

from routelog import layout
from routelog.errors import CommitConflictError, DuplicateSampleError, StepSealedError
from routelog.format import CommitRecord, dump_document, parse_document, utc_now
from routelog.part import BuiltPart, PartOptions, build_part
from routelog.record import PreparedRecord, Record, prepare_record

if TYPE_CHECKING:
    from routelog.store import Store

DEFAULT_FLUSH_BYTES = 64 << 20
"""Raw-equivalent bytes of routing buffered before a part is written (zarr's >= 1 MB advice, S3's 8-16 MB GETs)."""


def default_writer_id() -> str:
    return f"w{os.getpid()}-{secrets.token_hex(3)}"


class StepWriter:
    """Appends records to one step and commits them in parts; a context manager.

    ``append`` validates a record completely before buffering it: a rejected record raises
    :class:`~routelog.errors.InvalidRecordError` and changes nothing. On exit (also after an exception in the
    ``with`` body) the buffered records are committed; call :meth:`abort` first to drop them instead.
    """

    def __init__(
        self,
        store: Store,
        step: int,
        *,
        writer_id: str | None = None,
        options: PartOptions | None = None,
        flush_bytes: int | None = None,
    ) -> None:
        self.store = store
        self.step = layout.check_step(step)
        self.writer_id = layout.check_writer_id(writer_id or default_writer_id())
        self.options = options or PartOptions()
        self.flush_bytes = flush_bytes or DEFAULT_FLUSH_BYTES
        if store.storage.exists(layout.seal_key(step)):
            raise StepSealedError(f"step {step} of {store.url} is sealed and accepts no more records")
        self._next_seq = self._first_free_seq()
        self._buffer: list[PreparedRecord] = []
        self._buffered_bytes = 0
        self._sample_ids: set[str] = set()
        self.commits: list[CommitRecord] = []
        self._closed = False

    def _first_free_seq(self) -> int:
        """One past this writer id's last commit in the step, so a restarted writer never collides with itself."""
        seqs = [
            parsed[1]
            for parsed in map(layout.parse_commit_name, self.store.storage.list(layout.commits_dir(self.step)))
            if parsed is not None and parsed[0] == self.writer_id
        ]
        return max(seqs, default=-1) + 1

    # -- appending -------------------------------------------------------------------------------------------
    def append(self, record: Record) -> None:
        """Validate and buffer one record; flush a part when the buffer reaches ``flush_bytes``."""
        self._check_open()
        if record.sample_id in self._sample_ids:
            raise DuplicateSampleError(
                record.sample_id,
                "sample_id",
                f"already appended to step {self.step}",
                "give every record of a step a unique sample id",
            )
        prepared = prepare_record(record, self.store.model_spec, self.step, self.options.topk_order)
        self._sample_ids.add(record.sample_id)
        self._buffer.append(prepared)
        self._buffered_bytes += prepared.raw_nbytes
        if self._buffered_bytes >= self.flush_bytes:
            self.flush()

    def flush(self) -> CommitRecord | None:
        """Write the buffered records as one part and commit it; ``None`` when nothing is buffered."""
        self._check_open()
        if not self._buffer:
            return None
        built = build_part(self._buffer, self.store.model_spec, self.options)
        commit = publish_part(self.store, self.step, self.writer_id, self._next_seq, built)
        self._next_seq += 1
        self._buffer.clear()
        self._buffered_bytes = 0
        self.commits.append(commit)
        return commit

    def abort(self) -> None:
        """Drop the buffered, uncommitted records and close."""
        self._buffer.clear()
        self._buffered_bytes = 0
        self._closed = True

    def close(self) -> list[CommitRecord]:
        """Commit what is buffered; returns every commit this writer made."""
        if not self._closed:
            self.flush()
            self._closed = True
        return self.commits

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"writer {self.writer_id!r} of step {self.step} is closed")

    def __enter__(self) -> StepWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):
            self.abort()  # KeyboardInterrupt, SystemExit: do not start uploads while the process is going down
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
