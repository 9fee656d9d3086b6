"""Sealing a step: from then on its content is exactly the commits before the seal, and readers open it in a few
requests.

A seal is an entry of the step's log (:mod:`routelog.store.steplog`): the commits before it are the step's content, and
a commit after it is not (its writer learns so from the entries before its own, and reports its records as not
committed). So no writer is ever told "committed" for a record a reader of the sealed step will not see, and none
waits for a sealer.

1. The sealer creates ``_SEALING.json`` (its intent): writers start no upload while it exists, so the log soon
   stops growing under it.
2. It reads the log, writes the step's commits and index into two consolidated objects under fresh names, and
   creates the seal entry at the next position. When another entry took that position first, it reads it, deletes
   its objects and starts again (a seal found there is the step's seal: it returns that one).
3. It copies the entry to ``_SEALED.json``, where readers and writers look first.

Sealing is safe to run again: a sealed step returns its seal, and a sealer that died between 2 and 3 is completed.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa

from routelog.errors import CorruptDataError, RecordNotFoundError, StoreError
from routelog.format import keys
from routelog.format.documents import (
    CommitRecord,
    Consolidated,
    SealedObjectInfo,
    SealIntent,
    SealRecord,
    dump_document,
    utc_now,
)
from routelog.format.part import index_table_to_parquet
from routelog.store.history import COMMIT_COLUMN, StepHistory, StepView
from routelog.store.root import StoreRoot
from routelog.store.steplog import Entry, read_seal_marker

SEAL_DEADLINE = 300.0
"""Seconds a sealer keeps trying while other entries (commits already uploading, drops) take its position."""


class _LogMovedError(Exception):
    """The log grew under the sealer: its consolidated objects are out of date."""


def seal_step(
    store: StoreRoot,
    step: int,
    *,
    allow_empty: bool = False,
    after_listing: Callable[[Sequence[str]], None] | None = None,
) -> SealRecord:
    """Seal ``step`` (see the module docs); the existing seal when it is sealed already.

    ``after_listing`` is called with the names of the commits the seal will hold, between reading the log and
    creating the seal entry: tests use it to make the commit/seal race deterministic.
    """
    storage = store.storage
    existing = read_seal_marker(store, step)
    if existing is not None:
        return existing
    history = StepHistory.read(store, step)
    if not allow_empty and not history.log.commits():
        steps = store.steps()
        raise RecordNotFoundError(
            f"step {step} of {store.url} has no records: sealing it would close it for good (steps with records: "
            f"{steps[:20]}{'...' if len(steps) > 20 else ''}); pass allow_empty (--allow-empty) to seal it anyway"
        )
    storage.create(keys.sealing_key(step), dump_document(SealIntent(step=step, started_at=utc_now())))
    deadline = time.monotonic() + SEAL_DEADLINE
    while True:
        history.refresh()
        view = history.view()
        if view.seal is not None:  # sealed by another process (or by a sealer that died before its copy)
            return _publish_marker(store, step, view.seal)
        entry = _attempt(history, view, after_listing)
        if entry is not None:
            return _publish_marker(store, step, entry)
        if time.monotonic() > deadline:
            raise StoreError(
                f"step {step} of {store.url}: the log kept growing for {SEAL_DEADLINE:.0f} s while sealing; not "
                "sealed (run the seal again once writers and drops are done)"
            )


def _attempt(
    history: StepHistory, view: StepView, after_listing: Callable[[Sequence[str]], None] | None
) -> Entry | None:
    """Consolidate what ``view`` holds and create the seal right after it; None when another entry took the
    position (the consolidated objects are deleted again)."""
    storage, step = history.store.storage, history.step
    # In the order of their names, which the seal lists sorted (a commit entry's commits by slot: the view lists
    # them by what they became, dropped whole or not, so two of one entry may come in either order).
    content = sorted([*view.commits, *view.whole_dropped], key=lambda e: e.name)
    if after_listing is not None:
        after_listing([e.name for e in content])
    objects = _consolidate(content, view.commits, view.stored)
    base = keys.step_dir(step)
    storage.write_many({f"{base}/{k}": v for k, v in objects.items()})
    infos = [SealedObjectInfo(key=k, size=len(v), sha256=hashlib.sha256(v).hexdigest()) for k, v in objects.items()]
    template = SealRecord(
        step=step,
        position=0,
        sealed_at=utc_now(),
        commits=[e.name for e in content],
        n_records=view.stored.num_rows,
        n_tokens=sum(e.doc.n_tokens for e in view.commits if isinstance(e.doc, CommitRecord)),
        consolidated=Consolidated(commits=infos[0], index=infos[1]),
    )

    def moved(new: Sequence[Entry]) -> None:
        if new:
            raise _LogMovedError

    try:
        [entry] = history.log.append(
            lambda position: template.model_copy(update={"position": position, "sealed_at": utc_now()}), check=moved
        )
    except _LogMovedError:
        storage.delete(f"{base}/{k}" for k in objects)
        return None
    return entry


def _consolidate(content: Sequence[Entry], kept: Sequence[Entry], stored: pa.Table) -> dict[str, bytes]:
    """The consolidated commit list (every commit of the content, in the order the seal names them) and index (the
    rows of the commits not dropped whole, ``_commit`` renumbered to that list), under a fresh nonce."""
    order = {e.name: i for i, e in enumerate(content)}
    renumber = np.array([order[e.name] for e in kept], dtype=np.int32)
    commit_of = stored.column(COMMIT_COLUMN).to_numpy(zero_copy_only=False)
    index = stored.set_column(
        stored.schema.get_field_index(COMMIT_COLUMN),
        COMMIT_COLUMN,
        pa.array(renumber[commit_of] if len(renumber) else np.zeros(0, np.int32), pa.int32()),
    )
    nonce = secrets.token_hex(6)
    return {
        f"{keys.SEALED_DIR}/{nonce}.commits.json": json.dumps([e.doc.model_dump(mode="json") for e in content]).encode(
            "utf-8"
        ),
        f"{keys.SEALED_DIR}/{nonce}.index.parquet": index_table_to_parquet(index),
    }


def _publish_marker(store: StoreRoot, step: int, entry: Entry) -> SealRecord:
    """Copy the seal entry to ``_SEALED.json`` (done already when another process did)."""
    seal = entry.doc
    if not isinstance(seal, SealRecord):  # pragma: no cover - callers pass the seal entry
        raise TypeError(f"{entry.key} is not a seal")
    if not store.storage.create(keys.seal_key(step), dump_document(seal)):
        existing = read_seal_marker(store, step)
        if existing != seal:
            raise CorruptDataError(
                f"{store.storage.url_of(keys.seal_key(step))} differs from the step's seal entry {entry.name}"
            )
    return seal
