"""What every engine adapter shares: layer axes, EPLB tables, missing rows, and turning a payload into a record.

Rules (see ``docs`` in ``schemas/FORMAT.md`` and the engine notes in each module):

* The layer axis of a payload is decided from the model spec and the payload's shape, never from its values: the
  full decoder axis (``num_layers``; dense layers present, usually as zeros) or the MoE-only axis.
* Engines never forward the final sampled token, so a payload has ``n_tokens - 1 - start`` rows; one more (the
  final token was forwarded after all) is accepted as a valid row.
* A row of zeros in every slot is a route the engine never captured (expert 0 chosen K times is not a top-k set):
  it becomes a missing row, never a stored route. A MoE layer that is zero for every token is a capture bug
  (SGLang with pipeline parallelism does not merge stage captures) and is rejected.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from routelog.engines.versions import physical_id_note
from routelog.errors import IngestError
from routelog.format.documents import IdSpace, Segment
from routelog.format.limits import MAX_RECORD_TOKENS
from routelog.format.record import MAX_TOKEN_ID, Record, token_hash
from routelog.format.spec import ModelSpec

LayerAxis = Literal["full", "moe"]

MAX_PAYLOAD_BYTES = 4 << 30
"""Decoded bytes of one routing payload (an array header claiming more is refused before anything is allocated)."""


# -- payload fields, checked as they are read -------------------------------------------------------------------
@contextmanager
def malformed(where: str) -> Iterator[None]:
    """Turn the raw errors a malformed payload can still provoke into :class:`IngestError` naming ``where``.

    Adapters check the fields they read explicitly; this is the net under those checks, so no payload, however
    broken, surfaces as a bare ``TypeError`` or ``IndexError``.
    """
    try:
        yield
    except IngestError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError, RecursionError) as exc:
        raise IngestError(f"{where}: malformed payload ({type(exc).__name__}: {exc})") from exc


def mapping_field(value: Any, where: str, name: str, *, optional: bool = False) -> Mapping[str, Any]:
    """A JSON object field (``{}`` when absent and ``optional``)."""
    if value is None and optional:
        return {}
    if not isinstance(value, Mapping):
        raise IngestError(f"{where}: {name} must be a JSON object, got {type(value).__name__}")
    return value


def list_field(value: Any, where: str, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise IngestError(f"{where}: {name} must be a JSON list, got {type(value).__name__}")
    return value


def response_choices(response: Mapping[str, Any], where: str) -> list[Mapping[str, Any]]:
    """An OpenAI-style response's ``choices``, each a JSON object; at least one."""
    choices = [
        mapping_field(c, where, f"choices[{i}]")
        for i, c in enumerate(list_field(response.get("choices"), where, "choices"))
    ]
    if not choices:
        raise IngestError(f"{where}: the response has no choices")
    return choices


def int_field(
    value: Any, where: str, name: str, *, default: int | None = None, lo: int = 0, hi: int = 2**31 - 1
) -> int:
    """A JSON integer in ``[lo, hi]`` (not a bool, not a string, not a float)."""
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise IngestError(f"{where}: {name} must be an integer, got {value!r}")
    if not lo <= int(value) <= hi:
        raise IngestError(f"{where}: {name} = {value} is outside [{lo}, {hi}]")
    return int(value)


def token_ids_field(value: Any, where: str, name: str) -> npt.NDArray[np.int64]:
    """Token ids: a flat list of integers in ``[0, 2**31)`` (the index stores them as int32)."""
    ids = int_array(value, where, name, ndim=1)
    if ids.size and (ids.min() < 0 or ids.max() > MAX_TOKEN_ID):
        raise IngestError(f"{where}: {name} holds ids outside [0, {MAX_TOKEN_ID}]")
    if ids.shape[0] > MAX_RECORD_TOKENS:
        raise IngestError(f"{where}: {name} holds {ids.shape[0]} tokens, more than {MAX_RECORD_TOKENS} per record")
    return ids


def int_array(value: Any, where: str, name: str, *, ndim: int) -> npt.NDArray[np.int64]:
    """Nested JSON lists of integers as an ``ndim``-D int64 array: floats, bools, strings, values beyond int64
    and ragged lists are refused (never truncated or reshaped)."""
    if isinstance(value, np.ndarray):
        array = value
    else:
        try:
            array = np.asarray(value)
        except (ValueError, TypeError, OverflowError) as exc:  # ragged
            raise IngestError(f"{where}: {name} is not a regular nested list of integers ({exc})") from None
    if array.size == 0 and array.ndim <= ndim:
        return np.zeros((0,) * ndim, dtype=np.int64) if array.ndim != ndim else array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise IngestError(f"{where}: {name} must hold integers, got {array.dtype} values")
    if array.ndim != ndim:
        raise IngestError(f"{where}: {name} has {array.ndim} dimensions {array.shape}, expected {ndim}")
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and array.size and int(array.max()) > 2**63 - 1:
        raise IngestError(f"{where}: {name} holds values beyond int64")
    return array.astype(np.int64, copy=False)


def decode_base64(text: Any, where: str, name: str) -> bytes:
    if not isinstance(text, str):
        raise IngestError(f"{where}: {name} must be a base64 string, got {type(text).__name__}")
    if len(text) > MAX_PAYLOAD_BYTES * 4 // 3 + 4:
        raise IngestError(f"{where}: {name} is {len(text)} characters, more than a routing payload can be")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise IngestError(f"{where}: {name} is not valid base64 (truncated?): {exc}") from None


def load_npy(raw: bytes, where: str, name: str, *, text: bool = False) -> npt.NDArray[Any]:
    """An ``.npy`` file's array, never unpickled, with the header checked against the bytes actually present:
    a header that claims 10**12 elements is refused, not allocated. Numbers only, or, with ``text`` (id fields),
    fixed-width strings too (unicode or bytes: no pickle either); object arrays never."""
    stream = io.BytesIO(raw)
    try:
        major, _minor = np.lib.format.read_magic(stream)
        if major == 1:
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif major in (2, 3):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"unknown .npy version {major}")
    except (ValueError, OSError, SyntaxError, EOFError) as exc:
        raise IngestError(f"{where}: {name} is not a valid .npy array ({exc})") from None
    if dtype.hasobject or dtype.kind not in ("biufUS" if text else "biuf"):
        allowed = "plain numbers or fixed-width strings" if text else "plain numbers"
        raise IngestError(f"{where}: {name} has dtype {dtype}; it must hold {allowed} (object arrays are never read)")
    count = math.prod(shape)
    body = raw[stream.tell() :]
    if count * dtype.itemsize != len(body):
        raise IngestError(
            f"{where}: {name}'s header declares shape {shape} of {dtype} ({count * dtype.itemsize} bytes), the "
            f"payload holds {len(body)} bytes (truncated or forged)"
        )
    array = np.frombuffer(body, dtype=dtype).reshape(shape, order="F" if fortran else "C")
    return array


def npy_header_nbytes(header: bytes, where: str) -> tuple[int, int]:
    """``(header length, data bytes)`` an ``.npy`` header declares, from its first bytes (for bounded reads)."""
    stream = io.BytesIO(header)
    try:
        major, _minor = np.lib.format.read_magic(stream)
        read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, _fortran, dtype = read(stream)
    except (ValueError, OSError, SyntaxError, EOFError) as exc:
        raise IngestError(f"{where}: not a valid .npy array ({exc})") from None
    if dtype.hasobject:
        raise IngestError(f"{where}: object arrays need pickle, which routelog refuses")
    return stream.tell(), math.prod(shape) * dtype.itemsize


def resolve_layer_axis(n_layers: int, spec: ModelSpec, where: str) -> LayerAxis:
    """``full`` or ``moe`` from the payload's layer count; an error when it matches neither convention."""
    if n_layers == spec.num_moe_layers:
        return "moe"  # also the full axis when every layer routes: the two conventions coincide
    if n_layers == spec.num_layers:
        return "full"
    raise IngestError(
        f"{where}: the payload has {n_layers} layers, but model {spec.name!r} has {spec.num_layers} decoder layers "
        f"(full axis) and {spec.num_moe_layers} MoE layers (MoE-only axis); check that the model spec matches the "
        "engine's model"
    )


def to_moe_axis(ids: npt.NDArray[Any], spec: ModelSpec) -> npt.NDArray[Any]:
    """``[..., num_layers, K]`` (full axis) -> ``[..., num_moe_layers, K]``: the rows of the MoE layers by global index.

    Indexing by the spec's global layer numbers is what keeps layers after a dense prefix in place (mapping
    payload row ``i + offset`` onto the i-th router shifts every MoE layer after the dense ones).
    """
    return np.take(ids, list(spec.moe_layers), axis=-2)


def to_full_axis(ids: npt.NDArray[Any], spec: ModelSpec, fill: int = 0) -> npt.NDArray[Any]:
    """``[..., num_moe_layers, K]`` -> ``[..., num_layers, K]`` with ``fill`` in the dense layers."""
    shape = (*ids.shape[:-2], spec.num_layers, ids.shape[-1])
    out = np.full(shape, fill, dtype=ids.dtype)
    out[..., list(spec.moe_layers), :] = ids
    return out


def logical_ids(
    ids: npt.NDArray[Any],
    physical_to_logical: npt.ArrayLike,
    where: str,
    *,
    captured: npt.NDArray[np.bool_] | None = None,
) -> npt.NDArray[np.int64]:
    """Map physical expert IDs (after EPLB replication) to logical ones with the engine's table.

    ``ids`` is ``[rows, num_moe_layers, K]`` on the MoE-only axis. The table is either one ``[num_physical]`` map
    for every layer, or vLLM's own per-layer form ``[num_moe_layers, num_physical]`` (it differs per layer after
    rebalancing). Only ``captured`` rows are mapped (a never-captured all-zero row stays missing, not "physical
    expert 0").
    """
    table = np.asarray(physical_to_logical)
    if table.dtype.kind not in "iu" or table.ndim not in (1, 2) or table.size == 0:
        raise IngestError(
            f"{where}: the physical-to-logical table must be integers of shape [num_physical] or "
            f"[num_moe_layers, num_physical], got {table.dtype} {table.shape}"
        )
    table = table.astype(np.int64)
    if table.ndim == 2 and table.shape[0] != ids.shape[1]:
        raise IngestError(
            f"{where}: the per-layer EPLB table has {table.shape[0]} rows, the payload has {ids.shape[1]} MoE layers"
        )
    rows = ids if captured is None else ids[captured]
    if rows.size and (rows.min() < 0 or rows.max() >= table.shape[-1]):
        raise IngestError(
            f"{where}: physical expert IDs reach {int(rows.max())}, the EPLB table has {table.shape[-1]} entries"
        )
    mapped = table[rows] if table.ndim == 1 else table[np.arange(ids.shape[1])[None, :, None], rows]
    out = np.zeros(ids.shape, dtype=np.int64)
    if captured is None:
        out[...] = mapped
    else:
        out[captured] = mapped
    return out


@dataclass(frozen=True)
class Payload:
    """The routing rows an engine returned for one sequence, as received."""

    request_id: str
    """Named in every error about this payload."""
    rows: npt.NDArray[Any]
    """``[n_rows, n_layers, K]``; row ``r`` is the routing of input position ``start + r``."""
    start: int = 0
    """Input position of the first row (vLLM ``routed_experts_prompt_start``, SGLang ``routed_experts_start_len``)."""
    missing: npt.NDArray[np.bool_] | None = None
    """Rows the payload itself marks as never routed (a -1 sentinel, a dummy final row); all-zero rows are found
    by :func:`captured_rows`."""


@dataclass(frozen=True)
class NormalizedRows:
    """A payload's rows on the MoE-only axis in logical IDs, and which of them hold routes."""

    rows: npt.NDArray[np.int64]
    captured: npt.NDArray[np.bool_]
    id_space: IdSpace


def normalize_rows(
    payload: Payload, spec: ModelSpec, *, physical_to_logical: npt.ArrayLike | None = None
) -> NormalizedRows:
    """Shape, layer axis and K of a payload's rows; which rows hold routes (all-zero rows and rows the payload
    marks missing do not); physical IDs mapped to logical; value range of the routed rows."""
    where = f"request {payload.request_id}"
    rows = np.asarray(payload.rows)
    if rows.ndim != 3:
        raise IngestError(f"{where}: routed experts have shape {rows.shape}, expected [rows, layers, topk]")
    if rows.shape[2] != spec.topk:
        raise IngestError(
            f"{where}: routed experts have top-k {rows.shape[2]}, model {spec.name!r} routes to {spec.topk}"
        )
    if rows.dtype.kind not in "iu":
        raise IngestError(f"{where}: routed experts have dtype {rows.dtype}, expected integers")
    if resolve_layer_axis(rows.shape[1], spec, where) == "full":
        rows = to_moe_axis(rows, spec)
    rows = rows.astype(np.int64)
    missing = np.zeros(rows.shape[0], bool) if payload.missing is None else np.asarray(payload.missing, bool)
    if missing.shape != (rows.shape[0],):
        raise IngestError(f"{where}: the missing-row mask has {missing.shape[0]} entries for {rows.shape[0]} rows")
    rows[missing] = 0
    captured = captured_rows(rows, spec, where, ignore=missing) & ~missing
    id_space: IdSpace = "logical"
    if physical_to_logical is not None:
        rows = logical_ids(rows, physical_to_logical, where, captured=captured)
        id_space = "mapped_from_physical"
    routed = rows[captured]
    if routed.size and (routed.min() < 0 or routed.max() >= spec.num_experts):
        bad = np.argwhere((rows < 0) | (rows >= spec.num_experts))[0]
        raise IngestError(
            f"{where}: expert ID {int(rows[tuple(bad)])} at row {int(bad[0])}, MoE layer "
            f"{spec.moe_layers[int(bad[1])]} is outside [0, {spec.num_experts}); physical IDs after EPLB need the "
            "engine's physical-to-logical table (--eplb-map)"
        )
    return NormalizedRows(rows, captured, id_space)


def check_rows(payload: Payload, spec: ModelSpec) -> npt.NDArray[Any]:
    """Shape, layer axis, K and value range of a payload's rows; returns them on the MoE-only axis."""
    return normalize_rows(payload, spec).rows


def captured_rows(
    rows: npt.NDArray[Any], spec: ModelSpec, where: str, *, ignore: npt.NDArray[np.bool_] | None = None
) -> npt.NDArray[np.bool_]:
    """Which rows hold routes: all-zero rows were never captured; an all-zero MoE layer is a capture bug.
    Rows in ``ignore`` (already known missing) count for neither."""
    if rows.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    if spec.topk == 1:
        return np.ones(rows.shape[0], dtype=bool)  # a single zero is expert 0, a real route
    zero: npt.NDArray[np.bool_] = ~np.any(rows, axis=2)  # [rows, layers]
    considered = zero if ignore is None else zero[~ignore]
    dead_layers = np.flatnonzero(np.all(considered, axis=0)) if considered.shape[0] else np.zeros(0, np.int64)
    if dead_layers.size and considered.shape[0] > 1:
        layers = [spec.moe_layers[int(j)] for j in dead_layers]
        raise IngestError(
            f"{where}: MoE layers {layers} are all zeros for every token: the engine did not capture them (SGLang "
            "with pipeline parallelism returns only the last stage's layers; vLLM 0.15.0 and 0.15.1 never bound "
            "their capturer). Refusing to replay expert 0 everywhere"
        )
    partial = np.any(zero, axis=1) & ~np.all(zero, axis=1)
    if ignore is not None:
        partial &= ~ignore
    if partial.any():
        row = int(np.argmax(partial))
        layers = [spec.moe_layers[int(j)] for j in np.flatnonzero(zero[row])]
        raise IngestError(f"{where}: row {row} has no route (all zeros) in MoE layers {layers} but routes in others")
    captured: npt.NDArray[np.bool_] = ~np.all(zero, axis=1)
    return captured


def provenance(
    prompt_len: int,
    n_tokens: int,
    *,
    engine: str | None,
    engine_version: str | None,
    id_space: IdSpace,
    policy_version: int | None = None,
    weight_versions: Sequence[tuple[str, int, int]] = (),
) -> list[Segment]:
    """Segments of a single-request record: the prompt, then the response split where the engine reports a weight
    change (``weight_versions``: ``(label, start, end)`` over output-token indexes, vLLM ``weight_versions`` /
    SGLang ``meta_info.weight_versions``)."""

    def segment(start: int, end: int, source: str, label: str | None = None) -> Segment:
        version = int(label) if label is not None and label.isdigit() else policy_version
        return Segment(
            start=start,
            end=end,
            source=source,
            policy_version=version,
            engine=engine,
            engine_version=engine_version,
            id_space=id_space,
            weight_version=label,
        )

    segments = [segment(0, prompt_len, "prompt")] if prompt_len else []
    position = prompt_len
    for label, start, end in sorted(weight_versions, key=lambda span: span[1]):
        lo, hi = prompt_len + max(start, 0), min(prompt_len + end, n_tokens)
        if lo > position:
            segments.append(segment(position, lo, "response"))
        if hi > lo:
            segments.append(segment(lo, hi, "response", label))
            position = hi
    if position < n_tokens:
        segments.append(segment(position, n_tokens, "response"))
    return segments


def weight_version_spans(value: Any, where: str) -> list[tuple[str, int, int]]:
    """vLLM's ``[{version, start, end}]`` or SGLang's ``[[version, start, end]]`` weight-version spans."""
    if value is None:
        return []
    spans = []
    for i, item in enumerate(list_field(value, where, "weight_versions")):
        if isinstance(item, Mapping):
            label, start, end = item.get("version"), item.get("start"), item.get("end")
        elif isinstance(item, list) and len(item) == 3:
            label, start, end = item
        else:
            raise IngestError(f"{where}: weight_versions[{i}] is not a (version, start, end) span")
        spans.append(
            (
                str(label),
                int_field(start, where, f"weight_versions[{i}].start"),
                int_field(end, where, f"weight_versions[{i}].end"),
            )
        )
    return spans


def payload_to_record(
    payload: Payload,
    spec: ModelSpec,
    *,
    sample_id: str,
    prompt_len: int,
    response_len: int,
    token_ids: npt.ArrayLike | None = None,
    group_id: str | None = None,
    policy_version: int | None = None,
    engine: str | None = None,
    engine_version: str | None = None,
    physical_to_logical: npt.ArrayLike | None = None,
    segments: Sequence[Segment] | None = None,
    weight_versions: Sequence[tuple[str, int, int]] = (),
    extra: Mapping[str, Any] | None = None,
) -> Record:
    """A record from one sequence's payload: rows placed at their input positions, the rest missing.

    Without ``segments`` the record gets its provenance from :func:`provenance` (prompt, response, weight-version
    spans, engine and version, logical or mapped IDs).
    """
    where = f"request {payload.request_id}"
    n_tokens = prompt_len + response_len
    if prompt_len < 0 or response_len < 0 or n_tokens > MAX_RECORD_TOKENS:
        raise IngestError(
            f"{where}: prompt {prompt_len} + response {response_len} tokens is not a record length (at most "
            f"{MAX_RECORD_TOKENS})"
        )
    normalized = normalize_rows(payload, spec, physical_to_logical=physical_to_logical)
    rows = normalized.rows
    start = payload.start
    expected = n_tokens - 1 - start
    if not 0 <= start <= n_tokens or rows.shape[0] not in (expected, expected + 1):
        raise IngestError(
            f"{where}: {rows.shape[0]} routing rows, expected {max(expected, 0)} (prompt {prompt_len} + response "
            f"{response_len} tokens - 1 final token never forwarded - {start} rows before the start offset)"
        )
    tokens = None if token_ids is None else token_ids_field(token_ids, where, "token ids")
    if tokens is not None and tokens.shape[0] != n_tokens:
        raise IngestError(f"{where}: {tokens.shape[0]} token ids for {n_tokens} tokens")
    ids = np.zeros((n_tokens, spec.num_moe_layers, spec.topk), dtype=np.int64)
    ids[start : start + rows.shape[0]] = rows
    valid = np.zeros(n_tokens, dtype=bool)
    valid[start : start + rows.shape[0]] = normalized.captured
    if segments is None:
        segments = provenance(
            prompt_len,
            n_tokens,
            engine=engine,
            engine_version=engine_version,
            id_space=normalized.id_space,
            policy_version=policy_version,
            weight_versions=weight_versions,
        )
    return Record(
        sample_id=sample_id,
        expert_ids=ids,
        prompt_len=prompt_len,
        response_len=response_len,
        valid=valid,
        token_ids=tokens,
        group_id=group_id,
        policy_version=policy_version,
        engine=engine,
        engine_version=engine_version,
        segments=segments,
        extra=extra,
        payload_start=start,
    )


# -- options every HTTP adapter takes ------------------------------------------------------------------------------
@dataclass(frozen=True)
class IngestOptions:
    """What the caller knows about the payloads beyond what they carry."""

    group_id: str | None = None
    policy_version: int | None = None
    engine_version: str | None = None
    """The engine's version: decides how version-dependent payloads are read (see :mod:`routelog.engines.versions`)."""
    physical_to_logical: npt.ArrayLike | None = None
    """The engine's EPLB table (``[num_physical]`` or vLLM's ``[num_moe_layers, num_physical]``)."""
    eplb: bool = False
    """The engine ran with expert-parallel load balancing (replicated experts)."""


def eplb_table(engine: str, options: IngestOptions, physical: bool | None, where: str) -> npt.ArrayLike | None:
    """The table to map this payload's IDs with, or None; refuses what would silently mis-map.

    ``physical`` says whether this engine version reports physical IDs under EPLB (None: unknown version).
    """
    table = options.physical_to_logical
    version = options.engine_version or "of unknown version"
    if table is not None and physical is False:
        raise IngestError(
            f"{where}: {engine} {version} reports logical expert IDs; mapping them with an EPLB table would corrupt "
            f"them. Drop the table ({physical_id_note(engine, options.engine_version)})"
        )
    if options.eplb and table is None and physical is not False:
        raise IngestError(
            f"{where}: {engine} {version} ran with EPLB and may report physical expert IDs: pass its "
            f"physical-to-logical table ({physical_id_note(engine, options.engine_version)})"
        )
    return table if options.eplb or table is not None else None


def shaped_bytes(raw: bytes, dtype_name: Any, shape: Any, where: str, what: str) -> npt.NDArray[Any]:
    """``raw`` little-endian values of a declared integer dtype and 3-D shape, checked against the byte count."""
    if not isinstance(dtype_name, str) or dtype_name not in _ENVELOPE_DTYPES:
        raise IngestError(f"{where}: {what} dtype {dtype_name!r} is not one of {sorted(_ENVELOPE_DTYPES)}")
    given = list_field(shape, where, f"{what} shape")
    dims = [int_field(d, where, f"{what} shape", hi=MAX_RECORD_TOKENS) for d in given]
    dtype = np.dtype(dtype_name).newbyteorder("<")
    if len(dims) != 3 or math.prod(dims) * dtype.itemsize != len(raw):
        raise IngestError(
            f"{where}: {what} declares shape {dims} of {dtype_name} ({math.prod(dims) * dtype.itemsize} bytes), "
            f"it holds {len(raw)} bytes"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(dims)


_ENVELOPE_DTYPES = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32"}


class TurnStitcher:
    """Builds one record from a multi-turn or resumed rollout whose turns return only their new rows.

    Each turn brings the whole token sequence so far and the rows from its start offset on (SGLang
    ``routed_experts_start_len``, vLLM ``routed_experts_prompt_start``). Rows before the offset come from the
    earlier turns; the tokens before it must be identical to theirs, or the turn is refused (a re-rendered
    template that shares a shorter prefix must resume from the actually shared prefix).
    """

    def __init__(self, spec: ModelSpec, sample_id: str) -> None:
        self.spec = spec
        self.sample_id = sample_id
        self._tokens: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        self._ids = np.zeros((0, spec.num_moe_layers, spec.topk), dtype=np.int64)
        self._valid = np.zeros(0, dtype=bool)
        self._segments: list[Segment] = []
        self._prompt_len = 0
        self._payload_start: int | None = None
        self._turns = 0

    def add_turn(
        self,
        payload: Payload,
        token_ids: npt.ArrayLike,
        prompt_len: int,
        *,
        policy_version: int | None = None,
        source: str | None = None,
        physical_to_logical: npt.ArrayLike | None = None,
        engine: str | None = None,
        engine_version: str | None = None,
    ) -> None:
        """Add a turn: ``token_ids`` is the full sequence so far, ``prompt_len`` how many of them the turn was fed."""
        tokens = token_ids_field(token_ids, f"request {payload.request_id}", "token ids")
        where = f"request {payload.request_id}"
        start = payload.start
        if start > self._tokens.shape[0]:
            raise IngestError(
                f"{where}: the turn's rows start at position {start}, but earlier turns cover only "
                f"{self._tokens.shape[0]} tokens of sample {self.sample_id!r}"
            )
        shared = tokens[:start]
        if shared.shape[0] < start or not np.array_equal(shared, self._tokens[:start]):
            diverge = int(np.argmax(shared != self._tokens[: shared.shape[0]])) if shared.shape[0] else 0
            raise IngestError(
                f"{where}: tokens before the start offset {start} differ from the earlier turns of sample "
                f"{self.sample_id!r} (first difference at position {diverge}); resume from the shared prefix"
            )
        turn = payload_to_record(
            payload,
            self.spec,
            sample_id=self.sample_id,
            prompt_len=prompt_len,
            response_len=tokens.shape[0] - prompt_len,
            physical_to_logical=physical_to_logical,
            engine=engine,
            engine_version=engine_version,
        )
        ids = np.asarray(turn.expert_ids)
        valid = np.asarray(turn.valid)
        ids[:start] = self._ids[:start]
        valid[:start] = self._valid[:start]
        self._segments = [s.model_copy(update={"end": min(s.end, start)}) for s in self._segments if s.start < start]
        id_space = turn.segments[-1].id_space if turn.segments else None
        self._segments.append(
            Segment(
                start=start,
                end=tokens.shape[0],
                policy_version=policy_version,
                source=source or f"turn-{self._turns}",
                engine=engine,
                engine_version=engine_version,
                id_space=id_space,
            )
        )
        if not self._prompt_len:
            self._prompt_len = prompt_len
        if self._payload_start is None:
            self._payload_start = start
        self._turns += 1
        self._tokens, self._ids, self._valid = tokens, ids, valid

    def record(self, **metadata: Any) -> Record:
        """The stitched record (``metadata``: group_id, policy_version, engine, engine_version, extra)."""
        n = self._tokens.shape[0]
        return Record(
            sample_id=self.sample_id,
            expert_ids=self._ids,
            prompt_len=self._prompt_len,
            response_len=n - self._prompt_len,
            valid=self._valid,
            token_ids=self._tokens,
            token_hash=token_hash(self._tokens),
            segments=list(self._segments),
            payload_start=self._payload_start,
            **metadata,
        )
