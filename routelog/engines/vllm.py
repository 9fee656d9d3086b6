"""vLLM: ``CompletionOutput.routed_experts`` in process, ``choices[i].routed_experts`` over HTTP.

Layouts by version, as read from each version's own code (``tests/fixtures/engines/FACTS.md``):

* 0.14.x-0.20: in-process only; ``int32`` ``[n_tokens - 1, num_hidden_layers, K]`` on the full layer axis. 0.14.x
  (and 0.21) capture **physical** IDs under EPLB; 0.15.0 and 0.15.1 return all zeros (refused as all-zero layers).
* 0.21: MoE-only axis counted without ``first_k_dense_replace`` (DeepSeek-style models get trailing zero layers),
  ``int16`` nested JSON lists; the prompt rows come once per response in ``prompt_routed_experts``, taken from the
  first result of the batch, so with several prompts in one request only the first prompt's rows are there.
  ``routed_experts`` is ``null`` for aborts, stop-string finishes and preempted requests.
* 0.22+: full layer axis, ``uint8`` (E <= 256) or ``uint16``, base64 of a whole ``.npy`` file, per choice of
  ``/v1/completions``, ``/v1/chat/completions`` and ``/inference/v1/generate``; rows from
  ``routed_experts_prompt_start`` (a ``SamplingParams`` field from 0.22: over HTTP ``sampling_params`` of generate;
  a top-level request field from 0.28). Aborted requests return the rows computed so far. Streamed generate (0.24+)
  carries the routing on its final chunk only, whose ``token_ids`` is the last delta: see
  :func:`records_from_stream`.

The envelopes of frameworks built on vLLM are recognised wherever ``routed_experts`` appears: NeMo-RL's ``nrlre1:``
string (:mod:`~routelog.engines.nemo_rl`) and ms-swift's ``__ndarray__`` object (:mod:`~routelog.engines.ms_swift`).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.engines import ms_swift, nemo_rl
from routelog.engines.common import (
    IngestOptions,
    Payload,
    decode_base64,
    eplb_table,
    int_array,
    int_field,
    list_field,
    load_npy,
    malformed,
    mapping_field,
    payload_to_record,
    response_choices,
    to_full_axis,
    token_ids_field,
    weight_version_spans,
)
from routelog.engines.versions import parse_version, vllm_physical_ids
from routelog.errors import IngestError, RoutingAbsentError
from routelog.format.record import Record
from routelog.format.spec import ModelSpec

ENGINE = "vllm"


# -- decoding ------------------------------------------------------------------------------------------------------
def decode_npy_base64(text: str, where: str) -> npt.NDArray[Any]:
    """vLLM 0.22+ HTTP encoding: base64 of ``np.save`` output (shape and dtype in the header; never pickled, and
    the header is checked against the bytes present before anything is allocated)."""
    return load_npy(decode_base64(text, where, "routed_experts"), where, "routed_experts")


def encode_npy_base64(array: npt.NDArray[Any]) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


@dataclass(frozen=True)
class Decoded:
    """Rows decoded from one ``routed_experts`` field, and the rows its encoding marks as never routed."""

    rows: npt.NDArray[Any]
    missing: npt.NDArray[np.bool_] | None = None
    form: str = "npy"
    """``npy`` (0.22+), ``lists`` (0.21), ``nemo-rl`` or ``ms-swift``."""


def decode_routed(value: Any, where: str) -> Decoded:
    """Any form a ``routed_experts`` field arrives in (see the module docstring)."""
    if isinstance(value, str) and value.startswith(nemo_rl.PREFIX):
        rows, missing = nemo_rl.decode(value, where)
        return Decoded(rows, missing, "nemo-rl")
    if isinstance(value, str):
        return Decoded(decode_npy_base64(value, where))
    if ms_swift.is_envelope(value):
        return Decoded(ms_swift.decode(value, where), form="ms-swift")
    if isinstance(value, list):
        return Decoded(int_array(value, where, "routed_experts", ndim=3), form="lists")
    raise IngestError(
        f"{where}: routed_experts is a {type(value).__name__}; expected a base64 .npy string (vLLM 0.22+), nested "
        "lists (vLLM 0.21), an 'nrlre1:' envelope (NeMo-RL) or an '__ndarray__' object (ms-swift)"
    )


def v021_layers(spec: ModelSpec) -> int:
    """Columns of vLLM 0.21's MoE-only axis: ``_count_moe_layers`` ignores ``first_k_dense_replace``, so
    DeepSeek-style models (dense layers first) get one column per decoder layer, trailing ones zero."""
    dense_first = (
        spec.moe_layers
        and spec.moe_layers[0] > 0
        and list(spec.moe_layers) == list(range(spec.moe_layers[0], spec.num_layers))
    )
    return spec.num_layers if dense_first else spec.num_moe_layers


def _v021_axis(rows: npt.NDArray[np.int64], spec: ModelSpec, where: str) -> npt.NDArray[np.int64]:
    """0.21 rows on the MoE-only axis: trailing columns beyond the model's MoE layers must be zero."""
    layers = rows.shape[1]
    if layers > spec.num_moe_layers and layers in (spec.num_layers, v021_layers(spec)):
        if rows[:, spec.num_moe_layers :].any():
            raise IngestError(
                f"{where}: a vLLM 0.21 payload with {layers} layers must have zeros after the "
                f"{spec.num_moe_layers} MoE layers"
            )
        return rows[:, : spec.num_moe_layers]
    if layers != spec.num_moe_layers and rows.size:
        raise IngestError(
            f"{where}: vLLM 0.21 routing has {layers} layers, model {spec.name!r} has {spec.num_moe_layers} MoE layers"
        )
    return rows


# -- why a choice has no routing ------------------------------------------------------------------------------------
def absent(choice: Mapping[str, Any], engine_version: str | None, where: str) -> RoutingAbsentError:
    """The truthful error for ``routed_experts: null``: aborted, stop string, preempted, or routing not enabled."""
    finish = choice.get("finish_reason")
    stop_reason = choice.get("stop_reason")
    version = parse_version(engine_version)
    v021 = version is not None and (0, 21, 0) <= version < (0, 22, 0)
    if finish == "abort":
        return RoutingAbsentError(
            f"{where}: the request was aborted before vLLM returned its routing (vLLM 0.21 and the in-process "
            "0.14-0.20 return none for aborts, 0.22+ only when aborted before the first step); drop the sample "
            "(routelog ingest --skip-absent skips and counts such samples)",
            "aborted",
        )
    if finish == "stop" and isinstance(stop_reason, str) and (v021 or version is None):
        return RoutingAbsentError(
            f"{where}: the request ended on the stop string {stop_reason!r}, and vLLM 0.21.0 returns no routing for "
            "stop-string finishes (its runner cannot predict them); stop with stop_token_ids instead, or use vLLM "
            "0.22+",
            "stop_string",
        )
    if v021:
        return RoutingAbsentError(
            f"{where}: no routing (finish_reason {finish!r}): vLLM 0.21.0 drops the routing of a request that was "
            "preempted, without any marker; if no request of this server has routing, it was started without "
            "--enable-return-routed-experts",
            "preempted_or_disabled",
        )
    return RoutingAbsentError(
        f"{where}: no routed_experts (finish_reason {finish!r}); start vLLM with --enable-return-routed-experts "
        "(0.22+ then returns routing for every request; 0.21 drops it for preempted requests)",
        "disabled",
    )


# -- HTTP ----------------------------------------------------------------------------------------------------------
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
    """Records from a ``/v1/completions``, ``/v1/chat/completions`` or ``/inference/v1/generate`` response (one
    per choice), any version, plain or in NeMo-RL's / ms-swift's envelopes.

    A choice without routing raises :class:`~routelog.errors.RoutingAbsentError` saying why, or, with
    ``on_absent``, is handed to it and skipped (the other choices are still read).

    Token ids come from the choices (``token_ids``, or NeMo-RL's message fields) and ``prompt_token_ids`` (choice or
    response level, with ``return_token_ids: true``), else from the request's token prompt (``prompt`` of
    completions, ``token_ids`` of generate). The start offset is the request's ``routed_experts_prompt_start``, top
    level or in ``sampling_params``. vLLM 0.21's response-level prompt rows are attached only to choices whose
    prompt tokens are the batch's first prompt's; the prompt rows of any other prompt are missing, never borrowed.
    """
    options = IngestOptions(group_id, policy_version, engine_version, physical_to_logical, eplb)
    request = mapping_field(request, "request", "the request", optional=True)
    response = mapping_field(response, "response", "the response")
    response_id = str(response.get("id") or response.get("request_id") or request.get("request_id") or "unknown")
    with malformed(f"request {response_id}"):
        return _records_from_http(response, request, response_id, spec, sample_ids, options, on_absent)


def _records_from_http(
    response: Mapping[str, Any],
    request: Mapping[str, Any],
    response_id: str,
    spec: ModelSpec,
    sample_ids: Sequence[str] | None,
    options: IngestOptions,
    on_absent: Callable[[RoutingAbsentError], None] | None,
) -> list[Record]:
    where = f"request {response_id}"
    choices = response_choices(response, where)
    start = _prompt_start(request, where)
    per_prompt = int_field(request.get("n"), where, "n", default=1, lo=1)
    request_prompts = _request_prompts(request, where)
    shared_prompt_rows = response.get("prompt_routed_experts")
    prompts = [
        _choice_prompt(c, response, request_prompts, per_prompt, position, where) for position, c in enumerate(choices)
    ]
    table = eplb_table(ENGINE, options, vllm_physical_ids(options.engine_version), where)
    records = []
    for position, choice in enumerate(choices):
        index = int_field(choice.get("index"), where, f"choices[{position}].index", default=position)
        here = f"{where} choice {index}"
        message = mapping_field(choice.get("message"), here, "message", optional=True)
        prompt = prompts[position]
        raw_output = choice.get("token_ids", message.get("generation_token_ids"))
        output = None if raw_output is None else token_ids_field(raw_output, here, "token_ids")
        routed = choice.get("routed_experts", message.get("routed_experts"))
        if "finish_reason" in choice and choice["finish_reason"] is None and routed is None:
            raise IngestError(f"{here}: {_STREAM_CHUNK}")
        if routed is None and not (shared_prompt_rows is not None and output is not None and len(output) == 1):
            error = absent(choice, options.engine_version, here)
            if on_absent is None:
                raise error
            on_absent(error)
            continue
        if prompt is None:
            stream = "request_id" in response and "id" not in response  # generate's chunks carry request_id
            raise IngestError(
                f"{here}: no prompt token ids in the response or the request; "
                + (
                    f"if this line is the final chunk of a streamed generate response: {_STREAM_CHUNK}"
                    if stream
                    else "send 'return_token_ids': true (or a token-id prompt) with the request"
                )
            )
        if routed is None or isinstance(routed, list):  # vLLM 0.21: generation rows, prompt rows apart
            borrowed = prompts[0] is not None and np.array_equal(prompt, prompts[0])
            rows, missing = _v021_rows(shared_prompt_rows if borrowed else None, routed, prompt.shape[0], spec, here)
            decoded = Decoded(rows, missing, "lists")
        else:
            decoded = decode_routed(routed, here)
        response_len = (
            output.shape[0]
            if output is not None
            else decoded.rows.shape[0] + (0 if decoded.form == "nemo-rl" else 1) + start - prompt.shape[0]
        )
        sample_id = sample_ids[position] if sample_ids else _default_sample_id(response_id, index, len(choices))
        records.append(
            payload_to_record(
                Payload(here.removeprefix("request "), decoded.rows, start, decoded.missing),
                spec,
                sample_id=sample_id,
                prompt_len=prompt.shape[0],
                response_len=response_len,
                token_ids=None if output is None else np.concatenate([prompt, output]),
                group_id=options.group_id or response_id,
                policy_version=options.policy_version,
                engine=ENGINE,
                engine_version=options.engine_version,
                physical_to_logical=table,
                weight_versions=weight_version_spans(choice.get("weight_versions"), here),
            )
        )
    return records


_STREAM_CHUNK = (
    "this is a chunk of a streamed response (a complete response has a finish_reason and carries the prompt's "
    "token ids); ingest the whole stream, one file per streamed request, with --stream-request REQUEST.json "
    "(records_from_stream in Python)"
)


def _prompt_start(request: Mapping[str, Any], where: str) -> int:
    """``routed_experts_prompt_start``: a top-level request field (0.28+) or in generate's ``sampling_params``."""
    params = mapping_field(request.get("sampling_params"), where, "sampling_params", optional=True)
    value = request.get("routed_experts_prompt_start", params.get("routed_experts_prompt_start"))
    return int_field(value, where, "routed_experts_prompt_start", default=0)


def _request_prompts(request: Mapping[str, Any], where: str) -> list[npt.NDArray[np.int64]] | None:
    """The request's token prompts: generate's ``token_ids``, or ``prompt`` as one token list or a list of them."""
    if request.get("token_ids") is not None:
        return [token_ids_field(request["token_ids"], where, "token_ids")]
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return [token_ids_field(p, where, f"prompt[{i}]") for i, p in enumerate(prompt)]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return [token_ids_field(prompt, where, "prompt")]
    return None


def _choice_prompt(
    choice: Mapping[str, Any],
    response: Mapping[str, Any],
    request_prompts: list[npt.NDArray[np.int64]] | None,
    per_prompt: int,
    position: int,
    where: str,
) -> npt.NDArray[np.int64] | None:
    message = mapping_field(choice.get("message"), where, "message", optional=True)
    for value in (choice.get("prompt_token_ids"), message.get("prompt_token_ids"), response.get("prompt_token_ids")):
        if value is not None:
            return token_ids_field(value, where, "prompt_token_ids")
    if request_prompts:
        prompt = position // per_prompt
        if prompt < len(request_prompts):
            return request_prompts[prompt]
    return None


def _v021_rows(
    prompt_rows: Any, generated: Any, prompt_len: int, spec: ModelSpec, where: str
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """0.21's rows ``[0, n - 1)``: the response-level prompt rows (None when they are another prompt's) and the
    choice's generation rows, on the MoE-only axis; rows not provided are marked missing."""
    generation = (
        np.zeros((0, spec.num_moe_layers, spec.topk), np.int64)
        if generated is None
        else _v021_axis(int_array(generated, where, "routed_experts", ndim=3), spec, where)
    )
    if prompt_rows is not None:
        prompt = _v021_axis(int_array(prompt_rows, where, "prompt_routed_experts", ndim=3), spec, where)
        if prompt.shape[0] != prompt_len:
            raise IngestError(
                f"{where}: prompt_routed_experts has {prompt.shape[0]} rows for a prompt of {prompt_len} tokens"
            )
        missing = np.zeros(prompt_len, bool)
    else:  # another prompt's rows (vLLM takes them from the batch's first result): the prompt is unrouted
        prompt = np.zeros((prompt_len, spec.num_moe_layers, spec.topk), np.int64)
        missing = np.ones(prompt_len, bool)
    if generation.size and generation.shape[1:] != prompt.shape[1:]:
        raise IngestError(f"{where}: prompt and generation routing have different shapes")
    rows = np.concatenate([prompt, generation.reshape(-1, *prompt.shape[1:])])
    return rows, np.concatenate([missing, np.zeros(generation.shape[0], bool)])


def records_from_stream(
    chunks: Sequence[Mapping[str, Any]],
    spec: ModelSpec,
    *,
    request: Mapping[str, Any] | None = None,
    sample_ids: Sequence[str] | None = None,
    **options: Any,
) -> list[Record]:
    """Records from a streamed ``/inference/v1/generate`` response (0.24+): every chunk, in order. Each choice's
    ``token_ids`` are the deltas of its chunks; its routing is on its final chunk only."""
    if not chunks:
        raise IngestError("a streamed response needs its chunks")
    merged: dict[int, dict[str, Any]] = {}
    response: dict[str, Any] = {}
    for number, raw in enumerate(chunks):
        chunk = mapping_field(raw, f"chunk {number}", "the chunk")
        for key, value in chunk.items():
            if key != "choices" and value is not None:
                response.setdefault(key, value)
        for position, raw_choice in enumerate(list_field(chunk.get("choices") or [], f"chunk {number}", "choices")):
            choice = mapping_field(raw_choice, f"chunk {number}", f"choices[{position}]")
            index = int_field(choice.get("index"), f"chunk {number}", "index", default=position)
            whole = merged.setdefault(index, {"index": index, "token_ids": []})
            whole["token_ids"].extend(token_ids_field(choice.get("token_ids") or [], f"chunk {number}", "token_ids"))
            for key, value in choice.items():
                if key not in ("token_ids", "index") and value is not None:
                    whole[key] = value
    response["choices"] = [merged[i] for i in sorted(merged)]
    return records_from_http(response, spec, request=request, sample_ids=sample_ids, **options)


def _default_sample_id(response_id: str, index: int, n_choices: int) -> str:
    return f"{response_id}/{index}" if n_choices > 1 else response_id


# -- in process ---------------------------------------------------------------------------------------------------
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
    eplb: bool = False,
) -> Record:
    """A record from an in-process ``vllm.RequestOutput`` (``LLM.generate`` / ``AsyncLLM``), any version."""
    request_id = str(request_output.request_id)
    where = f"request {request_id}"
    with malformed(where):
        completion = request_output.outputs[choice]
        prompt_ids = token_ids_field(list(request_output.prompt_token_ids), where, "prompt_token_ids")
        output_ids = token_ids_field(list(completion.token_ids), where, "token_ids")
        routed = getattr(completion, "routed_experts", None)
        prompt_rows = getattr(request_output, "prompt_routed_experts", None)
        if routed is None and prompt_rows is None:
            raise absent(
                {
                    "finish_reason": getattr(completion, "finish_reason", None),
                    "stop_reason": getattr(completion, "stop_reason", None),
                },
                engine_version,
                f"{where} choice {choice}",
            )
        missing = None
        if prompt_rows is not None:  # 0.21: prompt rows on the RequestOutput, generation rows on the choice
            rows, missing = _v021_rows(
                np.asarray(prompt_rows),
                None if routed is None else np.asarray(routed),
                prompt_ids.shape[0],
                spec,
                where,
            )
        else:
            rows = np.asarray(routed)
        options = IngestOptions(group_id, policy_version, engine_version, physical_to_logical, eplb)
        spans = getattr(completion, "weight_versions", None) or []
        return payload_to_record(
            Payload(request_id, rows, prompt_start, missing),
            spec,
            sample_id=sample_id or _default_sample_id(request_id, choice, len(request_output.outputs)),
            prompt_len=prompt_ids.shape[0],
            response_len=output_ids.shape[0],
            token_ids=np.concatenate([prompt_ids, output_ids]),
            group_id=group_id or request_id,
            policy_version=policy_version,
            engine=ENGINE,
            engine_version=engine_version,
            physical_to_logical=eplb_table(ENGINE, options, vllm_physical_ids(engine_version), where),
            weight_versions=[(str(s.version), int(s.start), int(s.end)) for s in spans],
        )


# -- export -------------------------------------------------------------------------------------------------------
def to_array(record: Record, spec: ModelSpec, *, prompt_start: int | None = None) -> npt.NDArray[Any]:
    """The 0.22+ payload for ``record``: ``[n_tokens - 1 - start, num_hidden_layers, K]`` uint8/uint16, zeros in
    dense layers and in rows the engine never computed; ``start`` defaults to the record's ``payload_start``."""
    start = (record.payload_start or 0) if prompt_start is None else prompt_start
    ids = np.asarray(record.expert_ids).astype(spec.id_dtype)
    if record.valid is not None:
        ids[~np.asarray(record.valid)] = 0
    rows = ids[start : record.n_tokens - 1]
    out: npt.NDArray[Any] = to_full_axis(rows, spec, fill=0)
    return out


def to_http_choice(record: Record, spec: ModelSpec, *, prompt_start: int | None = None) -> str:
    """``choices[i].routed_experts`` as vLLM 0.22+ sends it (base64 of a ``.npy`` file)."""
    return encode_npy_base64(to_array(record, spec, prompt_start=prompt_start))


def to_v021(record: Record, spec: ModelSpec) -> tuple[list[Any], list[Any] | None]:
    """vLLM 0.21's ``(prompt_routed_experts, routed_experts)`` nested lists for ``record`` (int16 values on 0.21's
    MoE-only axis, trailing zero layers included; ``None`` generation rows for a one-token output)."""
    ids = np.asarray(record.expert_ids).astype(np.int16)
    if record.valid is not None:
        ids[~np.asarray(record.valid)] = 0
    columns = v021_layers(spec)
    rows = np.zeros((record.n_tokens - 1, columns, spec.topk), np.int16)
    rows[:, : spec.num_moe_layers] = ids[: record.n_tokens - 1]
    prompt, generation = rows[: record.prompt_len], rows[record.prompt_len :]
    return prompt.tolist(), (generation.tolist() if generation.shape[0] else None)
