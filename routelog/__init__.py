"""routelog: record, store, audit and replay the routing decisions of Mixture-of-Experts models.

>>> import routelog
>>> spec = routelog.ModelSpec.from_hf_config(config_dict)                       # doctest: +SKIP
>>> with routelog.open_writer("s3://bucket/run-1", step=3, model_spec=spec) as w:  # doctest: +SKIP
...     w.append(routelog.Record(sample_id="req-1/0", expert_ids=ids, prompt_len=p, response_len=r, valid=v))
>>> snap = routelog.open_store("s3://bucket/run-1").step(3)                      # doctest: +SKIP
>>> snap.read("req-1/0", moe_layers=range(12)).expert_ids                       # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Unpack

from pydantic import JsonValue

from routelog.errors import (
    AlignmentError,
    CommitConflictError,
    CorruptDataError,
    DuplicateSampleError,
    FormatVersionError,
    IngestError,
    InvalidRecordError,
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
from routelog.format.documents import FORMAT_VERSION, IndexRow, Segment
from routelog.format.part import PartOptions
from routelog.format.record import Record, StreamRows, token_hash
from routelog.format.routing import RecordRouting
from routelog.format.spec import ModelSpec, RouterSpec, StreamSpec
from routelog.store.fidelity import FidelityGate
from routelog.store.process_writer import ProcessWriter
from routelog.store.reader import StepSnapshot
from routelog.store.store import Store, create_store, open_store
from routelog.store.writer import StepWriter, WriterOptions

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
    if model_spec is None:
        store = open_store(url, storage_options=storage_options)
    else:
        store = create_store(url, model_spec, run_id=run_id, config=config, storage_options=storage_options)
    return store.writer(step, writer_id, **options)


__all__ = [
    "FORMAT_VERSION",
    "AlignmentError",
    "CommitConflictError",
    "CorruptDataError",
    "DuplicateSampleError",
    "FidelityGate",
    "FormatVersionError",
    "IndexRow",
    "IngestError",
    "InvalidRecordError",
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
