"""Opening and creating stores: one store is one training run, at one URL."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any, Unpack

from pydantic import JsonValue

from routelog.display import html_card
from routelog.errors import ModelSpecError, RecordNotFoundError, StoreError
from routelog.format import keys
from routelog.format.documents import RunDocument, SealRecord, dump_document, utc_now
from routelog.format.spec import ModelSpec
from routelog.store.annotate import Annotator
from routelog.store.archive import ArchiveOutcome, Progress, archive_step
from routelog.store.drop import DropOutcome, drop_records
from routelog.store.gc import GcReport, collect_garbage
from routelog.store.reader import StepSnapshot
from routelog.store.root import StoreRoot, read_run_document
from routelog.store.seal import seal_step
from routelog.store.storage import Storage
from routelog.store.summary import store_summary
from routelog.store.verify import VerifyReport, verify_store
from routelog.store.writer import StepWriter, WriterOptions


class Store(StoreRoot):
    """A routelog store: the run document plus steps of committed records. The one entry point: read a step,
    write, annotate, seal, verify, collect garbage, drop records."""

    @classmethod
    def on(cls, storage: Storage) -> Store:
        """The store rooted at an already configured :class:`~routelog.store.storage.Storage`."""
        return cls(storage, read_run_document(storage))

    def __repr__(self) -> str:
        spec = self.model_spec
        return (
            f"Store({self.url!r}, run {self.run.run_id!r}, model {spec.name!r}: {spec.num_moe_layers} MoE layers, "
            f"E={spec.num_experts}, K={spec.topk})"
        )

    def _repr_html_(self) -> str:
        spec = self.model_spec
        steps = self.steps()
        facts: list[tuple[str, object]] = [
            ("run", self.run.run_id),
            ("created", self.run.created_at.isoformat(timespec="seconds")),
            ("format", self.run.format_version),
            (
                "model",
                f"{spec.name}: {spec.num_layers} layers, {spec.num_moe_layers} MoE, E={spec.num_experts}, "
                f"K={spec.topk}",
            ),
            ("steps", f"{len(steps)}: {steps[:10]}{' ...' if len(steps) > 10 else ''}"),
        ]
        return html_card(f"routelog store {self.url}", facts)

    def step(self, step: int, *, as_of: datetime | None = None) -> StepSnapshot:
        """The committed records of ``step`` now (exactly the sealed set, once sealed), or as they were at
        ``as_of`` (the log entries the storage held then, by its own timestamps, never a writer's clock). A step
        the store does not have is refused with :class:`~routelog.errors.RecordNotFoundError` listing the steps it
        has."""
        snapshot = StepSnapshot.load(self, step, as_of=as_of)
        if not snapshot.commits and not snapshot.sealed and step not in (steps := self.steps()):
            raise RecordNotFoundError(
                f"{self.url} has no step {step}; its steps are {steps[:20]}{'...' if len(steps) > 20 else ''}"
                if steps
                else f"{self.url} has no steps yet (nothing was written)"
            )
        return snapshot

    def annotate(self, step: int, writer_id: str) -> Annotator:
        """Attach per-token columns (e.g. the trainer's ``logprob_train``) to records committed in ``step``."""
        return Annotator(self, step, writer_id)

    def writer(self, step: int, writer_id: str | None = None, **options: Unpack[WriterOptions]) -> StepWriter:
        """A writer appending records to ``step``; use it as a context manager. ``options`` are
        :class:`~routelog.store.writer.StepWriter`'s: ``options`` (:class:`~routelog.format.part.PartOptions`),
        ``flush_bytes``, ``flush_seconds``, ``max_pending``, ``background``, ``on_commit``, ``max_commit_delay``,
        ``on_duplicate``, ``encode_threads`` and ``committer`` (a :class:`~routelog.store.committer.Committer`, or a
        client of one in another process, shared with other writers: see :mod:`routelog.store.committer`)."""
        return StepWriter(self, step, writer_id=writer_id, **options)

    def seal(self, step: int, *, allow_empty: bool = False) -> SealRecord:
        """Close ``step``: its content becomes exactly the commits made so far; see
        :func:`routelog.store.seal.seal_step`. A step with no records is refused unless ``allow_empty``; a sealed step
        returns its seal (safe to run again)."""
        return seal_step(self, step, allow_empty=allow_empty)

    def archive(
        self, step: int, *, progress: Progress | None = None, check: Callable[[], None] | None = None
    ) -> ArchiveOutcome:
        """Re-code sealed ``step``'s records with the archive codec and make them its content in one entry of its
        log; see :mod:`routelog.store.archive`. An archived step is left as it is (safe to run again)."""
        return archive_step(self, step, progress=progress, check=check)

    def drop(
        self,
        step: int,
        *,
        sample_ids: Iterable[str] = (),
        parts: Iterable[str] = (),
        writers: Iterable[str] = (),
        reason: str | None = None,
    ) -> DropOutcome:
        """Remove records from ``step`` (by sample id, part or writer) without rewriting data; see
        :mod:`routelog.store.drop`. What was dropped already is reported, not dropped again (safe to run again)."""
        return drop_records(self, step, sample_ids=sample_ids, parts=parts, writers=writers, reason=reason)

    def verify(self) -> VerifyReport:
        """Re-check the whole store; see :func:`routelog.store.verify.verify_store`."""
        return verify_store(self)

    def gc(
        self, older_than: float = 24 * 3600.0, *, delete: bool = False, force: bool = False, now: float | None = None
    ) -> GcReport:
        """Find (and with ``delete``, remove) garbage older than ``older_than`` seconds (by ``now``, seconds since
        the epoch, default the clock); see :func:`routelog.store.gc.collect_garbage`."""
        return collect_garbage(self, older_than, delete=delete, force=force, now=now)

    def summary(self) -> dict[str, Any]:
        """Steps, records, tokens and bytes (what ``routelog inspect --json`` prints)."""
        return store_summary(self)


def open_store(url: str, *, storage_options: Mapping[str, Any] | None = None) -> Store:
    """Open an existing store; :class:`StoreNotFoundError` when there is none at ``url``."""
    return Store.on(Storage.open(url, storage_options))


def create_store(
    url: str,
    model_spec: ModelSpec,
    *,
    run_id: str | None = None,
    config: Mapping[str, JsonValue] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Store:
    """Open the store at ``url``, creating its run document if none exists.

    Concurrent creators race on an exclusive create; the losers open the winner's store. An existing store
    whose model spec differs from ``model_spec`` raises :class:`ModelSpecError`.
    """
    storage = Storage.open(url, storage_options)
    storage.check_path_round_trips()
    storage.check_not_an_object()
    doc = RunDocument(
        run_id=run_id or uuid.uuid4().hex,
        created_at=utc_now(),
        model_spec=model_spec,
        config=dict(config or {}),
    )
    if storage.create(keys.RUN_DOCUMENT, dump_document(doc)):
        return Store(storage, doc)
    store = open_store(url, storage_options=storage_options)
    if not store.model_spec.compatible_with(model_spec):
        raise ModelSpecError(
            f"store {url!r} holds routing of model {store.model_spec.name!r} "
            f"({store.model_spec.num_layers} layers, MoE layers {list(store.model_spec.moe_layers)}, "
            f"E={store.model_spec.num_experts}, K={store.model_spec.topk}); the given spec "
            f"({model_spec.num_layers} layers, MoE layers {list(model_spec.moe_layers)}, E={model_spec.num_experts}, "
            f"K={model_spec.topk}) differs. Use a new URL for a different model."
        )
    if run_id is not None and store.run.run_id != run_id:
        raise StoreError(f"store {url!r} belongs to run {store.run.run_id!r}, not {run_id!r}")
    return store
