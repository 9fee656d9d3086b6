"""Attaching per-token columns to records already committed, e.g. the trainer's log-probs after its forward pass.

Parts are immutable, so an annotation is its own small commit: the values object is uploaded under a fresh
directory ``steps/<step>/annotations/<writer>.<seq>.<nonce>/`` and becomes visible when its entry is appended to the
step's log, exactly as parts are committed. Each annotated record is checked against the live one (it exists, same
token count, same token hash), and readers give the values only to a record committed before the annotation with
those tokens, so values can never attach to the wrong tokens (nor to a record written again after a drop).
Annotations are additive metadata: they are accepted after a step is sealed.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy.typing as npt

from routelog.errors import InvalidRecordError, StoreError
from routelog.format import keys
from routelog.format.documents import AnnotationCommit, ObjectInfo, ValueColumn, ValuesInfo, utc_now
from routelog.format.values import VALUES_OBJECT, FloatArray, check_token_values, values_to_parquet
from routelog.store.history import StepHistory
from routelog.store.reader import StepSnapshot
from routelog.store.root import StoreRoot
from routelog.store.steplog import Entry
from routelog.store.writer import MAX_COMMIT_DELAY


class Annotator:
    """Collects per-token columns for committed records of one step; :meth:`commit` publishes them at once."""

    def __init__(self, store: StoreRoot, step: int, writer_id: str) -> None:
        self.store = store
        self.step = keys.check_step(step)
        self.writer_id = keys.check_writer_id(writer_id)
        self._history = StepHistory.read(store, step)
        self._snapshot = StepSnapshot.of(self._history)
        self._rows: dict[str, tuple[str | None, dict[str, FloatArray]]] = {}
        self._n_tokens = 0

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
        self._n_tokens += info.n_tokens

    def commit(self) -> AnnotationCommit | None:
        """Upload the values and create the annotation commit; None if nothing was added."""
        if not self._rows:
            return None
        storage = self.store.storage
        names = sorted({name for _, values in self._rows.values() for name in values})
        data = values_to_parquet([(sid, digest, values) for sid, (digest, values) in self._rows.items()], names)
        log = self._history.log
        seq = sum(1 for e in log.entries if isinstance(e.doc, AnnotationCommit) and e.doc.writer_id == self.writer_id)
        part = keys.new_part_name(self.writer_id, seq)
        deadline = time.monotonic() + MAX_COMMIT_DELAY  # gc may consider older uncommitted data an orphan
        storage.write(f"{keys.annotation_key(self.step, part)}/{VALUES_OBJECT}", data)

        def in_time(new: Sequence[Entry]) -> None:
            if time.monotonic() > deadline:
                raise StoreError(
                    f"annotation {part} of step {self.step}: not committed within {MAX_COMMIT_DELAY:.0f} s of its "
                    "upload; retry"
                )

        in_time(())
        [entry] = log.append(
            lambda position: AnnotationCommit(
                step=self.step,
                part=part,
                writer_id=self.writer_id,
                seq=seq,
                position=position,
                created_at=utc_now(),
                n_records=len(self._rows),
                n_tokens=self._n_tokens,
                values=ValuesInfo(columns=[ValueColumn(name=n) for n in names]),
                objects=[ObjectInfo(key=VALUES_OBJECT, size=len(data), sha256=hashlib.sha256(data).hexdigest())],
            ),
            check=in_time,
        )
        self._rows.clear()
        self._n_tokens = 0
        if not isinstance(entry.doc, AnnotationCommit):  # pragma: no cover - built above
            raise TypeError(entry.key)
        return entry.doc

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
