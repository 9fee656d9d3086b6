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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from routelog.errors import IngestError
from routelog.format import Segment
from routelog.record import Record, token_hash
from routelog.spec import ModelSpec

LayerAxis = Literal["full", "moe"]


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


def logical_ids(ids: npt.NDArray[Any], physical_to_logical: npt.ArrayLike, where: str) -> npt.NDArray[np.int64]:
    """Map physical expert IDs (after EPLB replication) to logical ones with the engine's table."""
    table = np.asarray(physical_to_logical, dtype=np.int64)
    if table.ndim != 1:
        raise IngestError(f"{where}: the physical-to-logical table must be one-dimensional, got {table.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise IngestError(
            f"{where}: physical expert IDs reach {int(ids.max())}, the EPLB table has {table.shape[0]} entries"
        )
    mapped: npt.NDArray[np.int64] = table[ids]
    return mapped


@dataclass(frozen=True)
class Payload:
    """The routing rows an engine returned for one sequence, as received."""

    request_id: str
    """Named in every error about this payload."""
    rows: npt.NDArray[Any]
    """``[n_rows, n_layers, K]``; row ``r`` is the routing of input position ``start + r``."""
    start: int = 0
    """Input position of the first row (vLLM ``routed_experts_prompt_start``, SGLang ``routed_experts_start_len``)."""


def check_rows(payload: Payload, spec: ModelSpec) -> npt.NDArray[Any]:
    """Shape, layer axis, K and value range of a payload's rows; returns them on the MoE-only axis."""
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
    if rows.size and (rows.min() < 0 or rows.max() >= spec.num_experts):
        bad = np.argwhere((rows < 0) | (rows >= spec.num_experts))[0]
        raise IngestError(
            f"{where}: expert ID {int(rows[tuple(bad)])} at row {int(bad[0])}, MoE layer "
            f"{spec.moe_layers[int(bad[1])]} is outside [0, {spec.num_experts}); physical IDs after EPLB need the "
            "engine's physical-to-logical table"
        )
    return rows


def captured_rows(rows: npt.NDArray[Any], spec: ModelSpec, where: str) -> npt.NDArray[np.bool_]:
    """Which rows hold routes: all-zero rows were never captured; an all-zero MoE layer is a capture bug."""
    if rows.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    if spec.topk == 1:
        return np.ones(rows.shape[0], dtype=bool)  # a single zero is expert 0, a real route
    zero: npt.NDArray[np.bool_] = ~np.any(rows, axis=2)  # [rows, layers]
    dead_layers = np.flatnonzero(np.all(zero, axis=0))
    if dead_layers.size and rows.shape[0] > 1:
        layers = [spec.moe_layers[int(j)] for j in dead_layers]
        raise IngestError(
            f"{where}: MoE layers {layers} are all zeros for every token: the engine did not capture them (SGLang "
            "with pipeline parallelism returns only the last stage's layers; vLLM 0.15 never bound its capturer). "
            "Refusing to replay expert 0 everywhere"
        )
    partial = np.any(zero, axis=1) & ~np.all(zero, axis=1)
    if partial.any():
        row = int(np.argmax(partial))
        layers = [spec.moe_layers[int(j)] for j in np.flatnonzero(zero[row])]
        raise IngestError(f"{where}: row {row} has no route (all zeros) in MoE layers {layers} but routes in others")
    captured: npt.NDArray[np.bool_] = ~np.all(zero, axis=1)
    return captured


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
    segments: Sequence[Segment] = (),
    extra: Mapping[str, Any] | None = None,
) -> Record:
    """A record from one sequence's payload: rows placed at their input positions, the rest missing."""
    where = f"request {payload.request_id}"
    raw = np.asarray(payload.rows)
    if physical_to_logical is not None and raw.ndim == 3:
        raw = logical_ids(raw, physical_to_logical, where)
    rows = check_rows(Payload(payload.request_id, raw, payload.start), spec)
    n_tokens = prompt_len + response_len
    start = payload.start
    expected = n_tokens - 1 - start
    if not 0 <= start <= n_tokens or rows.shape[0] not in (expected, expected + 1):
        raise IngestError(
            f"{where}: {rows.shape[0]} routing rows, expected {max(expected, 0)} (prompt {prompt_len} + response "
            f"{response_len} tokens - 1 final token never forwarded - {start} rows before the start offset)"
        )
    if token_ids is not None and len(np.asarray(token_ids)) != n_tokens:
        raise IngestError(f"{where}: {len(np.asarray(token_ids))} token ids for {n_tokens} tokens")
    ids = np.zeros((n_tokens, spec.num_moe_layers, spec.topk), dtype=np.int64)
    ids[start : start + rows.shape[0]] = rows
    valid = np.zeros(n_tokens, dtype=bool)
    valid[start : start + rows.shape[0]] = captured_rows(rows, spec, where)
    return Record(
        sample_id=sample_id,
        expert_ids=ids,
        prompt_len=prompt_len,
        response_len=response_len,
        valid=valid,
        token_ids=None if token_ids is None else np.asarray(token_ids, dtype=np.int64),
        group_id=group_id,
        policy_version=policy_version,
        engine=engine,
        engine_version=engine_version,
        segments=segments,
        extra=extra,
    )


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

    def add_turn(
        self,
        payload: Payload,
        token_ids: npt.ArrayLike,
        prompt_len: int,
        *,
        policy_version: int | None = None,
        source: str | None = None,
        physical_to_logical: npt.ArrayLike | None = None,
    ) -> None:
        """Add a turn: ``token_ids`` is the full sequence so far, ``prompt_len`` how many of them the turn was fed."""
        tokens = np.asarray(token_ids, dtype=np.int64)
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
        )
        ids = np.asarray(turn.expert_ids)
        valid = np.asarray(turn.valid)
        ids[:start] = self._ids[:start]
        valid[:start] = self._valid[:start]
        self._segments = [s.model_copy(update={"end": min(s.end, start)}) for s in self._segments if s.start < start]
        self._segments.append(
            Segment(
                start=start,
                end=tokens.shape[0],
                policy_version=policy_version,
                source=source or f"turn-{len(self._segments)}",
            )
        )
        if not self._prompt_len:
            self._prompt_len = prompt_len
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
            **metadata,
        )
