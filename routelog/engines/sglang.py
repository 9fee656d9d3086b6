"""SGLang: ``meta_info["routed_experts"]`` of ``/generate``, and the OpenAI-compatible endpoints.

Facts by version, as read from each version's own code (``tests/fixtures/engines/FACTS.md``):

* 0.5.7+ ``/generate``: ``meta_info.routed_experts``, base64 of raw little-endian int32 with **no shape header**,
  logically ``[rows, num_hidden_layers, K]`` on the full layer axis (dense layers zero), rows ``[0, n - 1)``
  (radix-cache hits filled). ``routed_experts_start_len`` is declared from 0.5.8 but honoured only from 0.5.12
  (rows ``[start_len, n - 1)``); for an unknown version the row count of the payload decides which happened.
* 0.5.9+ OpenAI ``/v1/completions`` and ``/v1/chat/completions``: response-level ``sglext.routed_experts``, for the
  **first** choice only; the other choices get no routing.
* 0.5.15+ chat with ``return_meta_info``: ``choices[i].meta_info.routed_experts`` per choice, ``prompt_token_ids``
  on the choice (``response_token_ids`` from 0.5.18).
* An abort while running returns the rows computed so far; an abort in the waiting queue has no routing at all.
* With pipeline parallelism SGLang returns only one stage's layers (the others all zero): refused.
* 0.5.23 ``/generate`` with ``return_indexer_topk`` (server ``--enable-return-indexer-topk``): a DSA model's indexer
  selections in ``meta_info.indexer_topk``, the same raw int32 base64, ``[n - 1, num_hidden_layers, index_topk]``:
  every decoder layer has a slot, a layer reusing an earlier layer's selection holds a copy of it, -1 pads; rows
  ``[0, n - 1)`` whatever ``routed_experts_start_len`` says (:func:`indexer_rows`).

Multi-turn sessions request only new rows with ``routed_experts_start_len`` and are stitched with
:class:`routelog.engines.common.TurnStitcher`.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.engines.common import (
    IngestOptions,
    Payload,
    decode_base64,
    eplb_table,
    int_field,
    list_field,
    malformed,
    mapping_field,
    payload_to_record,
    to_full_axis,
    token_ids_field,
    weight_version_spans,
)
from routelog.engines.versions import sglang_honours_start_len
from routelog.errors import IngestError, InvalidRecordError, RoutingAbsentError
from routelog.format.limits import MAX_RECORD_TOKENS
from routelog.format.positions import check_position_rows
from routelog.format.record import Record
from routelog.format.spec import ModelSpec

ENGINE = "sglang"


def decode_int32_base64(text: str, where: str, name: str = "routed_experts") -> npt.NDArray[np.int32]:
    """The flat int32 values of SGLang's encoding (base64 of raw little-endian int32, no header)."""
    raw = decode_base64(text, where, name)
    if len(raw) % 4:
        raise IngestError(f"{where}: {name} has {len(raw)} bytes, not a whole number of int32 values")
    values: npt.NDArray[np.int32] = np.frombuffer(raw, dtype="<i4").astype(np.int32)
    return values


def encode_int32_base64(array: npt.NDArray[Any]) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype="<i4").tobytes()).decode()


def _rows_for(
    routed: str, n_tokens: int, start: int, spec: ModelSpec, engine_version: str | None, where: str
) -> tuple[npt.NDArray[np.int32], int]:
    """Shape the flat values by the row count, and the input position of the first row.

    The layer axis is SGLang's full axis, so the row count follows from the size. It must be ``n - 1 - start``
    (0.5.12+ honour ``routed_experts_start_len``) or ``n - 1`` (0.5.8-0.5.11 ignore it); the version decides when
    known, else the count itself. One surplus row (the final token forwarded after all) is accepted.
    """
    flat = decode_int32_base64(routed, where)
    width = spec.num_layers * spec.topk
    if flat.size % width:
        raise IngestError(
            f"{where}: routed_experts holds {flat.size} values, not a whole number of rows of {spec.num_layers} "
            f"layers x top-{spec.topk} (SGLang's full layer axis); check the model spec"
        )
    n_rows = flat.size // width
    honours = sglang_honours_start_len(engine_version)
    starts = [start] if honours else [0] if honours is False else sorted({start, 0}, reverse=True)
    for first in starts:
        if n_rows in (n_tokens - 1 - first, n_tokens - first):
            return flat.reshape(n_rows, spec.num_layers, spec.topk), first
    ignored = " (SGLang before 0.5.12 ignores routed_experts_start_len)" if start and honours is None else ""
    raise IngestError(
        f"{where}: {n_rows} routing rows, expected {n_tokens - 1 - starts[0]} for {n_tokens} tokens from position "
        f"{starts[0]}{ignored}; check the request's routed_experts_start_len and the model spec"
    )


_NOT_POSITIONS = (
    "these are not key positions within the request; they look like KV-cache slots. SGLang 0.5.23 captures the "
    "indexer's output after its fused top-k transform (the default, SGLANG_DSA_FUSE_TOPK=1), which turns positions "
    "into KV-pool slots (decode) or offsets into the batch's ragged KV (prefill); with SGLANG_DSA_FUSE_TOPK=0 in the "
    "server's environment the indexer returns positions within the request, which is what routelog stores"
)


def _b64_nbytes(text: str) -> int:
    """Bytes a padded base64 string decodes to, from its length alone (-1: not a whole number of quads)."""
    if len(text) % 4:
        return -1
    return len(text) // 4 * 3 - (2 if text.endswith("==") else 1 if text.endswith("=") else 0)


def indexer_rows(
    meta: Mapping[str, Any], spec: ModelSpec, n_rows: int, n_tokens: int, where: str
) -> npt.NDArray[np.int32] | None:
    """``Record.indexer`` from ``meta["indexer_topk"]`` (None when the payload has none): ``n_rows`` SGLang rows (the
    tokens ``[0, n_rows)`` it forwarded) on its every-decoder-layer axis, reduced to the spec's computing layers,
    each row sorted (top-k order is the kernel's), the tokens after them (the last sampled one) missing (-1)."""
    text = meta.get("indexer_topk")
    if text is None:
        return None
    indexer = spec.indexer
    if indexer is None:
        raise IngestError(
            f"{where}: meta_info carries indexer_topk (sparse-attention indexer selections), but model "
            f"{spec.name!r} declares no indexer: declare ModelSpec.indexer (ModelSpec.from_hf_config derives it for "
            "deepseek_v32 and glm_moe_dsa), or stop sending return_indexer_topk"
        )
    if not isinstance(text, str):
        raise IngestError(f"{where}: indexer_topk must be a base64 string, got {type(text).__name__}")
    k = indexer.index_topk
    expected = n_rows * spec.num_layers * k * 4
    size = _b64_nbytes(text)  # checked before anything is decoded or allocated
    if size != expected:
        held = "a base64 string of no whole number of bytes" if size < 0 else f"{size} bytes"
        raise IngestError(
            f"{where}: indexer_topk holds {held}, expected {expected}: {n_rows} rows (the tokens SGLang forwarded) x "
            f"{spec.num_layers} decoder layers (SGLang gives every layer a slot) x index_topk {k} x 4 (int32); check "
            "the model spec's num_layers and indexer.index_topk"
        )
    values = decode_int32_base64(text, where, "indexer_topk").reshape(n_rows, spec.num_layers, k)
    for layer in indexer.shared:  # SGLang mirrors the source's selection into a shared layer's slot
        source = indexer.layers[indexer.source_of(layer)]
        differs = np.any(values[:, layer] != values[:, source], axis=1)
        if differs.any():
            raise IngestError(
                f"{where}: indexer_topk of layer {layer}, which the model spec declares as reusing layer {source}'s "
                f"selection, differs from it at token {int(np.argmax(differs))}: the server's model computes its own "
                "selection there; check the spec's indexer.layers / shared (indexer_types, index_topk_pattern, "
                "index_topk_freq, index_skip_topk_offset of the model's config)"
            )
    rows = np.full((n_tokens, indexer.num_layers, k), -1, np.int32)
    forwarded = rows[:n_rows]
    forwarded[...] = values[:, list(indexer.layers)]
    if k > 1:  # a row of zeros was never written (SGLang's host buffer starts zeroed): not run, as in the routing
        forwarded[~forwarded.any(axis=(1, 2))] = -1
    forwarded.view(np.uint32).sort(axis=-1)  # ascending, -1 (0xFFFFFFFF) last: the kernels' top-k is unordered
    for j, layer in enumerate(indexer.layers):
        try:
            check_position_rows(rows[:, j, :], 0)
        except InvalidRecordError as exc:
            raise IngestError(f"{where}: indexer_topk of layer {layer}, {exc.problem}: {_NOT_POSITIONS}") from None
    return rows


def _with_indexer(record: Record, meta: Mapping[str, Any], spec: ModelSpec, n_rows: int, where: str) -> Record:
    """``record`` with the indexer rows of ``meta`` (itself when it has none)."""
    rows = indexer_rows(meta, spec, n_rows, record.n_tokens, f"{where} (sample {record.sample_id!r})")
    return record if rows is None else dataclasses.replace(record, indexer=rows)


def _absent(finish: Any, where: str, *, first_choice_only: bool = False) -> RoutingAbsentError:
    if first_choice_only:
        return RoutingAbsentError(
            f"{where}: SGLang's OpenAI endpoints return routing for the first choice only (sglext.routed_experts); "
            "request n=1 per prompt, use chat with return_meta_info (0.5.15+), or /generate",
            "first_choice_only",
        )
    finish = finish if isinstance(finish, Mapping) else {}
    if finish.get("type") == "abort":
        return RoutingAbsentError(
            f"{where}: the request was aborted ({finish.get('message')!r}) before SGLang computed routing for it; "
            "drop the sample (routelog ingest --skip-absent skips and counts such samples)",
            "aborted",
        )
    return RoutingAbsentError(
        f"{where}: meta_info has no routed_experts; send return_routed_experts: true to a server started with "
        "--enable-return-routed-experts",
        "disabled",
    )


def _weight_versions(meta: Mapping[str, Any], output_len: int, where: str) -> list[tuple[str, int, int]]:
    """SGLang's ``meta_info.weight_versions`` spans, or its single ``weight_version`` label for the whole output."""
    spans = weight_version_spans(meta.get("weight_versions"), where)
    if not spans and isinstance(meta.get("weight_version"), str) and output_len:
        spans = [(meta["weight_version"], 0, output_len)]
    return spans


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
    eplb: bool = False,
) -> Record:
    """A record from one ``/generate`` response (``output_ids``, ``meta_info``) and its request (``input_ids``).

    For a multi-turn continuation (``routed_experts_start_len > 0``) this record has rows only from the start
    offset; feed the turns to a :class:`~routelog.engines.common.TurnStitcher` instead to get one record.
    """
    request = mapping_field(request, "request", "the request", optional=True)
    response = mapping_field(response, "response", "the response")
    meta = mapping_field(response.get("meta_info"), "response", "meta_info", optional=True)
    request_id = str(meta.get("id") or request.get("rid") or "unknown")
    options = IngestOptions(group_id, policy_version, engine_version, physical_to_logical, eplb)
    with malformed(f"request {request_id}"):
        return _record_from_generate(response, meta, request, request_id, spec, sample_id, options)


def _record_from_generate(
    response: Mapping[str, Any],
    meta: Mapping[str, Any],
    request: Mapping[str, Any],
    request_id: str,
    spec: ModelSpec,
    sample_id: str | None,
    options: IngestOptions,
) -> Record:
    where = f"request {request_id}"
    routed = meta.get("routed_experts")
    if not isinstance(routed, str):  # absent (queued abort, flag off) or [] (0.5.7-0.5.10, no routing)
        raise _absent(meta.get("finish_reason"), where)
    output_ids = token_ids_field(response.get("output_ids") or [], where, "output_ids")
    raw_inputs = request.get("input_ids")
    input_ids = None if raw_inputs is None else token_ids_field(raw_inputs, where, "input_ids")
    if input_ids is not None:
        prompt_len = input_ids.shape[0]
    elif meta.get("prompt_tokens") is not None:
        prompt_len = int_field(meta["prompt_tokens"], where, "meta_info.prompt_tokens", hi=MAX_RECORD_TOKENS)
    else:
        raise IngestError(f"{where}: neither the request's input_ids nor meta_info.prompt_tokens give the prompt")
    requested = int_field(request.get("routed_experts_start_len"), where, "routed_experts_start_len", default=0)
    n_tokens = prompt_len + output_ids.shape[0]
    rows, start = _rows_for(routed, n_tokens, requested, spec, options.engine_version, where)
    record = payload_to_record(
        Payload(request_id, rows, start),
        spec,
        sample_id=sample_id or request_id,
        prompt_len=prompt_len,
        response_len=output_ids.shape[0],
        token_ids=None if input_ids is None else np.concatenate([input_ids, output_ids]),
        group_id=options.group_id,
        policy_version=options.policy_version,
        engine=ENGINE,
        engine_version=options.engine_version,
        physical_to_logical=eplb_table(ENGINE, options, False, where),
        weight_versions=_weight_versions(meta, output_ids.shape[0], where),
    )
    return _with_indexer(record, meta, spec, start + rows.shape[0], where)  # indexer rows ignore the start


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
    eplb: bool = False,
    on_absent: Callable[[RoutingAbsentError], None] | None = None,
) -> list[Record]:
    """Records from a ``/generate`` response (one object, or a list for a batched request) or an OpenAI-style
    response (``sglext.routed_experts`` for the first choice, or ``choices[i].meta_info`` with
    ``return_meta_info``). A sample without routing raises :class:`~routelog.errors.RoutingAbsentError` saying why,
    or, with ``on_absent``, is handed to it and skipped."""
    options = IngestOptions(group_id, policy_version, engine_version, physical_to_logical, eplb)
    request = mapping_field(request, "request", "the request", optional=True)
    if isinstance(response, Mapping) and "choices" in response:
        with malformed(f"request {response.get('id') or 'unknown'}"):
            return _records_from_openai(response, spec, request, sample_ids, options, on_absent)
    if not isinstance(response, (Mapping, list)):
        raise IngestError(f"response: expected a JSON object or a list of them, got {type(response).__name__}")
    responses = [response] if isinstance(response, Mapping) else list(response)
    inputs = request.get("input_ids")
    batched = isinstance(inputs, list) and bool(inputs) and isinstance(inputs[0], list)
    records = []
    with malformed("request"):
        for i, item in enumerate(responses):
            sub_request = dict(request)
            if batched and inputs is not None:
                sub_request["input_ids"] = inputs[i]
            sid = sample_ids[i] if sample_ids else None
            try:
                record = record_from_generate(
                    item,
                    spec,
                    request=sub_request,
                    sample_id=sid,
                    group_id=options.group_id,
                    policy_version=options.policy_version,
                    engine_version=options.engine_version,
                    physical_to_logical=options.physical_to_logical,
                    eplb=options.eplb,
                )
            except RoutingAbsentError as error:
                if on_absent is None:
                    raise
                on_absent(error)
                continue
            records.append(record)
    return records


def _records_from_openai(
    response: Mapping[str, Any],
    spec: ModelSpec,
    request: Mapping[str, Any],
    sample_ids: Sequence[str] | None,
    options: IngestOptions,
    on_absent: Callable[[RoutingAbsentError], None] | None,
) -> list[Record]:
    response_id = str(response.get("id") or "unknown")
    where = f"request {response_id}"
    choices = [
        mapping_field(c, where, f"choices[{i}]")
        for i, c in enumerate(list_field(response["choices"], where, "choices"))
    ]
    extra_body = mapping_field(request.get("extra_body"), where, "extra_body", optional=True)
    requested = int_field(
        request.get("routed_experts_start_len", extra_body.get("routed_experts_start_len")),
        where,
        "routed_experts_start_len",
        default=0,
    )
    shared = mapping_field(response.get("sglext"), where, "sglext", optional=True).get("routed_experts")
    raw_request_prompt = request.get("prompt", request.get("input_ids"))
    records = []
    for position, choice in enumerate(choices):
        index = int_field(choice.get("index"), where, f"choices[{position}].index", default=position)
        here = f"{where} choice {index}"
        meta = mapping_field(choice.get("meta_info"), here, "meta_info", optional=True)
        routed = meta.get("routed_experts", shared if position == 0 else None)
        if not isinstance(routed, str):
            error = _absent(meta.get("finish_reason"), here, first_choice_only=shared is not None and not meta)
            if on_absent is None:
                raise error
            on_absent(error)
            continue
        raw_prompt = choice.get("prompt_token_ids", response.get("prompt_token_ids"))
        if raw_prompt is None and isinstance(raw_request_prompt, list):
            raw_prompt = raw_request_prompt
        if raw_prompt is None:
            raise IngestError(f"{here}: no prompt token ids in the response or the request (send return_token_ids)")
        prompt = token_ids_field(raw_prompt, here, "prompt_token_ids")
        raw_output = choice.get("response_token_ids", choice.get("token_ids", choice.get("output_ids")))
        output = None if raw_output is None else token_ids_field(raw_output, here, "response_token_ids")
        if output is None:  # 0.5.9-0.5.17: no output ids; the row count gives the length (rows [start, n - 1))
            width = spec.num_layers * spec.topk
            n_rows = len(decode_int32_base64(routed, here)) // width
            first = requested if sglang_honours_start_len(options.engine_version) else 0
            n_tokens = n_rows + 1 + first
        else:
            n_tokens = prompt.shape[0] + output.shape[0]
        rows, start = _rows_for(routed, n_tokens, requested, spec, options.engine_version, here)
        sid = sample_ids[position] if sample_ids else (f"{response_id}/{index}" if len(choices) > 1 else response_id)
        record = payload_to_record(
            Payload(here.removeprefix("request "), rows, start),
            spec,
            sample_id=sid,
            prompt_len=prompt.shape[0],
            response_len=n_tokens - prompt.shape[0],
            token_ids=None if output is None else np.concatenate([prompt, output]),
            group_id=options.group_id or response_id,
            policy_version=options.policy_version,
            engine=ENGINE,
            engine_version=options.engine_version,
            physical_to_logical=eplb_table(ENGINE, options, False, here),
            weight_versions=_weight_versions(meta, n_tokens - prompt.shape[0], here),
        )
        records.append(_with_indexer(record, meta, spec, start + rows.shape[0], here))
    return records


def to_array(record: Record, spec: ModelSpec, *, start_len: int | None = None) -> npt.NDArray[np.int32]:
    """SGLang's rows for ``record``: int32 ``[n_tokens - 1 - start_len, num_hidden_layers, K]`` on the full axis
    (``start_len`` defaults to the record's ``payload_start``), zeros in dense layers and never-computed rows."""
    start = (record.payload_start or 0) if start_len is None else start_len
    ids = np.asarray(record.expert_ids).astype(np.int32)
    if record.valid is not None:
        ids[~np.asarray(record.valid)] = 0
    rows: npt.NDArray[np.int32] = to_full_axis(ids[start : record.n_tokens - 1], spec, fill=0)
    return rows


def to_meta_info(record: Record, spec: ModelSpec, *, start_len: int | None = None) -> str:
    """``meta_info["routed_experts"]`` as SGLang sends it: :func:`to_array` as flat base64 int32, no header."""
    return encode_int32_base64(to_array(record, spec, start_len=start_len))


def to_indexer_meta_info(record: Record, spec: ModelSpec) -> str | None:
    """``meta_info["indexer_topk"]`` as SGLang 0.5.23 sends it for ``record`` (None when it has no indexer rows):
    rows ``[0, n - 1)``, a slot per decoder layer, each shared layer a copy of its source's, 0 in a layer without
    an indexer (SGLang's zeroed buffer), -1 padding; :func:`indexer_rows` reads it back to the same rows."""
    if record.indexer is None:
        return None
    indexer = spec.indexer
    if indexer is None:
        raise IngestError(f"sample {record.sample_id!r} has indexer rows, but model {spec.name!r} declares no indexer")
    rows = np.asarray(record.indexer)[: record.n_tokens - 1]
    out = np.zeros((rows.shape[0], spec.num_layers, indexer.index_topk), np.int32)
    slots = sorted((*indexer.layers, *indexer.shared))
    out[:, slots] = rows[:, [indexer.source_of(layer) for layer in slots]]
    return encode_int32_base64(out)
