"""Reading blocks of committed parts: the shard indexes, then exactly the inner chunks a request touches, with
concurrent ranged reads of the shard objects; each chunk is checksum-verified, decoded into place and its rows
checked as sets (FORMAT.md section 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.errors import CorruptDataError
from routelog.format.codec import TopkOrder, decode_rows, invalid_row
from routelog.format.documents import CommitRecord, RoutingArrayInfo, WeightsArrayInfo
from routelog.format.part import shard_layout
from routelog.format.shard import (
    ChunkRead,
    ShardFormatError,
    ShardLayout,
    chunks_for,
    coalesce,
    decode_chunk,
    decode_shard_index,
)
from routelog.store.storage import Storage

MAX_GAP = 1 << 19
"""Byte gap under which two chunk reads of a shard merge into one request (fewer requests for some bytes more;
a trainer rank, which reads a fraction of each record, uses 0: bytes are what it pays for)."""


@dataclass(frozen=True)
class BlockRequest:
    """Layers ``[layers[0], layers[1])`` of rows ``[rows[0], rows[1])`` of one routing array of one part."""

    part_key: str
    """The part directory relative to the store root."""
    array: RoutingArrayInfo | WeightsArrayInfo
    """The part's decoder routing, one of its streams, or its routing weights."""
    shard_nbytes: tuple[int, ...]
    """Each shard's size as the commit lists it (0 when unlisted: every chunk then lies outside it)."""
    layers: tuple[int, int]
    rows: tuple[int, int]
    samples: tuple[str, ...] = ()
    """Records these rows belong to, named in errors."""

    @classmethod
    def of(
        cls,
        part_key: str,
        commit: CommitRecord,
        layers: tuple[int, int],
        rows: tuple[int, int],
        samples: tuple[str, ...] = (),
        *,
        stream: str | None = None,
        weights: bool = False,
    ) -> BlockRequest:
        """A request for the commit's decoder routing, for its stream ``stream``, or (``weights``, when the part
        has them) for its routing weights."""
        array: RoutingArrayInfo | WeightsArrayInfo = commit.routing if stream is None else commit.streams[stream]
        if weights:
            if commit.weights is None:
                raise ValueError(f"part {part_key!r} holds no routing weights")
            array = commit.weights
        sizes = {o.key: o.size for o in commit.objects}
        nbytes = tuple(sizes.get(f"{array.path}/{key}", 0) for key in shard_layout(array).shard_keys)
        return cls(part_key, array, nbytes, layers, rows, samples)

    @property
    def array_key(self) -> str:
        """The array's directory relative to the store root."""
        return f"{self.part_key}/{self.array.path}"

    def shard_reads(self) -> list[ShardRead]:
        """The request cut at shard boundaries: one read per shard its layers touch."""
        layout_ = shard_layout(self.array)
        if not self.array.n_rows or self.rows[0] >= self.rows[1] or self.layers[0] >= self.layers[1]:
            return []
        span = layout_.layers_per_shard
        reads = []
        for shard in range(layout_.shard_of(self.layers[0]), layout_.shard_of(self.layers[1] - 1) + 1):
            first = shard * span
            local = (max(self.layers[0], first) - first, min(self.layers[1], first + span) - first)
            key = f"{self.array_key}/{layout_.shard_key(shard)}"
            reads.append(ShardRead(key, self.shard_nbytes[shard], layout_, first, local))
        return reads


@dataclass(frozen=True)
class ShardRead:
    """The part of a :class:`BlockRequest` that one shard object holds."""

    key: str
    """The shard object's key relative to the store root (what the shard-index cache is keyed by)."""
    nbytes: int
    layout: ShardLayout
    first_layer: int
    """The array layer the shard starts at."""
    layers: tuple[int, int]
    """The requested layers, counted from the shard's first."""


class ShardIndexCache:
    """Shard indexes already fetched, keyed by shard object (a snapshot keeps one, so each index is read once)."""

    def __init__(self) -> None:
        self._indexes: dict[str, npt.NDArray[np.uint64]] = {}

    def fetch(self, storage: Storage, reads: Sequence[ShardRead]) -> dict[str, npt.NDArray[np.uint64]]:
        shards = {r.key: r for r in reads}
        missing = [r for key, r in shards.items() if key not in self._indexes]
        ranges = [(r.key, 0, r.layout.index_nbytes) for r in missing]
        for read, data in zip(missing, _read_ranges(storage, ranges, [()] * len(missing)), strict=True):
            try:
                index = decode_shard_index(data, read.layout, read.nbytes)
            except ShardFormatError as exc:
                raise CorruptDataError(f"{storage.url_of(read.key)}: {exc}") from exc
            self._indexes[read.key] = index
        return {key: self._indexes[key] for key in shards}


def fetch_blocks(
    storage: Storage,
    requests: Sequence[BlockRequest],
    cache: ShardIndexCache | None = None,
    max_gap: int = MAX_GAP,
) -> list[np.ndarray[Any, Any]]:
    """Decoded expert IDs (or stored weights) for each request, layer-major ``[layers, rows, topk]`` in the
    storage dtype.

    Two rounds of concurrent ranged reads: the shard indexes not cached yet, then exactly the inner chunks the
    requests touch (neighbouring chunks of a shard merged into one request). Each chunk is checksum-verified,
    decompressed into its place in the output and un-transformed there while it is in cache.
    """
    if not requests:
        return []
    reads = [request.shard_reads() for request in requests]
    indexes = (cache or ShardIndexCache()).fetch(storage, [read for shards in reads for read in shards])
    plans = [
        [(read, chunks_for(indexes[read.key], read.layout, read.layers, request.rows)) for read in shards]
        for request, shards in zip(requests, reads, strict=True)
    ]
    pieces = _read_pieces(storage, requests, plans, max_gap)
    blocks = []
    for request, planned in zip(requests, plans, strict=True):
        array, layout_ = request.array, shard_layout(request.array)
        # Ranked chunks decode to IDs themselves and untransformed ones are what they store; gaps are undone below.
        direct = isinstance(array, WeightsArrayInfo) or array.transform != "sorted_gaps"
        raw = np.empty(layout_.chunk_shape, layout_.dtype)  # scratch: stored form of one chunk
        ids = np.empty(layout_.chunk_shape, layout_.dtype)  # scratch: its expert IDs (or weights)
        (l0, l1), (r0, r1) = request.layers, request.rows
        block = np.empty((l1 - l0, r1 - r0, array.topk), dtype=layout_.dtype)
        # A ranked chunk decodes its overlap with the request straight into the block (each layer's rows are
        # contiguous there): no copy, and no work for its layers and rows outside the request.
        in_place = layout_.ranked
        chunk_layers, chunk_rows = layout_.chunk_layers, layout_.chunk_rows
        for read, chunks in planned:
            for chunk in chunks:
                cl0 = read.first_layer + chunk.layer_chunk * chunk_layers
                cr0 = chunk.row_chunk * chunk_rows
                ls, le = max(l0, cl0), min(l1, cl0 + chunk_layers)
                rs, re_ = max(r0, cr0), min(r1, cr0 + chunk_rows)
                target = block[ls - l0 : le - l0, rs - r0 : re_ - r0] if in_place else ids if direct else raw
                window = ((ls - cl0, le - cl0), (rs - cr0, re_ - cr0)) if in_place else None
                try:
                    decode_chunk(pieces[read.key, chunk.start], layout_, target, window)
                except ShardFormatError as exc:
                    raise CorruptDataError(
                        f"{storage.url_of(read.key)}: inner chunk rows [{cr0}, {cr0 + layout_.chunk_rows}) "
                        f"layer chunk {chunk.layer_chunk} cannot be decoded ({exc}); affected samples: "
                        f"{list(request.samples[:8])}"
                    ) from exc
                if in_place:
                    continue
                # Un-transform the whole chunk while it is contiguous and in cache, then place the overlap: one
                # contiguous copy per layer.
                if not direct:
                    decode_rows(raw, "sorted_gaps", out=ids)
                placed = ids[ls - cl0 : le - cl0, rs - cr0 : re_ - cr0]
                # FORMAT.md section 5: the rows handed out (never the chunk's padding, which is unspecified) are sets
                problem = None if isinstance(array, WeightsArrayInfo) else invalid_row(placed, *_universe(array))
                if problem is not None:
                    layer, row = divmod(problem.row, re_ - rs)
                    experts, order = _universe(array)
                    raise CorruptDataError(
                        f"{storage.url_of(read.key)}: inner chunk rows [{cr0}, {cr0 + layout_.chunk_rows}) "
                        f"layer chunk {chunk.layer_chunk}: layer {ls + layer} row {rs + row} decodes to "
                        f"{list(problem.values)}, no set of distinct IDs in [0, {experts})"
                        f"{' in ascending order' if order == 'sorted' else ''} ({problem.kind}); "
                        f"affected samples: {list(request.samples[:8])}"
                    )
                block[ls - l0 : le - l0, rs - r0 : re_ - r0] = placed
        blocks.append(block)
    return blocks


def _universe(array: RoutingArrayInfo | WeightsArrayInfo) -> tuple[int, TopkOrder]:
    """The experts and top-k order a routing array's rows are checked against."""
    if isinstance(array, WeightsArrayInfo):  # pragma: no cover - weights are never checked as sets
        raise TypeError("routing weights hold no sets")
    return array.num_experts, array.topk_order


def _read_pieces(
    storage: Storage,
    requests: Sequence[BlockRequest],
    plans: list[list[tuple[ShardRead, list[ChunkRead]]]],
    max_gap: int,
) -> dict[tuple[str, int], memoryview]:
    """The stored bytes of every planned chunk, keyed by (shard, offset); nearby chunks share one ranged read."""
    wanted: dict[str, set[tuple[int, int]]] = {}
    samples: dict[str, set[str]] = {}
    for request, planned in zip(requests, plans, strict=True):
        for read, chunks in planned:
            wanted.setdefault(read.key, set()).update((chunk.start, chunk.stop) for chunk in chunks)
            samples.setdefault(read.key, set()).update(request.samples)
    ranges = [(key, lo, hi) for key, spans in wanted.items() for lo, hi in coalesce(list(spans), max_gap)]
    datas = _read_ranges(storage, ranges, [tuple(samples[key]) for key, _, _ in ranges])
    pieces: dict[tuple[str, int], memoryview] = {}
    for (key, lo, hi), data in zip(ranges, datas, strict=True):
        view = memoryview(data)
        for start, stop in wanted[key]:
            if lo <= start and stop <= hi:
                pieces[(key, start)] = view[start - lo : stop - lo]
    return pieces


def _read_ranges(storage: Storage, ranges: list[tuple[str, int, int]], samples: list[tuple[str, ...]]) -> list[bytes]:
    try:
        return storage.read_ranges(ranges)
    except FileNotFoundError as exc:
        affected = sorted({s for group in samples for s in group})[:8]
        raise CorruptDataError(
            f"an object listed in its commit is missing from {storage.url}: {exc}; affected samples: {affected}"
        ) from exc
