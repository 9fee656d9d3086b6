"""The on-disk documents of the store format, as pydantic models (the source of ``schemas/*.schema.json``).

``schemas/FORMAT.md`` is the normative page; this module is its executable form. The Parquet index schema is
derived from :class:`IndexRow`, so the JSON schema and the Parquet columns cannot drift apart.
"""

from __future__ import annotations

import json
import math
import types
import typing
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, Final, Literal, TypeVar

import numpy as np
import numpy.typing as npt
import pyarrow as pa
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue, StringConstraints, model_validator

from routelog.errors import CorruptDataError, FormatVersionError
from routelog.format import keys
from routelog.format.codec import TopkOrder, Transform
from routelog.format.digest import DIGEST_PATTERN, decode_hashes
from routelog.format.limits import (
    FORMAT_VERSION,
    MAX_EXPERTS,
    MAX_INDEX_TOPK,
    MAX_LAYERS,
    MAX_MOE_LAYERS,
    MAX_RECORD_TOKENS,
    MAX_TOPK,
    check_count,
)
from routelog.format.spec import ModelSpec
from routelog.format.values import VALUES_OBJECT
from routelog.format.weights import WeightsDtype

CONTEXT_FEATURE = "ranked_context"
"""The feature a commit names when its routing uses the ``ranked_context`` transform (FORMAT.md section 5):
readers that predate it refuse the commit with :class:`~routelog.errors.FormatVersionError`."""
CONTEXT_ESCAPES_FEATURE = "context_escapes"
"""Revision 3.2: ``ranked_context`` chunks and models of version 2, their escapes and lists range-coded (FORMAT.md
section 5.1)."""
CONTEXT_REFERENCES_FEATURE = "context_references"
"""Revision 3.3: ``ranked_context`` chunks of version 3, each escaped row range-coded against a reference among its
candidates (FORMAT.md section 5.1)."""
CONTEXT_LIST_REFERENCES_FEATURE = "context_list_references"
"""Revision 3.4: ``ranked_context`` chunks of version 4, an escaped row its candidates do not reference may take any
listed set as its reference (FORMAT.md section 5.1)."""
ARCHIVE_FEATURE = "archive"
"""Revision 4.2: the entry re-codes a sealed step's records into archive parts (FORMAT.md section 3.15); a reader
that predates it refuses the entry rather than read parts that are no longer the step's content."""
INDEXER_FEATURE = "indexer_positions"
"""Revision 4.1: the part holds its records' sparse-attention indexer rows (``indexer.bin``, FORMAT.md section
15); a reader that predates it refuses the commit rather than drop what it does not know."""
SUPPORTED_FEATURES: frozenset[str] = frozenset(
    {
        CONTEXT_FEATURE,
        CONTEXT_ESCAPES_FEATURE,
        CONTEXT_REFERENCES_FEATURE,
        CONTEXT_LIST_REFERENCES_FEATURE,
        INDEXER_FEATURE,
        ARCHIVE_FEATURE,
    }
)
"""Optional format features this routelog understands; a document requiring any other is refused."""

# -- limits (FORMAT.md section 9): every size read from storage is bounded before anything is allocated --------
MAX_CHUNK_BYTES: Final = 64 << 20
"""Decoded size of one inner chunk of a routing array."""
MAX_CHUNKS: Final = 1 << 24
"""Inner chunks of one part's shard (its index alone is 16 bytes per chunk)."""
MAX_PART_ROWS: Final = (1 << 31) - 1
MAX_DOCUMENT_BYTES: Final = 256 << 20
"""A JSON document (commit, seal, run, annotation, consolidated commit list)."""
MAX_JSON_DEPTH: Final = 64
"""Nesting of any JSON document or payload routelog parses."""
MAX_NAME_CHARS: Final = 1024
"""Sample ids, group ids and other free-text identifiers."""

RUN_KIND: Final = "routelog.run"
COMMIT_KIND: Final = "routelog.commit"
SEAL_KIND: Final = "routelog.seal"
ANNOTATION_KIND: Final = "routelog.annotation"
DROP_KIND: Final = "routelog.drop"
FIDELITY_KIND: Final = "routelog.fidelity"
ARCHIVE_KIND: Final = "routelog.archive"


class ArrowType:
    """Annotation marker: the Parquet/Arrow type of an :class:`IndexRow` field when the default is too wide."""

    def __init__(self, dtype: pa.DataType) -> None:
        self.dtype = dtype


Int32 = Annotated[int, ArrowType(pa.int32())]

PartName = Annotated[str, StringConstraints(pattern=f"^{keys.PART_NAME_PATTERN}$")]
"""``<writer>.<seq:08d>.<hex>``: a part or annotation directory, one path segment."""
CommitName = Annotated[str, StringConstraints(pattern=f"^{keys.ENTRY_NAME_PATTERN}$")]
"""A commit's name: ``<position:010d>.<slot:05d>.json`` (its place in a commit entry, format 4),
``<position:010d>.json`` (its log entry, format 3) or ``<writer>.<seq:08d>.json`` (formats 1-2)."""
WriterId = Annotated[str, StringConstraints(pattern=f"^{keys.WRITER_ID_PATTERN}$")]
Segment_ = Annotated[str, StringConstraints(pattern=f"^{keys.SEGMENT_PATTERN}$")]
RelativeKey = Annotated[str, StringConstraints(pattern=f"^{keys.RELATIVE_KEY_PATTERN}$")]
SpanPart = Annotated[str, StringConstraints(pattern=f"^{keys.SPAN_PART_PATTERN}$")]
SealedObject = Annotated[str, StringConstraints(pattern=f"^{keys.SEALED_OBJECT_PATTERN}$")]
Sha256 = Annotated[str, StringConstraints(pattern="^[0-9a-f]{64}$")]
TokenHash = Annotated[str, StringConstraints(pattern="^blake2b-128:[0-9a-f]{32}$")]
Name = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)]


def utc_now() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime) -> datetime:
    """A timestamp in UTC; one without an offset (written by another tool, or typed by a user) is read as UTC."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


UtcDateTime = Annotated[datetime, AfterValidator(as_utc)]
"""Every stored timestamp: read as UTC when it carries no offset, so comparisons never mix naive and aware times."""
Position = Annotated[int, Field(ge=0, lt=keys.MAX_POSITION)]


class _Document(BaseModel):
    # Unknown fields are ignored so that additive changes of a later minor revision stay readable.
    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)


_D = TypeVar("_D", bound=_Document)


# -- per-record index (Parquet) ----------------------------------------------------------------------------------
class Span(_Document):
    """Tokens ``[token_start, token_start + n_rows)`` of a record are stored at rows ``[row, row + n_rows)``."""

    token_start: Int32 = Field(ge=0, lt=MAX_RECORD_TOKENS)
    n_rows: Int32 = Field(ge=1, le=MAX_RECORD_TOKENS)
    row: int = Field(ge=0, le=MAX_PART_ROWS)
    """First row in the routing array of the part named by ``part``."""
    part: SpanPart | None = None
    """Part holding the rows, as ``steps/<step>/parts/<part>`` relative to the store root; null = this record's
    own part. Version-1 writers always write null; readers MUST follow non-null references (shared prefixes)."""


IdSpace = Literal["logical", "mapped_from_physical"]


class Segment(_Document):
    """Provenance of tokens ``[start, end)``: which policy version produced them, and how."""

    start: Int32 = Field(ge=0, le=MAX_RECORD_TOKENS)
    end: Int32 = Field(ge=0, le=MAX_RECORD_TOKENS)
    policy_version: int | None = None
    """Weights that generated these tokens (partial rollouts resumed after a weight update change it mid-record)."""
    source: Name | None = None
    """Free text such as ``prompt``, ``response``, ``turn-2``, ``tool`` or ``resumed``."""
    engine: Name | None = None
    """Engine that routed these tokens (format 1.2), e.g. ``vllm``; the record's ``engine`` when null."""
    engine_version: Name | None = None
    """Its version (format 1.2); the record's ``engine_version`` when null."""
    id_space: IdSpace | None = None
    """``logical``: the engine reported logical expert IDs; ``mapped_from_physical``: it reported physical (EPLB)
    IDs, mapped to logical with its table on ingest (format 1.2). Stored IDs are always logical."""
    weight_version: Name | None = None
    """The engine's own label of the weights (vLLM ``weight_versions``, SGLang ``weight_version``; format 1.2)."""


StreamName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,31}$")]


class StreamSpans(_Document):
    """Where a record's rows of one extra routing stream (format 1.2) are stored."""

    name: StreamName
    spans: list[Span]


class IndexRow(_Document):
    """One committed record: a Parquet row of the part's ``index.parquet``."""

    sample_id: Name = Field(min_length=1)
    """Unique within a step; never used as an object key."""
    step: int = Field(ge=0)
    group_id: Name | None = None
    policy_version: int | None = None
    engine: Name | None = None
    engine_version: Name | None = None
    prompt_len: Int32 = Field(ge=0, le=MAX_RECORD_TOKENS)
    response_len: Int32 = Field(ge=0, le=MAX_RECORD_TOKENS)
    n_tokens: Int32 = Field(ge=0, le=MAX_RECORD_TOKENS)
    """``prompt_len + response_len``; routing row ``t`` belongs to input position ``t``."""
    token_hash: TokenHash | None = None
    """``blake2b-128:<hex>`` of the token ids as little-endian int64."""
    token_ids: list[Int32] | None = None
    spans: list[Span]
    """Where the computed rows are stored, ascending and disjoint; tokens covered by no span are missing."""
    segments: list[Segment]
    extra: str | None = None
    """User metadata as a JSON text."""
    streams: list[StreamSpans] | None = None
    """Rows of extra routing streams (format 1.2; e.g. ``mtp``), each stored in its own array of the part."""
    payload_start: Int32 | None = Field(default=None, ge=0, le=MAX_RECORD_TOKENS)
    """Input position of the first routing row the engine returned (vLLM ``routed_experts_prompt_start``, SGLang
    ``routed_experts_start_len``; format 1.2): an export in the engine's layout starts its rows there."""

    @model_validator(mode="after")
    def _consistent(self) -> IndexRow:
        if self.n_tokens != self.prompt_len + self.response_len:
            raise ValueError(f"n_tokens {self.n_tokens} != prompt_len {self.prompt_len} + response_len")
        if self.token_ids is not None and len(self.token_ids) != self.n_tokens:
            raise ValueError(f"{len(self.token_ids)} token_ids for n_tokens {self.n_tokens}")
        for spans in [self.spans, *(s.spans for s in self.streams or [])]:
            end = 0
            for span in spans:
                if span.token_start < end or span.token_start + span.n_rows > self.n_tokens:
                    raise ValueError(f"spans must be ascending, disjoint and inside [0, n_tokens={self.n_tokens})")
                end = span.token_start + span.n_rows
        if self.streams is not None and len({s.name for s in self.streams}) != len(self.streams):
            raise ValueError("a stream is listed twice")
        end = 0
        for segment in self.segments:
            if not end <= segment.start <= segment.end <= self.n_tokens:
                raise ValueError(f"segments must be ascending, disjoint and inside [0, n_tokens={self.n_tokens}]")
            end = segment.end
        return self

    @property
    def n_missing(self) -> int:
        return self.n_tokens - sum(span.n_rows for span in self.spans)


# -- commit and run documents (JSON) -----------------------------------------------------------------------------
class ObjectInfo(_Document):
    """One immutable data object of a part, for integrity checks."""

    key: RelativeKey
    """Path relative to the part directory (plain segments: it can never leave it)."""
    size: int = Field(ge=0, lt=1 << 48)
    sha256: Sha256


class RoutingArrayInfo(_Document):
    """The zarr v3 array ``routing`` of a part: layer-major ``[num_moe_layers, n_rows, topk]`` stored IDs."""

    path: RelativeKey = "routing"
    """Directory of the array in the part: ``routing``, or ``streams/<name>`` for an extra stream."""
    dtype: Literal["uint8", "uint16"]
    n_rows: int = Field(ge=0, le=MAX_PART_ROWS)
    num_moe_layers: int = Field(ge=1, le=MAX_MOE_LAYERS)
    topk: int = Field(ge=1, le=MAX_TOPK)
    num_experts: int = Field(ge=1, le=MAX_EXPERTS)
    transform: Transform
    """``ranked_gaps`` (format 2): sorted IDs through the learning chunk codec; ``sorted_gaps`` (format 1): sorted
    IDs stored as gaps; ``none``: IDs as given (see FORMAT.md)."""
    topk_order: TopkOrder
    """``sorted``: rows were canonicalised ascending; ``score``: the engine's order was kept."""
    chunk_rows: int = Field(ge=1, le=MAX_PART_ROWS)
    chunk_layers: int = Field(ge=1, le=MAX_MOE_LAYERS)
    shard_layers: int | None = Field(default=None, ge=1, le=MAX_MOE_LAYERS)
    """Layers per shard object (a multiple of ``chunk_layers``, fewer than the array's layers): shard ``i`` holds
    layers ``[i * shard_layers, (i + 1) * shard_layers)``. Null: one shard holds every layer."""
    zarr_metadata: dict[str, JsonValue] = {}
    """A copy of ``routing/zarr.json``, so readers open the array without fetching it."""

    @model_validator(mode="after")
    def _bounded(self) -> RoutingArrayInfo:
        if self.topk > self.num_experts:
            raise ValueError(f"topk {self.topk} exceeds num_experts {self.num_experts}")
        if (self.dtype == "uint8") != (self.num_experts <= 256):
            raise ValueError(f"dtype {self.dtype} does not fit num_experts {self.num_experts}")
        _check_chunking(self, 1 if self.dtype == "uint8" else 2)
        return self


class WeightsArrayInfo(_Document):
    """The zarr v3 array ``weights`` of a part (format 2, optional): the routing weights (gate probabilities) of the
    chosen experts, ``[num_moe_layers, n_rows, topk]`` aligned element by element with ``routing`` (same rows, same
    slot order). bf16 values are stored as their uint16 bit patterns; both dtypes as byte planes, like uint16 IDs.
    NaN marks a row whose record carried no weights."""

    path: Literal["weights"] = "weights"
    dtype: WeightsDtype
    n_rows: int = Field(ge=0, le=MAX_PART_ROWS)
    num_moe_layers: int = Field(ge=1, le=MAX_MOE_LAYERS)
    topk: int = Field(ge=1, le=MAX_TOPK)
    chunk_rows: int = Field(ge=1, le=MAX_PART_ROWS)
    chunk_layers: int = Field(ge=1, le=MAX_MOE_LAYERS)
    shard_layers: int | None = Field(default=None, ge=1, le=MAX_MOE_LAYERS)
    """Layers per shard object (a multiple of ``chunk_layers``, fewer than the array's layers): shard ``i`` holds
    layers ``[i * shard_layers, (i + 1) * shard_layers)``. Null: one shard holds every layer."""
    zarr_metadata: dict[str, JsonValue] = {}
    """A copy of ``weights/zarr.json``."""

    @model_validator(mode="after")
    def _bounded(self) -> WeightsArrayInfo:
        _check_chunking(self, 2 if self.dtype == "bfloat16" else 4)
        return self


def _check_chunking(array: RoutingArrayInfo | WeightsArrayInfo, itemsize: int) -> None:
    """An array's chunking is within the format's limits (chunk size, number of chunks)."""
    if array.chunk_layers > array.num_moe_layers:
        raise ValueError(f"chunk_layers {array.chunk_layers} exceeds num_moe_layers {array.num_moe_layers}")
    if array.shard_layers is not None and (
        array.shard_layers % array.chunk_layers or array.shard_layers >= array.num_moe_layers
    ):
        raise ValueError(
            f"shard_layers {array.shard_layers} must be a multiple of chunk_layers {array.chunk_layers} and fewer "
            f"than num_moe_layers {array.num_moe_layers}"
        )
    if array.chunk_layers * array.chunk_rows * array.topk * itemsize > MAX_CHUNK_BYTES:
        raise ValueError(f"an inner chunk would decode to more than {MAX_CHUNK_BYTES} bytes")
    grid = math.ceil(array.num_moe_layers / array.chunk_layers) * max(1, math.ceil(array.n_rows / array.chunk_rows))
    if grid > MAX_CHUNKS:
        raise ValueError(f"the shard would hold {grid} inner chunks (at most {MAX_CHUNKS})")


class ValueColumn(_Document):
    """A per-token float column (see ``routelog.format.values``): entry ``t`` belongs to input position ``t``."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,63}$")
    """``logprob_infer`` and ``logprob_train`` are the well-known names; others are free."""
    dtype: Literal["float32"] = "float32"


class ValuesInfo(_Document):
    """The Parquet object holding a part's per-token columns: ``sample_id``, ``token_hash``, then one
    ``list<float32>`` column per declared name (null where a record has no such column; NaN = no value)."""

    key: Segment_ = "values.parquet"
    """Path relative to the part (or annotation) directory; also listed in ``objects``."""
    columns: list[ValueColumn] = Field(min_length=1)


class IndexerInfo(_Document):
    """The part's sparse-attention indexer object (FORMAT.md section 15): one positions block per record and
    indexer layer, found through a table of the records' sample-id hashes at its head."""

    key: Literal["indexer.bin"] = "indexer.bin"
    """Path relative to the part directory; also listed in ``objects``."""
    n_records: int = Field(ge=1)
    """Records holding indexer rows (at most the commit's ``n_records``)."""
    num_layers: int = Field(ge=1, le=MAX_LAYERS)
    """Indexer layers of each record (the model spec's ``indexer.layers``)."""
    index_topk: int = Field(ge=1, le=MAX_INDEX_TOPK)
    table_crc32c: int = Field(ge=0, lt=1 << 32)
    """crc32c of the object's head and table (a ranged read checks them before it trusts an offset)."""


class _CommitBase(_Document):
    """What a commit and an annotation commit share: the document named ``<writer_id>.<seq:08d>.json`` that makes
    the data under ``part`` visible."""

    format_version: int = FORMAT_VERSION
    features: list[str] = []
    step: int = Field(ge=0)
    part: PartName
    """Directory name of the data: ``<writer_id>.<seq:08d>.<hex>``."""
    writer_id: WriterId
    seq: int = Field(ge=0, lt=10**8)
    """The writer's part counter: ``part`` starts with ``<writer_id>.<seq:08d>.``. In formats 1-2 it also names the
    commit (``<writer_id>.<seq:08d>.json``)."""
    position: Position | None = None
    """The commit's position in the step's log (formats 3 and 4; its entry is ``log/<position:010d>.json``). Null for
    format 1-2 commits, which live under ``commits/<writer_id>.<seq:08d>.json``."""
    created_at: UtcDateTime
    n_records: int = Field(ge=0)
    objects: list[ObjectInfo]
    values: ValuesInfo | None = None

    @model_validator(mode="after")
    def _consistent(self) -> _CommitBase:
        tokens = getattr(self, "n_tokens", None)
        if tokens is not None:  # what bounds reading its index (or values)
            check_count(
                tokens,
                name="n_tokens",
                at_most=self.n_records * MAX_RECORD_TOKENS,
                where=f"part {self.part}",
                expected=f"its n_records = {self.n_records}, {MAX_RECORD_TOKENS} tokens a record at the most",
                error=ValueError,
            )
        # A damaged or forged ``part`` cannot point at another writer's data.
        if not self.part.startswith(keys.part_prefix(self.writer_id, self.seq)):
            raise ValueError(f"part {self.part!r} does not belong to commit {self.writer_id}.{self.seq:08d}")
        names = [o.key for o in self.objects]
        if len(names) != len(set(names)):
            raise ValueError("objects lists a key twice")
        if self.values is not None and self.values.key not in names:
            raise ValueError(f"values object {self.values.key!r} is not listed in objects")
        if self.values is None and VALUES_OBJECT in names:
            raise ValueError(f"objects lists {VALUES_OBJECT}, but no values columns are declared")
        return self

    @property
    def name(self) -> str:
        """The document's file name: ``<position:010d>.json`` in the log, ``<writer_id>.<seq:08d>.json`` before."""
        return keys.commit_name(self.writer_id, self.seq) if self.position is None else keys.log_name(self.position)


class CommitDigest(_Document):
    """What a format-4 commit's records are, 8 bytes each (``routelog.format.digest``): a process deciding duplicates
    or looking for shared prefixes reads the part's index only when one of its hashes matches."""

    sample_ids: Annotated[str, StringConstraints(pattern=f"^{DIGEST_PATTERN}$")]
    """Base64 of the sorted, distinct 64-bit hashes of the records' sample ids (little-endian)."""
    prefixes: Annotated[str, StringConstraints(pattern=f"^{DIGEST_PATTERN}$")] = ""
    """Base64 of the sorted, distinct 64-bit probes of the first token ids of each record long enough to share a
    prefix (FORMAT.md section 6)."""


class CommitRecord(_CommitBase):
    """What makes the part under ``steps/<step>/parts/<part>/`` visible: one of the commits of a commit entry of the
    step's log (format 4, :class:`CommitGroup`), an entry of its own (format 3), or
    ``steps/<step>/commits/<writer>.<seq>.json`` (formats 1-2); created exclusively after its part."""

    kind: Literal["routelog.commit"] = COMMIT_KIND
    n_tokens: int = Field(ge=0)
    """Tokens of the part's records (at most ``MAX_RECORD_TOKENS`` each): what bounds reading its index."""
    routing: RoutingArrayInfo
    values: ValuesInfo | None = None
    """Per-token float columns of the part's records, if any were attached (added in format 1.1: readers that
    do not know the field ignore it and never fetch the object)."""
    streams: dict[StreamName, RoutingArrayInfo] = {}
    """Extra routing streams of the part's records (format 1.2), e.g. ``mtp``: the routing of multi-token-
    prediction layers, kept apart from the decoder's so that it is never installed into a decoder router."""
    weights: WeightsArrayInfo | None = None
    """The routing weights of the part's rows (format 2), when any of its records carried them; read only when
    asked for."""
    slot: int | None = Field(default=None, ge=0, lt=keys.MAX_GROUP_COMMITS)
    """Format 4: the commit's place in its commit entry's list (commits of one entry are ordered by it). Null for a
    format-3 commit, which is an entry of its own."""
    digest: CommitDigest | None = None
    """Format 4: hashes of the records' sample ids and first tokens (FORMAT.md section 3.3)."""
    indexer: IndexerInfo | None = None
    """The sparse-attention indexer rows of the part's records, when any carried them (feature
    ``indexer_positions``)."""

    @property
    def name(self) -> str:
        """``<position:010d>.<slot:05d>.json`` in a format-4 commit entry, else as :class:`_CommitBase` names it."""
        if self.position is not None and self.slot is not None:
            return keys.member_name(self.position, self.slot)
        return super().name

    @model_validator(mode="after")
    def _arrays(self) -> CommitRecord:
        for name, array in self.streams.items():
            if array.path != f"{STREAMS_DIR}/{name}":
                raise ValueError(f"stream {name!r} must be stored under {STREAMS_DIR}/{name}, not {array.path!r}")
        for field, array in [("routing", self.routing), *((f"streams.{n}", a) for n, a in self.streams.items())]:
            check_count(  # readers size per-row tables by it (the tokens of a context-coded array's rows)
                array.n_rows,
                name=f"{field}.n_rows",
                at_most=self.n_tokens,
                where=f"part {self.part}",
                expected=f"its records' n_tokens = {self.n_tokens}: a stored row is a token of one of them",
                error=ValueError,
            )
        weights, routing = self.weights, self.routing
        if weights is not None and (weights.n_rows, weights.num_moe_layers, weights.topk) != (
            routing.n_rows,
            routing.num_moe_layers,
            routing.topk,
        ):
            raise ValueError("the weights array must have the routing array's rows, layers and top-k")
        if self.slot is not None and self.position is None:
            raise ValueError("a commit with a slot has a log position")
        if (self.indexer is not None) != (INDEXER_FEATURE in self.features):
            raise ValueError(f"the feature {INDEXER_FEATURE!r} goes with an indexer object, and only with it")
        if self.indexer is not None:
            if self.indexer.key not in {o.key for o in self.objects}:
                raise ValueError(f"indexer object {self.indexer.key!r} is not listed in objects")
            check_count(
                self.indexer.n_records,
                name="indexer.n_records",
                at_most=self.n_records,
                where=f"part {self.part}",
                expected=f"its n_records = {self.n_records}",
                error=ValueError,
            )
        if self.digest is not None:
            try:  # bounded by the records the commit vouches for, before anything else reads them
                self.sample_id_hashes("digest")
                self.prefix_probes("digest")
            except CorruptDataError as exc:
                raise ValueError(str(exc)) from None
        return self

    def sample_id_hashes(self, where: str) -> npt.NDArray[np.uint64] | None:
        """The digest's sample-id hashes (None without a digest), bounded by the commit's records."""
        if self.digest is None:
            return None
        return decode_hashes(self.digest.sample_ids, self.n_records, f"{where}: sample_ids")

    def prefix_probes(self, where: str) -> npt.NDArray[np.uint64] | None:
        """The digest's prefix probes (None without a digest), bounded by the commit's records."""
        if self.digest is None:
            return None
        return decode_hashes(self.digest.prefixes, self.n_records, f"{where}: prefixes")


STREAMS_DIR: Final = "streams"


class AnnotationCommit(_CommitBase):
    """An entry of the step's log, created exclusively after its data (format 3; formats 1-2:
    ``steps/<step>/annotations/<writer>.<seq>.json``): per-token columns for records committed before it in the
    step (e.g. the trainer's log-probs), stored under ``steps/<step>/annotations/<part>/``."""

    kind: Literal["routelog.annotation"] = ANNOTATION_KIND
    values: ValuesInfo
    n_tokens: int | None = Field(default=None, ge=0)
    """Tokens of the annotated records (format 3; what bounds reading the values object). Null before."""


class DropRecord(_Document):
    """An entry of the step's log (format 3; ``steps/<step>/drops/<writer>.<seq>.json`` in formats 1.3-2): records
    removed from the step without rewriting any data object. It removes the records it names (by sample id, by
    part or by writer) among the commits before it in the log; records committed after it are not touched.
    ``routelog gc`` reclaims the bytes of parts dropped whole. Readers as of an earlier time do not apply it."""

    format_version: int = FORMAT_VERSION
    kind: Literal["routelog.drop"] = DROP_KIND
    features: list[str] = []
    step: int = Field(ge=0)
    writer_id: WriterId
    """Who dropped: ``drop`` for ``routelog drop``, ``gc`` for parts gc found dead."""
    seq: int | None = Field(default=None, ge=0, lt=10**8)
    """Formats 1.3-2: the writer's drop counter naming the document. Null in format 3."""
    position: Position | None = None
    """Format 3: the drop's position in the step's log."""
    created_at: UtcDateTime
    sample_ids: list[Name] = []
    parts: list[PartName] = []
    """Whole parts dropped (gc writes these for parts whose every record was dropped or shadowed)."""
    writers: list[WriterId] = []
    """Every part committed by these writers in this step."""
    reason: Name | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> DropRecord:
        if not (self.sample_ids or self.parts or self.writers):
            raise ValueError("a drop names at least one sample id, part or writer")
        if (self.seq is None) == (self.position is None):
            raise ValueError("a drop has either a seq (formats 1.3-2) or a log position (format 3)")
        return self

    @property
    def name(self) -> str:
        """The document's file name in the log (format 3) or in ``drops/`` (formats 1.3-2)."""
        if self.position is not None:
            return keys.log_name(self.position)
        return keys.commit_name(self.writer_id, self.seq or 0)


class FidelityRecord(_Document):
    """Created exclusively under ``steps/<step>/fidelity/<writer>.<seq>.json`` (format 2, optional): how faithfully
    one training rank replayed the step's routing. While replaying, each router still computes its own top-k;
    per MoE layer the rank counts the rows it replayed and, of those, the rows whose own top-k set differs from the
    replayed one (the R3 paper's router diff, measured in the trainer); optionally the same per sparse-attention
    indexer layer (the indexer diff). Counts are summed on the rank and published once per step, so a step of any
    size costs one small document per rank."""

    format_version: int = FORMAT_VERSION
    kind: Literal["routelog.fidelity"] = FIDELITY_KIND
    features: list[str] = []
    step: int = Field(ge=0)
    writer_id: WriterId
    """The rank that measured, e.g. ``train-dp0-pp1``."""
    seq: int = Field(ge=0, lt=10**8)
    created_at: UtcDateTime
    trainer_step: int | None = None
    """The trainer's own iteration counter, when it differs from the store's step."""
    phase: Name | None = None
    """What the measured forwards were for, e.g. ``old_logprob`` or ``train``."""
    layers: list[int] = Field(max_length=MAX_MOE_LAYERS)
    """Global layer indices (0-based decoder layers) of the counts below."""
    replayed_rows: list[int]
    differing_rows: list[int]
    """Replayed rows whose router would have chosen another set."""
    fallback_rows: list[int] = []
    """Rows without a recorded route that took the router's own choice (the ``router`` missing policy)."""
    samples: int = Field(ge=0)
    """Records installed by the rank in the step."""
    token_mismatches: int = Field(0, ge=0)
    """Records whose fed tokens hashed differently from the recorded ones (a gate in ``warn`` mode let them through)."""
    indexer_layers: list[int] = Field([], max_length=MAX_LAYERS)
    """Global layer indices (0-based decoder layers) of the sparse-attention indexer counts below; empty when the
    rank replayed no indexer selections (older documents have none)."""
    indexer_replayed_rows: list[int] = []
    """Query rows whose recorded indexer selection the rank replayed."""
    indexer_differing_rows: list[int] = []
    """Replayed query rows whose indexer's own top-k set differs from the replayed selection (the indexer diff)."""

    @model_validator(mode="after")
    def _aligned(self) -> FidelityRecord:
        n = len(self.layers)
        if len(self.replayed_rows) != n or len(self.differing_rows) != n or len(self.fallback_rows) not in (0, n):
            raise ValueError("replayed_rows, differing_rows and fallback_rows must have one count per layer")
        if any(d < 0 or d > r for d, r in zip(self.differing_rows, self.replayed_rows, strict=True)):
            raise ValueError("every layer's differing_rows must lie in [0, replayed_rows]")
        m = len(self.indexer_layers)
        if len(self.indexer_replayed_rows) != m or len(self.indexer_differing_rows) != m:
            raise ValueError("indexer_replayed_rows and indexer_differing_rows must have one count per indexer layer")
        if any(d < 0 or d > r for d, r in zip(self.indexer_differing_rows, self.indexer_replayed_rows, strict=True)):
            raise ValueError("every indexer layer's indexer_differing_rows must lie in [0, indexer_replayed_rows]")
        return self

    @property
    def name(self) -> str:
        return keys.commit_name(self.writer_id, self.seq)


class RunDocument(_Document):
    """``routelog.json`` at the store root, created exclusively once: the run this store belongs to."""

    format_version: int = FORMAT_VERSION
    kind: Literal["routelog.run"] = RUN_KIND
    features: list[str] = []
    run_id: str
    created_at: UtcDateTime
    model_spec: ModelSpec
    config: dict[str, JsonValue] = {}
    """Free-form user configuration of the run."""


class SealedObjectInfo(ObjectInfo):
    """A consolidated object of a seal; ``key`` is ``_sealed/<nonce>.<kind>`` relative to the step directory."""

    key: SealedObject


class Consolidated(_Document):
    """The step's commits and index gathered in two objects at seal time, so readers of a sealed step need a few
    GETs (and the listing of the log) whatever the number of parts (keys relative to the step directory)."""

    commits: SealedObjectInfo
    """JSON list of the commit records, in the order of :attr:`SealRecord.commits`."""
    index: SealedObjectInfo
    """Parquet: every index row of the listed commits (format 3: of those not dropped whole before the seal) plus
    ``_commit`` (int32), the row's position in that list."""


class SealRecord(_Document):
    """An entry of the step's log (format 3), copied to ``steps/<step>/_SEALED.json`` once created (formats 1-2:
    only that document): the step is closed; the commits before the seal are its content, and no later one."""

    format_version: int = FORMAT_VERSION
    kind: Literal["routelog.seal"] = SEAL_KIND
    features: list[str] = []
    step: int = Field(ge=0)
    position: Position | None = None
    """Format 3: the seal's position in the step's log; it closes the step to commits after it."""
    sealed_at: UtcDateTime
    commits: list[CommitName]
    """Names of the commits of the step, sorted and unique: formats 3 and 4, every commit before the seal (a commit
    entry's commits by their names, ``<position>.<slot>.json``); formats 1-2, the commit documents
    (``<writer>.<seq>.json``) the sealer listed."""
    n_records: int = Field(ge=0)
    n_tokens: int = Field(ge=0)
    """Records and tokens the consolidated index holds (format 3: every record of the commits not dropped whole
    before the seal, dropped or shadowed ones included; formats 1-2: the records live when sealed)."""
    consolidated: Consolidated | None = None
    """Optional copies of the commits and indexes; readers MAY use them instead of reading each part's."""

    @model_validator(mode="after")
    def _sorted(self) -> SealRecord:
        if self.commits != sorted(set(self.commits)):
            raise ValueError("commits must be sorted and unique")
        return self

    @property
    def name(self) -> str:
        """The seal's file name: its log entry (format 3), or ``_SEALED.json`` (formats 1-2)."""
        return keys.SEAL if self.position is None else keys.log_name(self.position)


class SealIntent(_Document):
    """``steps/<step>/_SEALING.json``: created by a sealer before it lists the step's commits. Writers start no
    upload while it exists, so the sealer's entry soon finds its position free. (Formats 1-2 also fenced commits
    with it; in format 3 a commit knows from the log whether a seal precedes it.)"""

    format_version: int = FORMAT_VERSION
    kind: Literal["routelog.seal-intent"] = "routelog.seal-intent"
    features: list[str] = []
    step: int = Field(ge=0)
    started_at: UtcDateTime


class StepLogMarker(_Document):
    """``steps/<step>/commits/_log.00000000.json``, created before the first log entry of a step of a format-1/2
    store: its name is a format-1/2 commit name, so older readers parse it and refuse its version instead of
    reading the step without its log."""

    format_version: int = FORMAT_VERSION
    kind: Literal["routelog.step-log"] = "routelog.step-log"
    features: list[str] = []
    step: int = Field(ge=0)


class CommitGroup(_Document):
    """A commit entry of format 4 (``steps/<step>/log/<position>.json``, kind ``routelog.commit``): one or more
    parts made visible together, in the order of :attr:`commits` (a commit's slot). One process appends it for
    the writers whose parts it holds (a committer batching many writers, or a writer committing its own parts), so
    a thousand writers commit in a few appends instead of contending for a thousand positions. An older reader
    refuses it by its ``format_version``."""

    format_version: int = FORMAT_VERSION
    kind: Literal["routelog.commit"] = COMMIT_KIND
    features: list[str] = []
    """Every feature one of its commits names (so a reader that lacks one refuses the entry before reading it)."""
    step: int = Field(ge=0)
    position: Position
    created_at: UtcDateTime
    committer: WriterId
    """The process that appended the entry: a committer's id, or the writer's own when it committed its parts."""
    commits: list[CommitRecord] = Field(min_length=1, max_length=keys.MAX_GROUP_COMMITS)
    """The commits, each with this entry's ``step``, ``position`` and ``created_at``, and its index as ``slot``."""

    @model_validator(mode="after")
    def _members(self) -> CommitGroup:
        _check_members(self.commits, self.step, self.position, self.created_at, self.format_version)
        features = sorted({f for c in self.commits for f in c.features})
        if sorted(set(self.features)) != features:
            raise ValueError(f"features {self.features} differ from its commits' {features}")
        return self

    @property
    def name(self) -> str:
        return keys.log_name(self.position)


ARCHIVE_WRITER: Final = "archive"
"""The writer id of archive parts (their names start ``archive.<seq:08d>.``)."""


class ArchivedPart(_Document):
    """One part of an archive entry: the commits of the step whose records it holds, in that order."""

    replaces: list[CommitName] = Field(min_length=1)
    """Names of the commits whose records the part holds: its index lists every row of the first one's index, in
    that index's order, then the second's, and so on."""
    commit: CommitRecord
    """The part described as a commit is (its objects, arrays, counts and digest), with the archive entry's step,
    position and time, its index in :attr:`ArchiveRecord.parts` as ``slot``, and writer ``archive``."""


class ArchiveRecord(_Document):
    """An entry of a sealed step's log (revision 4.2, feature ``archive``): the step's records re-coded into
    archive parts. A view whose entries include it reads each commit it replaces from its archive part (the
    commit keeps its place, writer and part name for every rule); a view as of an earlier time reads the original
    parts, which gc keeps until the entry is older than its grace period."""

    format_version: int = FORMAT_VERSION
    kind: Literal["routelog.archive"] = ARCHIVE_KIND
    features: list[str] = []
    """``archive`` and every feature one of its parts names."""
    step: int = Field(ge=0)
    position: Position
    created_at: UtcDateTime
    writer_id: WriterId
    """The process that archived the step."""
    seal: CommitName | Literal["_SEALED.json"]
    """The name of the step's seal entry (``_SEALED.json`` for a format-1/2 seal): an archive follows it."""
    parts: list[ArchivedPart] = Field(min_length=1, max_length=keys.MAX_GROUP_COMMITS)
    bytes_before: int = Field(ge=0)
    """Bytes of the original parts' objects the replaced commits list (informational)."""

    @model_validator(mode="after")
    def _parts(self) -> ArchiveRecord:
        replaced = [name for p in self.parts for name in p.replaces]
        if len(set(replaced)) != len(replaced):
            raise ValueError("an archive replaces a commit twice")
        commits = [p.commit for p in self.parts]
        _check_members(commits, self.step, self.position, self.created_at, self.format_version)
        strangers = [c.writer_id for c in commits if c.writer_id != ARCHIVE_WRITER]
        if strangers:
            raise ValueError(f"archive parts are written by {ARCHIVE_WRITER!r}, not {strangers[0]!r}")
        features = sorted({ARCHIVE_FEATURE, *(f for c in commits for f in c.features)})
        if sorted(set(self.features)) != features:
            raise ValueError(f"features {self.features} differ from {features} (archive and its parts' features)")
        return self

    @property
    def name(self) -> str:
        return keys.log_name(self.position)


def _check_members(
    commits: list[CommitRecord], step: int, position: int, created_at: datetime, format_version: int
) -> None:
    """The commits of one log entry (a commit entry's, an archive's parts) carry its step, position and time, their
    index as slot, no newer format than the entry's, and name distinct parts."""
    for slot, commit in enumerate(commits):
        if (commit.step, commit.position, commit.slot, commit.created_at) != (step, position, slot, created_at):
            raise ValueError(
                f"commit {slot} ({commit.part}) says step {commit.step}, position {commit.position}, slot "
                f"{commit.slot}, created {commit.created_at}: a commit of an entry has the entry's step, position "
                "and time, and its index as slot"
            )
        if commit.format_version > format_version:
            raise ValueError(f"commit {slot} has format version {commit.format_version}, its entry older")
    parts = [c.part for c in commits]
    if len(set(parts)) != len(parts):
        raise ValueError("an entry names a part twice")


LogDocument = CommitRecord | DropRecord | AnnotationCommit | SealRecord | ArchiveRecord
"""What one entry of a step's log stands for (a format-4 commit entry stands for each of its commits)."""
StoredEntry = CommitGroup | LogDocument
"""What a log entry's object holds: a format-4 commit entry (several commits) or one document."""
_LOG_MODELS: dict[
    str, type[CommitRecord] | type[DropRecord] | type[AnnotationCommit] | type[SealRecord] | type[ArchiveRecord]
] = {
    COMMIT_KIND: CommitRecord,
    DROP_KIND: DropRecord,
    ANNOTATION_KIND: AnnotationCommit,
    SEAL_KIND: SealRecord,
    ARCHIVE_KIND: ArchiveRecord,
}


def parse_log_document(data: bytes, where: str) -> StoredEntry:
    """A log entry, by its ``kind`` (a commit entry holding ``commits`` is a format-4 group); :class:`CorruptDataError`
    for any other document."""
    try:
        raw = load_json(data, where)
    except ValueError as exc:
        raise CorruptDataError(f"{exc}; the object is damaged") from None
    kind = raw.get("kind") if isinstance(raw, dict) else None
    model = _LOG_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        if isinstance(raw, dict) and "format_version" in raw:
            check_format(raw, where)  # an entry of a later revision names what it needs: refused by that
        kind = raw.get("kind") if isinstance(raw, dict) else type(raw).__name__
        raise CorruptDataError(f"{where}: not a log entry (kind {kind!r})")
    if model is CommitRecord and "commits" in raw:
        return validate_document(raw, CommitGroup, where)
    return validate_document(raw, model, where)


DOCUMENT_MODELS: dict[str, type[BaseModel]] = {
    "run": RunDocument,
    "commit": CommitRecord,
    "commit_group": CommitGroup,
    "archive": ArchiveRecord,
    "seal": SealRecord,
    "seal_intent": SealIntent,
    "annotation": AnnotationCommit,
    "drop": DropRecord,
    "fidelity": FidelityRecord,
    "step_log_marker": StepLogMarker,
    "index_row": IndexRow,
    "model_spec": ModelSpec,
}
"""Models published as ``schemas/<name>.schema.json``."""


def json_schemas() -> dict[str, dict[str, Any]]:
    """The published JSON Schemas, ``schemas/<name>.schema.json``, generated from the models."""
    out = {}
    for name, model in DOCUMENT_MODELS.items():
        schema = model.model_json_schema(mode="validation")
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["$id"] = f"https://routelog.dev/schemas/v{FORMAT_VERSION}/{name}.schema.json"
        out[name] = schema
    return out


def load_json(data: bytes | str, where: str, *, max_bytes: int = MAX_DOCUMENT_BYTES) -> Any:
    """Parse JSON text bounded in size and nesting (:data:`MAX_JSON_DEPTH`); ``ValueError`` naming ``where``.

    Callers turn the ``ValueError`` into their typed error (:class:`CorruptDataError` for stored documents,
    :class:`~routelog.errors.IngestError` for engine payloads).
    """
    if len(data) > max_bytes:
        raise ValueError(f"{where}: {len(data)} bytes of JSON, more than the {max_bytes} allowed")
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: not valid JSON ({exc})") from None
    _check_depth(value, where)
    return value


def _check_depth(value: Any, where: str) -> None:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, (dict, list)))


def parse_document(data: bytes, model: type[_D], where: str) -> _D:
    """Parse a JSON document, refusing newer format versions and unknown features with a typed error."""
    try:
        raw = load_json(data, where)
    except ValueError as exc:
        raise CorruptDataError(f"{exc}; the object is damaged") from None
    return validate_document(raw, model, where)


def validate_document(raw: Any, model: type[_D], where: str) -> _D:
    """A parsed JSON value as ``model``, after the version check; :class:`CorruptDataError` if it does not fit."""
    if not isinstance(raw, dict):
        raise CorruptDataError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    check_format(raw, where)
    try:
        return model.model_validate(raw)
    except ValueError as exc:
        raise CorruptDataError(f"{where}: does not match the format-{FORMAT_VERSION} schema: {exc}") from None


def check_format(doc: Mapping[str, Any], where: str) -> None:
    """Raise :class:`FormatVersionError` unless this routelog can read a document of this version."""
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CorruptDataError(f"{where}: 'format_version' is missing or not an integer ({version!r})")
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{where} was written in routelog format version {version}; this routelog reads versions up to "
            f"{FORMAT_VERSION}. Upgrade routelog (pip install -U routelog) to read it."
        )
    if version < 1:
        raise CorruptDataError(f"{where}: 'format_version' {version} is not a routelog format version")
    features = doc.get("features", [])
    if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
        raise CorruptDataError(f"{where}: 'features' must be a list of strings, got {features!r}")
    unknown = sorted(set(features) - SUPPORTED_FEATURES)
    if unknown:
        raise FormatVersionError(
            f"{where} requires format features {unknown} that this routelog does not implement; upgrade routelog."
        )


def dump_document(doc: BaseModel) -> bytes:
    """A document's stored bytes: compact JSON (indentation was 30 % of a commit's bytes; ``routelog inspect`` and
    any JSON tool print it indented)."""
    return doc.model_dump_json().encode() + b"\n"


# -- Parquet schema derived from IndexRow --------------------------------------------------------------------------
_SCALARS: dict[type, pa.DataType] = {int: pa.int64(), str: pa.string(), bool: pa.bool_(), float: pa.float64()}


def _arrow_field(name: str, annotation: Any, metadata: list[Any]) -> pa.Field:
    nullable = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(annotation))
        (annotation,) = args
        origin = typing.get_origin(annotation)
    if origin is Annotated:
        annotation, *extra = typing.get_args(annotation)
        metadata = [*metadata, *extra]
        origin = typing.get_origin(annotation)
    override = next((m.dtype for m in metadata if isinstance(m, ArrowType)), None)
    if origin is list:
        (item,) = typing.get_args(annotation)
        dtype: pa.DataType = pa.list_(_arrow_field("element", item, []))
    elif origin is Literal and all(isinstance(v, str) for v in typing.get_args(annotation)):
        dtype = pa.string()
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        dtype = pa.struct([_arrow_field(n, f.annotation, list(f.metadata)) for n, f in annotation.model_fields.items()])
    else:
        dtype = override if override is not None else _SCALARS[annotation]
    return pa.field(name, dtype, nullable=nullable)


def _index_schema() -> pa.Schema:
    fields = [_arrow_field(n, f.annotation, list(f.metadata)) for n, f in IndexRow.model_fields.items()]
    return pa.schema(fields, metadata={b"routelog.format_version": str(FORMAT_VERSION).encode()})


INDEX_SCHEMA = _index_schema()
"""Arrow schema of ``index.parquet``."""
