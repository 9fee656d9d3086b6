"""Removing records from a step without rewriting anything: a drop, an entry of the step's log.

A drop removes, among the commits before it in the log, the records of the sample ids it names and every record of
the parts and writers it names; what is committed after it is untouched (a sample id written again after its drop
is live, and so are the new parts of a writer id used again). A view as of an earlier time still shows the dropped
records (``routelog ls --as-of``) until ``routelog gc`` reclaims the bytes of parts dropped whole. Names are
checked against the step first: what it never held is refused; what is dropped already is a no-op, so running the
same drop again is safe.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from routelog.errors import RecordNotFoundError
from routelog.format.documents import CommitRecord, DropRecord, utc_now
from routelog.store.history import StepHistory
from routelog.store.root import StoreRoot
from routelog.store.steplog import StepLog

DROP_WRITER = "drop"
"""Writer id of drops made by ``routelog drop`` (and gc's, which use ``gc``)."""


@dataclass
class DropOutcome:
    """What a drop did: its log entry (None when everything named was dropped already), and what it named that was
    already dropped."""

    drop: DropRecord | None
    already_dropped: list[str] = field(default_factory=list)


def drop_records(
    store: StoreRoot,
    step: int,
    *,
    sample_ids: Iterable[str] = (),
    parts: Iterable[str] = (),
    writers: Iterable[str] = (),
    reason: str | None = None,
    writer_id: str = DROP_WRITER,
) -> DropOutcome:
    """Drop records of ``step``; :class:`RecordNotFoundError` names any sample id, part or writer the step never
    held. Names dropped already are left out (and reported); nothing is written when none is left."""
    sample_ids, parts, writers = sorted(set(sample_ids)), sorted(set(parts)), sorted(set(writers))
    history = StepHistory.read(store, step, columns=("sample_id", "token_hash", "n_tokens"))
    view = history.view()
    live_ids = set(view.index.column("sample_id").to_pylist())
    held_ids = set(view.stored.column("sample_id").to_pylist())
    live_parts = {e.doc.part for e in view.commits if isinstance(e.doc, CommitRecord)}
    held_parts = live_parts | {e.doc.part for e in view.whole_dropped if isinstance(e.doc, CommitRecord)}
    live_writers = {e.doc.writer_id for e in view.commits if isinstance(e.doc, CommitRecord)}
    held_writers = live_writers | {e.doc.writer_id for e in view.whole_dropped if isinstance(e.doc, CommitRecord)}
    unknown = [sid for sid in sample_ids if sid not in held_ids]
    unknown += [f"part {p}" for p in parts if p not in held_parts]
    unknown += [f"writer {w}" for w in writers if w not in held_writers]
    if unknown:
        raise RecordNotFoundError(
            f"step {step} of {store.url} holds no {', '.join(unknown[:8])} (live or dropped); list what it holds "
            f"with routelog ls {store.url} --step {step}"
        )
    already = [sid for sid in sample_ids if sid not in live_ids]  # held, not live: a drop removed every copy
    already += [f"part {p}" for p in parts if p not in live_parts]
    already += [f"writer {w}" for w in writers if w not in live_writers]
    sample_ids = [sid for sid in sample_ids if sid in live_ids]
    parts = [p for p in parts if p in live_parts]
    writers = [w for w in writers if w in live_writers]
    if not (sample_ids or parts or writers):
        return DropOutcome(None, already)
    drop = write_drop(
        history.log, sample_ids=sample_ids, parts=parts, writers=writers, reason=reason, writer_id=writer_id
    )
    return DropOutcome(drop, already)


def write_drop(
    log: StepLog,
    *,
    sample_ids: list[str],
    parts: list[str],
    writers: list[str],
    reason: str | None,
    writer_id: str,
) -> DropRecord:
    """Append a drop to the step's log."""
    [entry] = log.append(
        lambda position: DropRecord(
            step=log.step,
            writer_id=writer_id,
            position=position,
            created_at=utc_now(),
            sample_ids=sample_ids,
            parts=parts,
            writers=writers,
            reason=reason,
        )
    )
    if not isinstance(entry.doc, DropRecord):  # pragma: no cover - built above
        raise TypeError(entry.key)
    return entry.doc
