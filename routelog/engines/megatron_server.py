"""Megatron-core's own inference server: ``choices[i].moe_topk_indices`` of its completions endpoints.

megatron-core's dynamic text-generation server (``megatron/core/inference/text_generation_server/
dynamic_text_gen_server/endpoints/completions.py`` and ``chat_completions.py``) returns, when the engine records
routing (``RoutingMetadata``, the model built with ``moe_enable_routing_replay``), each choice's
``moe_topk_indices``: the request's ``routing_indices``, ``[prompt + generated - 1, num_moe_layers, topk]`` int32
on the **MoE-only** layer axis, row ``t`` the routing of input position ``t`` (the last generated token is never
forwarded). The choice also carries ``prompt_token_ids`` and ``generation_token_ids`` (chat: under ``message``
too), and ``prompt_moe_topk_indices``, the first ``prompt`` rows again, which is not read.

The array reaches JSON in one of three forms, all accepted: nested lists; megatron-core's ``serialize_ndarray``
object ``{"data": [...], "dtype": "int32"}``; or that object still tagged as the request serialised it,
``["ndarray", {"data": ..., "dtype": ...}]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.engines.common import (
    Payload,
    int_array,
    malformed,
    mapping_field,
    payload_to_record,
    response_choices,
    token_ids_field,
)
from routelog.errors import IngestError, RoutingAbsentError
from routelog.format.record import Record
from routelog.format.spec import ModelSpec

ENGINE = "megatron"
FIELD = "moe_topk_indices"


def decode(value: Any, where: str) -> npt.NDArray[np.int64]:
    """``moe_topk_indices`` in any of its JSON forms, as ``[rows, layers, K]`` int64."""
    if isinstance(value, list) and len(value) == 2 and value[0] == "ndarray":
        value = value[1]
    if isinstance(value, Mapping):
        dtype = value.get("dtype")
        if not isinstance(dtype, str) or not np.issubdtype(np.dtype(dtype), np.integer):
            raise IngestError(f"{where}: {FIELD}.dtype is {dtype!r}, expected an integer dtype such as 'int32'")
        value = value.get("data")
    if not isinstance(value, list):
        raise IngestError(
            f"{where}: {FIELD} is a {type(value).__name__}; expected nested lists [tokens - 1][layers][K], "
            "megatron-core's {'data': ..., 'dtype': ...} object, or ['ndarray', {...}]"
        )
    return int_array(value, where, FIELD, ndim=3)


def records_from_http(
    response: Mapping[str, Any],
    spec: ModelSpec,
    *,
    request: Mapping[str, Any] | None = None,
    sample_ids: Sequence[str] | None = None,
    group_id: str | None = None,
    policy_version: int | None = None,
    engine_version: str | None = None,
    physical_to_logical: npt.ArrayLike | None = None,
    eplb: bool = False,
    on_absent: Callable[[RoutingAbsentError], None] | None = None,
) -> list[Record]:
    """Records from one completions or chat-completions response of megatron-core's server (one per choice).

    ``request`` is accepted for symmetry with the other engines and not read: the choices carry their own token
    ids. Expert ids are logical (megatron-core records the router's choice before any expert-parallel mapping), so
    ``physical_to_logical`` and ``eplb`` are refused if set.
    """
    response = mapping_field(response, "response", "the response")
    response_id = str(response.get("id") or "unknown")
    where = f"request {response_id}"
    if physical_to_logical is not None or eplb:
        raise IngestError(f"{where}: megatron-core records logical expert ids; drop physical_to_logical / eplb")
    with malformed(where):
        records = []
        for position, choice in enumerate(response_choices(response, where)):
            index = choice.get("index", position)
            here = f"{where} choice {index}"
            message = mapping_field(choice.get("message"), here, "message", optional=True)
            routed = choice.get(FIELD, message.get(FIELD))
            if routed is None:
                error = RoutingAbsentError(
                    f"{here}: no {FIELD}: start megatron-core's server with a model built with "
                    "moe_enable_routing_replay=True so the engine records routing",
                    "not enabled",
                )
                if on_absent is None:
                    raise error
                on_absent(error)
                continue
            prompt_raw = choice.get("prompt_token_ids", message.get("prompt_token_ids"))
            if prompt_raw is None:
                raise IngestError(
                    f"{here}: no prompt_token_ids; send return_prompt_tokens=true in the request's sampling "
                    "parameters (megatron-core drops the prompt tokens otherwise)"
                )
            prompt = token_ids_field(prompt_raw, here, "prompt_token_ids")
            output = token_ids_field(
                choice.get("generation_token_ids", message.get("generation_token_ids")), here, "generation_token_ids"
            )
            rows = decode(routed, here)
            sample_id = sample_ids[position] if sample_ids else f"{response_id}/{index}"
            records.append(
                payload_to_record(
                    Payload(here.removeprefix("request "), rows),
                    spec,
                    sample_id=sample_id,
                    prompt_len=prompt.shape[0],
                    response_len=output.shape[0],
                    token_ids=np.concatenate([prompt, output]),
                    group_id=group_id or response_id,
                    policy_version=policy_version,
                    engine=ENGINE,
                    engine_version=engine_version,
                )
            )
    return records


def encode(record: Record, spec: ModelSpec) -> dict[str, Any]:
    """``record`` as one completions choice of megatron-core's server: every input row but the final one is routed
    there, so a record missing an earlier row cannot be written in this form."""
    if record.token_ids is None:
        raise IngestError(
            f"sample {record.sample_id!r}: megatron-core's choice carries the token ids and the record was stored "
            "without them: export it to a layout without token ids (vllm, sglang, verl, full)"
        )
    n = record.n_tokens
    valid = np.ones(n, bool) if record.valid is None else np.asarray(record.valid, bool)
    if n and not valid[: n - 1].all():
        first = int(np.argmin(valid[: n - 1]))
        raise IngestError(
            f"sample {record.sample_id!r}: row {first} has no route, and megatron-core's {FIELD} routes every "
            "input position but the last: export it to a layout with missing rows (vllm, verl, full)"
        )
    tokens = np.asarray(record.token_ids, np.int64)
    rows = np.asarray(record.expert_ids)[: max(n - 1, 0)].astype(np.int32)  # the record's axis is MoE-only
    return {
        "index": 0,
        "prompt_token_ids": tokens[: record.prompt_len].tolist(),
        "generation_token_ids": tokens[record.prompt_len :].tolist(),
        FIELD: {"data": rows.tolist(), "dtype": "int32"},
    }
