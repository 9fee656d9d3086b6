"""Reading blocks of committed parts: the shard indexes, then exactly the inner chunks a request touches, with
concurrent ranged reads of the shard objects; each chunk is checksum-verified and decoded once (a snapshot keeps
the latest decoded chunks, within a byte budget, for the reads that follow: records stored side by side share
chunks), and the rows handed out are checked as sets (FORMAT.md section 5).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.errors import CorruptDataError
from routelog.format import context
from routelog.format.codec import TopkOrder, decode_rows, invalid_row
from routelog.format.documents import CommitRecord, RoutingArrayInfo, WeightsArrayInfo
from routelog.format.index_rows import RowTokens
from routelog.format.part import shard_layout
from routelog.format.shard import (
    ChunkContext,
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
    model_nbytes: int = 0
    """The size of the array's model as the commit lists it (context-coded arrays; 0 otherwise)."""

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
        model = sizes.get(f"{array.path}/{context.MODEL_KEY}", 0)
        return cls(part_key, array, nbytes, layers, rows, samples, model)

    @property
    def model_key(self) -> str:
        """The array's model object relative to the store root (context-coded arrays)."""
        return f"{self.array_key}/{context.MODEL_KEY}"

    def model_layers(self) -> tuple[int, int]:
        """The layers whose models the request's chunks decode with: from its first layer chunk's first layer."""
        layout_ = shard_layout(self.array)
        first = self.layers[0] // layout_.chunk_layers * layout_.chunk_layers
        last = min(layout_.num_layers, -(-self.layers[1] // layout_.chunk_layers) * layout_.chunk_layers)
        return first, last

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


MODEL_CACHE_BYTES = 64 << 20
"""What a snapshot keeps of the ``ranked_context`` models it fetched (each layer's list and lookup tables), least
recently used first out past it."""
CHUNK_CACHE_BYTES = 32 << 20
"""What a snapshot keeps of the chunks it decoded last (a 4096-row chunk of 4 layers of top-8 uint8 IDs is 128 KiB):
a record read after its neighbour finds the chunks they share decoded."""


SCRATCH_BYTES = 64 << 20
"""The largest read buffer a snapshot keeps, per thread, for its next read (a batch of 32 records of 4096 tokens,
48 layers of top-8 of 128, reads 33 MB of chunks); a larger read gets a buffer of its own."""


class ReadCache:
    """What a snapshot keeps between reads: every shard index it fetched (each is read once), the chunks it
    decoded last, least recently used first out past ``chunk_bytes``, and each thread's read buffer. Safe to share
    between threads."""

    def __init__(self, chunk_bytes: int = CHUNK_CACHE_BYTES) -> None:
        self._indexes: dict[str, npt.NDArray[np.uint64]] = {}
        self._model_heads: dict[str, context.ModelHead] = {}
        self._models: OrderedDict[tuple[str, int], context.LayerModel] = OrderedDict()
        self._model_bytes = 0
        self._chunks: OrderedDict[tuple[str, int], np.ndarray[Any, Any]] = OrderedDict()
        self._chunk_bytes = 0
        self.chunk_budget = chunk_bytes
        self._lock = threading.Lock()
        self._scratch = threading.local()

    def scratch(self, nbytes: int) -> memoryview:
        """A buffer of at least ``nbytes`` for this thread's read; the same memory as its last one when that was
        large enough (what it held is overwritten)."""
        kept: bytearray | None = getattr(self._scratch, "buffer", None)
        if kept is not None and len(kept) >= nbytes:
            return memoryview(kept)
        buffer = bytearray(nbytes)
        if nbytes <= SCRATCH_BYTES:
            self._scratch.buffer = buffer
        return memoryview(buffer)

    def fetch(self, storage: Storage, reads: Sequence[ShardRead]) -> dict[str, npt.NDArray[np.uint64]]:
        shards = {r.key: r for r in reads}
        missing = [r for key, r in shards.items() if key not in self._indexes]
        ranges = [(r.key, 0, r.layout.index_nbytes) for r in missing]
        with _objects_listed(storage, [()]):
            datas = storage.read_ranges(ranges)
        for read, data in zip(missing, datas, strict=True):
            try:
                index = decode_shard_index(data, read.layout, read.nbytes)
            except ShardFormatError as exc:
                raise CorruptDataError(f"{storage.url_of(read.key)}: {exc}") from exc
            self._indexes[read.key] = index
        return {key: self._indexes[key] for key in shards}

    def fetch_models(
        self, storage: Storage, requests: Sequence[BlockRequest]
    ) -> dict[tuple[str, int], context.LayerModel]:
        """The models of the layers context-coded requests decode with (:meth:`BlockRequest.model_layers`), by
        (model key, layer): those the cache keeps, and the others fetched, the heads of the arrays' models not seen
        yet, then the sections, in two rounds of concurrent ranged reads, each section checked before use
        (:func:`routelog.format.context.decode_section`); then kept, least recently used first out past
        :data:`MODEL_CACHE_BYTES`."""
        needed: dict[tuple[str, int], context.LayerModel | None] = {}
        arrays: dict[str, RoutingArrayInfo] = {}
        sizes: dict[str, int] = {}
        for request in requests:
            if isinstance(request.array, RoutingArrayInfo) and shard_layout(request.array).context:
                arrays[request.model_key] = request.array
                sizes[request.model_key] = request.model_nbytes
                first, last = request.model_layers()
                for layer in range(first, last):
                    needed[(request.model_key, layer)] = self._models.get((request.model_key, layer))
        wanted = sorted(item for item, model in needed.items() if model is None)
        with self._lock:
            for item in needed:
                if item in self._models:
                    self._models.move_to_end(item)
        samples = [tuple(sorted({s for r in requests if r.model_key in arrays for s in r.samples}))]
        heads = {key: arrays[key] for key, _ in wanted if key not in self._model_heads}
        ranges = [(key, 0, context.model_header_nbytes(array.num_moe_layers)) for key, array in heads.items()]
        with _objects_listed(storage, samples):
            datas = storage.read_ranges(ranges)
        for (key, array), data in zip(heads.items(), datas, strict=True):
            try:
                self._model_heads[key] = context.read_model_head(
                    data, array.num_moe_layers, sizes[key], array.num_experts
                )
            except context.ContextFormatError as exc:
                raise CorruptDataError(f"{storage.url_of(key)}: {exc}") from exc
        ranges = []
        for key, layer in wanted:
            ends = self._model_heads[key].ends
            start = context.model_header_nbytes(ends.size) if layer == 0 else int(ends[layer - 1])
            ranges.append((key, start, int(ends[layer])))
        with _objects_listed(storage, samples):
            datas = storage.read_ranges(ranges)
        for (key, layer), data in zip(wanted, datas, strict=True):  # ascending: a layer's below is decoded first
            array = arrays[key]
            layout_ = shard_layout(array)
            below = needed[(key, layer - 1)] if layer % layout_.chunk_layers else None
            below_sets = None if below is None else below.n_sets
            try:
                needed[(key, layer)] = context.decode_section(
                    data,
                    layer,
                    array.n_rows,
                    array.topk,
                    layout_.dtype,
                    array.num_experts,
                    below_sets,
                    self._model_heads[key].version,
                )
            except context.ContextFormatError as exc:
                raise CorruptDataError(f"{storage.url_of(key)}: {exc}") from exc
        found = {item: model for item, model in needed.items() if model is not None}
        with self._lock:
            for item in wanted:
                self._models[item] = found[item]
                self._model_bytes += found[item].nbytes
            while self._model_bytes > MODEL_CACHE_BYTES and len(self._models) > 1:
                _, dropped = self._models.popitem(last=False)
                self._model_bytes -= dropped.nbytes
        return found

    def chunk(self, key: tuple[str, int]) -> np.ndarray[Any, Any] | None:
        """The decoded chunk at ``key`` (shard key, chunk offset), when it is still kept."""
        with self._lock:
            found = self._chunks.get(key)
            if found is not None:
                self._chunks.move_to_end(key)
            return found

    def keep(self, key: tuple[str, int], chunk: np.ndarray[Any, Any]) -> None:
        if chunk.nbytes > self.chunk_budget:
            return
        with self._lock:
            if key in self._chunks:
                return
            self._chunks[key] = chunk
            self._chunk_bytes += chunk.nbytes
            while self._chunk_bytes > self.chunk_budget:
                _, dropped = self._chunks.popitem(last=False)
                self._chunk_bytes -= dropped.nbytes


Destination = tuple[int, np.ndarray[Any, Any]]
"""Where some of a request's rows go: ``(first row, view)``, the view ``[layers, rows, topk]`` (each layer's rows
contiguous) taking the request's layers for rows ``[first row, first row + rows)`` of the array."""


def fetch_blocks(
    storage: Storage,
    requests: Sequence[BlockRequest],
    cache: ReadCache | None = None,
    max_gap: int = MAX_GAP,
    into: Sequence[Sequence[Destination] | None] | None = None,
    row_tokens: Callable[[str], RowTokens] | None = None,
) -> list[np.ndarray[Any, Any]]:
    """Decoded expert IDs (or stored weights) for each request, layer-major ``[layers, rows, topk]`` in the
    storage dtype; where ``into`` lists a request's destinations, written to them instead (rows between them are
    not written anywhere) and the request's entry in the result is an empty array.

    Two rounds of concurrent ranged reads: the shard indexes not cached yet, then exactly the inner chunks the
    requests touch that ``cache`` does not hold decoded (neighbouring chunks of a shard merged into one request).
    Each chunk is checksum-verified and decoded whole once, its rows un-transformed; each request then takes its
    overlap, checked as sets (a chunk's edge padding is never handed out). A whole chunk that one destination
    takes and no other request shares (a record's own rows) is decoded straight into it: no copy.

    Context-coded arrays (:mod:`routelog.format.context`) also fetch their models' sections for the layers read, once
    per cache, and decode with the token id of each row of the part: ``row_tokens(part_key)``.
    """
    if not requests:
        return []
    cache = cache or ReadCache()
    reads = [request.shard_reads() for request in requests]
    indexes = cache.fetch(storage, [read for shards in reads for read in shards])
    models = cache.fetch_models(storage, requests)
    plans = [
        [(read, chunks_for(indexes[read.key], read.layout, read.layers, request.rows)) for read in shards]
        for request, shards in zip(requests, reads, strict=True)
    ]
    # Chunks already decoded are held here for the whole call (the cache may drop them meanwhile); the others read.
    held: dict[tuple[str, int], np.ndarray[Any, Any]] = {}
    for planned in plans:
        for read, chunks in planned:
            for chunk in chunks:
                found = cache.chunk((read.key, chunk.start))
                if found is not None:
                    held[(read.key, chunk.start)] = found
    unread = [[(read, [c for c in chunks if (read.key, c.start) not in held]) for read, chunks in p] for p in plans]
    pieces = _read_pieces(storage, cache, requests, unread, max_gap)
    uses = Counter((read.key, chunk.start) for planned in plans for read, chunks in planned for chunk in chunks)
    blocks = []
    for i, (request, planned) in enumerate(zip(requests, plans, strict=True)):
        array, layout_ = request.array, shard_layout(request.array)
        (l0, l1), (r0, r1) = request.layers, request.rows
        destinations = None if into is None else into[i]
        if destinations is None:
            block = np.empty((l1 - l0, r1 - r0, array.topk), dtype=layout_.dtype)
            destinations = ((r0, block),)
        else:
            block = np.empty((0, 0, array.topk), dtype=layout_.dtype)
        chunk_layers, chunk_rows = layout_.chunk_layers, layout_.chunk_rows
        for read, chunks in planned:
            for chunk in chunks:
                key = (read.key, chunk.start)
                cl0 = read.first_layer + chunk.layer_chunk * chunk_layers
                cr0 = chunk.row_chunk * chunk_rows
                ls, le = max(l0, cl0), min(l1, cl0 + chunk_layers)
                rs, re_ = max(r0, cr0), min(r1, cr0 + chunk_rows)
                takers = [(d0, view) for d0, view in destinations if d0 < re_ and rs < d0 + view.shape[1]]
                # The chunk's rows inside the array (an edge chunk's padding past them is never decoded)
                real_layers = min(chunk_layers, layout_.num_layers - cl0)
                real_rows = min(chunk_rows, layout_.n_rows - cr0)
                ids = held.get(key)
                # A ranked chunk's rows are checked in the kernel's pass as it decodes; a context chunk's are listed
                # sets (checked with the model) or format-2 rows
                checked = layout_.ranked or layout_.context
                coded_with = None
                if ids is None and layout_.context:
                    if row_tokens is None:
                        raise ValueError("fetch_blocks: context-coded parts decode only with their rows' token ids")
                    tokens = row_tokens(request.part_key).window(cr0, cr0 + real_rows)
                    layers = [models[(request.model_key, layer)] for layer in range(cl0, cl0 + real_layers)]
                    coded_with = ChunkContext(tokens, layers)
                if ids is None and checked:
                    whole_once = uses[key] == 1 and (le - ls, re_ - rs) == (real_layers, real_rows)
                    if (
                        whole_once
                        and len(takers) == 1
                        and takers[0][0] <= rs
                        and re_ <= takers[0][0] + takers[0][1].shape[1]
                    ):
                        # A whole chunk no other request of the call shares, all of it for one destination: decoded
                        # in place, and not kept (no neighbour reads it).
                        d0, view = takers[0]
                        _decoded(
                            storage,
                            read,
                            chunk,
                            pieces[key],
                            request,
                            view[ls - l0 : le - l0, rs - d0 : re_ - d0],
                            coded_with,
                        )
                        continue
                    ids = np.empty((chunk_layers, chunk_rows, array.topk), dtype=layout_.dtype)
                    _decoded(storage, read, chunk, pieces[key], request, ids[:real_layers, :real_rows], coded_with)
                    if not whole_once:
                        held[key] = ids
                        cache.keep(key, ids)
                elif ids is None:
                    ids = _decoded(storage, read, chunk, pieces[key], request)
                    held[key] = ids
                    cache.keep(key, ids)
                placed = ids[ls - cl0 : le - cl0]
                # FORMAT.md section 5: the rows handed out (never the chunk's padding, which is unspecified) are sets
                problem = (
                    None
                    if checked or isinstance(array, WeightsArrayInfo)
                    else invalid_row(placed[:, rs - cr0 : re_ - cr0], *_universe(array))
                )
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
                for d0, view in takers:
                    a, b = max(rs, d0), min(re_, d0 + view.shape[1])
                    view[ls - l0 : le - l0, a - d0 : b - d0] = placed[:, a - cr0 : b - cr0]
        blocks.append(block)
    return blocks


def _decoded(
    storage: Storage,
    read: ShardRead,
    chunk: ChunkRead,
    piece: memoryview,
    request: BlockRequest,
    out: np.ndarray[Any, Any] | None = None,
    coded_with: ChunkContext | None = None,
) -> np.ndarray[Any, Any]:
    """One whole chunk's expert IDs (or weights), un-transformed; its edge padding is whatever was stored. With
    ``out`` (a ranked chunk's first ``out.shape[0]`` layers of its first ``out.shape[1]`` rows, each layer's rows
    contiguous: the chunk's rows inside the array), only those, into ``out``, every row checked as a set."""
    layout_ = read.layout
    array = request.array
    try:
        window = None if out is None else ((0, out.shape[0]), (0, out.shape[1]))
        ids = decode_chunk(piece, layout_, out, window, coded_with)
    except ShardFormatError as exc:
        raise CorruptDataError(
            f"{storage.url_of(read.key)}: inner chunk rows [{chunk.row_chunk * layout_.chunk_rows}, "
            f"{(chunk.row_chunk + 1) * layout_.chunk_rows}) layer chunk {chunk.layer_chunk} cannot be decoded "
            f"({exc}); affected samples: {list(request.samples[:8])}"
        ) from exc
    # Ranked chunks decode to IDs themselves and untransformed ones are what they store; gaps are undone here.
    if not isinstance(array, WeightsArrayInfo) and array.transform == "sorted_gaps":
        ids = decode_rows(ids, "sorted_gaps", out=np.empty_like(ids))
    return ids


def _universe(array: RoutingArrayInfo | WeightsArrayInfo) -> tuple[int, TopkOrder]:
    """The experts and top-k order a routing array's rows are checked against."""
    if isinstance(array, WeightsArrayInfo):  # pragma: no cover - weights are never checked as sets
        raise TypeError("routing weights hold no sets")
    return array.num_experts, array.topk_order


def _read_pieces(
    storage: Storage,
    cache: ReadCache,
    requests: Sequence[BlockRequest],
    plans: list[list[tuple[ShardRead, list[ChunkRead]]]],
    max_gap: int,
) -> dict[tuple[str, int], memoryview]:
    """The stored bytes of every planned chunk, keyed by (shard, offset), read into the cache's buffer for this
    thread (valid until its next read); nearby chunks share one ranged read."""
    wanted: dict[str, set[tuple[int, int]]] = {}
    samples: dict[str, set[str]] = {}
    for request, planned in zip(requests, plans, strict=True):
        for read, chunks in planned:
            wanted.setdefault(read.key, set()).update((chunk.start, chunk.stop) for chunk in chunks)
            samples.setdefault(read.key, set()).update(request.samples)
    ranges = [(key, lo, hi) for key, spans in wanted.items() for lo, hi in coalesce(list(spans), max_gap)]
    buffer = cache.scratch(sum(hi - lo for _, lo, hi in ranges))
    with _objects_listed(storage, [tuple(samples[key]) for key, _, _ in ranges]):
        views = storage.read_ranges(ranges, buffer)
    pieces: dict[tuple[str, int], memoryview] = {}
    for (key, lo, hi), view in zip(ranges, views, strict=True):
        for start, stop in wanted[key]:
            if lo <= start and stop <= hi:
                pieces[(key, start)] = view[start - lo : stop - lo]
    return pieces


@contextmanager
def _objects_listed(storage: Storage, samples: list[tuple[str, ...]]) -> Iterator[None]:
    """Reads of objects a commit lists: one that is missing is corrupt data, named with the samples it holds."""
    try:
        yield
    except FileNotFoundError as exc:
        affected = sorted({s for group in samples for s in group})[:8]
        raise CorruptDataError(
            f"an object listed in its commit is missing from {storage.url}: {exc}; affected samples: {affected}"
        ) from exc
