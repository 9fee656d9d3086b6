"""Sealing a step: from then on its content is exactly the commits made before, and readers need three GETs.

The sealer reads the step once, writes the consolidated commit list and index under fresh names, then creates
``_SEALED.json`` exclusively: of two sealers exactly one wins; the loser's consolidated objects are deleted (or
left for ``routelog gc``). Writers refuse to start on a sealed step, and a commit that lands after the seal is
reported to its writer as not accepted (readers never see it).
"""

from __future__ import annotations

import hashlib
import io
import json
import secrets
from typing import TYPE_CHECKING

import pyarrow.parquet as pq

from routelog import layout
from routelog.errors import StepSealedError
from routelog.format import Consolidated, ObjectInfo, SealRecord, dump_document, parse_document, utc_now
from routelog.reader import StepSnapshot

if TYPE_CHECKING:
    from routelog.store import Store

SEALED_DIR = "_sealed"


def seal_step(store: Store, step: int) -> SealRecord:
    """Seal ``step`` exactly once; :class:`StepSealedError` if it already is (by this or another process)."""
    storage = store.storage
    key = layout.seal_key(step)
    if storage.exists(key):
        existing = parse_document(storage.read(key), SealRecord, storage.url_of(key))
        raise StepSealedError(f"step {step} of {store.url} was already sealed at {existing.sealed_at.isoformat()}")
    snapshot = StepSnapshot.load(store, step)
    names = [layout.commit_name(c.writer_id, c.seq) for c in snapshot.commits]
    commits_json = json.dumps([c.model_dump(mode="json") for c in snapshot.commits]).encode()
    sink = io.BytesIO()
    pq.write_table(snapshot.index, sink, compression="zstd")
    nonce = secrets.token_hex(6)
    objects = {
        f"{SEALED_DIR}/{nonce}.commits.json": commits_json,
        f"{SEALED_DIR}/{nonce}.index.parquet": sink.getvalue(),
    }
    base = layout.step_dir(step)
    storage.write_many({f"{base}/{k}": v for k, v in objects.items()})
    infos = [ObjectInfo(key=k, size=len(v), sha256=hashlib.sha256(v).hexdigest()) for k, v in objects.items()]
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
