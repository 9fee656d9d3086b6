"""routelog: record, store, audit and replay the routing decisions of Mixture-of-Experts models.

>>> import routelog
>>> spec = routelog.ModelSpec.from_hf_config(config_dict)                       # doctest: +SKIP
>>> with routelog.open_writer("s3://bucket/run-1", step=3, model_spec=spec) as w:  # doctest: +SKIP
...     w.append(routelog.Record(sample_id="req-1/0", expert_ids=ids, prompt_len=p, response_len=r, valid=v))
>>> snap = routelog.open_store("s3://bucket/run-1").step(3)                      # doctest: +SKIP
>>> snap.read("req-1/0", moe_layers=range(12)).expert_ids                       # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Unpack

if TYPE_CHECKING:
    from pydantic import JsonValue

    from routelog.errors import (
        AlignmentError,
        CommitConflictError,
        CorruptDataError,
        CredentialsInUrlError,
        DuplicateSampleError,
        EnvironmentVariableError,
        ForkedWriterError,
        FormatVersionError,
        IngestError,
        InvalidRecordError,
        MissingExtraError,
        ModelSpecError,
        RecordNotFoundError,
        ReplayConfigError,
        RoutelogError,
        StepSealedError,
        StoreAccessError,
        StoreError,
        StoreNotFoundError,
        StoreUnreachableError,
        ValuesNotFoundError,
        WriteInterruptedError,
    )
    from routelog.format.documents import IndexRow, Segment
    from routelog.format.limits import FORMAT_VERSION
    from routelog.format.part import PartOptions
    from routelog.format.record import Record, StreamRows, token_hash
    from routelog.format.routing import RecordRouting
    from routelog.format.spec import ModelSpec, RouterSpec, StreamSpec
    from routelog.store.committer import Committer
    from routelog.store.fidelity import FidelityGate
    from routelog.store.process_writer import ProcessWriter
    from routelog.store.reader import StepSnapshot
    from routelog.store.store import Store, create_store, open_store
    from routelog.store.writer import StepWriter, WriterOptions

_PUBLIC = {
    "AlignmentError": "routelog.errors",
    "CommitConflictError": "routelog.errors",
    "Committer": "routelog.store.committer",
    "CorruptDataError": "routelog.errors",
    "DuplicateSampleError": "routelog.errors",
    "FORMAT_VERSION": "routelog.format.limits",
    "FidelityGate": "routelog.store.fidelity",
    "FormatVersionError": "routelog.errors",
    "IndexRow": "routelog.format.documents",
    "IngestError": "routelog.errors",
    "InvalidRecordError": "routelog.errors",
    "ModelSpec": "routelog.format.spec",
    "ModelSpecError": "routelog.errors",
    "PartOptions": "routelog.format.part",
    "ProcessWriter": "routelog.store.process_writer",
    "Record": "routelog.format.record",
    "RecordNotFoundError": "routelog.errors",
    "RecordRouting": "routelog.format.routing",
    "ReplayConfigError": "routelog.errors",
    "RoutelogError": "routelog.errors",
    "RouterSpec": "routelog.format.spec",
    "Segment": "routelog.format.documents",
    "MissingExtraError": "routelog.errors",
    "ForkedWriterError": "routelog.errors",
    "CredentialsInUrlError": "routelog.errors",
    "EnvironmentVariableError": "routelog.errors",
    "StepSealedError": "routelog.errors",
    "StepSnapshot": "routelog.store.reader",
    "StepWriter": "routelog.store.writer",
    "Store": "routelog.store.store",
    "StoreAccessError": "routelog.errors",
    "StoreError": "routelog.errors",
    "StoreNotFoundError": "routelog.errors",
    "StoreUnreachableError": "routelog.errors",
    "StreamRows": "routelog.format.record",
    "StreamSpec": "routelog.format.spec",
    "ValuesNotFoundError": "routelog.errors",
    "WriteInterruptedError": "routelog.errors",
    "WriterOptions": "routelog.store.writer",
    "create_store": "routelog.store.store",
    "open_store": "routelog.store.store",
    "token_hash": "routelog.format.record",
}
"""Where each public name lives: ``import routelog`` loads none of them (numpy, pyarrow and pydantic's models load
on first use, so a process that only imports routelog, or the command line's help, pays for nothing more)."""


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'routelog' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


__version__ = "0.1.0"


def open_writer(
    url: str,
    step: int,
    *,
    model_spec: ModelSpec | None = None,
    writer_id: str | None = None,
    run_id: str | None = None,
    config: Mapping[str, JsonValue] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **options: Unpack[WriterOptions],
) -> StepWriter:
    """A writer for ``step`` of the store at ``url``, creating the store when ``model_spec`` is given.

    Without ``model_spec`` the store must exist. With it, an existing store must hold the same model. ``options``
    are every option of :meth:`Store.writer` (``flush_bytes``, ``flush_seconds``, ``on_commit``, ``on_duplicate``,
    ...).
    """
    from routelog.store.store import create_store, open_store

    if model_spec is None:
        store = open_store(url, storage_options=storage_options)
    else:
        store = create_store(url, model_spec, run_id=run_id, config=config, storage_options=storage_options)
    return store.writer(step, writer_id, **options)


__all__ = [
    "FORMAT_VERSION",
    "AlignmentError",
    "CommitConflictError",
    "Committer",
    "CorruptDataError",
    "CredentialsInUrlError",
    "DuplicateSampleError",
    "EnvironmentVariableError",
    "FidelityGate",
    "ForkedWriterError",
    "FormatVersionError",
    "IndexRow",
    "IngestError",
    "InvalidRecordError",
    "MissingExtraError",
    "ModelSpec",
    "ModelSpecError",
    "PartOptions",
    "ProcessWriter",
    "Record",
    "RecordNotFoundError",
    "RecordRouting",
    "ReplayConfigError",
    "RoutelogError",
    "RouterSpec",
    "Segment",
    "StepSealedError",
    "StepSnapshot",
    "StepWriter",
    "Store",
    "StoreAccessError",
    "StoreError",
    "StoreNotFoundError",
    "StoreUnreachableError",
    "StreamRows",
    "StreamSpec",
    "ValuesNotFoundError",
    "WriteInterruptedError",
    "WriterOptions",
    "__version__",
    "create_store",
    "open_store",
    "open_writer",
    "token_hash",
]
