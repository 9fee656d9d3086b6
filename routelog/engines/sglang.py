"""SGLang: ``meta_info["routed_experts"]`` of ``/generate`` and ``choices[i].sgl_ext.routed_experts`` of the
OpenAI-compatible endpoints.

The payload is base64 of raw little-endian int32 with **no shape header**, logically
``[seqlen - 1 - routed_experts_start_len, num_hidden_layers, K]`` on the full layer axis (dense layers zero). The
row count follows from the token counts, so the layer count is derived from the payload size and checked against
the model spec. Multi-turn sessions request only new rows with ``routed_experts_start_len`` and are stitched
with :class:`routelog.engines.common.TurnStitcher`. With pipeline parallelism SGLang returns only one stage's
layers (the others all zero); such payloads are refused.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.engines.common import (
    Payload,
    decode_base64,
    int_field,
    list_field,
    malformed,
    mapping_field,
    payload_to_record,
    to_full_axis,
    token_ids_field,
)
from routelog.errors import IngestError
from routelog.format import MAX_RECORD_TOKENS
from routelog.record import Record
from routelog.spec import ModelSpec

ENGINE = "sglang"


def decode_int32_base64(text: str, where: str) -> npt.NDArray[np.int32]:
    """The flat int32 values of SGLang's encoding (base64 of raw little-endian int32, no header)."""
    raw = decode_base64(text, where, "routed_experts")
    if len(raw) % 4:
        raise IngestError(f"{where}: routed_experts has {len(raw)} bytes, not a whole number of int32 values")
    values: npt.NDArray[np.int32] = np.frombuffer(raw, dtype="<i4").astype(np.int32)
    return values


def encode_int32_base64(array: npt.NDArray[Any]) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype="<i4").tobytes()).decode()


def _rows_for(routed: str, n_tokens: int, start: int, spec: ModelSpec, where: str) -> npt.NDArray[np.int32]:
    """Shape the flat values with the engine's row count (``n_tokens - 1 - start``; one surplus row, the final
    token forwarded after all, is accepted); the layer count follows and must be one of the spec's axes."""
    flat = decode_int32_base64(routed, where)
    for n_rows in (n_tokens - 1 - start, n_tokens - start):
        if n_rows > 0 and flat.size % (n_rows * spec.topk) == 0:
            layers = flat.size // (n_rows * spec.topk)
            if layers in (spec.num_layers, spec.num_moe_layers):
                return flat.reshape(n_rows, layers, spec.topk)
    raise IngestError(
        f"{where}: routed_experts holds {flat.size} values, not a whole number of layers of top-{spec.topk} for "
        f"{n_tokens - 1 - start} rows (expected {spec.num_layers} or {spec.num_moe_layers} layers per row); check "
        "the request's routed_experts_start_len and the model spec"
    )


def record_from_generate(
    response: Mapping[str, Any],
    spec: ModelSpec,
    *,
    request: Mapping[str, Any] | None = None,
    sample_id: str | None = None,
    group_id: str | None = None,
    policy_version: int | None = None,
    engine_version: str | None = None,
    physical_to_logical: npt.ArrayLike | None = None,
) -> Record:
    """A record from one ``/generate`` response (``output_ids``, ``meta_info``) and its request (``input_ids``).

    For a multi-turn continuation (``routed_experts_start_len > 0``) this record has rows only from the start
    offset; feed the turns to a :class:`~routelog.engines.common.TurnStitcher` instead to get one record.
    """
    request = mapping_field(request, "request", "the request", optional=True)
    response = mapping_field(response, "response", "the response")
    meta = mapping_field(response.get("meta_info"), "response", "meta_info", optional=True)
    request_id = str(meta.get("id") or request.get("rid") or "unknown")
    with malformed(f"request {request_id}"):
        return _record_from_generate(
            response,
            meta,
            request,
            request_id,
            spec,
            sample_id,
            group_id,
            policy_version,
            engine_version,
            physical_to_logical,
        )


def _record_from_generate(
    response: Mapping[str, Any],
    meta: Mapping[str, Any],
    request: Mapping[str, Any],
    request_id: str,
    spec: ModelSpec,
    sample_id: str | None,
    group_id: str | None,
    policy_version: int | None,
    engine_version: str | None,
    physical_to_logical: npt.ArrayLike | None,
) -> Record:
    where = f"request {request_id}"
    routed = meta.get("routed_experts")
    if not isinstance(routed, str):
        raise IngestError(
            f"{where}: meta_info has no routed_experts string; send return_routed_experts: true to "
            "a server started with --enable-return-routed-experts"
        )
    output_ids = token_ids_field(response.get("output_ids") or [], where, "output_ids")
    raw_inputs = request.get("input_ids")
    input_ids = None if raw_inputs is None else token_ids_field(raw_inputs, where, "input_ids")
    if input_ids is not None:
        prompt_len = input_ids.shape[0]
    elif meta.get("prompt_tokens") is not None:
        prompt_len = int_field(meta["prompt_tokens"], where, "meta_info.prompt_tokens", hi=MAX_RECORD_TOKENS)
    else:
        raise IngestError(f"{where}: neither the request's input_ids nor meta_info.prompt_tokens give the prompt")
    start = int_field(request.get("routed_experts_start_len"), where, "routed_experts_start_len", default=0)
    n_tokens = prompt_len + output_ids.shape[0]
    rows = _rows_for(routed, n_tokens, start, spec, where)
    return payload_to_record(
        Payload(request_id, rows, start),
        spec,
        sample_id=sample_id or request_id,
        prompt_len=prompt_len,
        response_len=output_ids.shape[0],
        token_ids=None if input_ids is None else np.concatenate([input_ids, output_ids]),
        group_id=group_id,
        policy_version=policy_version,
        engine=ENGINE,
        engine_version=engine_version,
        physical_to_logical=physical_to_logical,
    )


def records_from_http(
    response: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    spec: ModelSpec,
    *,
    request: Mapping[str, Any] | None = None,
    sample_ids: Sequence[str] | None = None,
    group_id: str | None = None,
    policy_version: int | None = None,
    engine_version: str | None = None,
    physical_to_logical: npt.ArrayLike | None = None,
) -> list[Record]:
    """Records from a ``/generate`` response (one object, or a list for a batched request) or an OpenAI-style
    response whose choices carry ``sgl_ext.routed_experts``."""
    common: dict[str, Any] = {
        "group_id": group_id,
        "policy_version": policy_version,
        "engine_version": engine_version,
        "physical_to_logical": physical_to_logical,
    }
    request = mapping_field(request, "request", "the request", optional=True)
    if isinstance(response, Mapping) and "choices" in response:
        with malformed(f"request {response.get('id') or 'unknown'}"):
            return _records_from_openai(response, spec, request, sample_ids, common)
    if not isinstance(response, (Mapping, list)):
        raise IngestError(f"response: expected a JSON object or a list of them, got {type(response).__name__}")
    responses = [response] if isinstance(response, Mapping) else list(response)
    inputs = request.get("input_ids")
    batched = isinstance(inputs, list) and bool(inputs) and isinstance(inputs[0], list)
    records = []
    for i, item in enumerate(responses):
        sub_request = dict(request)
        if batched and inputs is not None:
            sub_request["input_ids"] = inputs[i]
        sid = sample_ids[i] if sample_ids else None
        records.append(record_from_generate(item, spec, request=sub_request, sample_id=sid, **common))
    return records


def _records_from_openai(
    response: Mapping[str, Any],
    spec: ModelSpec,
    request: Mapping[str, Any],
    sample_ids: Sequence[str] | None,
    common: dict[str, Any],
) -> list[Record]:
    response_id = str(response.get("id") or "unknown")
    choices = list_field(response["choices"], f"request {response_id}", "choices")
    raw_prompt = response.get("prompt_token_ids") or request.get("prompt") or request.get("input_ids")
    if not isinstance(raw_prompt, list):
        raise IngestError(f"request {response_id}: no prompt token ids in the response or the request")
    prompt = token_ids_field(raw_prompt, f"request {response_id}", "prompt token ids")
    extra_body = mapping_field(request.get("extra_body"), f"request {response_id}", "extra_body", optional=True)
    start = int_field(
        request.get("routed_experts_start_len") or extra_body.get("routed_experts_start_len"),
        f"request {response_id}",
        "routed_experts_start_len",
        default=0,
    )
    records = []
    for position, raw_choice in enumerate(choices):
        choice = mapping_field(raw_choice, f"request {response_id}", f"choices[{position}]")
        index = int_field(choice.get("index"), f"request {response_id}", f"choices[{position}].index", default=position)
        where = f"request {response_id} choice {index}"
        routed = mapping_field(choice.get("sgl_ext"), where, "sgl_ext", optional=True).get("routed_experts")
        raw_output = choice.get("token_ids") or choice.get("output_ids")
        if not isinstance(routed, str) or raw_output is None:
            raise IngestError(f"{where}: needs sgl_ext.routed_experts and the choice's token ids")
        output = token_ids_field(raw_output, where, "token_ids")
        n_tokens = len(prompt) + len(output)
        rows = _rows_for(routed, n_tokens, start, spec, where)
        sid = sample_ids[position] if sample_ids else (f"{response_id}/{index}" if len(choices) > 1 else response_id)
        records.append(
            payload_to_record(
                Payload(where.removeprefix("request "), rows, start),
                spec,
                sample_id=sid,
                prompt_len=len(prompt),
                response_len=len(output),
                token_ids=np.concatenate([prompt, output]),
                engine=ENGINE,
                **{**common, "group_id": common["group_id"] or response_id},
            )
        )
    return records


def to_meta_info(record: Record, spec: ModelSpec, *, start_len: int = 0) -> str:
    """``meta_info["routed_experts"]`` as SGLang sends it: flat base64 int32 on the full axis, rows
    ``[start_len, n_tokens - 1)``, zeros in dense layers and never-computed rows."""
    ids = np.asarray(record.expert_ids).astype(np.int32)
    if record.valid is not None:
        ids[~np.asarray(record.valid)] = 0
    return encode_int32_base64(to_full_axis(ids[start_len : record.n_tokens - 1], spec, fill=0))
