"""Reading committed records: a step snapshot, then routing for chosen records and chosen layers.

A snapshot is the set of commit records of a step (the seal's list once sealed), and the union of their parts'
Parquet indexes. Routing reads go straight to the chunks that hold the requested rows and layers (ranged reads
of the sharded array; the array metadata comes embedded in the commit), concurrently across parts.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import zarr

from routelog import layout
from routelog.errors import CorruptDataError, DuplicateSampleError, RecordNotFoundError
from routelog.format import (
    INDEX_SCHEMA,
    AnnotationCommit,
    CommitRecord,
    Consolidated,
    IndexRow,
    SealRecord,
    Span,
    ValuesInfo,
    parse_document,
)
from routelog.part import BlockRequest, ShardIndexCache, fetch_blocks, index_from_parquet
from routelog.record import Record
from routelog.values import FloatArray, values_from_parquet

if TYPE_CHECKING:
    import torch

    from routelog.store import Store

_VALUES_CACHE = 4
"""Values objects kept decoded per snapshot (streaming reads visit parts one after another)."""

MISSING = -1
"""Value of rows the engine never computed in :attr:`RecordRouting.expert_ids`."""


@dataclass(frozen=True)
class RecordRouting:
    """The routing of one record for the layers asked for."""

    info: IndexRow
    by_layer: npt.NDArray[np.unsignedinteger[Any]]
    """``[n_layers, n_tokens, topk]`` (C-contiguous, one ``[T, K]`` block per router) in the storage dtype
    (uint8/uint16); rows not in ``valid`` hold 0."""
    valid: npt.NDArray[np.bool_]
    """``[n_tokens]``: rows the engine computed."""
    moe_layers: tuple[int, ...]
    """Positions of axis 1 on the MoE-only axis."""
    layers: tuple[int, ...]
    """Global layer indices of axis 1."""
    topk_order: str
    num_moe_layers: int
    """Length of the model's MoE axis (``moe_layers`` may be a subset)."""

    @property
    def sample_id(self) -> str:
        return self.info.sample_id

    @property
    def ids(self) -> npt.NDArray[np.unsignedinteger[Any]]:
        """``[n_tokens, n_layers, topk]`` view of :attr:`by_layer` (not C-contiguous); invalid rows hold 0."""
        return self.by_layer.transpose(1, 0, 2)

    @cached_property
    def expert_ids(self) -> npt.NDArray[np.signedinteger[Any]]:
        """``[n_tokens, n_layers, topk]`` int16 (int32 above 32767 experts), C-contiguous; missing rows are -1."""
        dtype = np.int16 if self.by_layer.dtype == np.uint8 or int(self.by_layer.max(initial=0)) < 32767 else np.int32
        out: npt.NDArray[np.signedinteger[Any]] = np.ascontiguousarray(self.ids, dtype=dtype)
        out[~self.valid] = MISSING
        return out

    def to_record(self) -> Record:
        """The record as written (all of its layers must have been read), e.g. to export it to an engine layout."""
        if self.moe_layers != tuple(range(self.num_moe_layers)):
            raise ValueError("to_record needs every MoE layer; read the record without moe_layers")
        info = self.info
        return Record(
            sample_id=info.sample_id,
            expert_ids=np.ascontiguousarray(self.ids),
            prompt_len=info.prompt_len,
            response_len=info.response_len,
            valid=self.valid,
            token_ids=None if info.token_ids is None else np.asarray(info.token_ids, dtype=np.int64),
            token_hash=info.token_hash,
            group_id=info.group_id,
            policy_version=info.policy_version,
            engine=info.engine,
            engine_version=info.engine_version,
            segments=info.segments,
            extra=None if info.extra is None else json.loads(info.extra),
        )

    def to_torch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(expert_ids, valid)`` as torch tensors (int16/int32 and bool)."""
        import torch

        return torch.from_numpy(self.expert_ids), torch.from_numpy(self.valid)


@dataclass(frozen=True)
class _PartRead:
    """One contiguous row range of one part, read for one contiguous run of MoE layers."""

    part_key: str
    row_start: int
    row_stop: int
    layer_start: int
    """First MoE-axis position read."""
    layer_stop: int
    out_start: int
    """Where the layers land on axis 1 of the output."""
    out_stop: int
    members: tuple[tuple[str, Span], ...]
    """The (sample id, span) pairs whose rows this read covers."""

    def request(self, commit: CommitRecord) -> BlockRequest:
        return BlockRequest(
            part_key=self.part_key,
            commit=commit,
            rows=(self.row_start, self.row_stop),
            layers=(self.layer_start, self.layer_stop),
            samples=tuple(sorted({sid for sid, _ in self.members})),
        )


@dataclass
class StepSnapshot:
    """The committed records of one step at the time it was loaded."""

    store: Store
    step: int
    commits: list[CommitRecord]
    index: pa.Table
    """All index rows of the step, plus ``_commit``: the position of the row's commit in :attr:`commits`."""
    sealed: bool
    as_of: datetime | None = None
    _positions: dict[str, int] = field(init=False, repr=False)
    _commit_column: npt.NDArray[np.int32] = field(init=False, repr=False)
    _n_tokens: npt.NDArray[np.int32] = field(init=False, repr=False)
    _own: dict[str, CommitRecord] = field(init=False, repr=False)
    _foreign: dict[str, CommitRecord] = field(default_factory=dict, init=False, repr=False)
    _index_cache: ShardIndexCache = field(default_factory=ShardIndexCache, init=False, repr=False)
    _annotations: list[AnnotationCommit] | None = field(default=None, init=False, repr=False)
    _values_cache: OrderedDict[tuple[str, tuple[str, ...]], dict[str, dict[str, FloatArray]]] = field(
        default_factory=OrderedDict, init=False, repr=False
    )

    def __post_init__(self) -> None:
        self._commit_column = self.index.column("_commit").to_numpy()
        self._n_tokens = self.index.column("n_tokens").to_numpy()
        self._own = {layout.part_dir(self.step, c.part): c for c in self.commits}
        ids = self.index.column("sample_id").to_pylist()
        positions: dict[str, int] = {}
        for i, sid in enumerate(ids):
            if sid in positions:
                first = self.commits[self._commit_of(positions[sid])].part
                second = self.commits[self._commit_of(i)].part
                raise DuplicateSampleError(
                    sid,
                    "sample_id",
                    f"is committed twice in step {self.step} (parts {first!r} and {second!r})",
                    "give concurrent writers disjoint sample ids (e.g. synth --sample-prefix); run routelog verify",
                )
            positions[sid] = i
        self._positions = positions

    # -- loading -------------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, store: Store, step: int, *, as_of: datetime | None = None) -> StepSnapshot:
        """The step's committed records; with ``as_of``, only commits created by then (and the seal only if it
        was sealed by then), i.e. the step as a reader saw it at that time."""
        storage = store.storage
        seal_key = layout.seal_key(step)
        try:
            seal: SealRecord | None = parse_document(storage.read(seal_key), SealRecord, storage.url_of(seal_key))
        except FileNotFoundError:
            seal = None
        if seal is not None and as_of is not None and seal.sealed_at > as_of:
            seal = None
        if seal is not None and seal.consolidated is not None:
            return cls._load_consolidated(store, step, seal.consolidated, as_of)
        names = (
            seal.commits
            if seal is not None
            else [n for n in storage.list(layout.commits_dir(step)) if layout.parse_commit_name(n)]
        )
        keys = [layout.commit_key(step, n) for n in names]
        raw = storage.read_many(keys)
        commits = [parse_document(raw[k], CommitRecord, storage.url_of(k)) for k in keys]
        if as_of is not None:
            commits = [c for c in commits if c.created_at <= as_of]
        index_keys = [f"{layout.part_dir(step, c.part)}/{layout.INDEX}" for c in commits]
        try:
            index_bytes = storage.read_many(index_keys)
        except FileNotFoundError as exc:
            raise CorruptDataError(f"step {step} of {store.url}: a committed part's index is missing ({exc})") from exc
        tables = []
        for i, key in enumerate(index_keys):
            table = _parquet(index_bytes[key], storage.url_of(key))
            tables.append(table.append_column("_commit", pa.array([i] * table.num_rows, pa.int32())))
        empty = INDEX_SCHEMA.empty_table().append_column("_commit", pa.array([], pa.int32()))
        index = pa.concat_tables([empty, *tables], promote_options="permissive")
        return cls(store=store, step=step, commits=commits, index=index, sealed=seal is not None, as_of=as_of)

    @classmethod
    def _load_consolidated(
        cls, store: Store, step: int, consolidated: Consolidated, as_of: datetime | None
    ) -> StepSnapshot:
        """A sealed step from its two consolidated objects (checked against the seal's SHA-256s)."""
        storage = store.storage
        base = layout.step_dir(step)
        keys = [f"{base}/{consolidated.commits.key}", f"{base}/{consolidated.index.key}"]
        try:
            data = storage.read_many(keys)
        except FileNotFoundError as exc:
            raise CorruptDataError(f"step {step} of {store.url}: a consolidated object of the seal is missing") from exc
        for info, key in zip((consolidated.commits, consolidated.index), keys, strict=True):
            if hashlib.sha256(data[key]).hexdigest() != info.sha256:
                raise CorruptDataError(f"{storage.url_of(key)}: SHA-256 differs from the seal (corrupted)")
        try:
            docs = json.loads(data[keys[0]])
            commits = [CommitRecord.model_validate(doc) for doc in docs]
        except ValueError as exc:
            raise CorruptDataError(f"{storage.url_of(keys[0])}: not a list of commit records ({exc})") from exc
        index = _parquet(data[keys[1]], storage.url_of(keys[1]))
        return cls(store=store, step=step, commits=commits, index=index, sealed=True, as_of=as_of)

    def _commit_of(self, position: int) -> int:
        return int(self._commit_column[position])

    # -- records ---------------------------------------------------------------------------------------------------
    @property
    def sample_ids(self) -> list[str]:
        return list(self._positions)

    def __len__(self) -> int:
        return len(self._positions)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._positions

    @property
    def n_tokens(self) -> int:
        return sum(c.n_tokens for c in self.commits)

    @property
    def stored_bytes(self) -> int:
        return sum(o.size for c in self.commits for o in c.objects)

    def info(self, sample_id: str) -> IndexRow:
        """The index row of ``sample_id``."""
        return self._row(self._position(sample_id))

    def infos(self) -> Iterator[IndexRow]:
        for position in range(self.index.num_rows):
            yield self._row(position)

    def _position(self, sample_id: str) -> int:
        try:
            return self._positions[sample_id]
        except KeyError:
            raise RecordNotFoundError(
                f"sample {sample_id!r} is not committed in step {self.step} of {self.store.url}"
            ) from None

    def _row(self, position: int) -> IndexRow:
        data = self.index.slice(position, 1).to_pylist()[0]
        data.pop("_commit")
        return IndexRow.model_validate(data)

    # -- routing -----------------------------------------------------------------------------------------------------
    def read(self, sample_id: str, *, moe_layers: Sequence[int] | None = None) -> RecordRouting:
        """Routing of one record; ``moe_layers`` are positions on the MoE axis (default: all)."""
        return self.read_many([sample_id], moe_layers=moe_layers)[0]

    def read_many(self, sample_ids: Iterable[str], *, moe_layers: Sequence[int] | None = None) -> list[RecordRouting]:
        """Routing of several records, fetched concurrently; results follow the order of ``sample_ids``."""
        spec = self.store.model_spec
        wanted = list(range(spec.num_moe_layers)) if moe_layers is None else sorted(set(moe_layers))
        if any(not 0 <= j < spec.num_moe_layers for j in wanted):
            raise ValueError(f"moe_layers {list(moe_layers or [])} outside [0, {spec.num_moe_layers})")
        rows = [self.info(sid) for sid in sample_ids]
        own_part = {r.sample_id: self._part_key(r.sample_id) for r in rows}
        out = {r.sample_id: np.zeros((len(wanted), r.n_tokens, spec.topk), dtype=spec.id_dtype) for r in rows}
        valid = {r.sample_id: np.zeros(r.n_tokens, dtype=bool) for r in rows}
        by_part: dict[str, list[tuple[str, Span]]] = defaultdict(list)
        for r in rows:
            for span in r.spans:
                by_part[span.part or own_part[r.sample_id]].append((r.sample_id, span))
                valid[r.sample_id][span.token_start : span.token_start + span.n_rows] = True
        commits = {key: self._commit_for(key) for key in by_part}
        runs = _contiguous_runs(wanted)
        reads: list[_PartRead] = []
        for key, items in by_part.items():
            for lo, hi, members in _merge_rows(items, commits[key].routing.chunk_rows):
                for a, b in runs:
                    reads.append(_PartRead(key, lo, hi, wanted[a], wanted[b - 1] + 1, a, b, members))
        requests = [read.request(commits[read.part_key]) for read in reads]
        for read, block in zip(reads, fetch_blocks(self.store.storage, requests, self._index_cache), strict=True):
            for sid, span in read.members:
                src = block[:, span.row - read.row_start : span.row - read.row_start + span.n_rows]
                out[sid][read.out_start : read.out_stop, span.token_start : span.token_start + span.n_rows] = src
        return [
            RecordRouting(
                info=r,
                by_layer=out[r.sample_id],
                valid=valid[r.sample_id],
                moe_layers=tuple(wanted),
                layers=tuple(spec.moe_layers[j] for j in wanted),
                topk_order=self._commit_for(own_part[r.sample_id]).routing.topk_order,
                num_moe_layers=spec.num_moe_layers,
            )
            for r in rows
        ]

    # -- per-token values ------------------------------------------------------------------------------------------
    @property
    def annotations(self) -> list[AnnotationCommit]:
        """The step's annotation commits (per-token columns added after the records; as of :attr:`as_of`)."""
        if self._annotations is None:
            storage = self.store.storage
            names = [n for n in storage.list(layout.annotations_dir(self.step)) if layout.parse_commit_name(n)]
            keys = [layout.annotation_key(self.step, n) for n in names]
            raw = storage.read_many(keys)
            docs = [parse_document(raw[k], AnnotationCommit, storage.url_of(k)) for k in keys]
            self._annotations = [d for d in docs if self.as_of is None or d.created_at <= self.as_of]
        return self._annotations

    def value_columns(self) -> list[str]:
        """Names of the per-token columns present in the step (in parts or annotations)."""
        names = {c.name for commit in self.commits if commit.values for c in commit.values.columns}
        names.update(c.name for a in self.annotations for c in a.values.columns)
        return sorted(names)

    def token_values(self, sample_ids: Iterable[str], names: Sequence[str]) -> dict[str, dict[str, FloatArray]]:
        """``{sample_id: {name: float32 [n_tokens]}}`` for the named columns each record has (a column a record
        lacks is absent from its dict). Only the values objects of the records' parts are fetched, and only the
        named columns of them; a column given twice for one record (in its part and an annotation, or two
        annotations) raises :class:`DuplicateSampleError`."""
        wanted = set(names)
        # Only the token counts are needed: read them from the index column, not by building index rows.
        lengths = {sid: int(self._n_tokens[self._position(sid)]) for sid in sample_ids}
        out: dict[str, dict[str, FloatArray]] = {sid: {} for sid in lengths}
        sources: dict[tuple[str, str], str] = {}
        holders: dict[str, ValuesInfo] = {}  # directory -> values object holding some of the wanted columns
        for sid in lengths:
            commit = self.commits[self._commit_of(self._position(sid))]
            if commit.values is not None:
                holders[layout.part_dir(self.step, commit.part)] = commit.values
        for annotation in self.annotations:
            holders[f"{layout.annotations_dir(self.step)}/{annotation.part}"] = annotation.values
        places = [(base, info, sorted(wanted & {c.name for c in info.columns})) for base, info in holders.items()]
        for base, info, columns in places:
            if not columns:
                continue
            for sid, values in self._values_of(f"{base}/{info.key}", tuple(columns)).items():
                if sid not in out:
                    continue
                for name, array in values.items():
                    if (sid, name) in sources:
                        raise DuplicateSampleError(
                            sid,
                            f"token_values[{name!r}]",
                            f"is given twice in step {self.step} ({sources[(sid, name)]} and {base})",
                            "annotate each record's column once; remove the extra annotation commit",
                        )
                    sources[(sid, name)] = base
                    if len(array) != lengths[sid]:
                        raise CorruptDataError(f"{base}: column {name!r} of sample {sid!r} has the wrong length")
                    out[sid][name] = array
        return out

    def _values_of(self, key: str, columns: tuple[str, ...]) -> dict[str, dict[str, FloatArray]]:
        """One values object's columns, with a small LRU so streaming over a part reads its object once."""
        cache_key = (key, columns)
        if cache_key in self._values_cache:
            self._values_cache.move_to_end(cache_key)
            return self._values_cache[cache_key]
        storage = self.store.storage
        try:
            data = storage.read(key)
        except FileNotFoundError:
            raise CorruptDataError(f"{storage.url_of(key)}: a committed values object is missing") from None
        values = values_from_parquet(data, columns, storage.url_of(key))
        self._values_cache[cache_key] = values
        while len(self._values_cache) > _VALUES_CACHE:
            self._values_cache.popitem(last=False)
        return values

    def open_zarr(self, part: str) -> zarr.Array[Any]:
        """A part's routing array opened with zarr-python (stored form: gaps when sorted, uint16 as byte planes;
        see ``schemas/FORMAT.md``). For interoperability; :meth:`read_many` is the fast path."""
        commit = self._own[layout.part_dir(self.step, part)]
        store = self.store.storage.zarr_store(f"{layout.part_dir(self.step, part)}/{commit.routing.path}")
        return zarr.open_array(store, mode="r")

    def _part_key(self, sample_id: str) -> str:
        return layout.part_dir(self.step, self.commits[self._commit_of(self._position(sample_id))].part)

    def _commit_for(self, part_key: str) -> CommitRecord:
        return self._own.get(part_key) or self._foreign_commit(part_key)

    def _foreign_commit(self, part_key: str) -> CommitRecord:
        """The commit of a part referenced from another step (a shared prefix stored once)."""
        if part_key in self._foreign:
            return self._foreign[part_key]
        pieces = part_key.split("/")
        step = layout.parse_step_name(pieces[1]) if len(pieces) == 4 else None
        parsed = layout.parse_commit_name(pieces[3].rsplit(".", 1)[0] + ".json") if step is not None else None
        if step is None or parsed is None or pieces[0] != layout.STEPS or pieces[2] != "parts":
            raise CorruptDataError(f"span reference {part_key!r} is not a part path of this store")
        key = layout.commit_key(step, layout.commit_name(*parsed))
        storage = self.store.storage
        try:
            commit = parse_document(storage.read(key), CommitRecord, storage.url_of(key))
        except FileNotFoundError:
            raise CorruptDataError(f"span reference {part_key!r} points at an uncommitted part") from None
        self._foreign[part_key] = commit
        return commit


def _parquet(data: bytes, where: str) -> pa.Table:
    try:
        return index_from_parquet(data)
    except (pa.ArrowException, OSError) as exc:
        raise CorruptDataError(f"{where}: unreadable Parquet index ({exc})") from exc


def _contiguous_runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """Runs of consecutive values in ``positions`` as ``(start, stop)`` indices into ``positions``."""
    runs = []
    start = 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs


def _merge_rows(items: list[tuple[str, Span]], chunk_rows: int) -> list[tuple[int, int, tuple[tuple[str, Span], ...]]]:
    """Coalesce spans of one part into row ranges; a gap under one chunk costs no extra request."""
    merged: list[tuple[int, int, list[tuple[str, Span]]]] = []
    for sid, span in sorted(items, key=lambda item: item[1].row):
        lo, hi = span.row, span.row + span.n_rows
        if merged and lo - merged[-1][1] < chunk_rows:
            prev_lo, prev_hi, members = merged[-1]
            merged[-1] = (prev_lo, max(prev_hi, hi), [*members, (sid, span)])
        else:
            merged.append((lo, hi, [(sid, span)]))
    return [(lo, hi, tuple(members)) for lo, hi, members in merged]
