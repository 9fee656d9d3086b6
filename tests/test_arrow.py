"""routelog.format.arrow converts through buffers exactly what pyarrow's own conversions give."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from routelog.format.arrow import bool_array, numeric_array, string_array, to_numpy


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.float32])
def test_numbers_and_their_slices_convert_as_pyarrow_does(dtype: type) -> None:
    values = (np.arange(37) * 3 - 20).astype(dtype)
    array = pa.array(values)
    for piece in (array, array.slice(5, 20), array.slice(36), array.slice(37)):
        np.testing.assert_array_equal(to_numpy(piece), piece.to_numpy(zero_copy_only=False))
    chunked = pa.chunked_array([array.slice(0, 10), array.slice(10)])
    np.testing.assert_array_equal(to_numpy(chunked), values)
    if dtype in (np.int32, np.int64):
        assert numeric_array(values, dtype).equals(array)


def test_booleans_nulls_and_strings() -> None:
    flags = np.random.default_rng(0).random(29) < 0.5
    arrow = bool_array(flags)
    assert arrow.equals(pa.array(flags))
    np.testing.assert_array_equal(to_numpy(arrow.slice(3, 17)), flags[3:20])
    lengths = pc.list_value_length(pa.array([[1], None, [], [2, 3]]))
    np.testing.assert_array_equal(to_numpy(lengths, fill=0), [1, 0, 0, 2])
    np.testing.assert_array_equal(to_numpy(lengths.slice(1), fill=7), [7, 0, 2])
    assert string_array(["a", "", "ü-7"]).equals(pa.array(["a", "", "ü-7"]))
    assert to_numpy(numeric_array([], np.int32)).size == 0
