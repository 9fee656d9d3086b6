"""The on-disk documents of format version 1, as pydantic models (the source of ``schemas/*.schema.json``).

``schemas/FORMAT.md`` is the normative page; this module is its executable form. The Parquet index schema is
derived from :class:`IndexRow`, so the JSON schema and the Parquet columns cannot drift apart.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, Final, Literal, TypeVar

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, JsonValue

from routelog.codec import TopkOrder, Transform
from routelog.errors import CorruptDataError, FormatVersionError
from routelog.spec import ModelSpec

FORMAT_VERSION = 1
"""The format this routelog writes, and the newest it reads."""

SUPPORTED_FEATURES: frozenset[str] = frozenset()
"""Optional format features this routelog understands; a document requiring any other is refused."""

RUN_KIND: Final = "routelog.run"
COMMIT_KIND: Final = "routelog.commit"
SEAL_KIND: Final = "routelog.seal"
ANNOTATION_KIND: Final = "routelog.annotation"


class ArrowType:
    """Annotation marker: the Parquet/Arrow type of an :class:`IndexRow` field when the default is too wide."""

    def __init__(self, dtype: pa.DataType) -> None:
        self.dtype = dtype


Int32 = Annotated[int, ArrowType(pa.int32())]


def utc_now() -> datetime:
    return datetime.now(UTC)


class _Document(BaseModel):
    # Unknown fields are ignored so that additive changes of a later minor revision stay readable.
    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)


_D = TypeVar("_D", bound=_Document)


# -- per-record index (Parquet) ----------------------------------------------------------------------------------
class Span(_Document):
    """Tokens ``[token_start, token_start + n_rows)`` of a record are stored at rows ``[row, row + n_rows)``."""

    token_start: Int32 = Field(ge=0)
    n_rows: Int32 = Field(ge=1)
    row: int = Field(ge=0)
    """First row in the routing array of the part named by ``part``."""
    part: str | None = None
    """Part holding the rows, as ``steps/<step>/parts/<part>`` relative to the store root; null = this record's
    own part. Version-1 writers always write null; readers MUST follow non-null references (shared prefixes)."""


class Segment(_Document):
    """Provenance of tokens ``[start, end)``: which policy version produced them and how."""

    start: Int32 = Field(ge=0)
    end: Int32 = Field(ge=0)
    policy_version: int | None = None
    source: str | None = None
    """Free text such as ``prompt``, ``response``, ``turn-2``, ``tool`` or ``resumed``."""


class IndexRow(_Document):
    """One committed record: a Parquet row of the part's ``index.parquet``."""

    sample_id: str
    """Unique within a step; never used as an object key."""
    step: int
    group_id: str | None = None
    policy_version: int | None = None
    engine: str | None = None
    engine_version: str | None = None
    prompt_len: Int32 = Field(ge=0)
    response_len: Int32 = Field(ge=0)
    n_tokens: Int32 = Field(ge=0)
    """``prompt_len + response_len``; routing row ``t`` belongs to input position ``t``."""
    token_hash: str | None = None
    """``blake2b-128:<hex>`` of the token ids as little-endian int64."""
    token_ids: list[Int32] | None = None
    spans: list[Span]
    """Where the computed rows are stored; tokens covered by no span are missing (never computed)."""
    segments: list[Segment]
    extra: str | None = None
    """User metadata as a JSON text."""

    @property
    def n_missing(self) -> int:
        return self.n_tokens - sum(span.n_rows for span in self.spans)


# -- commit and run documents (JSON) -----------------------------------------------------------------------------
class ObjectInfo(_Document):
    """One immutable data object of a part, for integrity checks."""

    key: str
    """Path relative to the part directory."""
    size: int = Field(ge=0)
    sha256: str


class RoutingArrayInfo(_Document):
    """The zarr v3 array ``routing`` of a part: layer-major ``[num_moe_layers, n_rows, topk]`` stored IDs."""

    path: str = "routing"
    dtype: Literal["uint8", "uint16"]
    n_rows: int = Field(ge=0)
    num_moe_layers: int = Field(ge=1)
    topk: int = Field(ge=1)
    num_experts: int = Field(ge=1)
    transform: Transform
    """``sorted_gaps``: rows are sorted IDs stored as gaps (see FORMAT.md); ``none``: IDs as given."""
    topk_order: TopkOrder
    """``sorted``: rows were canonicalised ascending; ``score``: the engine's order was kept."""
    chunk_rows: int = Field(ge=1)
    chunk_layers: int = Field(ge=1)
    zarr_metadata: dict[str, JsonValue] = {}
    """A copy of ``routing/zarr.json``, so readers open the array without fetching it."""


class ValueColumn(_Document):
    """A per-token float column (see ``routelog.values``): entry ``t`` belongs to input position ``t``."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,63}$")
    """``logprob_infer`` and ``logprob_train`` are the well-known names; others are free."""
    dtype: Literal["float32"] = "float32"


class ValuesInfo(_Document):
    """The Parquet object holding a part's per-token columns: ``sample_id``, ``token_hash``, then one
    ``list<float32>`` column per declared name (null where a record has no such column; NaN = no value)."""

    key: str = "values.parquet"
    """Path relative to the part (or annotation) directory; also listed in ``objects``."""
    columns: list[ValueColumn]


class CommitRecord(_Document):
    """Created exclusively, last, under ``steps/<step>/commits/<writer>.<seq>.json``: the part becomes visible."""

    format_version: int = FORMAT_VERSION
    kind: Literal["routelog.commit"] = COMMIT_KIND
    features: list[str] = []
    step: int = Field(ge=0)
    part: str
    """Directory name of the part under ``steps/<step>/parts/``."""
    writer_id: str
    seq: int = Field(ge=0)
    """The writer's commit counter; with ``writer_id`` it names the commit, which makes re-commits idempotent."""
    created_at: datetime
    n_records: int = Field(ge=0)
    n_tokens: int = Field(ge=0)
    routing: RoutingArrayInfo
    objects: list[ObjectInfo]
    values: ValuesInfo | None = None
    """Per-token float columns of the part's records, if any were attached (added in format 1.1: readers that
    do not know the field ignore it and never fetch the object)."""


class AnnotationCommit(_Document):
    """Created exclusively, last, under ``steps/<step>/annotations/<writer>.<seq>.json``: per-token columns for
    records already committed in the step (e.g. the trainer's log-probs), stored under
    ``steps/<step>/annotations/<part>/``."""

    format_version: int = FORMAT_VERSION
    kind: Literal["routelog.annotation"] = ANNOTATION_KIND
    features: list[str] = []
    step: int = Field(ge=0)
    part: str
    """Directory name of the data under ``steps/<step>/annotations/``."""
    writer_id: str
    seq: int = Field(ge=0)
    created_at: datetime
    n_records: int = Field(ge=0)
    values: ValuesInfo
    objects: list[ObjectInfo]


class RunDocument(_Document):
    """``routelog.json`` at the store root, created exclusively once: the run this store belongs to."""

    format_version: int = FORMAT_VERSION
    kind: Literal["routelog.run"] = RUN_KIND
    features: list[str] = []
    run_id: str
    created_at: datetime
    model_spec: ModelSpec
    config: dict[str, JsonValue] = {}
    """Free-form user configuration of the run."""


class Consolidated(_Document):
    """The step's commits and index gathered in two objects at seal time, so readers of a sealed step need
    three GETs whatever the number of parts (keys relative to the step directory)."""

    commits: ObjectInfo
    """JSON list of the commit records, in the order of :attr:`SealRecord.commits`."""
    index: ObjectInfo
    """Parquet: every index row of the step plus ``_commit`` (int32), the row's position in that list."""


class SealRecord(_Document):
    """``steps/<step>/_SEALED.json``: the step is closed; exactly these commits are its content."""

    format_version: int = FORMAT_VERSION
    kind: Literal["routelog.seal"] = SEAL_KIND
    features: list[str] = []
    step: int = Field(ge=0)
    sealed_at: datetime
    commits: list[str]
    """Commit file names (``<writer>.<seq>.json``) in the step, sorted."""
    n_records: int = Field(ge=0)
    n_tokens: int = Field(ge=0)
    consolidated: Consolidated | None = None
    """Optional copies of the commits and indexes; readers MAY use them instead of reading each part's."""


DOCUMENT_MODELS: dict[str, type[BaseModel]] = {
    "run": RunDocument,
    "commit": CommitRecord,
    "seal": SealRecord,
    "annotation": AnnotationCommit,
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


def parse_document(data: bytes, model: type[_D], where: str) -> _D:
    """Parse a JSON document, refusing newer format versions and unknown features with a typed error."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptDataError(f"{where}: not valid JSON ({exc}); the object is damaged") from exc
    if not isinstance(raw, dict):
        raise CorruptDataError(f"{where}: expected a JSON object")
    check_format(raw, where)
    try:
        return model.model_validate(raw)
    except ValueError as exc:
        raise CorruptDataError(f"{where}: does not match the format-{FORMAT_VERSION} schema: {exc}") from exc


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
    unknown = sorted(set(doc.get("features") or []) - SUPPORTED_FEATURES)
    if unknown:
        raise FormatVersionError(
            f"{where} requires format features {unknown} that this routelog does not implement; upgrade routelog."
        )


def dump_document(doc: BaseModel) -> bytes:
    return doc.model_dump_json(indent=1).encode() + b"\n"


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
