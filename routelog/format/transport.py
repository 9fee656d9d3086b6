"""A record as plain numpy arrays plus a JSON string: how records cross process boundaries (Ray actors, the writer
process) without pickling any Python object."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.format.documents import Segment
from routelog.format.record import Record, StreamRows

META = "meta"
"""The payload entry holding the JSON metadata; every other entry is an array."""


def record_payload(record: Record) -> dict[str, Any]:
    """``{"meta": JSON text, <array name>: array, ...}`` for ``record`` (arrays as given, not copied)."""
    meta = {
        "sample_id": record.sample_id,
        "prompt_len": int(record.prompt_len),
        "response_len": int(record.response_len),
        "token_hash": record.token_hash,
        "group_id": record.group_id,
        "policy_version": record.policy_version,
        "engine": record.engine,
        "engine_version": record.engine_version,
        "segments": [s.model_dump(mode="json") for s in record.segments],
        "extra": None if record.extra is None else dict(record.extra),
        "payload_start": record.payload_start,
    }
    payload: dict[str, Any] = {META: json.dumps(meta), "expert_ids": np.asarray(record.expert_ids)}
    for name in ("valid", "token_ids", "weights", "indexer"):
        value = getattr(record, name)
        if value is not None:
            payload[name] = np.asarray(value)
    for name, column in (record.token_values or {}).items():
        payload[f"token_values/{name}"] = np.asarray(column)
    for name, rows in (record.streams or {}).items():
        payload[f"streams/{name}/expert_ids"] = np.asarray(rows.expert_ids)
        if rows.valid is not None:
            payload[f"streams/{name}/valid"] = np.asarray(rows.valid)
    return payload


def record_from_payload(payload: Mapping[str, Any]) -> Record:
    """The record :func:`record_payload` described (its arrays are used as given)."""
    meta = json.loads(payload[META])
    arrays: dict[str, npt.NDArray[Any]] = {k: v for k, v in payload.items() if k != META and v is not None}
    token_values = {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("token_values/")}
    streams = {
        name: StreamRows(arrays[f"streams/{name}/expert_ids"], arrays.get(f"streams/{name}/valid"))
        for name in {k.split("/")[1] for k in arrays if k.startswith("streams/")}
    }
    return Record(
        sample_id=meta["sample_id"],
        expert_ids=arrays["expert_ids"],
        prompt_len=meta["prompt_len"],
        response_len=meta["response_len"],
        valid=arrays.get("valid"),
        token_ids=arrays.get("token_ids"),
        token_hash=meta["token_hash"],
        group_id=meta["group_id"],
        policy_version=meta["policy_version"],
        engine=meta["engine"],
        engine_version=meta["engine_version"],
        segments=[Segment.model_validate(s) for s in meta["segments"]],
        extra=meta["extra"],
        token_values=token_values or None,
        streams=streams or None,
        payload_start=meta.get("payload_start"),
        weights=arrays.get("weights"),
        indexer=arrays.get("indexer"),
    )
