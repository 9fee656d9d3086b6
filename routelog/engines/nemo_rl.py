"""NeMo-RL's routing envelope: ``choices[i].message.routed_experts = "nrlre1:<dtype>:<S>x<L>x<K>:<base64>"``.

NeMo-RL (with vLLM 0.25.1) returns the chat choice's prompt and generation token ids in the message and the routing
of all ``S = n`` input positions in the narrowest signed dtype (int8 up to 128 experts, int16 up to 32768, else
int32), on vLLM's full layer axis. Rows the engine never routed are -1; the final row, whose token was never
forwarded, is a dummy ``arange(K)``. The rest of the response is vLLM's (read by :mod:`routelog.engines.vllm`).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.engines.common import decode_base64, shaped_bytes, to_full_axis
from routelog.errors import IngestError
from routelog.format.record import Record
from routelog.format.spec import ModelSpec

PREFIX = "nrlre1:"
MISSING = -1


def decode(text: str, where: str) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_]]:
    """The envelope's rows and which of them are missing (-1 rows and the dummy final row)."""
    parts = text[len(PREFIX) :].split(":", 2)
    if not text.startswith(PREFIX) or len(parts) != 3:
        raise IngestError(f"{where}: the NeMo-RL envelope must be 'nrlre1:<dtype>:<S>x<L>x<K>:<base64>'")
    dtype_name, shape_text, data = parts
    try:
        shape = [int(d) for d in shape_text.split("x")]
    except ValueError:
        raise IngestError(f"{where}: NeMo-RL envelope shape {shape_text!r} is not <S>x<L>x<K>") from None
    rows = shaped_bytes(decode_base64(data, where, "routed_experts"), dtype_name, shape, where, "the NeMo-RL envelope")
    sentinel = rows == MISSING
    missing = sentinel.all(axis=(1, 2))
    partial = sentinel.any(axis=(1, 2)) & ~missing
    if partial.any():
        raise IngestError(f"{where}: NeMo-RL row {int(np.argmax(partial))} is -1 in some layers only")
    if rows.shape[0]:
        missing[-1] = True  # the final token's row is a dummy arange(K), never a route
    return rows, missing


def narrowest_dtype(num_experts: int) -> np.dtype[Any]:
    """NeMo-RL's choice: int8 up to 128 experts, int16 up to 32768, else int32."""
    if num_experts <= 128:
        return np.dtype(np.int8)
    return np.dtype(np.int16) if num_experts <= 32768 else np.dtype(np.int32)


def encode(record: Record, spec: ModelSpec) -> str:
    """``record`` in NeMo-RL's envelope: ``n`` rows on the full axis, -1 where missing, the final row a dummy."""
    dtype = narrowest_dtype(spec.num_experts)
    ids = np.asarray(record.expert_ids).astype(dtype)
    full = to_full_axis(ids, spec, fill=0)
    valid = np.ones(record.n_tokens, bool) if record.valid is None else np.asarray(record.valid)
    full[~valid] = MISSING
    if record.n_tokens:
        full[-1] = np.arange(spec.topk, dtype=dtype)
    shape = "x".join(str(d) for d in full.shape)
    data = base64.b64encode(np.ascontiguousarray(full, dtype=dtype.newbyteorder("<")).tobytes()).decode()
    return f"{PREFIX}{dtype.name}:{shape}:{data}"
