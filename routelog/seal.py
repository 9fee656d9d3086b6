"""Sealing a step: from then on its content is exactly the commits made before, and readers open it in a few requests.

The fence between sealing and committing (FORMAT.md section 3, rule 5):

1. the sealer creates ``_SEALING.json`` (its intent) before it lists the step's commits;
2. it lists and reads the commits, writes the consolidated commit list and index under fresh names, then creates
   ``_SEALED.json`` exclusively: of two sealers exactly one wins, the loser's objects are deleted;
3. a writer, after its commit's exclusive create, reads whether ``_SEALING.json`` exists. If it does not, every
   sealer lists after that moment and so includes the commit: the writer may report it committed. If it does,
   the writer waits for ``_SEALED.json`` and reports the commit committed only if the seal lists it.

So a writer is never told "committed" for a record that a reader of the sealed step will not see. A sealer that
dies between the two creates leaves the step refusing new commits; running the seal again finishes it.
"""

from __future__ import annotations

import hashlib
import io
import json
import secrets
from collections.abc import Callable, Sequence

import pyarrow.parquet as pq

from routelog import keys
from routelog.errors import RecordNotFoundError, StepSealedError
from routelog.format import (
    Consolidated,
    SealedObjectInfo,
    SealIntent,
    SealRecord,
    dump_document,
    utc_now,
)
from routelog.reader import StepSnapshot, read_seal
from routelog.root import StoreRoot


def seal_step(
    store: StoreRoot,
    step: int,
    *,
    allow_empty: bool = False,
    after_listing: Callable[[Sequence[str]], None] | None = None,
) -> SealRecord:
    """Seal ``step`` exactly once; :class:`StepSealedError` if it already is (by this or another process).

    ``after_listing`` is called with the commit names the seal will hold, between the listing and the seal's
    create: tests use it to make the commit/seal race deterministic.
    """
    storage = store.storage
    key = keys.seal_key(step)
    existing = read_seal(store, step)
    if existing is not None:
        raise StepSealedError(f"step {step} of {store.url} was already sealed at {existing.sealed_at.isoformat()}")
    if not allow_empty and not storage.list(keys.commits_dir(step)):
        steps = store.steps()
        raise RecordNotFoundError(
            f"step {step} of {store.url} has no records: sealing it would close it for good (steps with records: "
            f"{steps[:20]}{'...' if len(steps) > 20 else ''}); pass allow_empty (--allow-empty) to seal it anyway"
        )
    intent = SealIntent(step=step, started_at=utc_now())
    storage.create(keys.sealing_key(step), dump_document(intent))  # an earlier sealer's intent serves as well
    snapshot = StepSnapshot.load(store, step)  # lists the commits after the intent exists (in name order)
    names = [c.name for c in snapshot.commits]
    if after_listing is not None:
        after_listing(names)
    commits_json = json.dumps([c.model_dump(mode="json") for c in snapshot.commits]).encode()
    sink = io.BytesIO()
    pq.write_table(snapshot.index, sink, compression="zstd")
    nonce = secrets.token_hex(6)
    objects = {
        f"{keys.SEALED_DIR}/{nonce}.commits.json": commits_json,
        f"{keys.SEALED_DIR}/{nonce}.index.parquet": sink.getvalue(),
    }
    base = keys.step_dir(step)
    storage.write_many({f"{base}/{k}": v for k, v in objects.items()})
    infos = [SealedObjectInfo(key=k, size=len(v), sha256=hashlib.sha256(v).hexdigest()) for k, v in objects.items()]
    seal = SealRecord(
        step=step,
        sealed_at=utc_now(),
        commits=names,
        n_records=len(snapshot),
        n_tokens=snapshot.n_tokens,
        consolidated=Consolidated(commits=infos[0], index=infos[1]),
    )
    if not storage.create(key, dump_document(seal)):
        storage.delete(f"{base}/{k}" for k in objects)
        raise StepSealedError(f"step {step} of {store.url} was sealed by another process at the same time")
    return seal
