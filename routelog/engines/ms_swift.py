"""ms-swift's routing envelope: ``choices[i].routed_experts = {"data": b64, "shape", "dtype", "__ndarray__": true}``.

ms-swift serialises vLLM's ``CompletionOutput.routed_experts`` unchanged (``serialize_ndarray``: raw bytes, its
shape and dtype): on vLLM 0.22+ that is rows ``[0, n - 1)``, prompt rows included, uint8 (uint16 above 256 experts),
on the full layer axis. The rest of the response is vLLM's (read by :mod:`routelog.engines.vllm`).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.engines.common import decode_base64, shaped_bytes

MARKER = "__ndarray__"


def is_envelope(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get(MARKER) is True


def decode(value: Mapping[str, Any], where: str) -> npt.NDArray[Any]:
    raw = decode_base64(value.get("data"), where, "routed_experts.data")
    return shaped_bytes(raw, value.get("dtype"), value.get("shape"), where, "the ms-swift array")


def encode(rows: npt.NDArray[Any]) -> dict[str, Any]:
    """vLLM's rows (:func:`routelog.engines.vllm.to_array`, from the payload start) as ms-swift returns them."""
    array = np.ascontiguousarray(rows)
    return {
        "data": base64.b64encode(array.tobytes()).decode(),
        "shape": list(array.shape),
        "dtype": array.dtype.name,
        MARKER: True,
    }
