"""Arrow arrays to numpy and back through their buffers.

pyarrow's ``to_numpy`` and ``pa.array`` ask its pandas shim whether a value is a pandas object, which imports
pandas (about 0.3 s) into every process that opens a step. Converting through buffers skips that, so reading a store
never imports pandas (``StepSnapshot.to_pandas`` does, for whoever asks for pandas).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

_NUMPY_OF: dict[pa.DataType, np.dtype[Any]] = {
    arrow: np.dtype(numpy)
    for arrow, numpy in (
        (pa.int8(), np.int8),
        (pa.int16(), np.int16),
        (pa.int32(), np.int32),
        (pa.int64(), np.int64),
        (pa.uint8(), np.uint8),
        (pa.uint16(), np.uint16),
        (pa.uint32(), np.uint32),
        (pa.uint64(), np.uint64),
        (pa.float32(), np.float32),
        (pa.float64(), np.float64),
    )
}
_ARROW_OF = {numpy: arrow for arrow, numpy in _NUMPY_OF.items()}


def to_numpy(values: pa.Array | pa.ChunkedArray, fill: int | None = None) -> npt.NDArray[Any]:
    """``values`` as a numpy array (read-only where it shares Arrow's memory). Numbers and booleans without nulls
    go through their buffers, and numbers with nulls too when ``fill`` replaces them; anything else (strings, nulls
    without ``fill``) through pyarrow's own conversion."""
    array = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    if array.null_count and fill is not None and array.type in _NUMPY_OF:
        start, stop = array.offset, array.offset + len(array)
        validity, data = array.buffers()[:2]
        numbers = np.frombuffer(data, _NUMPY_OF[array.type], count=stop)[start:stop].copy()
        valid = np.unpackbits(np.frombuffer(validity, np.uint8), count=stop, bitorder="little")[start:stop]
        numbers[valid == 0] = fill
        return numbers
    if array.null_count == 0:
        start, stop = array.offset, array.offset + len(array)
        dtype = _NUMPY_OF.get(array.type)
        if dtype is not None:
            buffer = array.buffers()[1]
            if buffer is None:  # an empty array may have no data buffer
                return np.zeros(0, dtype)
            return np.frombuffer(buffer, dtype, count=stop)[start:stop]
        if pa.types.is_boolean(array.type):
            buffer = array.buffers()[1]
            bits = np.zeros(0, np.uint8) if buffer is None else np.frombuffer(buffer, np.uint8)
            return np.unpackbits(bits, count=stop, bitorder="little")[start:stop].astype(bool)
    converted: npt.NDArray[Any] = array.to_numpy(zero_copy_only=False)
    return converted


def numeric_array(values: npt.ArrayLike, dtype: npt.DTypeLike = np.int64) -> pa.Array:
    """An Arrow array of ``values`` as the numeric ``dtype`` (no nulls)."""
    data = np.ascontiguousarray(values, dtype=dtype)
    return pa.Array.from_buffers(_ARROW_OF[data.dtype], data.size, [None, pa.py_buffer(data)])


def bool_array(values: npt.ArrayLike) -> pa.Array:
    """An Arrow boolean array of ``values`` (no nulls): Arrow packs booleans as bits, least significant first."""
    flags = np.asarray(values, dtype=bool)
    bits = np.packbits(flags, bitorder="little")
    return pa.Array.from_buffers(pa.bool_(), flags.size, [None, pa.py_buffer(bits)])


def string_array(values: Sequence[str]) -> pa.Array:
    """An Arrow string array of ``values`` (no nulls)."""
    encoded = [value.encode() for value in values]
    offsets = np.zeros(len(encoded) + 1, np.int32)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return pa.Array.from_buffers(
        pa.string(), len(encoded), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))]
    )
