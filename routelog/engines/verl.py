"""veRL's batch tensor: ``batch["routed_experts"]`` ``[B, prompt_max + response_max, L, K]`` int16.

Prompts are left-padded into the first ``prompt_max`` positions and responses right-padded after them; the
``attention_mask`` marks real tokens. Padding and the final token (never forwarded) are zeros. ``L`` is the full
layer axis when the rows came from an engine (R3) and the MoE-only axis for training-side recordings (R2); the
model spec and the shape decide which.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.engines.common import LayerAxis, Payload, captured_rows, check_rows, to_full_axis
from routelog.errors import IngestError
from routelog.format.record import Record
from routelog.format.spec import ModelSpec

ENGINE = "verl"


def records_from_batch(
    routed_experts: npt.ArrayLike,
    attention_mask: npt.ArrayLike,
    prompt_length: int,
    spec: ModelSpec,
    *,
    input_ids: npt.ArrayLike | None = None,
    sample_ids: Sequence[str] | None = None,
    group_ids: Sequence[str] | None = None,
    policy_version: int | None = None,
    batch_name: str = "batch",
) -> list[Record]:
    """One record per batch row; rows follow the unpadded token order, zero rows become missing."""
    routes = np.asarray(routed_experts)
    mask = np.asarray(attention_mask).astype(bool)
    if routes.ndim != 4 or mask.shape != routes.shape[:2]:
        raise IngestError(
            f"{batch_name}: routed_experts {routes.shape} must be [B, S, L, K] with an attention_mask "
            f"of [B, S], got {mask.shape}"
        )
    if not 0 <= prompt_length <= routes.shape[1]:
        raise IngestError(f"{batch_name}: prompt_length {prompt_length} outside the sequence length {routes.shape[1]}")
    tokens = None if input_ids is None else np.asarray(input_ids)
    records = []
    for b in range(routes.shape[0]):
        sid = sample_ids[b] if sample_ids is not None else f"{batch_name}/{b}"
        where = f"{batch_name} row {b} ({sid})"
        positions = np.flatnonzero(mask[b])
        prompt_len = int(mask[b, :prompt_length].sum())
        rows = check_rows(Payload(f"{batch_name}/{b} ({sid})", routes[b, positions]), spec)
        valid = captured_rows(rows, spec, where)
        records.append(
            Record(
                sample_id=sid,
                expert_ids=rows,
                prompt_len=prompt_len,
                response_len=positions.shape[0] - prompt_len,
                valid=valid,
                token_ids=None if tokens is None else tokens[b, positions].astype(np.int64),
                group_id=None if group_ids is None else group_ids[b],
                policy_version=policy_version,
                engine=ENGINE,
            )
        )
    return records


def to_batch(
    records: Sequence[Record],
    spec: ModelSpec,
    *,
    prompt_length: int | None = None,
    response_length: int | None = None,
    layer_axis: LayerAxis = "full",
) -> dict[str, npt.NDArray[Any]]:
    """veRL's tensors for ``records``: ``routed_experts`` int16 (zeros for padding, dense layers and missing rows),
    ``attention_mask``, and ``input_ids``/``prompts``/``responses`` when the records carry token ids."""
    prompt_max = prompt_length if prompt_length is not None else max((r.prompt_len for r in records), default=0)
    response_max = response_length if response_length is not None else max((r.response_len for r in records), default=0)
    layers = spec.num_layers if layer_axis == "full" else spec.num_moe_layers
    batch = len(records)
    total = prompt_max + response_max
    routes = np.zeros((batch, total, layers, spec.topk), dtype=np.int16)
    mask = np.zeros((batch, total), dtype=np.int64)
    input_ids = np.zeros((batch, total), dtype=np.int64)
    have_tokens = all(r.token_ids is not None for r in records)
    for b, record in enumerate(records):
        if record.prompt_len > prompt_max or record.response_len > response_max:
            raise IngestError(
                f"record {record.sample_id!r} ({record.prompt_len}+{record.response_len} tokens) does not "
                f"fit prompt_length {prompt_max} + response_length {response_max}"
            )
        ids = np.asarray(record.expert_ids).astype(np.int16)
        if record.valid is not None:
            ids[~np.asarray(record.valid)] = 0
        if layer_axis == "full":
            ids = to_full_axis(ids, spec, fill=0)
        positions = np.r_[prompt_max - record.prompt_len : prompt_max, prompt_max : prompt_max + record.response_len]
        routes[b, positions] = ids
        mask[b, positions] = 1
        if have_tokens:
            input_ids[b, positions] = np.asarray(record.token_ids)
    out: dict[str, npt.NDArray[Any]] = {
        "routed_experts": routes,
        "attention_mask": mask,
        "prompt_length": np.asarray(prompt_max),
    }
    if have_tokens:
        out |= {"input_ids": input_ids, "prompts": input_ids[:, :prompt_max], "responses": input_ids[:, prompt_max:]}
    return out


def records_from_arrays(
    arrays: Mapping[str, npt.NDArray[Any]], spec: ModelSpec, name: str, policy_version: int | None = None
) -> list[Record]:
    """Records from a saved batch (``.npz`` / safetensors): ``routed_experts``, ``attention_mask`` and the prompt
    length as ``prompt_length``, or the width of ``prompts``; optional ``input_ids`` and ``sample_ids``."""
    for key in ("routed_experts", "attention_mask"):
        if key not in arrays:
            raise IngestError(f"{name}: a veRL batch needs {key!r} (has {sorted(arrays)})")
    if "prompt_length" in arrays:
        prompt_length = int(np.asarray(arrays["prompt_length"]))
    elif "prompts" in arrays:
        prompt_length = int(np.asarray(arrays["prompts"]).shape[1])
    elif "responses" in arrays:
        prompt_length = int(arrays["attention_mask"].shape[1] - np.asarray(arrays["responses"]).shape[1])
    else:
        raise IngestError(f"{name}: give the prompt length as 'prompt_length' or a 'prompts'/'responses' tensor")
    sample_ids = (
        [s.decode() if isinstance(s, bytes) else str(s) for s in np.asarray(arrays["sample_ids"]).reshape(-1)]
        if "sample_ids" in arrays
        else None
    )
    return records_from_batch(
        arrays["routed_experts"],
        arrays["attention_mask"],
        prompt_length,
        spec,
        input_ids=arrays.get("input_ids"),
        sample_ids=sample_ids,
        batch_name=name,
        policy_version=policy_version,
    )
