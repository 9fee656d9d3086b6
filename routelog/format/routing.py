"""The routing of one record as read: a data type shared by the reader, the alignment and the audits.

It lives below all of them so that the pure alignment (:mod:`routelog.align`) does not depend on the storage
layer for a data type.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from routelog.display import html_card
from routelog.format.documents import IndexRow
from routelog.format.record import Record

if TYPE_CHECKING:
    import torch

MISSING = -1
"""Value of rows the engine never computed in :attr:`RecordRouting.expert_ids`."""

ROUTING_TABLE_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("token", pa.int32(), nullable=False),
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("k", pa.int8(), nullable=False),
        pa.field("expert", pa.int32(), nullable=False),
    ]
)
"""Long-form routing: one row per (record, routed token, layer, top-k slot). ``token`` is the input position,
``layer`` the global layer index (the stream's own layer for a stream), ``k`` the slot in stored order."""


@dataclass(frozen=True)
class RecordRouting:
    """The routing of one record for the layers asked for."""

    info: IndexRow
    by_layer: npt.NDArray[np.unsignedinteger[Any]]
    """``[n_layers, n_tokens, topk]`` (C-contiguous, one ``[T, K]`` block per router) in the storage dtype
    (uint8/uint16); rows not in ``valid`` hold 0."""
    valid: npt.NDArray[np.bool_]
    """``[n_tokens]``: rows the engine computed."""
    moe_layers: tuple[int, ...]
    """Positions of axis 1 on the MoE-only axis."""
    layers: tuple[int, ...]
    """Global layer indices of axis 1."""
    topk_order: str
    num_moe_layers: int
    """Length of the model's MoE axis (``moe_layers`` may be a subset); of the stream's axis for a stream."""
    stream: str | None = None
    """The extra stream these rows are of (e.g. ``mtp``); None for the decoder routing."""
    weights: npt.NDArray[np.float32] | None = None
    """Routing weights ``[n_layers, n_tokens, topk]`` float32 aligned with :attr:`by_layer` (slot ``j`` weighs
    expert ``by_layer[..., j]``), when read with ``weights=True``; NaN where the record carried none."""

    @property
    def sample_id(self) -> str:
        return self.info.sample_id

    @property
    def ids(self) -> npt.NDArray[np.unsignedinteger[Any]]:
        """``[n_tokens, n_layers, topk]`` view of :attr:`by_layer` (not C-contiguous); invalid rows hold 0."""
        return self.by_layer.transpose(1, 0, 2)

    @cached_property
    def expert_ids(self) -> npt.NDArray[np.signedinteger[Any]]:
        """``[n_tokens, n_layers, topk]`` int16 (int32 above 32767 experts), C-contiguous; missing rows are -1."""
        dtype = np.int16 if self.by_layer.dtype == np.uint8 or int(self.by_layer.max(initial=0)) < 32767 else np.int32
        out: npt.NDArray[np.signedinteger[Any]] = np.ascontiguousarray(self.ids, dtype=dtype)
        out[~self.valid] = MISSING
        return out

    def to_record(self) -> Record:
        """The record as written (all of its layers must have been read), e.g. to export it to an engine layout."""
        if self.stream is not None:
            raise ValueError("to_record needs the decoder routing; this is the stream " + repr(self.stream))
        if self.moe_layers != tuple(range(self.num_moe_layers)):
            raise ValueError("to_record needs every MoE layer; read the record without moe_layers")
        info = self.info
        return Record(
            sample_id=info.sample_id,
            expert_ids=np.ascontiguousarray(self.ids),
            prompt_len=info.prompt_len,
            response_len=info.response_len,
            valid=self.valid,
            token_ids=None if info.token_ids is None else np.asarray(info.token_ids, dtype=np.int64),
            token_hash=info.token_hash,
            group_id=info.group_id,
            policy_version=info.policy_version,
            engine=info.engine,
            engine_version=info.engine_version,
            segments=info.segments,
            extra=None if info.extra is None else json.loads(info.extra),
            payload_start=info.payload_start,
            weights=None if self.weights is None or np.isnan(self.weights).all() else self.weights.transpose(1, 0, 2),
        )

    def to_arrow(self) -> pa.Table:
        """The routed rows in long form (:data:`ROUTING_TABLE_SCHEMA`): missing rows have no entries."""
        tokens = np.flatnonzero(self.valid).astype(np.int32)
        n_layers, topk = self.by_layer.shape[0], self.by_layer.shape[2]
        per_token = n_layers * topk
        n = len(tokens) * per_token
        columns = [
            pa.repeat(pa.scalar(self.sample_id, pa.string()), n),
            pa.array(np.repeat(tokens, per_token)),
            pa.array(np.tile(np.repeat(np.asarray(self.layers, np.int16), topk), len(tokens))),
            pa.array(np.tile(np.arange(topk, dtype=np.int8), len(tokens) * n_layers)),
            pa.array(self.ids[tokens].reshape(-1).astype(np.int32)),
        ]
        return pa.Table.from_arrays(columns, schema=ROUTING_TABLE_SCHEMA)

    def __repr__(self) -> str:
        return (
            f"RecordRouting({self.sample_id!r}: {self.info.n_tokens} tokens ({int(self.valid.sum())} routed), "
            f"{len(self.layers)} layers, K={self.by_layer.shape[2]}"
            + (f", stream {self.stream!r}" if self.stream else "")
            + ")"
        )

    def _repr_html_(self) -> str:
        info = self.info
        facts: list[tuple[str, object]] = [
            ("tokens", f"{info.n_tokens} (prompt {info.prompt_len}, response {info.response_len})"),
            ("routed rows", int(self.valid.sum())),
            ("layers", ", ".join(map(str, self.layers))),
            ("top-k", f"{self.by_layer.shape[2]} ({self.topk_order})"),
            ("policy version", info.policy_version),
            ("engine", " ".join(str(v) for v in (info.engine, info.engine_version) if v) or None),
        ]
        if self.stream:
            facts.append(("stream", self.stream))
        first = [(t, *self.expert_ids[t, 0].tolist()) for t in range(min(5, info.n_tokens))]
        columns = ["token", *(f"k{j}" for j in range(self.by_layer.shape[2]))] if first else []
        title = f"record {self.sample_id} (first tokens, layer {self.layers[0] if self.layers else '-'})"
        return html_card(title, facts, first, columns)

    def to_torch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(expert_ids, valid)`` as torch tensors (int16/int32 and bool)."""
        import torch

        return torch.from_numpy(self.expert_ids), torch.from_numpy(self.valid)
