"""Removing records from a step without rewriting anything: a drop document, created exclusively like a commit.

Readers leave out every record a drop names (by sample id, by part, or every part of a writer); a view as of an
earlier time still shows them (``routelog ls --as-of``) until ``routelog gc`` reclaims the bytes of parts whose
every record is dropped. Names are checked against the step first: what does not exist is refused.
"""

from __future__ import annotations

from collections.abc import Iterable

from routelog import keys
from routelog.errors import RecordNotFoundError
from routelog.format import DropRecord, utc_now
from routelog.numbered import create_numbered
from routelog.reader import StepSnapshot
from routelog.root import StoreRoot

DROP_WRITER = "drop"
"""Writer id of drops made by ``routelog drop`` (and gc's, which use ``gc``)."""


def drop_records(
    store: StoreRoot,
    step: int,
    *,
    sample_ids: Iterable[str] = (),
    parts: Iterable[str] = (),
    writers: Iterable[str] = (),
    reason: str | None = None,
    writer_id: str = DROP_WRITER,
) -> DropRecord:
    """Drop records of ``step``; :class:`RecordNotFoundError` names any sample id, part or writer the step lacks."""
    sample_ids, parts, writers = sorted(set(sample_ids)), sorted(set(parts)), sorted(set(writers))
    snapshot = StepSnapshot.load(store, step)
    unknown = [sid for sid in sample_ids if sid not in snapshot]
    unknown += [f"part {p}" for p in parts if p not in {c.part for c in snapshot.commits}]
    unknown += [f"writer {w}" for w in writers if w not in {c.writer_id for c in snapshot.commits}]
    if unknown:
        raise RecordNotFoundError(
            f"step {step} of {store.url} holds no live {', '.join(unknown[:8])}; list what it holds with "
            f"routelog ls {store.url} --step {step}"
        )
    return write_drop(
        store, step, sample_ids=sample_ids, parts=parts, writers=writers, reason=reason, writer_id=writer_id
    )


def write_drop(
    store: StoreRoot,
    step: int,
    *,
    sample_ids: list[str],
    parts: list[str],
    writers: list[str],
    reason: str | None,
    writer_id: str,
) -> DropRecord:
    """Create the next drop document of ``writer_id`` exclusively."""
    return create_numbered(
        store.storage,
        keys.drops_dir(step),
        writer_id,
        lambda seq: DropRecord(
            step=step,
            writer_id=writer_id,
            seq=seq,
            created_at=utc_now(),
            sample_ids=sample_ids,
            parts=parts,
            writers=writers,
            reason=reason,
        ),
    )
