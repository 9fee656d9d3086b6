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

from routelog.format import IndexRow
from routelog.record import Record

if TYPE_CHECKING:
    import torch

MISSING = -1
"""Value of rows the engine never computed in :attr:`RecordRouting.expert_ids`."""


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
        )

    def to_torch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(expert_ids, valid)`` as torch tensors (int16/int32 and bool)."""
        import torch

        return torch.from_numpy(self.expert_ids), torch.from_numpy(self.valid)
