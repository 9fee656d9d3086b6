"""A record: the routing of one rollout sequence, and its validation against a model spec."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.errors import InvalidRecordError
from routelog.format.codec import (
    IdArray,
    RowProblem,
    TopkOrder,
    layer_major,
    sort_by_layer,
    storage_dtype,
)
from routelog.format.documents import MAX_NAME_CHARS, IndexRow, Segment, Span, StreamSpans, load_json
from routelog.format.limits import MAX_RECORD_TOKENS
from routelog.format.positions import encode_positions
from routelog.format.spec import ModelSpec, StreamSpec
from routelog.format.values import FloatArray, check_token_values
from routelog.format.weights import WeightsDtype, to_storage

TOKEN_HASH_PREFIX = "blake2b-128:"
_TOKEN_HASH = re.compile(r"blake2b-128:[0-9a-f]{32}")
MAX_TOKEN_ID = 2**31 - 1
"""Token ids are stored as int32 in the index."""


def token_hash(token_ids: npt.ArrayLike) -> str:
    """The format's token hash: BLAKE2b with a 16-byte digest over the ids as little-endian int64."""
    ids = np.ascontiguousarray(np.asarray(token_ids), dtype="<i8")
    return TOKEN_HASH_PREFIX + hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest()


@dataclass
class StreamRows:
    """One record's rows of an extra routing stream: ``expert_ids`` ``[n_tokens, stream layers, stream topk]``
    and, optionally, which rows were computed (default: all)."""

    expert_ids: npt.ArrayLike
    valid: npt.ArrayLike | None = None


@dataclass
class Record:
    """The routing of one sequence (prompt and response tokens together) plus its metadata.

    ``expert_ids`` is ``[n_tokens, n_moe_layers, topk]`` of logical expert IDs on the MoE-only layer axis; row
    ``t`` is the routing computed when input position ``t`` was fed. Rows the engine never computed (the final
    sampled token, never-prefilled tokens) are marked ``False`` in ``valid``; their values are ignored and never
    stored.
    """

    sample_id: str
    expert_ids: npt.NDArray[np.integer[Any]]
    prompt_len: int
    response_len: int
    valid: npt.NDArray[np.bool_] | None = None
    token_ids: npt.ArrayLike | None = None
    token_hash: str | None = None
    group_id: str | None = None
    policy_version: int | None = None
    engine: str | None = None
    engine_version: str | None = None
    segments: Sequence[Segment] = ()
    extra: Mapping[str, Any] | None = None
    token_values: Mapping[str, npt.ArrayLike] | None = None
    """Per-token float columns, each ``[n_tokens]`` (NaN = no value), e.g. ``{"logprob_infer": ...}`` with the
    sampled tokens' log-probs; see :mod:`routelog.format.values`."""
    streams: Mapping[str, StreamRows] | None = None
    """Extra routing streams the store's model spec declares (e.g. ``mtp``), stored apart from the decoder's."""
    payload_start: int | None = None
    """Input position of the engine's first routing row (vLLM ``routed_experts_prompt_start``, SGLang
    ``routed_experts_start_len``), kept so an export reproduces the engine's payload."""
    weights: npt.ArrayLike | None = None
    """Optional routing weights ``[n_tokens, n_moe_layers, topk]`` (float; pass ``tensor.float().numpy()`` for a
    bf16 tensor): slot ``j`` weighs expert ``expert_ids[..., j]``. Stored in the part's ``weights_dtype`` beside
    the IDs (see :mod:`routelog.format.weights`); rows not in ``valid`` are ignored."""
    indexer: npt.ArrayLike | None = None
    """A DSA model's indexer selections ``[n_tokens, indexer layers, index_topk]`` (integers; the model spec's
    ``indexer``): row ``t`` of a layer holds the ``min(index_topk, t + 1)`` key positions the query at position
    ``t`` attends to, ascending, then -1; a token the engine did not run is a row of -1 (see
    :mod:`routelog.format.positions`)."""

    @property
    def n_tokens(self) -> int:
        return self.prompt_len + self.response_len


@dataclass
class PreparedRecord:
    """A validated record in stored form: the index row (spans relative to the record) and its stored rows."""

    row: IndexRow
    rows: IdArray
    """``[n_moe_layers, n_valid_rows, topk]`` (layer-major) in stored form (ascending sets when sorted)."""
    values: dict[str, FloatArray] = field(default_factory=dict)
    """Validated per-token columns (float32, ``[n_tokens]``)."""
    streams: dict[str, IdArray] = field(default_factory=dict)
    """Stored rows of each extra stream, ``[stream layers, n_valid_rows, stream topk]`` (spans in ``row``)."""
    raw_nbytes: int = field(default=0)
    """Size of the valid rows at one byte/two bytes per ID, the 'raw-equivalent' measure of throughput."""
    weights: npt.NDArray[Any] | None = None
    """Stored-form routing weights ``[n_moe_layers, n_valid_rows, topk]`` aligned with :attr:`rows`, or None."""
    indexer: list[bytes] = field(default_factory=list)
    """The record's indexer rows coded, one positions block per indexer layer (empty without them)."""
    released: bool = False
    """Its routing rows were handed to a part being built and are no longer held here (:meth:`release_routing`)."""

    def release_routing(self) -> None:
        """Let go of this record's routing rows: the part being built holds the only reference, and frees them as
        they are encoded."""
        self.rows = np.empty((self.rows.shape[0], 0, self.rows.shape[2]), self.rows.dtype)  # no view: frees them
        self.released = True

    def release(self) -> None:
        """Let go of everything a built part holds (routing, weights, streams, values): a writer keeps only what
        it reports on."""
        self.release_routing()
        self.weights = None
        self.streams = {}
        self.values = {}
        self.indexer = []


def prepare_record(
    record: Record, spec: ModelSpec, step: int, topk_order: TopkOrder, weights_dtype: WeightsDtype = "bfloat16"
) -> PreparedRecord:
    """Validate ``record`` against ``spec`` and convert it to stored form; raise :class:`InvalidRecordError`.

    Everything the part's index and values objects will hold is checked here, on the caller's thread, so a bad
    record is refused by ``append`` and can never fail the part it would have shared with good records.
    """
    sid = record.sample_id
    if not isinstance(sid, str) or not sid or not _is_text(sid):
        raise InvalidRecordError(
            None,
            "sample_id",
            f"must be a non-empty string of valid Unicode up to {MAX_NAME_CHARS} characters, got {sid!r}",
            "give every record a unique string id (e.g. '<request-id>/<choice>')",
        )
    for name in ("group_id", "engine", "engine_version"):
        value = getattr(record, name)
        if value is not None and (not isinstance(value, str) or not _is_text(value)):
            raise InvalidRecordError(
                sid,
                name,
                f"must be a string of valid Unicode up to {MAX_NAME_CHARS} characters or None, got {value!r}",
                "pass a plain string",
            )
    if record.policy_version is not None and not _is_int64(record.policy_version):
        raise InvalidRecordError(
            sid,
            "policy_version",
            f"must be an integer or None, got {record.policy_version!r}",
            "pass the weight version as an int",
        )
    n = _check_lengths(record)
    valid = _check_valid(sid, "valid", record.valid, n)
    digest = _check_tokens(record, n)
    segments = _check_segments(record, n)
    extra = _check_extra(record)
    values = check_token_values(record.token_values, n, sid)
    main = _Axis("expert_ids", spec.num_moe_layers, spec.num_experts, spec.topk, spec.moe_layers, spec)
    stored, spans = _stored_rows(sid, record.expert_ids, valid, main, n, topk_order)
    weights = None
    if record.weights is not None:
        weights = to_storage(_stored_weights(record, valid, main, n, topk_order), weights_dtype)
    streams: dict[str, IdArray] = {}
    stream_spans: list[StreamSpans] = []
    for name, (declared, given) in _check_streams(record, spec).items():
        axis = _Axis(f"streams[{name!r}].expert_ids", declared.num_layers, declared.universe, declared.topk, None, spec)
        stream_valid = _check_valid(sid, f"streams[{name!r}].valid", given.valid, n)
        streams[name], spans_of_stream = _stored_rows(sid, given.expert_ids, stream_valid, axis, n, topk_order)
        stream_spans.append(StreamSpans(name=name, spans=spans_of_stream))
    row = IndexRow(
        sample_id=sid,
        step=step,
        group_id=record.group_id,
        policy_version=record.policy_version,
        engine=record.engine,
        engine_version=record.engine_version,
        prompt_len=record.prompt_len,
        response_len=record.response_len,
        n_tokens=n,
        token_hash=digest,
        token_ids=None if record.token_ids is None else np.asarray(record.token_ids).tolist(),  # ints: checked
        spans=spans,
        segments=segments,
        extra=extra,
        streams=stream_spans or None,
        payload_start=_check_payload_start(record, n),
    )
    indexer = _indexer_blocks(record, spec, n)
    raw = stored.nbytes + sum(rows.nbytes for rows in streams.values())
    return PreparedRecord(
        row=row, rows=stored, values=values, streams=streams, raw_nbytes=raw, weights=weights, indexer=indexer
    )


def _indexer_blocks(record: Record, spec: ModelSpec, n: int) -> list[bytes]:
    """The record's indexer rows checked against the spec's indexer and coded, a block per layer."""
    if record.indexer is None:
        return []
    sid, declared = record.sample_id, spec.indexer
    if declared is None:
        raise InvalidRecordError(
            sid,
            "indexer",
            f"model {spec.name!r} declares no sparse-attention indexer",
            "declare it in the model spec (ModelSpec.indexer; from_hf_config does for deepseek_v32 and glm_moe_dsa)",
        )
    rows = np.asarray(record.indexer)
    shape = (n, declared.num_layers, declared.index_topk)
    if rows.shape != shape or not np.issubdtype(rows.dtype, np.integer):
        raise InvalidRecordError(
            sid,
            "indexer",
            f"is {rows.dtype} of shape {rows.shape}, expected integers of shape {shape} "
            "[n_tokens, indexer layers, index_topk]",
            "pass the selected key positions of every token and indexer layer, -1 padded",
        )
    blocks = []
    for j, layer in enumerate(declared.layers):
        try:
            blocks.append(encode_positions(np.ascontiguousarray(rows[:, j, :]), 0))
        except InvalidRecordError as exc:
            raise InvalidRecordError(sid, f"indexer[:, {j}] (layer {layer})", exc.problem, exc.fix) from None
    return blocks


@dataclass(frozen=True)
class _Axis:
    """The routing a record's array must hold: the decoder's MoE layers, or an extra stream's."""

    field: str
    num_layers: int
    universe: int
    topk: int
    layer_names: Sequence[int] | None
    """Global layer numbers for messages (the stream's own positions when None)."""
    spec: ModelSpec

    def layer(self, position: int) -> int:
        return position if self.layer_names is None else self.layer_names[position]


def _stored_rows(
    sid: str, given: npt.ArrayLike, valid: npt.NDArray[np.bool_], axis: _Axis, n: int, topk_order: TopkOrder
) -> tuple[IdArray, list[Span]]:
    """Validate one routing array and convert its computed rows to stored form (layer-major; sorted sets unless
    the engine's order is kept)."""
    ids = _check_ids_shape(sid, given, axis, n)
    starts, stops = _runs(valid)
    chosen = ids if len(starts) == 1 and stops[0] - starts[0] == n else ids[valid]
    # Stored layer-major: [layers, n_valid_rows, topk]; sorting also checks every row (range, repeats).
    sorted_rows, problem = sort_by_layer(chosen, axis.universe)
    if problem is not None:  # rows of `chosen` in token order
        token, layer_pos = divmod(problem.row, axis.num_layers)
        _raise_row_problem(sid, axis, problem, int(np.flatnonzero(valid)[token]), axis.layer(layer_pos))
    # Sorted sets are stored as IDs: the part's chunk codec (routelog.format.ranked) transforms them.
    stored = (
        sorted_rows if topk_order == "sorted" else layer_major(chosen.astype(storage_dtype(axis.universe), copy=False))
    )
    spans = []
    offset = 0
    for start, stop in zip(starts, stops, strict=True):
        spans.append(Span(token_start=start, n_rows=stop - start, row=offset))
        offset += stop - start
    return stored, spans


def _stored_weights(
    record: Record, valid: npt.NDArray[np.bool_], axis: _Axis, n: int, topk_order: TopkOrder
) -> npt.NDArray[np.float32]:
    """The weights of the computed rows, layer-major and in the slot order of the stored IDs (each weight follows
    its expert when the sets are sorted); the IDs were validated already."""
    sid = record.sample_id
    try:
        given = np.asarray(record.weights)
    except (ValueError, TypeError) as exc:
        raise InvalidRecordError(sid, "weights", f"is not a regular array ({exc})", "pass a float array") from None
    shape = (n, axis.num_layers, axis.topk)
    if given.shape != shape or given.dtype.kind not in "fiu":
        raise InvalidRecordError(
            sid,
            "weights",
            f"has shape {given.shape} and dtype {given.dtype}, expected a float array of shape {shape} like expert_ids",
            "pass the chosen experts' gate weights, one per expert ID (tensor.float().numpy() for bf16 tensors)",
        )
    weights = given[valid].astype(np.float32)
    if not np.isfinite(weights).all():
        token, layer_pos, _ = np.argwhere(~np.isfinite(weights))[0]
        raise InvalidRecordError(
            sid,
            "weights",
            f"token {int(np.flatnonzero(valid)[token])}, layer {axis.layer(int(layer_pos))} holds a non-finite weight",
            "store the gate's finite weights; mark rows the engine never computed invalid instead",
        )
    by_layer = np.ascontiguousarray(weights.transpose(1, 0, 2))
    if topk_order == "sorted":
        ids = np.asarray(record.expert_ids)[valid].transpose(1, 0, 2)
        by_layer = np.take_along_axis(by_layer, np.argsort(ids, axis=2, kind="stable"), axis=2)
    return by_layer


def _check_payload_start(record: Record, n: int) -> int | None:
    start = record.payload_start
    if start is not None and (not _is_int64(start) or not 0 <= int(start) <= n):
        raise InvalidRecordError(
            record.sample_id,
            "payload_start",
            f"must be an int in [0, {n}] or None, got {start!r}",
            "pass the engine's routed_experts_prompt_start / routed_experts_start_len",
        )
    return None if start is None else int(start)


def _check_streams(record: Record, spec: ModelSpec) -> dict[str, tuple[StreamSpec, StreamRows]]:
    given = record.streams or {}
    if not isinstance(given, Mapping):
        raise InvalidRecordError(
            record.sample_id,
            "streams",
            f"must be a mapping of stream name to StreamRows, got {type(given).__name__}",
            "pass {'mtp': routelog.StreamRows(expert_ids=...)}",
        )
    out = {}
    for name, rows in given.items():
        declared = spec.stream(name) if isinstance(name, str) else None
        if declared is None:
            raise InvalidRecordError(
                record.sample_id,
                f"streams[{name!r}]",
                f"is not a stream of model {spec.name!r} (it declares {[s.name for s in spec.streams]})",
                "declare the stream in the model spec (ModelSpec.streams, or with_mtp_stream() for MTP layers)",
            )
        if not isinstance(rows, StreamRows):
            raise InvalidRecordError(
                record.sample_id,
                f"streams[{name!r}]",
                f"is a {type(rows).__name__}, not StreamRows",
                "wrap the stream's expert ids in routelog.StreamRows",
            )
        out[name] = (declared, rows)
    return out


def _raise_row_problem(sid: str, axis: _Axis, problem: RowProblem, token: int, layer: int) -> None:
    where = f"token {token}, layer {layer}"
    if problem.kind == "duplicate":
        raise InvalidRecordError(
            sid,
            axis.field,
            f"{where} repeats an expert: {list(problem.values)}",
            "a top-k row must name k distinct experts; fix the capture or mark the row invalid instead of padding it",
        )
    raise InvalidRecordError(
        sid,
        axis.field,
        f"{where} has IDs {list(problem.values)} outside [0, num_experts={axis.universe})",
        "store logical expert IDs (convert physical EPLB IDs first) and check the spec",
    )


def _is_text(value: str) -> bool:
    """At most MAX_NAME_CHARS characters that encode as UTF-8 (no lone surrogates)."""
    if len(value) > MAX_NAME_CHARS:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int64(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and -(2**63) <= int(value) < 2**63


def _check_lengths(record: Record) -> int:
    for name in ("prompt_len", "response_len"):
        value = getattr(record, name)
        if not _is_int64(value) or value < 0:
            raise InvalidRecordError(
                record.sample_id, name, f"must be a non-negative int, got {value!r}", "pass token counts"
            )
    n = int(record.prompt_len) + int(record.response_len)
    if n > MAX_RECORD_TOKENS:
        raise InvalidRecordError(
            record.sample_id,
            "prompt_len",
            f"prompt_len + response_len = {n} exceeds the format's limit of {MAX_RECORD_TOKENS} tokens per record",
            "split the sequence into several records",
        )
    return n


def _check_ids_shape(sid: str, given: npt.ArrayLike, axis: _Axis, n: int) -> npt.NDArray[np.integer[Any]]:
    field, spec = axis.field, axis.spec
    try:
        ids = np.asarray(given)
    except (ValueError, TypeError) as exc:
        raise InvalidRecordError(
            sid, field, f"is not a regular array ({exc})", "pass a [tokens, layers, k] array"
        ) from None
    if ids.dtype.kind not in "iu":
        raise InvalidRecordError(
            sid,
            field,
            f"has dtype {ids.dtype}, expected an integer dtype",
            "pass integer expert IDs (uint8/uint16/int16/int32/int64)",
        )
    if ids.ndim != 3:
        raise InvalidRecordError(
            sid,
            field,
            f"has shape {ids.shape}, expected 3 axes [n_tokens, layers, topk]",
            "reshape the engine payload with the model spec (routelog.engines does this per engine)",
        )
    tokens, layers, k = ids.shape
    if layers != axis.num_layers:
        hint = (
            f"the payload has the full layer axis ({spec.num_layers} layers); keep only the MoE layers "
            f"with routelog.engines.to_moe_axis"
            if layers == spec.num_layers and axis.layer_names is not None
            else f"check the model spec: it has {axis.num_layers} layers here"
            + (f", the MoE layers {list(axis.layer_names)}" if axis.layer_names is not None else "")
        )
        raise InvalidRecordError(
            sid, field, f"has {layers} layers on axis 1, the model spec has {axis.num_layers} MoE layers", hint
        )
    if k != axis.topk:
        raise InvalidRecordError(
            sid,
            field,
            f"has top-k {k} on axis 2, the model spec says {axis.topk}",
            "use the spec of the model that generated the routing",
        )
    if tokens != n:
        raise InvalidRecordError(
            sid,
            field,
            f"has {tokens} rows, but prompt_len + response_len = {n}",
            "give one row per input position and mark rows the engine never computed "
            "(e.g. the final sampled token) with valid=False",
        )
    if np.iinfo(ids.dtype).max < axis.universe - 1:
        raise InvalidRecordError(
            sid,
            field,
            f"dtype {ids.dtype} cannot hold expert IDs up to {axis.universe - 1}, so values were likely truncated "
            "upstream",
            "capture the IDs in a wider dtype (uint16 or int32)",
        )
    return ids


def _check_valid(sid: str, field: str, given: npt.ArrayLike | None, n: int) -> npt.NDArray[np.bool_]:
    if given is None:
        return np.ones(n, dtype=bool)
    valid = np.asarray(given)
    if valid.dtype != np.bool_ or valid.shape != (n,):
        raise InvalidRecordError(
            sid,
            field,
            f"has dtype {valid.dtype} and shape {valid.shape}, expected bool of shape ({n},)",
            "pass one bool per token row",
        )
    return valid


def _check_tokens(record: Record, n: int) -> str | None:
    sid = record.sample_id
    digest = record.token_hash
    if record.token_ids is not None:
        try:
            tokens = np.asarray(record.token_ids)
        except (ValueError, TypeError, OverflowError) as exc:  # ragged nested lists
            raise InvalidRecordError(
                sid, "token_ids", f"is not a flat list of ids ({exc})", "pass one id per token"
            ) from None
        if tokens.ndim != 1 or tokens.shape[0] != n or tokens.dtype.kind not in "iu":
            raise InvalidRecordError(
                sid,
                "token_ids",
                f"has shape {tokens.shape} and dtype {tokens.dtype}, expected {n} integer ids",
                "pass the prompt and response token ids",
            )
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > MAX_TOKEN_ID):
            raise InvalidRecordError(
                sid,
                "token_ids",
                f"has ids outside [0, {MAX_TOKEN_ID}] (min {int(tokens.min())}, max {int(tokens.max())})",
                "pass the tokenizer's ids; the index stores them as int32",
            )
        computed = token_hash(tokens)
        if digest is not None and digest != computed:
            raise InvalidRecordError(
                sid,
                "token_hash",
                f"{digest} does not match the token ids ({computed})",
                "omit token_hash to have it computed, or hash with routelog.token_hash",
            )
        digest = computed
    if digest is not None and (not isinstance(digest, str) or not _TOKEN_HASH.fullmatch(digest)):
        raise InvalidRecordError(
            sid,
            "token_hash",
            f"{digest!r} is not a {TOKEN_HASH_PREFIX} digest (32 lowercase hex digits)",
            "compute it with routelog.token_hash(token_ids)",
        )
    return digest


def _check_segments(record: Record, n: int) -> list[Segment]:
    given = record.segments
    if isinstance(given, (str, bytes, Mapping)) or not isinstance(given, Sequence):
        raise InvalidRecordError(
            record.sample_id,
            "segments",
            f"must be a list of Segment, got {type(given).__name__}",
            "pass routelog.Segment objects (or dicts with start, end, policy_version, source)",
        )
    segments = []
    for i, seg in enumerate(given):
        try:
            segments.append(seg if isinstance(seg, Segment) else Segment.model_validate(seg))
        except ValueError as exc:
            raise InvalidRecordError(
                record.sample_id,
                f"segments[{i}]",
                f"is not a segment ({exc.__class__.__name__}: {exc})".split("\n")[0],
                "pass routelog.Segment(start=..., end=..., policy_version=..., source=...)",
            ) from None
        if segments[-1].source is not None and not _is_text(segments[-1].source):
            raise InvalidRecordError(record.sample_id, f"segments[{i}].source", "is not valid Unicode", "pass text")
    segments = segments or [Segment(start=0, end=n, policy_version=record.policy_version)]
    previous_end = 0
    for i, seg in enumerate(segments):
        if not (previous_end <= seg.start <= seg.end <= n):
            raise InvalidRecordError(
                record.sample_id,
                f"segments[{i}]",
                f"[{seg.start}, {seg.end}) is out of order or outside [0, {n})",
                "give ascending, non-overlapping segments",
            )
        previous_end = seg.end
    return segments


def _check_extra(record: Record) -> str | None:
    if record.extra is None:
        return None
    if not isinstance(record.extra, Mapping):
        raise InvalidRecordError(
            record.sample_id, "extra", f"must be a mapping, got {type(record.extra).__name__}", "pass a dict"
        )
    try:
        text = json.dumps(dict(record.extra), sort_keys=True, allow_nan=False)
        load_json(text, "extra")  # bounded nesting, as every reader will parse it
        return text
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidRecordError(
            record.sample_id,
            "extra",
            f"is not JSON-serialisable ({exc})",
            "keep extra to strings, numbers, lists and dicts",
        ) from exc


def _runs(valid: npt.NDArray[np.bool_]) -> tuple[list[int], list[int]]:
    """Start/stop positions of the runs of True in ``valid``."""
    if valid.all():  # the common case, without the passes below
        return ([0], [int(valid.size)]) if valid.size else ([], [])
    padded = np.concatenate(([False], valid, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return [int(v) for v in edges[0::2]], [int(v) for v in edges[1::2]]
