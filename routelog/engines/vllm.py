"""vLLM: ``CompletionOutput.routed_experts`` in process, ``choices[i].routed_experts`` over HTTP.

Layouts by version (engine notes, vLLM section):

* 0.15-0.20: in-process only; ``int32`` ``[n_tokens - 1, num_hidden_layers, K]`` on the full layer axis
  (0.15.0 reported all zeros: capture never bound; such payloads are refused as all-zero layers).
* 0.21: MoE-only axis, ``int16``; prompt rows separate (``RequestOutput.prompt_routed_experts`` /
  response-level ``prompt_routed_experts``), generation rows per choice; HTTP sends nested JSON lists. It counts
  MoE layers without ``first_k_dense_replace``, so DeepSeek-style models get all-zero trailing layers, dropped here.
* 0.22+: full layer axis, ``uint8`` (E <= 256) or ``uint16``; HTTP sends base64 of a whole ``.npy`` file;
  ``routed_experts_prompt_start`` skips the first prompt rows. Every version leaves out the final token.

The form of the payload (base64 string, nested lists with separate prompt rows, or an array) decides the layout;
the layer count is then checked against the model spec.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.engines.common import (
    Payload,
    decode_base64,
    int_array,
    int_field,
    list_field,
    load_npy,
    malformed,
    mapping_field,
    payload_to_record,
    to_full_axis,
    token_ids_field,
)
from routelog.errors import IngestError
from routelog.record import Record
from routelog.spec import ModelSpec

ENGINE = "vllm"


def decode_npy_base64(text: str, where: str) -> npt.NDArray[Any]:
    """vLLM 0.22+ HTTP encoding: base64 of ``np.save`` output (shape and dtype in the header; never pickled, and
    the header is checked against the bytes present before anything is allocated)."""
    return load_npy(decode_base64(text, where, "routed_experts"), where, "routed_experts")


def encode_npy_base64(array: npt.NDArray[Any]) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def _v021_rows(prompt: npt.ArrayLike, generated: npt.ArrayLike, spec: ModelSpec, where: str) -> npt.NDArray[Any]:
    """0.21: prompt and generation rows on the MoE-only axis, concatenated; trailing layers beyond the model's
    MoE layers must be zero (0.21 did not skip ``first_k_dense_replace`` layers when counting)."""
    parts = [
        int_array(p, where, name, ndim=3)
        for p, name in ((prompt, "prompt_routed_experts"), (generated, "routed_experts"))
    ]
    shaped = [p for p in parts if p.size]
    if not shaped:
        raise IngestError(f"{where}: vLLM 0.21 routing must be nested lists [rows, layers, topk]")
    try:
        rows = np.concatenate([p if p.size else p.reshape(0, *shaped[0].shape[1:]) for p in parts])
    except ValueError as exc:
        raise IngestError(f"{where}: prompt and generation routing have different shapes ({exc})") from exc
    layers = rows.shape[1]
    if layers > spec.num_moe_layers and layers == spec.num_layers:
        if rows[:, spec.num_moe_layers :].any():
            raise IngestError(
                f"{where}: a vLLM 0.21 payload with {layers} layers must have zeros after the "
                f"{spec.num_moe_layers} MoE layers"
            )
        rows = rows[:, : spec.num_moe_layers]
    elif layers != spec.num_moe_layers and rows.size:
        raise IngestError(
            f"{where}: vLLM 0.21 routing has {layers} layers, model {spec.name!r} has {spec.num_moe_layers} MoE layers"
        )
    return rows


def record_from_output(
    request_output: Any,
    spec: ModelSpec,
    *,
    choice: int = 0,
    sample_id: str | None = None,
    prompt_start: int = 0,
    group_id: str | None = None,
    policy_version: int | None = None,
    engine_version: str | None = None,
    physical_to_logical: npt.ArrayLike | None = None,
) -> Record:
    """A record from an in-process ``vllm.RequestOutput`` (``LLM.generate`` / ``AsyncLLM``), any version."""
    completion = request_output.outputs[choice]
    request_id = str(request_output.request_id)
    where = f"request {request_id}"
    prompt_ids = np.asarray(request_output.prompt_token_ids, dtype=np.int64)
    output_ids = np.asarray(completion.token_ids, dtype=np.int64)
    routed = getattr(completion, "routed_experts", None)
    if routed is None:
        raise IngestError(
            f"{where}: choice {choice} has no routed_experts; start vLLM with --enable-return-routed-experts"
        )
    prompt_rows = getattr(request_output, "prompt_routed_experts", None)
    rows = _v021_rows(prompt_rows, routed, spec, where) if prompt_rows is not None else np.asarray(routed)
    return payload_to_record(
        Payload(request_id, rows, prompt_start),
        spec,
        sample_id=sample_id or _default_sample_id(request_id, choice, len(request_output.outputs)),
        prompt_len=prompt_ids.shape[0],
        response_len=output_ids.shape[0],
        token_ids=np.concatenate([prompt_ids, output_ids]),
        group_id=group_id or request_id,
        policy_version=policy_version,
        engine=ENGINE,
        engine_version=engine_version,
        physical_to_logical=physical_to_logical,
    )


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
) -> list[Record]:
    """Records from a ``/v1/completions`` or ``/v1/chat/completions`` response (one per choice).

    Token ids come from ``prompt_token_ids`` and ``choices[i].token_ids`` when the response has them
    (``return_token_ids: true``), else from the request's token prompt; without output ids the response length
    is derived from the row count and no token hash is stored.
    """
    request = mapping_field(request, "request", "the request", optional=True)
    response = mapping_field(response, "response", "the response")
    response_id = str(response.get("id") or request.get("request_id") or "unknown")
    with malformed(f"request {response_id}"):
        return _records_from_http(
            response,
            request,
            response_id,
            spec,
            sample_ids,
            group_id,
            common={
                "policy_version": policy_version,
                "engine_version": engine_version,
                "physical_to_logical": physical_to_logical,
            },
        )


def _records_from_http(
    response: Mapping[str, Any],
    request: Mapping[str, Any],
    response_id: str,
    spec: ModelSpec,
    sample_ids: Sequence[str] | None,
    group_id: str | None,
    common: dict[str, Any],
) -> list[Record]:
    choices = list_field(response.get("choices"), f"request {response_id}", "choices")
    if not choices:
        raise IngestError(f"request {response_id}: the response has no choices")
    start = int_field(
        request.get("routed_experts_prompt_start"), f"request {response_id}", "routed_experts_prompt_start", default=0
    )
    prompt_ids = response.get("prompt_token_ids")
    if (
        prompt_ids is None
        and isinstance(request.get("prompt"), list)
        and all(isinstance(t, int) for t in request["prompt"])
    ):
        prompt_ids = request["prompt"]
    records = []
    for position, raw_choice in enumerate(choices):
        choice = mapping_field(raw_choice, f"request {response_id}", f"choices[{position}]")
        index = int_field(choice.get("index"), f"request {response_id}", f"choices[{position}].index", default=position)
        where = f"request {response_id} choice {index}"
        routed = choice.get("routed_experts")
        if routed is None:
            raise IngestError(f"{where}: no routed_experts; start vLLM with --enable-return-routed-experts")
        choice_prompt = choice.get("prompt_token_ids", prompt_ids)
        if isinstance(routed, str):
            rows = decode_npy_base64(routed, where)
        else:
            rows = _v021_rows(response.get("prompt_routed_experts") or [], routed, spec, where)
        if choice_prompt is None:
            raise IngestError(
                f"{where}: no prompt token ids in the response or the request; send "
                "'return_token_ids': true (or a token-id prompt) with the request"
            )
        prompt = token_ids_field(choice_prompt, where, "prompt_token_ids")
        output = choice.get("token_ids")
        output_ids = None if output is None else token_ids_field(output, where, "token_ids")
        response_len = output_ids.shape[0] if output_ids is not None else rows.shape[0] + 1 + start - prompt.shape[0]
        sample_id = sample_ids[position] if sample_ids else _default_sample_id(response_id, index, len(choices))
        records.append(
            payload_to_record(
                Payload(where.removeprefix("request "), rows, start),
                spec,
                sample_id=sample_id,
                prompt_len=prompt.shape[0],
                response_len=response_len,
                token_ids=None if output_ids is None else np.concatenate([prompt, output_ids]),
                group_id=group_id or response_id,
                engine=ENGINE,
                **common,
            )
        )
    return records


def _default_sample_id(response_id: str, index: int, n_choices: int) -> str:
    return f"{response_id}/{index}" if n_choices > 1 else response_id


def to_array(record: Record, spec: ModelSpec, *, prompt_start: int = 0) -> npt.NDArray[Any]:
    """The 0.22+ payload for ``record``: ``[n_tokens - 1 - prompt_start, num_hidden_layers, K]`` uint8/uint16,
    zeros in dense layers and in rows the engine never computed."""
    ids = np.asarray(record.expert_ids).astype(spec.id_dtype)
    if record.valid is not None:
        ids[~np.asarray(record.valid)] = 0
    rows = ids[prompt_start : record.n_tokens - 1]
    out: npt.NDArray[Any] = to_full_axis(rows, spec, fill=0)
    return out


def to_http_choice(record: Record, spec: ModelSpec, *, prompt_start: int = 0) -> str:
    """``choices[i].routed_experts`` as vLLM 0.22+ sends it (base64 of a ``.npy`` file)."""
    return encode_npy_base64(to_array(record, spec, prompt_start=prompt_start))
