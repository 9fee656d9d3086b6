"""Attaching per-token columns to records already committed, e.g. the trainer's log-probs after its forward pass.

Parts are immutable, so an annotation is its own small commit: the values object is uploaded under a fresh
directory ``steps/<step>/annotations/<writer>.<seq>.<nonce>/`` and becomes visible when
``steps/<step>/annotations/<writer>.<seq>.json`` is created exclusively, exactly as parts are committed. Each
annotated record is checked against the committed one (it exists, same token count, same token hash), so values
can never attach to the wrong tokens. Annotations are additive metadata: they are accepted after a step is sealed.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import numpy.typing as npt

from routelog import keys
from routelog.errors import CommitConflictError, InvalidRecordError, StoreError
from routelog.format import AnnotationCommit, ObjectInfo, ValueColumn, ValuesInfo, dump_document, utc_now
from routelog.reader import StepSnapshot
from routelog.root import StoreRoot
from routelog.values import VALUES_OBJECT, FloatArray, check_token_values, values_to_parquet
from routelog.writer import MAX_COMMIT_DELAY


class Annotator:
    """Collects per-token columns for committed records of one step; :meth:`commit` publishes them at once."""

    def __init__(self, store: StoreRoot, step: int, writer_id: str) -> None:
        self.store = store
        self.step = keys.check_step(step)
        self.writer_id = keys.check_writer_id(writer_id)
        self._snapshot = StepSnapshot.load(store, step)
        self._rows: dict[str, tuple[str | None, dict[str, FloatArray]]] = {}

    def add(self, sample_id: str, values: Mapping[str, npt.ArrayLike], *, token_hash: str | None = None) -> None:
        """Columns for one committed record (each ``[n_tokens]``, NaN = no value); ``token_hash`` is checked
        against the committed record's when both are known."""
        info = self._snapshot.info(sample_id)  # RecordNotFoundError names the sample and step
        if token_hash is not None and info.token_hash is not None and token_hash != info.token_hash:
            raise InvalidRecordError(
                sample_id,
                "token_hash",
                f"{token_hash} differs from the committed record's {info.token_hash}",
                "annotate the record with the values computed on its own tokens",
            )
        if sample_id in self._rows:
            raise InvalidRecordError(sample_id, "sample_id", "is annotated twice in one commit", "add it once")
        self._rows[sample_id] = (info.token_hash, check_token_values(values, info.n_tokens, sample_id))

    def commit(self) -> AnnotationCommit | None:
        """Upload the values and create the annotation commit; None if nothing was added."""
        if not self._rows:
            return None
        storage = self.store.storage
        names = sorted({name for _, values in self._rows.values() for name in values})
        data = values_to_parquet([(sid, digest, values) for sid, (digest, values) in self._rows.items()], names)
        existing = [keys.parse_commit_name(n) for n in storage.list(keys.annotations_dir(self.step))]
        seq = 1 + max((p[1] for p in existing if p is not None and p[0] == self.writer_id), default=-1)
        part = keys.new_part_name(self.writer_id, seq)
        started = time.monotonic()
        storage.write(f"{keys.annotation_key(self.step, part)}/{VALUES_OBJECT}", data)
        if time.monotonic() - started > MAX_COMMIT_DELAY:  # gc may already consider the data an orphan
            raise StoreError(
                f"annotation {self.writer_id}.{seq:08d} of step {self.step}: the upload took longer than "
                f"{MAX_COMMIT_DELAY:.0f} s; not committed, retry"
            )
        commit = AnnotationCommit(
            step=self.step,
            part=part,
            writer_id=self.writer_id,
            seq=seq,
            created_at=utc_now(),
            n_records=len(self._rows),
            values=ValuesInfo(columns=[ValueColumn(name=n) for n in names]),
            objects=[ObjectInfo(key=VALUES_OBJECT, size=len(data), sha256=hashlib.sha256(data).hexdigest())],
        )
        key = keys.annotation_key(self.step, keys.commit_name(self.writer_id, seq))
        if not storage.create(key, dump_document(commit)):
            raise CommitConflictError(
                f"{storage.url_of(key)} already exists: another process annotates step {self.step} under writer id "
                f"{self.writer_id!r}. Give every concurrent annotator its own id. (Uploaded data is left to gc.)"
            )
        self._rows.clear()
        return commit

    def __enter__(self) -> Annotator:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.commit()


def annotate(
    store: StoreRoot, step: int, writer_id: str, values: Mapping[str, Mapping[str, Any]]
) -> AnnotationCommit | None:
    """One-shot form: ``values`` maps sample id -> columns."""
    annotator = Annotator(store, step, writer_id)
    for sample_id, columns in values.items():
        annotator.add(sample_id, columns)
    return annotator.commit()
