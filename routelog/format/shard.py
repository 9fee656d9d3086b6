"""The bytes of a part's routing array: zarr v3 ``sharding_indexed`` shards, written and read directly.

The array is **layer-major**, ``[num_moe_layers, n_rows, K]``: a pipeline stage is a range of the first axis, a
record a range of the second, and a decoded chunk lands in a layer-major output with one contiguous copy per
layer (a row-major ``[rows, layers, K]`` output needs a 32-byte strided copy per row, which measured slower than
zstd itself). The trainer consumes one ``[T, K]`` tensor per router, so layer-major is also its natural order.

The layout is plain zarr v3 (zarr-python and TensorStore read it; tests prove zarr-python reads routelog's shards
bit-exactly and routelog reads zarr-python's): inner chunks of ``[chunk_layers, chunk_rows, K]``, each
``bytes -> zstd -> crc32c``, and an index of ``(offset, nbytes)`` uint64 pairs (``bytes -> crc32c``) at the
**start** of the shard, so one ranged read fetches it without knowing the object size. Inner chunks follow the
grid's C order (layer chunk, then row chunk): one stage's chunks over consecutive rows are adjacent bytes.

An array is one shard (every layer, every row: key ``c/0/0/0``) unless the part was written with
``shard_layers``: then shard ``i`` holds layers ``[i * shard_layers, (i + 1) * shard_layers)`` (key ``c/i/0/0``,
the last one padded like any edge chunk), so a pipeline stage reads only its own shards' indexes. A shard's index
has an entry per inner chunk of all its layers, and the reader fetches it whole (its crc32c covers it whole): with
one shard a stage's reader fetches every stage's entries.

Two chunk codecs, named by the array's transform:

* format 1 (``sorted_gaps`` and ``none``): ``bytes -> zstd -> crc32c`` over the stored form. uint16 IDs (more than
  256 experts) are stored as a uint8 array with a trailing byte axis, transposed by the ``transpose`` codec so each
  chunk holds its low-byte plane, then its high-byte plane: zstd then fits one Huffman table per plane
  (interleaved bytes cost ~25 % more).
* format 2 (``ranked_gaps``): ``routelog.ranked_gaps -> zstd -> crc32c`` over the expert IDs themselves (uint8 or
  uint16, no byte axis): the array -> bytes codec of :mod:`routelog.format.ranked`, which zarr-python finds through the
  ``zarr.codecs`` entry point, so ``zarr.open_array`` on a part returns expert IDs.

routelog encodes and decodes shards itself instead of going through zarr-python's array API, which costs ~0.5 ms
of asyncio/thread hand-off per inner chunk (measured: 80 MB/s write, 140 MB/s read on one core for chunks where
the same zstd work done directly runs at > 600 MB/s).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, Protocol

import google_crc32c
import numpy as np
import numpy.typing as npt

from routelog.format import context, mapped, ranked, zstd_frames
from routelog.format.context import CONTEXT_CODEC
from routelog.format.ranked import RANKED_CODEC
from routelog.format.row_blocks import RowBlocks


@dataclass(frozen=True)
class WrittenFile:
    """An object a build wrote straight to its local file (:class:`ShardSink`), not held in memory: the upload
    only makes it durable."""

    path: str
    size: int
    sha256: Callable[[], str]
    """Its digest, read back from the file by the store that wrote it."""
    new_directories: tuple[str, ...] = ()
    """Directories the sink created for it, whose entries (and their parents') must be made durable too."""

    def __len__(self) -> int:
        return self.size


class ShardSink(Protocol):
    """Where a shard's bytes go as they are compressed: a :class:`routelog.format.mapped.Buffer`, or a local file
    (``routelog.store.storage``'s), so the compressed part is never held in memory."""

    size: int

    def add(self, piece: bytes) -> None: ...

    def finish(self, head: bytes) -> mapped.Bytes | WrittenFile: ...


SinkFactory = Callable[[str, int, int], ShardSink]
"""``(object key, capacity, start) -> sink``: the sink of one shard object (its head, ``start`` bytes, written last)."""

EMPTY = np.uint64(2**64 - 1)
"""Index entry of an inner chunk that was never written (zarr reads it as the fill value 0; routelog refuses it:
its writers write every chunk)."""


class ShardFormatError(ValueError):
    """Shard bytes that fail a checksum or do not match the layout (wrapped as CorruptDataError by callers)."""


@dataclass(frozen=True)
class ShardLayout:
    """Geometry of a part's array ``[num_layers, n_rows, topk]`` and of its shards (one, or one per
    ``shard_layers`` layers)."""

    num_layers: int
    n_rows: int
    topk: int
    chunk_layers: int
    chunk_rows: int
    dtype: np.dtype[Any]
    ranked: bool = False
    """Chunks use the format-2 codec (:mod:`routelog.format.ranked`) over expert IDs; else format 1's plain bytes."""
    context: bool = False
    """Chunks use the ``ranked_context`` codec (:mod:`routelog.format.context`): coded against the array's model, stored
    beside the shards, given the token ids of their rows."""
    num_experts: int = 0
    """The ID universe (the ranked codec's tables have this many entries)."""
    shard_layers: int | None = None
    """Layers per shard (a multiple of ``chunk_layers``); None: one shard holds every layer."""

    @property
    def layers_per_shard(self) -> int:
        """The layers one shard spans (its last layer chunk padded)."""
        whole = math.ceil(self.num_layers / self.chunk_layers) * self.chunk_layers
        return whole if self.shard_layers is None else self.shard_layers

    @property
    def n_shards(self) -> int:
        return math.ceil(self.num_layers / self.layers_per_shard)

    def shard_of(self, layer: int) -> int:
        """The shard holding layer ``layer``."""
        return layer // self.layers_per_shard

    @property
    def grid(self) -> tuple[int, int]:
        """Inner chunks per shard along layers and rows (each shard is padded to whole chunks)."""
        return self.layers_per_shard // self.chunk_layers, max(1, math.ceil(self.n_rows / self.chunk_rows))

    @property
    def index_nbytes(self) -> int:
        """Bytes of one shard's index."""
        return math.prod(self.grid) * 16 + 4

    @property
    def chunk_shape(self) -> tuple[int, int, int]:
        return self.chunk_layers, self.chunk_rows, self.topk

    @property
    def planes(self) -> int:
        """Byte planes of a plain array: uint16 IDs are stored as two, float32 weights as four (the ranked codec
        splits its own)."""
        return 1 if self.ranked or self.context else self.dtype.itemsize

    def shard_key(self, shard: int = 0) -> str:
        """Key of shard ``shard``: ``c/<shard>/0/0`` (``c/<shard>/0/0/0`` with the byte axis of uint16 IDs)."""
        return f"c/{shard}" + "/0" * (2 if self.planes == 1 else 3)

    @property
    def shard_keys(self) -> list[str]:
        return [self.shard_key(i) for i in range(self.n_shards)]

    def zarr_metadata(self, zstd_level: int, attributes: dict[str, Any]) -> dict[str, Any]:
        """The array's ``zarr.json``, describing exactly the bytes :func:`encode_shard` produces."""
        shape = [self.num_layers, self.n_rows, self.topk]
        shard = [self.layers_per_shard, self.grid[1] * self.chunk_rows, self.topk]
        chunk = list(self.chunk_shape)
        names = ["layer", "row", "slot"]
        inner: list[dict[str, Any]] = [{"name": "bytes"}]
        data_type = "uint8"
        if self.ranked or self.context:
            data_type = self.dtype.name
            name = CONTEXT_CODEC if self.context else RANKED_CODEC
            inner = [{"name": name, "configuration": {"num_experts": self.num_experts, "level": zstd_level}}]
        elif self.planes > 1:
            shape, shard, chunk = [*shape, self.planes], [*shard, self.planes], [*chunk, self.planes]
            names.append("byte")
            inner = [{"name": "transpose", "configuration": {"order": [3, 0, 1, 2]}}, {"name": "bytes"}]
        if not (self.ranked or self.context):  # the ranked and context codecs compress their own output
            inner.append({"name": "zstd", "configuration": {"level": zstd_level, "checksum": False}})
        inner.append({"name": "crc32c"})
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": shape,
            "data_type": data_type,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": shard}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": 0,
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": chunk,
                        "codecs": inner,
                        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                        "index_location": "start",
                    },
                }
            ],
            "attributes": attributes,
            "dimension_names": names,
            "storage_transformers": [],
        }


def _crc(*pieces: bytes | bytearray | memoryview) -> bytes:
    """The crc32c of the pieces' bytes joined, as zarr stores it (little-endian)."""
    crc = 0
    for data in pieces:  # google_crc32c takes bytes or numpy arrays (zero-copy), not other buffers
        crc = google_crc32c.extend(crc, data if isinstance(data, bytes) else np.frombuffer(data, dtype=np.uint8))
    return int(crc).to_bytes(4, "little")


def encode_shards(
    stored: npt.NDArray[Any] | RowBlocks,
    layout: ShardLayout,
    zstd_level: int,
    transform: Callable[[npt.NDArray[Any]], npt.NDArray[Any]] | None = None,
    sink: SinkFactory | None = None,
    tokens: npt.NDArray[np.int64] | None = None,
    pool: Executor | None = None,
) -> dict[str, bytes | mapped.Bytes | WrittenFile]:
    """The shard objects for ``stored`` (``[num_layers, n_rows, topk]``, already in stored form, or the blocks it
    was appended in, see :mod:`routelog.format.row_blocks`), by key. ``transform`` maps each chunk's rows to what is
    stored, in place on a copy. ``sink`` makes each shard's sink (by default a mapped buffer). A context layout
    (:mod:`routelog.format.context`) also needs each row's token id, and adds the array's model
    (:data:`routelog.format.context.MODEL_KEY`). ``pool`` compresses the row chunks of each layer chunk
    concurrently (the kernels and zstd release the GIL); the objects are the same bytes either way."""
    blocks = RowBlocks.of(stored) if isinstance(stored, np.ndarray) else stored
    span = layout.layers_per_shard
    capacity = _max_shard_nbytes(layout)
    models: list[context.LayerModel] | None = None
    if layout.context:
        if tokens is None or tokens.shape != (blocks.n,):
            raise ValueError("a context-coded array needs the token id of each of its rows")
        models = []
    shards: dict[str, bytes | mapped.Bytes | WrittenFile] = {}
    for i in range(layout.n_shards):
        key = layout.shard_key(i)
        shard = (
            mapped.Buffer(capacity, layout.index_nbytes) if sink is None else sink(key, capacity, layout.index_nbytes)
        )
        coding = None if models is None or tokens is None else _Coding(tokens, models)
        shards[key] = shard.finish(_encode_shard(blocks, i * span, layout, zstd_level, transform, shard, coding, pool))
    if models is not None:
        shards[context.MODEL_KEY] = context.encode_model(models, layout.num_experts)
    return shards


@dataclass(frozen=True)
class _Coding:
    """What a context-coded shard is encoded with: its rows' token ids, and the list its layers' models join."""

    tokens: npt.NDArray[np.int64]
    models: list[context.LayerModel]


def encode_shard(stored: npt.NDArray[Any], layout: ShardLayout, zstd_level: int) -> mapped.Bytes:
    """One shard object for ``stored`` (its layers, at most ``layout.layers_per_shard``, in stored form)."""
    buffer = mapped.Buffer(_max_shard_nbytes(layout), layout.index_nbytes)
    return buffer.finish(_encode_shard(RowBlocks.of(stored), 0, layout, zstd_level, None, buffer))


def _max_shard_nbytes(layout: ShardLayout) -> int:
    """The most bytes one shard object can take: its index and every chunk at its largest."""
    return layout.index_nbytes + math.prod(layout.grid) * max_piece_nbytes(layout)


def _encode_shard(
    blocks: RowBlocks,
    first_layer: int,
    layout: ShardLayout,
    zstd_level: int,
    transform: Callable[[npt.NDArray[Any]], npt.NDArray[Any]] | None,
    shard: ShardSink,
    coding: _Coding | None = None,
    pool: Executor | None = None,
) -> bytes:
    """The chunks of the shard holding layers from ``first_layer`` on, added to ``shard`` as they are compressed
    (after room left for the index), and the shard's head, its index, to finish it with: the object is never held
    twice (joining the pieces would, for a moment, take a second copy of the whole shard), and held in a mapping
    (:mod:`routelog.format.mapped`) or not at all (a file). With a ``pool`` a layer chunk's row chunks are
    compressed on it, and added in order as they finish (a context layout's plans stay on this thread: building
    them holds the GIL, and planning the next layer chunks on the pool measured no faster)."""
    grid = layout.grid
    index = np.zeros((*grid, 2), dtype="<u8")
    cl, cr = layout.chunk_layers, layout.chunk_rows
    last_layer = min(blocks.layers, first_layer + layout.layers_per_shard)
    for lc in range(grid[0]):
        layers = slice(min(last_layer, first_layer + lc * cl), min(last_layer, first_layer + (lc + 1) * cl))
        planned = None
        if coding is not None:  # the layer chunk's models from its rows in the whole part, then its chunks
            whole = np.ascontiguousarray(blocks.rows(0, blocks.n, layers))
            planned = _Planned(whole, context.plan_layers(whole, coding.tokens, cr))
            coding.models.extend(planned.plan.models)
        chunk = partial(_chunk_payload, blocks, layers, planned, layout, zstd_level, transform)
        futures = [pool.submit(chunk, rc) for rc in range(grid[1])] if pool is not None and grid[1] > 1 else []
        try:
            for rc in range(grid[1]):
                payload = futures[rc].result() if futures else chunk(rc)
                offset = shard.size
                for piece in payload:
                    shard.add(piece)
                shard.add(_crc(*payload))
                index[lc, rc] = (offset, shard.size - offset)
        finally:  # a failed chunk: no compression may still read the rows when the caller lets them go
            for future in futures:
                future.cancel()
            wait(futures)
        blocks.release(layers)
    index_bytes = index.tobytes()
    return index_bytes + _crc(index_bytes)


class _Planned(NamedTuple):
    """A context-coded layer chunk ready to compress: its rows in the whole part, and their plan."""

    rows: npt.NDArray[Any]
    plan: context.LayerChunkPlan


def _chunk_payload(
    blocks: RowBlocks,
    layers: slice,
    planned: _Planned | None,
    layout: ShardLayout,
    zstd_level: int,
    transform: Callable[[npt.NDArray[Any]], npt.NDArray[Any]] | None,
    rc: int,
) -> list[bytes]:
    """The stored pieces of row chunk ``rc`` of a layer chunk (coded by its plan where it has one)."""
    cr = layout.chunk_rows
    r0, r1 = min(blocks.n, rc * cr), min(blocks.n, (rc + 1) * cr)
    if planned is not None:  # the chunk's rows inside the array only: the codec stores no padding
        return context.chunk_pieces(planned.plan, rc, planned.rows[:, r0:r1], layout.num_experts, zstd_level)
    return _payload(blocks.rows(r0, r1, layers), layout, zstd_level, transform)


def _payload(
    block: npt.NDArray[Any],
    layout: ShardLayout,
    zstd_level: int,
    transform: Callable[[npt.NDArray[Any]], npt.NDArray[Any]] | None,
) -> list[bytes]:
    """The stored pieces of one chunk of a format-1 or format-2 array: its rows transformed, padded to the chunk
    shape (readers never see the padding), then compressed."""
    if transform is not None:
        block = transform(np.array(block, order="C"))
    if block.shape != layout.chunk_shape:
        block = _padded(block, layout)
    if layout.ranked:  # the codec reads the block in place (each layer's rows are contiguous)
        return ranked.encode_pieces(block, layout.num_experts, level=zstd_level)
    block = np.ascontiguousarray(block, dtype=layout.dtype.newbyteorder("<"))
    if layout.planes > 1:
        block = np.ascontiguousarray(
            np.moveaxis(block.view(np.uint8).reshape(*layout.chunk_shape, layout.planes), 3, 0)
        )
    return [zstd_frames.compress(block, zstd_level)]


def _padded(block: npt.NDArray[Any], layout: ShardLayout) -> npt.NDArray[Any]:
    """An edge chunk grown to the chunk shape: with the fill value 0 in format 1 (as zarr writes it); with the last
    row repeated (and rows ``0..K-1`` in padding layers) for the ranked codec, where that costs a repeat bit."""
    layers, rows = block.shape[:2]
    if not layout.ranked:
        padded = np.zeros(layout.chunk_shape, dtype=block.dtype)
        padded[:layers, :rows] = block
        return padded
    padded = np.empty(layout.chunk_shape, dtype=block.dtype)
    padded[:layers, :rows] = block
    # Whole rows move as one K-byte item each (a broadcast of a [K] row costs ~7x more per chunk).
    row = np.dtype((np.void, layout.topk * block.dtype.itemsize))
    first_ids = np.arange(layout.topk, dtype=block.dtype).view(row)[0]
    padded.view(row)[layers:] = first_ids
    if rows < padded.shape[1]:
        padded.view(row)[:layers, rows:] = block.view(row)[:, -1:] if rows else first_ids
    return padded


def max_payload_nbytes(layout: ShardLayout) -> int:
    """The most bytes one inner chunk's compressed payload can take (before its crc32c)."""
    if layout.context:
        return context.max_chunk_nbytes(*layout.chunk_shape, layout.dtype.itemsize, layout.num_experts)
    if layout.ranked:
        return ranked.max_stored_nbytes(layout.chunk_shape, layout.dtype.itemsize, layout.num_experts)
    return zstd_frames.compress_bound(math.prod(layout.chunk_shape) * layout.planes)


def max_piece_nbytes(layout: ShardLayout) -> int:
    """The most bytes one stored inner chunk can take: the compressed payload's bound, plus its crc32c."""
    return max_payload_nbytes(layout) + 4


def decode_shard_index(data: bytes, layout: ShardLayout, shard_nbytes: int) -> npt.NDArray[np.uint64]:
    """``[layer_chunks, row_chunks, 2]`` (offset, nbytes) from the shard's leading index bytes.

    Every chunk must be present (routelog writes them all; a missing chunk would read back as the fill value, i.e.
    made-up routes) and lie inside the shard's ``shard_nbytes``, at most the compression bound long.
    """
    if len(data) != layout.index_nbytes:
        raise ShardFormatError(f"shard index has {len(data)} bytes, expected {layout.index_nbytes}")
    body, crc = data[:-4], data[-4:]
    if _crc(body) != crc:
        raise ShardFormatError("shard index checksum mismatch")
    index = np.frombuffer(body, dtype="<u8").reshape(*layout.grid, 2)
    offsets, sizes = index[..., 0], index[..., 1]
    if ((offsets == EMPTY) | (sizes == EMPTY)).any():
        raise ShardFormatError("the shard index marks an inner chunk as never written; its rows were lost")
    ends = offsets + sizes  # no overflow: both are below 2**63 once the checks below pass
    if (
        (offsets < layout.index_nbytes).any()
        or (sizes < 5).any()
        or (sizes > max_piece_nbytes(layout)).any()
        or (offsets > shard_nbytes).any()
        or (ends > shard_nbytes).any()
    ):
        raise ShardFormatError(f"the shard index points outside the shard's {shard_nbytes} bytes")
    return index


class ChunkContext(NamedTuple):
    """What a context-coded chunk decodes with: the token id of each of its rows inside the array, and the models
    of its layers inside the array (their counts are the chunk's real shape)."""

    tokens: npt.NDArray[np.int64]
    models: Sequence[context.LayerModel]


def decode_chunk(
    piece: bytes | memoryview,
    layout: ShardLayout,
    out: npt.NDArray[Any] | None = None,
    window: ranked.Window | None = None,
    coded_with: ChunkContext | None = None,
) -> npt.NDArray[Any]:
    """One inner chunk ``[chunk_layers, chunk_rows, topk]`` in the native dtype, checksum verified; of a ranked or
    context-coded array, only the chunk's ``window`` when given (:func:`routelog.format.ranked.decode`; a context
    chunk's window lies inside the array, and ``coded_with`` gives its rows' tokens and its layers' models).

    ``out`` (of the chunk's, or the window's, shape and dtype; C-contiguous, or for ranked arrays each layer's rows
    contiguous, such as a window of a reader's block) receives the values without an allocation.
    """
    stored = np.frombuffer(piece, dtype=np.uint8)
    if stored.size < 5 or google_crc32c.value(stored[:-4]) != int.from_bytes(stored[-4:], "little"):
        raise ShardFormatError("inner chunk checksum mismatch")
    payload = stored[:-4]
    if layout.context:
        if coded_with is None:
            raise ValueError("a context-coded chunk decodes only with its rows' tokens and its layers' models")
        real = (len(coded_with.models), coded_with.tokens.size, layout.topk)
        target = out
        if out is None and window is None:  # the whole chunk: the rows inside the array, the padding zeros
            target = np.zeros(layout.chunk_shape, dtype=layout.dtype)
            out = target[: real[0], : real[1]]
        try:
            found = context.decode_chunk(
                payload, real, layout.dtype, layout.num_experts, coded_with.tokens, coded_with.models, out, window
            )
        except context.ContextFormatError as exc:
            raise ShardFormatError(str(exc)) from exc
        return found if target is None else target
    if layout.ranked:
        try:
            return ranked.decode(payload, layout.chunk_shape, layout.dtype, layout.num_experts, out, window)
        except ranked.RankedFormatError as exc:
            raise ShardFormatError(str(exc)) from exc
    if window is not None:
        raise ValueError("only ranked chunks decode a window")
    target = np.empty(layout.chunk_shape, dtype=layout.dtype) if out is None else out
    size = math.prod(layout.chunk_shape) * layout.planes
    if layout.planes == 1:
        _decompress(payload, target.reshape(-1), size)
        return target
    planes = np.empty(size, dtype=np.uint8)
    _decompress(payload, planes, size)
    target.view(np.uint8).reshape(*layout.chunk_shape, layout.planes)[...] = np.moveaxis(
        planes.reshape(layout.planes, *layout.chunk_shape), 0, 3
    )
    return target


def _decompress(payload: npt.NDArray[np.uint8], out: npt.NDArray[np.uint8], size: int) -> None:
    # The frame must declare exactly one chunk's bytes: one that claims more is refused before it is decoded.
    try:
        out[...] = zstd_frames.decompress(payload, size, "inner chunk", exact=True)
    except zstd_frames.FrameError as exc:
        raise ShardFormatError(f"zstd cannot decode the inner chunk ({exc})") from exc


class ChunkRead(NamedTuple):
    """One inner chunk to fetch: its grid position and byte range in the shard (a named tuple: a loader's fetch
    plans one per chunk)."""

    layer_chunk: int
    row_chunk: int
    start: int
    stop: int


def chunks_for(
    index: npt.NDArray[np.uint64], layout: ShardLayout, layers: tuple[int, int], rows: tuple[int, int]
) -> list[ChunkRead]:
    """The inner chunks covering layers ``[layers)`` and rows ``[rows)``, in shard byte order."""
    l0, l1 = layers[0] // layout.chunk_layers, (layers[1] - 1) // layout.chunk_layers + 1
    r0, r1 = rows[0] // layout.chunk_rows, (rows[1] - 1) // layout.chunk_rows + 1
    spans = index[l0:l1, r0:r1].tolist()  # Python ints, not a numpy scalar per value
    return [
        ChunkRead(lc, rc, offset, offset + nbytes)
        for lc, row_spans in enumerate(spans, l0)
        for rc, (offset, nbytes) in enumerate(row_spans, r0)
    ]


def coalesce(ranges: list[tuple[int, int]], max_gap: int) -> list[tuple[int, int]]:
    """Merge byte ranges closer than ``max_gap``: fewer requests for a little more data."""
    merged: list[tuple[int, int]] = []
    for start, stop in sorted(ranges):
        if merged and start - merged[-1][1] <= max_gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged
