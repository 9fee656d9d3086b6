"""slime / miles: ``Sample.rollout_routed_experts``, ``[len(tokens) - 1, num_layers, K]`` int32 per sample.

slime decodes SGLang's payload onto the full layer axis (dense layers present) and asserts one row fewer than
tokens: the final token has none. Files hold, per sample, ``<sample_id>/rollout_routed_experts``,
``<sample_id>/tokens`` and ``<sample_id>/response_length``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.engines.common import Payload, payload_to_record, to_full_axis
from routelog.errors import IngestError
from routelog.format.record import Record
from routelog.format.spec import ModelSpec

ENGINE = "slime"
FIELDS = ("rollout_routed_experts", "tokens", "response_length")


def record_from_sample(
    rollout_routed_experts: npt.ArrayLike,
    tokens: npt.ArrayLike,
    response_length: int,
    spec: ModelSpec,
    *,
    sample_id: str,
    group_id: str | None = None,
    policy_version: int | None = None,
) -> Record:
    token_ids = np.asarray(tokens, dtype=np.int64)
    if not 0 <= response_length <= token_ids.shape[0]:
        raise IngestError(f"sample {sample_id}: response_length {response_length} exceeds {token_ids.shape[0]} tokens")
    return payload_to_record(
        Payload(sample_id, np.asarray(rollout_routed_experts)),
        spec,
        sample_id=sample_id,
        prompt_len=token_ids.shape[0] - response_length,
        response_len=response_length,
        token_ids=token_ids,
        group_id=group_id,
        policy_version=policy_version,
        engine=ENGINE,
    )


def to_sample(record: Record, spec: ModelSpec) -> dict[str, npt.NDArray[Any]]:
    """slime's fields for ``record`` (rows ``[0, n_tokens - 1)``; zeros in dense layers and missing rows)."""
    ids = np.asarray(record.expert_ids).astype(np.int32)
    if record.valid is not None:
        ids[~np.asarray(record.valid)] = 0
    out = {
        "rollout_routed_experts": to_full_axis(ids[: record.n_tokens - 1], spec, fill=0),
        "response_length": np.asarray(record.response_len, dtype=np.int64),
    }
    if record.token_ids is not None:
        out["tokens"] = np.asarray(record.token_ids, dtype=np.int64)
    return out


def records_from_arrays(
    arrays: Mapping[str, npt.NDArray[Any]], spec: ModelSpec, name: str, policy_version: int | None = None
) -> list[Record]:
    """Records from a file of samples keyed ``<sample_id>/<field>``."""
    samples = sorted({key.rsplit("/", 1)[0] for key in arrays if key.rsplit("/", 1)[-1] in FIELDS})
    if not samples:
        raise IngestError(f"{name}: no '<sample_id>/rollout_routed_experts' arrays found (has {sorted(arrays)[:5]})")
    records = []
    for sid in samples:
        missing = [f for f in FIELDS if f"{sid}/{f}" not in arrays]
        if missing:
            raise IngestError(f"{name}: sample {sid} lacks {missing}")
        records.append(
            record_from_sample(
                arrays[f"{sid}/rollout_routed_experts"],
                arrays[f"{sid}/tokens"],
                int(np.asarray(arrays[f"{sid}/response_length"])),
                spec,
                sample_id=sid,
                policy_version=policy_version,
            )
        )
    return records
