"""A part's routing array is plain zarr v3: zarr-python reads routelog's shards, and routelog reads zarr-python's."""

from __future__ import annotations

import itertools
import json
import uuid

import numpy as np
import pytest
import zarr
from zarr.storage import MemoryStore

from routelog.format.shard import (
    ShardFormatError,
    ShardLayout,
    chunks_for,
    decode_chunk,
    decode_shard_index,
    encode_shard,
)

CASES = [
    # (layers, rows, K, chunk_layers, chunk_rows, dtype): edge chunks padded on both axes, uint16 byte planes
    (6, 1000, 8, 4, 256, np.uint8),
    (13, 300, 6, 4, 128, np.uint16),
    (3, 5, 1, 4, 4096, np.uint8),
    (48, 4096, 8, 4, 4096, np.uint8),
]


def _zarr_view(objects: dict[str, bytes]) -> zarr.Array:
    """Open routelog's objects with zarr-python (metadata from zarr.json, data from the shard)."""
    from zarr.core.buffer import default_buffer_prototype

    store = MemoryStore()
    proto = default_buffer_prototype()
    for key, data in objects.items():
        zarr.core.sync.sync(store.set(key, proto.buffer.from_bytes(data)))
    return zarr.open_array(store, mode="r")


def _logical(array: zarr.Array, layout: ShardLayout) -> np.ndarray:
    """zarr's view back to routelog's IDs (uint16 arrays carry a trailing little-endian byte axis)."""
    values = array[...]
    if layout.planes == 1:
        return values
    return values[..., 0].astype(np.uint16) | (values[..., 1].astype(np.uint16) << 8)


@pytest.mark.parametrize(("layers", "rows", "k", "cl", "cr", "dtype"), CASES)
def test_zarr_python_reads_routelog_shards(layers: int, rows: int, k: int, cl: int, cr: int, dtype: type) -> None:
    rng = np.random.default_rng(layers * rows)
    data = rng.integers(0, np.iinfo(dtype).max, size=(layers, rows, k), dtype=dtype)
    layout = ShardLayout(layers, rows, k, cl, cr, np.dtype(dtype))
    metadata = layout.zarr_metadata(3, {"test": True})
    objects = {"zarr.json": json.dumps(metadata).encode(), layout.shard_key(): encode_shard(data, layout, 3)}
    array = _zarr_view(objects)
    assert array.attrs["test"] is True
    np.testing.assert_array_equal(_logical(array, layout), data)


def _decode_all(shard: bytes, layout: ShardLayout) -> np.ndarray:
    """Every inner chunk of ``shard`` decoded by routelog, placed into the whole array."""
    layers, rows, k, cl, cr = layout.num_layers, layout.n_rows, layout.topk, layout.chunk_layers, layout.chunk_rows
    index = decode_shard_index(shard[: layout.index_nbytes], layout, len(shard))
    out = np.empty((layers, rows, k), dtype=layout.dtype)
    for chunk in chunks_for(index, layout, (0, layers), (0, rows)):
        l0, r0 = chunk.layer_chunk * cl, chunk.row_chunk * cr
        values = decode_chunk(shard[chunk.start : chunk.stop], layout)
        out[l0 : l0 + cl, r0 : r0 + cr] = values[: min(cl, layers - l0), : min(cr, rows - r0)]
    return out


def _zarr_python_shard(data: np.ndarray, layout: ShardLayout, *, write_empty_chunks: bool) -> bytes:
    layers, rows, k = data.shape
    buffers: dict[str, object] = {}
    store = MemoryStore(buffers)  # type: ignore[arg-type]
    with zarr.config.set({"array.write_empty_chunks": write_empty_chunks}):
        array = zarr.create_array(
            store, shape=(layers, rows, k), dtype=layout.dtype if layout.ranked else "uint8", chunks=(1, 1, 1)
        )  # placeholder
        array = zarr.AsyncArray(metadata=layout.zarr_metadata(3, {}), store_path=array.store_path)  # type: ignore[call-overload]
        zarr.core.sync.sync(array._save_metadata(array.metadata))
        view = zarr.Array(array)
        view[...] = data if layout.planes == 1 else data.view(np.uint8).reshape(layers, rows, k, 2)
    return bytes(buffers[layout.shard_key()].to_bytes())  # type: ignore[attr-defined]


@pytest.mark.parametrize(("layers", "rows", "k", "cl", "cr", "dtype"), CASES)
def test_routelog_reads_zarr_python_shards(layers: int, rows: int, k: int, cl: int, cr: int, dtype: type) -> None:
    rng = np.random.default_rng(layers + rows)
    data = rng.integers(0, np.iinfo(dtype).max, size=(layers, rows, k), dtype=dtype)
    if layers > cl or rows > cr:
        data[: min(cl, layers), : min(cr, rows)] = 0  # one all-fill chunk, written only with write_empty_chunks
    layout = ShardLayout(layers, rows, k, cl, cr, np.dtype(dtype))
    shard = _zarr_python_shard(data, layout, write_empty_chunks=True)
    np.testing.assert_array_equal(_decode_all(shard, layout), data)


def test_a_chunk_marked_never_written_is_refused_not_filled() -> None:
    """zarr-python leaves an all-fill chunk unwritten by default; routelog's writers write every chunk, so an
    empty index entry means lost rows, never expert 0 (FORMAT.md section 4)."""
    layout = ShardLayout(2, 100, 4, 1, 64, np.dtype(np.uint8))
    data = np.random.default_rng(1).integers(1, 200, size=(2, 100, 4), dtype=np.uint8)
    data[0, :64] = 0
    shard = _zarr_python_shard(data, layout, write_empty_chunks=False)
    with pytest.raises(ShardFormatError, match="never written"):
        decode_shard_index(shard[: layout.index_nbytes], layout, len(shard))


def test_stage_chunks_are_adjacent_bytes() -> None:
    layout = ShardLayout(16, 4096 * 4, 8, 4, 4096, np.dtype(np.uint8))
    data = np.random.default_rng(0).integers(0, 128, size=(16, 4096 * 4, 8), dtype=np.uint8)
    shard = encode_shard(data, layout, 3)
    index = decode_shard_index(shard[: layout.index_nbytes], layout, len(shard))
    chunks = chunks_for(index, layout, (4, 8), (0, 4096 * 4))
    assert [c.layer_chunk for c in chunks] == [1, 1, 1, 1]
    assert all(a.stop == b.start for a, b in itertools.pairwise(chunks))


def test_damaged_bytes_fail_their_checksum() -> None:
    layout = ShardLayout(4, 100, 8, 4, 64, np.dtype(np.uint8))
    data = np.random.default_rng(0).integers(0, 128, size=(4, 100, 8), dtype=np.uint8)
    shard = bytearray(encode_shard(data, layout, 3))
    index = decode_shard_index(bytes(shard[: layout.index_nbytes]), layout, len(shard))
    first = chunks_for(index, layout, (0, 4), (0, 100))[0]
    shard[first.start + 3] ^= 0xFF
    with pytest.raises(ShardFormatError, match="checksum"):
        decode_chunk(bytes(shard[first.start : first.stop]), layout)
    shard[5] ^= 0xFF
    with pytest.raises(ShardFormatError, match="index checksum"):
        decode_shard_index(bytes(shard[: layout.index_nbytes]), layout, len(shard))


def test_tensorstore_style_reader_sees_documented_attributes() -> None:
    layout = ShardLayout(2, 10, 4, 4, 4096, np.dtype(np.uint16))
    metadata = layout.zarr_metadata(3, {"routelog": {"transform": "sorted_gaps"}})
    assert metadata["shape"] == [2, 10, 4, 2]
    assert metadata["dimension_names"] == ["layer", "row", "slot", "byte"]
    assert metadata["codecs"][0]["configuration"]["index_location"] == "start"
    assert str(uuid.UUID(int=0))  # metadata is plain JSON
    json.dumps(metadata)


def _valid_sets(rng: np.random.Generator, layers: int, rows: int, k: int, experts: int, dtype: type) -> np.ndarray:
    keys = rng.random((layers * rows, experts))
    return np.sort(np.argsort(keys, axis=1)[:, :k], axis=1).astype(dtype).reshape(layers, rows, k)


@pytest.mark.parametrize(("layers", "rows", "k", "cl", "cr", "dtype"), CASES[:3])
def test_format_2_shards_read_both_ways_with_zarr_python(
    layers: int, rows: int, k: int, cl: int, cr: int, dtype: type
) -> None:
    """Format 2 (ranked_gaps): zarr-python decodes routelog's shards to the IDs through the registered codec, and
    routelog decodes shards zarr-python wrote (its edge padding holds the fill value, kept as exceptions)."""
    experts = 256 if dtype is np.uint8 else 1000
    data = _valid_sets(np.random.default_rng(layers * k), layers, rows, k, experts, dtype)
    layout = ShardLayout(layers, rows, k, cl, cr, np.dtype(dtype), ranked=True, num_experts=experts)
    objects = {
        "zarr.json": json.dumps(layout.zarr_metadata(3, {})).encode(),
        layout.shard_key(): encode_shard(data, layout, 3),
    }
    np.testing.assert_array_equal(_zarr_view(objects)[...], data)
    shard = _zarr_python_shard(data, layout, write_empty_chunks=True)
    np.testing.assert_array_equal(_decode_all(shard, layout), data)
