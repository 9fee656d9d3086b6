"""Routing weights: the gate probabilities of the chosen experts, stored beside the expert IDs when a record has
them (format 2, optional), for users who replay the weights too.

They follow their experts: a record's weights are permuted with its IDs when the sets are sorted, so slot ``j``
of a stored row weighs expert ``ids[j]``. bf16 keeps the engines' own precision at half of float32's bytes; it is
stored as the uint16 bit pattern (numpy has no bfloat16), rounded to nearest even from float32. NaN marks rows of
records that carried no weights.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]
WeightsDtype = Literal["bfloat16", "float32"]


def storage_dtype(dtype: WeightsDtype) -> np.dtype[Any]:
    """How weights of ``dtype`` are held in memory and in a part: bf16 bit patterns as uint16, or float32."""
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(np.float32)


def to_storage(values: npt.NDArray[np.float32], dtype: WeightsDtype) -> npt.NDArray[Any]:
    """float32 weights in their stored form (bf16: round to nearest even, NaN kept NaN)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "float32":
        return values
    bits = values.view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
    # A NaN whose payload sits in the low half would round to infinity (or wrap): keep it a quiet NaN.
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded.astype(np.uint16))


def from_storage(stored: npt.NDArray[Any], dtype: WeightsDtype) -> FloatArray:
    """float32 weights from their stored form."""
    if dtype == "float32":
        return np.asarray(stored, dtype=np.float32)
    return (np.asarray(stored, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def missing(shape: tuple[int, ...], dtype: WeightsDtype) -> npt.NDArray[Any]:
    """Stored-form weights of rows whose record carried none (NaN)."""
    return to_storage(np.full(shape, np.nan, np.float32), dtype)
