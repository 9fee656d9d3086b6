"""A part: the immutable unit one flush writes, as a zarr v3 sharded array plus a Parquet index.

``routing`` is ``[num_moe_layers, n_rows, topk]`` of stored IDs (see :mod:`routelog.codec`), one shard object
holding inner chunks of ``chunk_layers x chunk_rows x topk`` compressed with zstd and guarded by crc32c (see
:mod:`routelog.shard`), so a reader of some records and some layers fetches only those chunks with ranged reads.
Every object's SHA-256 goes into the commit record.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from routelog import keys
from routelog.codec import (
    IdArray,
    TopkOrder,
    Transform,
    decode_rows,
    gaps_from_sorted,
    invalid_row,
    storage_dtype,
)
from routelog.dedup import PartRows, PrefixIndex
from routelog.errors import CorruptDataError
from routelog.format import (
    FORMAT_VERSION,
    INDEX_SCHEMA,
    MAX_PART_ROWS,
    MAX_RECORD_TOKENS,
    STREAMS_DIR,
    CommitRecord,
    IndexRow,
    ObjectInfo,
    RoutingArrayInfo,
    Span,
    ValueColumn,
    ValuesInfo,
    WeightsArrayInfo,
)
from routelog.parquet_limits import MAX_STREAMS, BoundedParquet, ParquetLeaf, decoded_budget
from routelog.record import PreparedRecord
from routelog.shard import (
    ChunkRead,
    ShardFormatError,
    ShardLayout,
    chunks_for,
    coalesce,
    decode_chunk,
    decode_shard_index,
    encode_shards,
)
from routelog.spec import ModelSpec
from routelog.storage import Storage
from routelog.values import VALUES_OBJECT, values_to_parquet
from routelog.weights import WeightsDtype
from routelog.weights import storage_dtype as weights_storage_dtype


@dataclass(frozen=True)
class PartOptions:
    """Layout knobs of the parts a writer produces (recorded per part, so readers need not know them)."""

    chunk_rows: int = 4096
    """Token rows per inner chunk: the unit of a record-subset read."""
    chunk_layers: int = 4
    """MoE layers per inner chunk: the unit of a pipeline-stage read. With 4096 rows and K = 8 an inner chunk is
    128 KiB raw (zstd is as effective as on whole arrays down to ~24 KiB; 256 KiB inputs measured worse)."""
    zstd_level: int = 3
    topk_order: TopkOrder = "sorted"
    """``sorted`` canonicalises each top-k set (smallest, and what replay needs); ``score`` keeps engine order."""
    transform: Literal["ranked_gaps", "sorted_gaps"] = "ranked_gaps"
    """Chunk codec of sorted sets: ``ranked_gaps`` (format 2, learns each chunk's popularity and repeats) or
    ``sorted_gaps`` (format 1's ID gaps: the fastest to encode, larger on skewed routing)."""
    dedup: Literal["step", "part", "off"] = "step"
    """Store a prefix a record shares with an earlier record (same tokens, same routing) once
    (:mod:`routelog.dedup`): ``step`` looks for it in the part, in the writer's earlier parts and in other
    writers' committed parts of the step; ``part`` only in the part; ``off`` stores every record whole."""
    weights_dtype: WeightsDtype = "bfloat16"
    """How records' routing weights are stored, when they carry some (:mod:`routelog.weights`)."""
    shard_layers: int | None = None
    """Split each array into one shard object per this many MoE layers (a multiple of ``chunk_layers``), so a
    pipeline stage's reader fetches only its own shards' chunk indexes: set it to the trainer's layers per stage
    (or a divisor) when ranks read a small share of each record. None: one shard per array (one object)."""

    def __post_init__(self) -> None:
        if self.chunk_rows < 1 or self.chunk_layers < 1:
            raise ValueError("chunk_rows and chunk_layers must be >= 1")
        if self.topk_order not in ("sorted", "score"):
            raise ValueError(f"topk_order must be 'sorted' or 'score', got {self.topk_order!r}")
        if self.transform not in ("ranked_gaps", "sorted_gaps"):
            raise ValueError(f"transform must be 'ranked_gaps' or 'sorted_gaps', got {self.transform!r}")
        if self.dedup not in ("step", "part", "off"):
            raise ValueError(f"dedup must be 'step', 'part' or 'off', got {self.dedup!r}")
        if self.weights_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"weights_dtype must be 'bfloat16' or 'float32', got {self.weights_dtype!r}")
        if self.shard_layers is not None and (self.shard_layers < 1 or self.shard_layers % self.chunk_layers):
            raise ValueError(
                f"shard_layers must be a positive multiple of chunk_layers ({self.chunk_layers}), got "
                f"{self.shard_layers}"
            )

    def shard_layers_for(self, layers: int) -> int | None:
        """``shard_layers`` for an array of ``layers`` layers (None where one shard holds them all anyway)."""
        return self.shard_layers if self.shard_layers is not None and self.shard_layers < layers else None


@dataclass(frozen=True)
class BuiltPart:
    """The bytes of one part, ready to upload, and what its commit will say about them."""

    objects: dict[str, bytes]
    """Keys relative to the part directory."""
    routing: RoutingArrayInfo
    rows: list[IndexRow]
    n_tokens: int
    values: ValuesInfo | None = None
    streams: dict[str, RoutingArrayInfo] = field(default_factory=dict)
    weights: WeightsArrayInfo | None = None
    prefix_part: int | None = None
    """The part's id in the :class:`~routelog.dedup.PrefixIndex` it was placed with: tell the index whether it
    was committed (``committed``) or not (``abandon``)."""

    def object_infos(self) -> list[ObjectInfo]:
        return [
            ObjectInfo(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())
            for key, data in sorted(self.objects.items())
        ]


def build_part(
    records: Sequence[PreparedRecord],
    spec: ModelSpec,
    options: PartOptions,
    prefixes: PrefixIndex | None = None,
    key: str = "",
) -> BuiltPart:
    """Concatenate the records' stored rows into one sharded zarr array (and one per extra stream the records
    carry, and one of routing weights when some record has them) and write their Parquet index.

    With ``dedup="step"``, ``prefixes`` is the writer's index of the step's earlier records (a fresh one when
    None): shared prefixes may then point at its earlier parts, and its later parts at this one, which they name
    by ``key`` (the part's ``steps/<step>/parts/<name>``, required with ``prefixes``)."""
    capacity = sum(r.rows.shape[1] for r in records)  # at most: shared prefixes only make it smaller
    routing = PartRows(spec.num_moe_layers, spec.topk, spec.id_dtype, capacity, options.weights_dtype)
    if options.dedup == "off":
        prefixes = None
    elif options.dedup == "part" or prefixes is None:
        prefixes = PrefixIndex()  # nothing outside the part names it
    elif not key:
        raise ValueError("build_part: a part placed in a shared prefix index needs its key")
    part_id = None if prefixes is None else prefixes.begin_part(routing, key)
    try:
        return _build(records, spec, options, routing, prefixes, part_id)
    except BaseException:
        if prefixes is not None and part_id is not None:
            prefixes.abandon(part_id)
        raise


def _build(
    records: Sequence[PreparedRecord],
    spec: ModelSpec,
    options: PartOptions,
    routing: PartRows,
    prefixes: PrefixIndex | None,
    part_id: int | None,
) -> BuiltPart:
    rows: list[IndexRow] = []
    stream_offsets: dict[str, int] = {}
    for rec in records:
        if prefixes is None or part_id is None:
            spans = [_shifted(s, routing.n) for s in rec.row.spans]
            routing.append(rec.rows, rec.weights)
        else:
            placed = prefixes.place(part_id, rec.row.token_ids, rec.row.spans, rec.rows, rec.weights)
            spans = placed.spans
            first = placed.first_own_row
            routing.append(rec.rows[:, first:], None if rec.weights is None else rec.weights[:, first:])
        streams = None
        if rec.row.streams:
            streams = []
            for entry in rec.row.streams:
                base = stream_offsets.get(entry.name, 0)
                streams.append(entry.model_copy(update={"spans": [_shifted(s, base) for s in entry.spans]}))
                stream_offsets[entry.name] = base + rec.streams[entry.name].shape[1]
        rows.append(rec.row.model_copy(update={"spans": spans, "streams": streams}))
    objects: dict[str, bytes] = {}
    attributes = {"num_experts": spec.num_experts, "moe_layers": list(spec.moe_layers)}
    info = _encode_array(
        [routing.data],
        keys.ROUTING,
        spec.num_moe_layers,
        spec.num_experts,
        spec.topk,
        options,
        attributes,
        objects,
    )
    streams_info = {}
    for name in sorted(stream_offsets):
        declared = spec.stream(name)
        if declared is None:
            raise ValueError(f"stream {name!r} is not declared by the model spec")
        streams_info[name] = _encode_array(
            [r.streams[name] for r in records if name in r.streams],
            f"{STREAMS_DIR}/{name}",
            declared.num_layers,
            declared.universe,
            declared.topk,
            options,
            {"stream": name, "num_experts": declared.universe},
            objects,
        )
    weights = None
    if routing.weights is not None:
        weights = _encode_weights(routing.weights, spec, options, objects)
    objects[keys.INDEX] = index_to_parquet(rows)
    names = sorted({name for r in records for name in r.values})
    values = None
    if names:  # only parts with per-token columns carry the values object
        values = ValuesInfo(key=VALUES_OBJECT, columns=[ValueColumn(name=n) for n in names])
        objects[VALUES_OBJECT] = values_to_parquet(
            [(r.row.sample_id, r.row.token_hash, r.values) for r in records], names
        )
    return BuiltPart(
        objects=objects,
        routing=info,
        rows=rows,
        n_tokens=sum(r.n_tokens for r in rows),
        values=values,
        streams=streams_info,
        weights=weights,
        prefix_part=part_id if options.dedup == "step" else None,
    )


def _shifted(span: Span, offset: int) -> Span:
    return Span(token_start=span.token_start, n_rows=span.n_rows, row=span.row + offset)


def _encode_array(
    blocks: list[IdArray],
    path: str,
    layers: int,
    universe: int,
    topk: int,
    options: PartOptions,
    attributes: dict[str, Any],
    objects: dict[str, bytes],
) -> RoutingArrayInfo:
    """Encode stored rows ``[layers, rows, topk]`` (concatenated on axis 1) as one sharded array under ``path``,
    adding its objects to ``objects``; returns its description (with the ``zarr.json`` copy)."""
    dtype = storage_dtype(universe)
    if len(blocks) == 1:
        data = blocks[0]
    else:
        data = np.concatenate(blocks, axis=1) if blocks else np.zeros((layers, 0, topk), dtype)
    transform: Transform = options.transform if options.topk_order == "sorted" else "none"
    if transform == "sorted_gaps":  # format 1's transform: the shard stores the gaps themselves
        data = gaps_from_sorted(np.array(data, order="C"))
    info = RoutingArrayInfo(
        path=path,
        dtype="uint8" if dtype == np.uint8 else "uint16",
        n_rows=data.shape[1],
        num_moe_layers=layers,
        topk=topk,
        num_experts=universe,
        transform=transform,
        topk_order=options.topk_order,
        chunk_rows=options.chunk_rows,
        chunk_layers=min(options.chunk_layers, layers),
        shard_layers=options.shard_layers_for(layers),
    )
    layout_ = shard_layout(info)
    stamp = {"format_version": FORMAT_VERSION, "transform": info.transform, "topk_order": info.topk_order}
    metadata = layout_.zarr_metadata(options.zstd_level, {"routelog": {**stamp, **attributes}})
    objects[f"{path}/zarr.json"] = json.dumps(metadata, indent=1).encode()
    if info.n_rows:  # an empty array has no chunk to store
        for key, shard in encode_shards(data, layout_, options.zstd_level).items():
            objects[f"{path}/{key}"] = shard
    return info.model_copy(update={"zarr_metadata": metadata})


def _encode_weights(
    data: npt.NDArray[Any], spec: ModelSpec, options: PartOptions, objects: dict[str, bytes]
) -> WeightsArrayInfo:
    """Encode the part's stored weights ``[layers, rows, topk]`` as the sharded array ``weights``."""
    info = WeightsArrayInfo(
        dtype=options.weights_dtype,
        n_rows=data.shape[1],
        num_moe_layers=spec.num_moe_layers,
        topk=spec.topk,
        chunk_rows=options.chunk_rows,
        chunk_layers=min(options.chunk_layers, spec.num_moe_layers),
        shard_layers=options.shard_layers_for(spec.num_moe_layers),
    )
    layout_ = shard_layout(info)
    attributes = {"routelog": {"format_version": FORMAT_VERSION, "weights_dtype": info.dtype}}
    metadata = layout_.zarr_metadata(options.zstd_level, attributes)
    objects[f"{info.path}/zarr.json"] = json.dumps(metadata, indent=1).encode()
    if info.n_rows:
        for key, shard in encode_shards(data, layout_, options.zstd_level).items():
            objects[f"{info.path}/{key}"] = shard
    return info.model_copy(update={"zarr_metadata": metadata})


def shard_layout(info: RoutingArrayInfo | WeightsArrayInfo) -> ShardLayout:
    if isinstance(info, WeightsArrayInfo):
        return ShardLayout(
            num_layers=info.num_moe_layers,
            n_rows=info.n_rows,
            topk=info.topk,
            chunk_layers=info.chunk_layers,
            chunk_rows=info.chunk_rows,
            dtype=weights_storage_dtype(info.dtype),
            shard_layers=info.shard_layers,
        )
    return ShardLayout(
        num_layers=info.num_moe_layers,
        n_rows=info.n_rows,
        topk=info.topk,
        chunk_layers=info.chunk_layers,
        chunk_rows=info.chunk_rows,
        dtype=np.dtype(info.dtype),
        ranked=info.transform == "ranked_gaps",
        num_experts=info.num_experts,
        shard_layers=info.shard_layers,
    )


def index_to_parquet(rows: Sequence[IndexRow]) -> bytes:
    table = pa.Table.from_pylist([r.model_dump() for r in rows], schema=INDEX_SCHEMA)
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", write_statistics=["sample_id", "step"], store_schema=True)
    return sink.getvalue()


CONSOLIDATED_COMMIT_COLUMN = "_commit"
"""The column a seal's consolidated index adds to the index schema: the position of each row's commit."""
_INDEX_COLUMNS = (*INDEX_SCHEMA.names, CONSOLIDATED_COMMIT_COLUMN)


def index_from_parquet(
    data: bytes,
    *,
    max_records: int | None = None,
    max_tokens: int | None = None,
    max_streams: int | None = None,
    where: str = keys.INDEX,
) -> pa.Table:
    """A part's (or a seal's consolidated) index: the columns of :data:`INDEX_SCHEMA` (and the consolidated
    index's ``_commit``) that it holds, decoded only after its footer and pages are checked against what its owner
    vouches for (:mod:`routelog.parquet_limits`): at most ``max_records`` rows, token lists, spans and segments of
    at most ``max_tokens`` tokens in all, rows listing at most ``max_streams`` extra streams each, and a decoded size
    linear in those. Other columns are never decoded. :class:`~routelog.errors.CorruptDataError` naming ``where``
    otherwise.

    Pass the commit's ``n_records`` and ``n_tokens`` (the seal's for a consolidated index) and the number of
    streams the commit holds. None (until every caller passes them) means the format's absolute limits: as many
    records as the footer declares up to ``MAX_PART_ROWS``, ``MAX_RECORD_TOKENS`` tokens each, :data:`MAX_STREAMS`
    streams.
    """
    parquet = BoundedParquet(data, where, max_rows=MAX_PART_ROWS if max_records is None else max_records)
    records = parquet.num_rows  # at most max_records: checked
    tokens = records * MAX_RECORD_TOKENS if max_tokens is None else min(max(max_tokens, 0), records * MAX_RECORD_TOKENS)
    streams = MAX_STREAMS if max_streams is None else max_streams
    streams = max(streams, 1)  # a row without streams still takes one (null) entry

    def max_values(leaf: ParquetLeaf) -> int:
        # An empty or null list takes one level, a record's token_ids, spans and segments at most n_tokens each
        # (spans and non-empty segments are disjoint); streams: at most `streams` entries per row, each with spans.
        if leaf.repeated == 0:  # a scalar: one value per row
            return records
        if leaf.path[0] == "streams":
            return streams * records if leaf.repeated == 1 else streams * (tokens + records)
        return tokens + records

    return parquet.read(_INDEX_COLUMNS, max_values=max_values, max_bytes=decoded_budget(records, tokens))


# -- reading ------------------------------------------------------------------------------------------------------
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
