"""A part: the immutable unit one flush writes, as a zarr v3 sharded array plus a Parquet index.

``routing`` is ``[num_moe_layers, n_rows, topk]`` of stored IDs (see :mod:`routelog.format.codec`), one shard object
holding inner chunks of ``chunk_layers x chunk_rows x topk`` compressed with zstd and guarded by crc32c (see
:mod:`routelog.format.shard`), so a reader of some records and some layers fetches only those chunks with ranged reads.
Every object's SHA-256 goes into the commit record.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from routelog.format import context, indexer_object, keys, mapped
from routelog.format.codec import (
    TopkOrder,
    Transform,
    gaps_from_sorted,
    storage_dtype,
)
from routelog.format.dedup import PartRows, PrefixIndex
from routelog.format.digest import encode_hashes, probe_hash, sample_id_hashes
from routelog.format.documents import (
    CONTEXT_ESCAPES_FEATURE,
    CONTEXT_FEATURE,
    CONTEXT_LIST_REFERENCES_FEATURE,
    CONTEXT_REFERENCES_FEATURE,
    INDEX_SCHEMA,
    INDEXER_FEATURE,
    MAX_PART_ROWS,
    STREAMS_DIR,
    CommitDigest,
    IndexerInfo,
    IndexRow,
    ObjectInfo,
    RoutingArrayInfo,
    Span,
    ValueColumn,
    ValuesInfo,
    WeightsArrayInfo,
)
from routelog.format.limits import FORMAT_VERSION, MAX_RECORD_TOKENS
from routelog.format.parquet_limits import MAX_STREAMS, BoundedParquet, ParquetLeaf, decoded_budget, most_records
from routelog.format.record import PreparedRecord
from routelog.format.row_blocks import RowBlocks
from routelog.format.shard import (
    ShardLayout,
    SinkFactory,
    WrittenFile,
    encode_shards,
)
from routelog.format.spec import ModelSpec
from routelog.format.values import VALUES_OBJECT, values_to_parquet
from routelog.format.weights import WeightsDtype
from routelog.format.weights import storage_dtype as weights_storage_dtype


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
    transform: Literal["ranked_context", "ranked_gaps", "sorted_gaps"] = "ranked_gaps"
    """Chunk codec of sorted sets: ``ranked_gaps`` (format 2, learns each chunk's popularity and repeats),
    ``ranked_context`` (chunks coded against a model of the whole part, which learns each token's and each set
    below's usual sets: 20-45 % smaller on routing that recurs, 1.5-4 x slower to write and read,
    :mod:`routelog.format.context`; extra routing streams keep ``ranked_gaps``) or ``sorted_gaps`` (format 1's ID
    gaps: the fastest to encode, larger on skewed routing)."""
    dedup: Literal["step", "part", "off"] = "step"
    """Store a prefix a record shares with an earlier record (same tokens, same routing) once
    (:mod:`routelog.format.dedup`): ``step`` looks for it in the part, in the writer's earlier parts and in other
    writers' committed parts of the step; ``part`` only in the part; ``off`` stores every record whole."""
    weights_dtype: WeightsDtype = "bfloat16"
    """How records' routing weights are stored, when they carry some (:mod:`routelog.format.weights`)."""
    shard_layers: int | None = None
    """Split each array into one shard object per this many MoE layers (a multiple of ``chunk_layers``), so a
    pipeline stage's reader fetches only its own shards' chunk indexes: set it to the trainer's layers per stage
    (or a divisor) when ranks read a small share of each record. None: one shard per array (one object)."""

    def __post_init__(self) -> None:
        if self.chunk_rows < 1 or self.chunk_layers < 1:
            raise ValueError("chunk_rows and chunk_layers must be >= 1")
        if self.topk_order not in ("sorted", "score"):
            raise ValueError(f"topk_order must be 'sorted' or 'score', got {self.topk_order!r}")
        if self.transform not in ("ranked_context", "ranked_gaps", "sorted_gaps"):
            raise ValueError(
                f"transform must be 'ranked_context', 'ranked_gaps' or 'sorted_gaps', got {self.transform!r}"
            )
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

    objects: dict[str, bytes | mapped.Bytes | WrittenFile]
    """Keys relative to the part directory (a shard is mapped, see :mod:`routelog.format.mapped`, or already in its
    local file)."""
    routing: RoutingArrayInfo
    rows: list[IndexRow]
    n_tokens: int
    values: ValuesInfo | None = None
    streams: dict[str, RoutingArrayInfo] = field(default_factory=dict)
    weights: WeightsArrayInfo | None = None
    prefix_part: int | None = None
    """The part's id in the :class:`~routelog.format.dedup.PrefixIndex` it was placed with: tell the index whether it
    was committed (``committed``) or not (``abandon``)."""
    indexer: IndexerInfo | None = None
    """The part's indexer object, when any of its records carried indexer rows."""

    @property
    def features(self) -> list[str]:
        """The optional format features its commit must name (FORMAT.md section 1): readers without them refuse it."""
        extra = [INDEXER_FEATURE] if self.indexer is not None else []
        if self.routing.transform != "ranked_context":
            return extra
        coded = context.codes_escapes(self.routing.num_experts)
        if not coded:
            return [CONTEXT_FEATURE, *extra]
        return [
            CONTEXT_FEATURE,
            CONTEXT_ESCAPES_FEATURE,
            CONTEXT_REFERENCES_FEATURE,
            CONTEXT_LIST_REFERENCES_FEATURE,
            *extra,
        ]

    def object_infos(self) -> list[ObjectInfo]:
        return [ObjectInfo(key=key, size=len(data), sha256=_sha256(data)) for key, data in sorted(self.objects.items())]

    @property
    def digest(self) -> CommitDigest:
        """The part's records in a few bytes each, for its commit (:mod:`routelog.format.digest`)."""
        return commit_digest([r.sample_id for r in self.rows], [r.token_ids for r in self.rows])

    @property
    def memory_nbytes(self) -> int:
        """Bytes of the objects held in memory (a written file's are on disk)."""
        return sum(len(data) for data in self.objects.values() if not isinstance(data, WrittenFile))


def commit_digest(sample_ids: Sequence[str], token_ids: Sequence[Sequence[int] | None]) -> CommitDigest:
    """The digest a commit of these records carries: hashes of their sample ids, and probes of the first tokens of
    those long enough to share a prefix."""
    probes = [probe_hash(np.asarray(t, dtype=np.int64)) for t in token_ids if t is not None]
    return CommitDigest(
        sample_ids=encode_hashes(sample_id_hashes(sample_ids)),
        prefixes=encode_hashes([p for p in probes if p is not None]),
    )


def zarr_json(metadata: dict[str, Any]) -> bytes:
    """An array's ``zarr.json``, compact (zarr reads any JSON)."""
    return json.dumps(metadata, separators=(",", ":")).encode()


def _sha256(data: bytes | mapped.Bytes | WrittenFile) -> str:
    return data.sha256() if isinstance(data, WrittenFile) else hashlib.sha256(data).hexdigest()


def build_part(
    records: Sequence[PreparedRecord],
    spec: ModelSpec,
    options: PartOptions,
    prefixes: PrefixIndex | None = None,
    key: str = "",
    *,
    consume: bool = False,
    sink: SinkFactory | None = None,
    on_release: Callable[[int], None] | None = None,
    pool: Executor | None = None,
) -> BuiltPart:
    """Concatenate the records' stored rows into one sharded zarr array (and one per extra stream the records
    carry, and one of routing weights when some record has them) and write their Parquet index.

    With ``dedup="step"``, ``prefixes`` is the writer's index of the step's earlier records (a fresh one when
    None): shared prefixes may then point at its earlier parts, and its later parts at this one, which they name
    by ``key`` (the part's ``steps/<step>/parts/<name>``, required with ``prefixes``).

    ``consume``: the records' routing rows are the caller's to give up (a writer's buffer). Unless the prefix index
    keeps them to compare against, the build then takes them from the records and gives each layer chunk's back to
    the OS once compressed: the part's raw rows are never copied, and shrink as its objects grow; ``on_release`` is
    told how many bytes of them each layer chunk gave back.

    ``sink`` makes the sink of each shard object (keyed relative to the part; by default a mapped buffer): a writer
    to local disk writes shards to their files as they are compressed. ``pool`` compresses each layer chunk's row
    chunks concurrently (:func:`routelog.format.shard.encode_shards`; the same bytes as without it)."""
    routing = PartRows(spec.num_moe_layers, spec.topk, spec.id_dtype, options.weights_dtype)
    if options.dedup == "off":
        prefixes = None
    elif options.dedup == "part" or prefixes is None:
        prefixes = PrefixIndex()  # nothing outside the part names it
    elif not key:
        raise ValueError("build_part: a part placed in a shared prefix index needs its key")
    part_id = None if prefixes is None else prefixes.begin_part(routing, key)
    try:
        return _build(records, spec, options, routing, prefixes, part_id, consume, sink, on_release, pool)
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
    consume: bool,
    sink: SinkFactory | None,
    on_release: Callable[[int], None] | None,
    pool: Executor | None,
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
    kept = prefixes is not None and part_id is not None and prefixes.placed(part_id)
    if consume and not kept:  # nothing compares against them later
        for rec in records:
            rec.release_routing()
        routing.ids.consume(on_release)
    objects: dict[str, bytes | mapped.Bytes | WrittenFile] = {}
    attributes = {"num_experts": spec.num_experts, "moe_layers": list(spec.moe_layers)}
    tokens = None
    if options.transform == "ranked_context" and options.topk_order == "sorted":
        tokens = context.row_tokens(
            ((r.token_ids, [(s.token_start, s.n_rows, s.row, s.part) for s in r.spans]) for r in rows), routing.ids.n
        )
    info = _encode_array(
        routing.ids,
        keys.ROUTING,
        spec.num_moe_layers,
        spec.num_experts,
        spec.topk,
        options,
        attributes,
        objects,
        sink,
        tokens,
        pool,
    )
    streams_info = {}
    for name in sorted(stream_offsets):
        declared = spec.stream(name)
        if declared is None:
            raise ValueError(f"stream {name!r} is not declared by the model spec")
        stream_rows = RowBlocks(declared.num_layers, declared.topk, storage_dtype(declared.universe))
        for r in records:
            if name in r.streams:
                stream_rows.append(r.streams[name])
        streams_info[name] = _encode_array(
            stream_rows,
            f"{STREAMS_DIR}/{name}",
            declared.num_layers,
            declared.universe,
            declared.topk,
            replace(options, transform="ranked_gaps") if options.transform == "ranked_context" else options,
            {"stream": name, "num_experts": declared.universe},
            objects,
            sink,
            pool=pool,
        )
    weights = None
    if routing.weights is not None:
        weights = _encode_weights(routing.weights, spec, options, objects, sink, pool)
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
        indexer=_build_indexer(records, spec, objects),
    )


def _build_indexer(
    records: Sequence[PreparedRecord], spec: ModelSpec, objects: dict[str, bytes | mapped.Bytes | WrittenFile]
) -> IndexerInfo | None:
    """The indexer object of the records that carry indexer rows (added to ``objects``), or None."""
    carrying = [(r.row.sample_id, r.indexer) for r in records if r.indexer]
    if not carrying:
        return None
    declared = spec.indexer
    if declared is None:  # pragma: no cover - prepare_record refuses indexer rows the spec does not declare
        raise ValueError("indexer rows for a model spec without an indexer")
    data, crc = indexer_object.build(carrying, declared.num_layers)
    objects[indexer_object.KEY] = data
    return IndexerInfo(
        n_records=len(carrying), num_layers=declared.num_layers, index_topk=declared.index_topk, table_crc32c=crc
    )


def _shifted(span: Span, offset: int) -> Span:
    return Span(token_start=span.token_start, n_rows=span.n_rows, row=span.row + offset)


def _encode_array(
    rows: RowBlocks,
    path: str,
    layers: int,
    universe: int,
    topk: int,
    options: PartOptions,
    attributes: dict[str, Any],
    objects: dict[str, bytes | mapped.Bytes | WrittenFile],
    sink: SinkFactory | None = None,
    tokens: npt.NDArray[np.int64] | None = None,
    pool: Executor | None = None,
) -> RoutingArrayInfo:
    """Encode stored rows ``[layers, rows, topk]`` as one sharded array under ``path``, adding its objects to
    ``objects``; returns its description (with the ``zarr.json`` copy). ``tokens``: each row's token id, for the
    ``ranked_context`` transform."""
    dtype = storage_dtype(universe)
    transform: Transform = options.transform if options.topk_order == "sorted" else "none"
    # format 1's transform: the shard stores the gaps themselves, computed chunk by chunk
    to_gaps = gaps_from_sorted if transform == "sorted_gaps" else None
    info = RoutingArrayInfo(
        path=path,
        dtype="uint8" if dtype == np.uint8 else "uint16",
        n_rows=rows.n,
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
    objects[f"{path}/zarr.json"] = zarr_json(metadata)
    if info.n_rows:  # an empty array has no chunk to store
        shards = encode_shards(rows, layout_, options.zstd_level, to_gaps, _under(sink, path), tokens, pool)
        for key, shard in shards.items():
            objects[f"{path}/{key}"] = shard
    return info.model_copy(update={"zarr_metadata": metadata})


def _under(sink: SinkFactory | None, path: str) -> SinkFactory | None:
    """``sink`` for the objects of the array at ``path`` (its keys are the array's)."""
    if sink is None:
        return None
    return lambda key, capacity, start: sink(f"{path}/{key}", capacity, start)


def _encode_weights(
    data: RowBlocks,
    spec: ModelSpec,
    options: PartOptions,
    objects: dict[str, bytes | mapped.Bytes | WrittenFile],
    sink: SinkFactory | None = None,
    pool: Executor | None = None,
) -> WeightsArrayInfo:
    """Encode the part's stored weights ``[layers, rows, topk]`` as the sharded array ``weights``."""
    info = WeightsArrayInfo(
        dtype=options.weights_dtype,
        n_rows=data.n,
        num_moe_layers=spec.num_moe_layers,
        topk=spec.topk,
        chunk_rows=options.chunk_rows,
        chunk_layers=min(options.chunk_layers, spec.num_moe_layers),
        shard_layers=options.shard_layers_for(spec.num_moe_layers),
    )
    layout_ = shard_layout(info)
    attributes = {"routelog": {"format_version": FORMAT_VERSION, "weights_dtype": info.dtype}}
    metadata = layout_.zarr_metadata(options.zstd_level, attributes)
    objects[f"{info.path}/zarr.json"] = zarr_json(metadata)
    if info.n_rows:
        shards = encode_shards(data, layout_, options.zstd_level, None, _under(sink, info.path), pool=pool)
        for key, shard in shards.items():
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
        context=info.transform == "ranked_context",
        num_experts=info.num_experts,
        shard_layers=info.shard_layers,
    )


_DICTIONARY_COLUMNS = [name for name in INDEX_SCHEMA.names if name != "token_ids"]
"""Index columns Parquet dictionary-encodes: not the token ids, whose dictionary (a vocabulary's worth of distinct
ids) makes a part's index larger and slower to write (64 records of 4096 Zipf-distributed ids over 150k: 807 KB in
11 ms with it, 682 KB in 4.8 ms without; the Qwen3-MoE-style corpus' indexes 5 % smaller)."""


TOKEN_IDS_ZSTD_LEVEL = 9
"""zstd level of a part's token ids, most of its index: level 9 stores them 14 % smaller than level 1
(Qwen3-MoE-style corpus: 3 parts' indexes 0.123 -> 0.106 B per routed token-layer, 2 ms more a part to write); level
19 would save 1.6 % more at 11 times the time (0.78 s for a million Zipf-distributed ids)."""

INDEX_ZSTD_LEVEL = 19
"""zstd level of the index's other columns, a few bytes a record: level 19 stores them 5 % smaller than level 9 at
no time that shows (DeepSeek-V3-style corpus: 3 parts' indexes 56.7 -> 56.0 KB; 12 ms for 1,152 records)."""


def _column_levels(schema: pa.Schema) -> dict[str, int]:
    """Each Parquet column (leaf) of an index schema and its zstd level."""

    def leaves(name: str, kind: pa.DataType) -> list[str]:
        if pa.types.is_list(kind):
            return leaves(f"{name}.list.element", kind.value_type)
        if pa.types.is_struct(kind):
            return [leaf for field in kind for leaf in leaves(f"{name}.{field.name}", field.type)]
        return [name]

    paths = [leaf for field in schema for leaf in leaves(field.name, field.type)]
    return {path: TOKEN_IDS_ZSTD_LEVEL if path == "token_ids.list.element" else INDEX_ZSTD_LEVEL for path in paths}


SPLIT_COLUMNS = {"token_ids.list.element": "BYTE_STREAM_SPLIT"}
"""Index columns stored as byte planes (Parquet's ``BYTE_STREAM_SPLIT``: each value's first bytes, then its second
bytes...): the token ids, whose high bytes are mostly zero or alike and compress apart from the varied low ones.
Measured on the corpus, three parts each: the indexes 14 % smaller (Qwen3-MoE-style 67.3 -> 57.8 KB,
DeepSeek-V3-style 65.6 -> 56.7 KB), at the same write time."""


def index_to_parquet(rows: Sequence[IndexRow]) -> bytes:
    """A part's ``index.parquet``. Without the Arrow schema in its footer: readers take the columns' types from
    the Parquet schema (:func:`index_from_parquet` checks them), and the serialized Arrow schema was half the
    footer (2 KB a part)."""
    return index_table_to_parquet(pa.Table.from_pylist([r.model_dump() for r in rows], schema=INDEX_SCHEMA))


def index_table_to_parquet(table: pa.Table) -> bytes:
    """An index table's Parquet bytes (a part's, or a seal's consolidated one with its ``_commit`` column)."""
    sink = io.BytesIO()
    pq.write_table(
        table,
        sink,
        compression="zstd",
        compression_level=_column_levels(table.schema),
        use_dictionary=_DICTIONARY_COLUMNS,
        column_encoding=SPLIT_COLUMNS,
        write_statistics=["sample_id", "step"],
        store_schema=False,
    )
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
    vouches for (:mod:`routelog.format.parquet_limits`): at most ``max_records`` rows, token lists, spans and segments
    of at most ``max_tokens`` tokens in all, rows listing at most ``max_streams`` extra streams each, and a decoded size
    linear in those. Other columns are never decoded. :class:`~routelog.errors.CorruptDataError` naming ``where``
    otherwise.

    Pass the commit's ``n_records`` and ``n_tokens`` (the seal's for a consolidated index) and the number of
    streams the commit holds; ``n_records`` is checked against the object's bytes first
    (:func:`~routelog.format.parquet_limits.most_records`). None (until every caller passes them) means the format's
    absolute limits: as many records as the footer declares up to ``MAX_PART_ROWS`` (and its bytes can hold),
    ``MAX_RECORD_TOKENS`` tokens each, :data:`MAX_STREAMS` streams.
    """
    parquet = BoundedParquet(data, where, max_rows=most_records(len(data), max_records, where, fallback=MAX_PART_ROWS))
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
