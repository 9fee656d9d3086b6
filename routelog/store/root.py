"""A store's root: its storage and run document. What every part of routelog that reads or writes a store needs.

:class:`~routelog.store.store.Store` (the entry point users hold) extends it with the operations (read a step, write,
seal, verify, gc, drop); the modules implementing those operations depend only on this root, never on the store
facade, so the package has no import cycles.
"""

from __future__ import annotations

from routelog.errors import StoreNotFoundError
from routelog.format import keys
from routelog.format.documents import RunDocument, parse_document
from routelog.format.spec import ModelSpec
from routelog.store.storage import Storage


class StoreRoot:
    """The run document plus the storage under it: one training run at one URL."""

    def __init__(self, storage: Storage, run: RunDocument) -> None:
        self.storage = storage
        self.run = run

    @classmethod
    def read(cls, storage: Storage) -> StoreRoot:
        """The store rooted at ``storage`` (reads its run document)."""
        return cls(storage, read_run_document(storage))

    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def model_spec(self) -> ModelSpec:
        return self.run.model_spec

    def steps(self) -> list[int]:
        """Steps that have a directory in the store, ascending (a step whose writers all crashed has no records)."""
        names = self.storage.list(keys.STEPS)
        return sorted(s for s in (keys.parse_step_name(n) for n in names) if s is not None)


def read_run_document(storage: Storage) -> RunDocument:
    try:
        data = storage.read(keys.RUN_DOCUMENT)
    except FileNotFoundError:
        storage.check_not_an_object()
        raise StoreNotFoundError(
            f"no routelog store at {storage.url!r} (no {keys.RUN_DOCUMENT}); create one with "
            "routelog.create_store or by writing records (routelog synth, routelog ingest)"
        ) from None
    return parse_document(data, RunDocument, storage.url_of(keys.RUN_DOCUMENT))
