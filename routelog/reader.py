"""Reading committed records: a step snapshot, then routing for chosen records and chosen layers.

A snapshot is the set of commit records of a step (the seal's list once sealed), and the union of their parts'
Parquet indexes. Routing reads go straight to the chunks that hold the requested rows and layers (ranged reads
of the sharded array; the array metadata comes embedded in the commit), concurrently across parts.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from routelog import keys
from routelog.codec import storage_dtype
from routelog.display import html_card
from routelog.errors import CorruptDataError, DuplicateSampleError, RecordNotFoundError
from routelog.format import (
    INDEX_SCHEMA,
    AnnotationCommit,
    CommitRecord,
    Consolidated,
    DropRecord,
    IndexRow,
    ObjectInfo,
    RoutingArrayInfo,
    SealRecord,
    Span,
    ValuesInfo,
    load_json,
    parse_document,
    validate_document,
)
from routelog.part import MAX_GAP, BlockRequest, ShardIndexCache, fetch_blocks, index_from_parquet, shard_layout
from routelog.root import StoreRoot
from routelog.routing import ROUTING_TABLE_SCHEMA, RecordRouting
from routelog.spec import ModelSpec
from routelog.storage import check_digest
from routelog.values import FloatArray, values_from_parquet
from routelog.weights import from_storage

if TYPE_CHECKING:
    import zarr

_VALUES_CACHE = 4
"""Values objects kept decoded per snapshot (streaming reads visit parts one after another)."""


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

    def request(self, commit: CommitRecord, stream: str | None, *, weights: bool = False) -> BlockRequest:
        return BlockRequest.of(
            self.part_key,
            commit,
            (self.layer_start, self.layer_stop),
            (self.row_start, self.row_stop),
            tuple(sorted({sid for sid, _ in self.members})),
            stream=stream,
            weights=weights,
        )


@dataclass
class StepSnapshot:
    """The committed records of one step at the time it was loaded.

    A record is live unless a drop names it (by sample id, part or writer) or it is shadowed: two writers that
    raced on one sample id both committed it, and readers keep the earliest commit's (by ``created_at``, then
    commit name), so every reader reads the same record and none fails; ``routelog verify`` reports the shadowed
    copies and ``routelog gc`` reclaims them.
    """

    store: StoreRoot
    step: int
    commits: list[CommitRecord]
    """The commits of the step's live parts (wholly dropped parts are left out)."""
    index: pa.Table
    """The live records' index rows, plus ``_commit``: the position of the row's commit in :attr:`commits`."""
    sealed: bool
    as_of: datetime | None = None
    drops: list[DropRecord] = field(default_factory=list)
    """The drop documents applied (as of :attr:`as_of`)."""
    dropped_commits: list[CommitRecord] = field(default_factory=list)
    """Commits of wholly dropped parts: none of their records is read, but live records' shared prefixes may
    still point at their rows."""
    shadowed: list[Shadowed] = field(init=False)
    """Records committed again by another commit and shadowed by the earliest one."""
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
        dropped = {sid for drop in self.drops for sid in drop.sample_ids}
        commit_of = self.index.column("_commit").to_numpy()
        order = {i: (c.created_at, c.name) for i, c in enumerate(self.commits)}
        winners: dict[str, int] = {}
        shadowed: list[Shadowed] = []
        for i, sid in enumerate(self.index.column("sample_id").to_pylist()):
            if sid in dropped:
                continue
            kept = winners.get(sid)
            if kept is None:
                winners[sid] = i
                continue
            first, second = sorted((kept, i), key=lambda row: order[int(commit_of[row])])
            winners[sid] = first
            names = (self.commits[int(commit_of[first])].name, self.commits[int(commit_of[second])].name)
            shadowed.append(Shadowed(sid, *names))
        self.shadowed = shadowed
        if len(winners) != self.index.num_rows:
            mask = np.zeros(self.index.num_rows, dtype=bool)
            mask[list(winners.values())] = True
            self.index = self.index.filter(pa.array(mask))
        self._commit_column = self.index.column("_commit").to_numpy()
        self._n_tokens = self.index.column("n_tokens").to_numpy()
        self._own = {keys.part_dir(self.step, c.part): c for c in [*self.dropped_commits, *self.commits]}
        self._positions = {sid: i for i, sid in enumerate(self.index.column("sample_id").to_pylist())}

    # -- loading -------------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, store: StoreRoot, step: int, *, as_of: datetime | None = None) -> StepSnapshot:
        """The step's committed records; with ``as_of``, only commits created by then (and the seal only if it
        was sealed by then), i.e. the step as a reader saw it at that time.

        Everything used is checked before use: each commit against its file name, its step and the run's model
        spec, each index against the SHA-256 its commit lists, and the rows against the commit's counts.
        """
        storage = store.storage
        seal = read_seal(store, step)
        if seal is not None and as_of is not None and seal.sealed_at > as_of:
            seal = None
        if seal is not None and seal.consolidated is not None:
            return cls._load_consolidated(store, step, seal, seal.consolidated, as_of)
        names = seal.commits if seal is not None else list_commit_names(store, step)
        commit_keys = [keys.commit_key(step, n) for n in names]
        try:
            raw = storage.read_many(commit_keys)
        except FileNotFoundError as exc:
            raise CorruptDataError(f"step {step} of {store.url}: a commit the seal lists is missing ({exc})") from None
        commits = [parse_document(raw[k], CommitRecord, storage.url_of(k)) for k in commit_keys]
        for name, commit in zip(names, commits, strict=True):
            check_commit(commit, name, step, store.model_spec, storage.url_of(keys.commit_key(step, name)))
        if as_of is not None:
            commits = [c for c in commits if c.created_at <= as_of]
        drops = read_drops(store, step, as_of)
        unread = len(commits)
        dropped = [c for c in commits if dropped_part(c, drops)]
        commits = [c for c in commits if not dropped_part(c, drops)]
        if as_of is not None:  # a part dropped after as_of is read as it was, unless gc has reclaimed it since
            later = read_drops(store, step)
            commits = [
                c
                for c in commits
                if not dropped_part(c, later) or storage.exists(f"{keys.part_dir(step, c.part)}/{keys.INDEX}")
            ]
        tables = []
        for i, commit in enumerate(commits):
            key = f"{keys.part_dir(step, commit.part)}/{keys.INDEX}"
            info = object_info(commit, keys.INDEX, storage.url_of(keys.commit_key(step, commit.name)))
            data = storage.read_verified(key, info.size, info.sha256, f"commit {commit.name}")
            table = _parquet(data, storage.url_of(key))
            tables.append(table.append_column("_commit", pa.array([i] * table.num_rows, pa.int32())))
        empty = INDEX_SCHEMA.empty_table().append_column("_commit", pa.array([], pa.int32()))
        index = _concat([empty, *tables], f"step {step} of {store.url}")
        check_index(index, commits, step, f"step {step} of {store.url}")
        if seal is not None and unread == len(commits):
            check_seal_counts(seal, index, commits, f"step {step} of {store.url}")
        return cls(store, step, commits, index, seal is not None, as_of, drops, dropped)

    @classmethod
    def _load_consolidated(
        cls, store: StoreRoot, step: int, seal: SealRecord, consolidated: Consolidated, as_of: datetime | None
    ) -> StepSnapshot:
        """A sealed step from its two consolidated objects (checked against the seal's SHA-256s)."""
        storage = store.storage
        base = keys.step_dir(step)
        owner = f"the seal of step {step}"
        commits_key, index_key = (f"{base}/{consolidated.commits.key}", f"{base}/{consolidated.index.key}")
        try:
            data = storage.read_many(
                [commits_key, index_key]
            )  # one batch: a sealed step opens in three GETs (+ the drops listing)
        except FileNotFoundError as exc:
            raise CorruptDataError(f"step {step} of {store.url}: a consolidated object of {owner} is missing") from exc
        commits_data, index_data = data[commits_key], data[index_key]
        for key, info in ((commits_key, consolidated.commits), (index_key, consolidated.index)):
            check_digest(data[key], info.size, info.sha256, f"{storage.url_of(key)} (listed by {owner})")
        where = storage.url_of(commits_key)
        try:
            docs = load_json(commits_data, where)
        except ValueError as exc:
            raise CorruptDataError(str(exc)) from None
        if not isinstance(docs, list) or len(docs) != len(seal.commits):
            raise CorruptDataError(f"{where}: not a list of the {len(seal.commits)} commit records the seal names")
        commits = [validate_document(doc, CommitRecord, f"{where} [{i}]") for i, doc in enumerate(docs)]
        for name, commit in zip(seal.commits, commits, strict=True):
            check_commit(commit, name, step, store.model_spec, f"{where} ({name})")
        index = _parquet(index_data, storage.url_of(index_key))
        check_index(index, commits, step, storage.url_of(index_key))
        check_seal_counts(seal, index, commits, f"step {step} of {store.url}")
        drops = read_drops(store, step, as_of)
        dropped = [c for c in commits if dropped_part(c, drops)]
        commits, index = _without_dropped_parts(commits, index, drops)
        return cls(store, step, commits, index, True, as_of, drops, dropped)

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
        """Every object of the step's parts: routing, values, streams and indexes."""
        return sum(o.size for c in self.commits for o in c.objects)

    @property
    def routing_bytes(self) -> int:
        """The routing arrays' chunks only: what the codec is measured by."""
        return sum(o.size for c in self.commits for o in c.objects if o.key.startswith(c.routing.path + "/c/"))

    @property
    def stored_rows(self) -> int:
        """Token rows stored in the routing arrays (a record's missing final rows are not stored; a prefix shared
        by several records of a part is stored once)."""
        return sum(c.routing.n_rows for c in self.commits)

    @property
    def routed_rows(self) -> int:
        """Routed token rows of the step's live records, shared prefixes counted in every record that has them."""
        spans = self.index.column("spans").combine_chunks()
        if not len(spans):
            return 0
        return int(pc.sum(pc.list_flatten(spans).field("n_rows")).as_py() or 0)

    def referenced_parts(self) -> set[str]:
        """Names of the step's parts that live records read rows from: their own, and the parts their shared
        prefixes point at (which may be dropped whole, and must then be kept)."""
        parts = {self.commits[int(i)].part for i in np.unique(self._commit_column)}
        spans = pc.list_flatten(self.index.column("spans").combine_chunks())
        for key in pc.unique(spans.field("part").drop_null()).to_pylist() if len(spans) else []:
            parsed = keys.parse_span_part(key)
            if parsed is not None and parsed[0] == self.step:
                parts.add(parsed[1])
        return parts

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
        try:
            return IndexRow.model_validate(data)
        except ValueError as exc:
            part = self.commits[self._commit_of(position)].part
            raise CorruptDataError(
                f"step {self.step} of {self.store.url}, part {part!r}: index row {data.get('sample_id')!r} breaks "
                f"the format ({exc})"
            ) from None

    # -- routing -----------------------------------------------------------------------------------------------------
    def read(self, sample_id: str, *, moe_layers: Sequence[int] | None = None) -> RecordRouting:
        """Routing of one record; ``moe_layers`` are positions on the MoE axis (default: all)."""
        return self.read_many([sample_id], moe_layers=moe_layers)[0]

    def read_many(
        self,
        sample_ids: Iterable[str],
        *,
        moe_layers: Sequence[int] | None = None,
        stream: str | None = None,
        weights: bool = False,
        tokens: Mapping[str, npt.NDArray[np.bool_]] | None = None,
        max_gap: int = MAX_GAP,
    ) -> list[RecordRouting]:
        """Routing of several records, fetched concurrently; results follow the order of ``sample_ids``.

        ``moe_layers`` are positions on the MoE axis (default: all). With ``stream`` (e.g. ``"mtp"``), the records'
        rows of that extra stream instead, ``moe_layers`` then being positions on the stream's own layer axis.
        With ``weights``, also the routing weights (:attr:`RecordRouting.weights`; never fetched otherwise).
        ``tokens[sample_id]`` (``[n_tokens]`` bool) restricts a record to those tokens: only the chunks holding
        them are fetched (a context-parallel rank needs a fraction of each sequence); the other rows read as
        missing. Chunks less than ``max_gap`` bytes apart are fetched in one request, gap included.
        """
        if weights and stream is not None:
            raise ValueError("routing weights are stored for the decoder routing only, not for a stream")
        spec = self.store.model_spec
        if stream is None:
            n_layers, topk, dtype, names = spec.num_moe_layers, spec.topk, spec.id_dtype, tuple(spec.moe_layers)
        else:
            declared = spec.stream(stream)
            if declared is None:
                raise ValueError(
                    f"model {spec.name!r} declares no stream {stream!r} ({[s.name for s in spec.streams]})"
                )
            n_layers, topk, names = declared.num_layers, declared.topk, tuple(range(declared.num_layers))
            dtype = storage_dtype(declared.universe)
        wanted = list(range(n_layers)) if moe_layers is None else sorted(set(moe_layers))
        if any(not 0 <= j < n_layers for j in wanted):
            raise ValueError(f"layers {list(moe_layers or [])} outside [0, {n_layers})")
        rows = [self.info(sid) for sid in sample_ids]
        own_part = {r.sample_id: self._part_key(r.sample_id) for r in rows}
        out = {r.sample_id: np.zeros((len(wanted), r.n_tokens, topk), dtype=dtype) for r in rows}
        valid = {r.sample_id: np.zeros(r.n_tokens, dtype=bool) for r in rows}
        by_part: dict[str, list[tuple[str, Span]]] = defaultdict(list)
        for r in rows:
            needed = None if tokens is None else tokens.get(r.sample_id)
            if needed is not None and needed.shape != (r.n_tokens,):
                raise ValueError(f"tokens[{r.sample_id!r}] has shape {needed.shape}, the record {r.n_tokens} tokens")
            for span in _spans(r, stream) if needed is None else _restricted(_spans(r, stream), needed):
                by_part[span.part or own_part[r.sample_id]].append((r.sample_id, span))
                valid[r.sample_id][span.token_start : span.token_start + span.n_rows] = True
        commits = {key: self._commit_for(key) for key in by_part}
        arrays = {key: _array(commit, stream, self.store.storage.url_of(key)) for key, commit in commits.items()}
        runs = _contiguous_runs(wanted)
        reads: list[_PartRead] = []
        for key, items in by_part.items():
            for lo, hi, members in _merge_rows(items, arrays[key].chunk_rows):
                for a, b in runs:
                    reads.append(_PartRead(key, lo, hi, wanted[a], wanted[b - 1] + 1, a, b, members))
        for key, items in by_part.items():
            _check_referenced_rows(key, arrays[key], items, self.store.storage.url_of(key))
        requests = [read.request(commits[read.part_key], stream) for read in reads]
        with_weights = [
            (read, info) for read in reads if weights and (info := commits[read.part_key].weights) is not None
        ]
        requests += [read.request(commits[read.part_key], None, weights=True) for read, _ in with_weights]
        blocks = fetch_blocks(self.store.storage, requests, self._index_cache, max_gap)
        for read, block in zip(reads, blocks[: len(reads)], strict=True):
            for sid, span in read.members:
                src = block[:, span.row - read.row_start : span.row - read.row_start + span.n_rows]
                out[sid][read.out_start : read.out_stop, span.token_start : span.token_start + span.n_rows] = src
        weights_out = (
            {r.sample_id: np.full(out[r.sample_id].shape, np.nan, np.float32) for r in rows} if weights else {}
        )
        for (read, info), block in zip(with_weights, blocks[len(reads) :], strict=True):
            values = from_storage(block, info.dtype)
            for sid, span in read.members:
                src = values[:, span.row - read.row_start : span.row - read.row_start + span.n_rows]
                weights_out[sid][read.out_start : read.out_stop, span.token_start : span.token_start + span.n_rows] = (
                    src
                )
        orders = {r.sample_id: self._topk_order(own_part[r.sample_id], stream) for r in rows}
        return [
            RecordRouting(
                info=r,
                by_layer=out[r.sample_id],
                valid=valid[r.sample_id],
                moe_layers=tuple(wanted),
                layers=tuple(names[j] for j in wanted),
                topk_order=orders[r.sample_id],
                num_moe_layers=n_layers,
                stream=stream,
                weights=weights_out.get(r.sample_id),
            )
            for r in rows
        ]

    # -- tables for DataFrame tools ----------------------------------------------------------------------------------
    def to_arrow(
        self,
        sample_ids: Iterable[str] | None = None,
        *,
        routing: bool = False,
        moe_layers: Sequence[int] | None = None,
        batch_records: int = 64,
    ) -> pa.Table:
        """The index (one row per record: the columns of :class:`~routelog.format.IndexRow`, plus ``part``), or
        with ``routing=True`` the decoded routing in long form (:data:`~routelog.routing.ROUTING_TABLE_SCHEMA`:
        sample_id, token, layer, k, expert; routed rows only) of ``sample_ids`` (default: every record; the long
        form takes about 12 bytes per token, layer and slot, so choose the records for a large step)."""
        ids = self.sample_ids if sample_ids is None else list(sample_ids)
        if not routing:
            positions = pa.array([self._position(sid) for sid in ids], pa.int64())
            table = self.index.take(positions)
            parts = pa.array([self.commits[i].part for i in table.column("_commit").to_pylist()], pa.string())
            return table.drop_columns(["_commit"]).append_column("part", parts)
        tables = [
            routing_.to_arrow()
            for start in range(0, len(ids), batch_records)
            for routing_ in self.read_many(ids[start : start + batch_records], moe_layers=moe_layers)
        ]
        return pa.concat_tables(tables) if tables else ROUTING_TABLE_SCHEMA.empty_table()

    def to_pandas(
        self,
        sample_ids: Iterable[str] | None = None,
        *,
        routing: bool = False,
        moe_layers: Sequence[int] | None = None,
    ) -> Any:
        """:meth:`to_arrow` as a ``pandas.DataFrame`` (pandas must be installed)."""
        return self.to_arrow(sample_ids, routing=routing, moe_layers=moe_layers).to_pandas()

    def __repr__(self) -> str:
        when = f" as of {self.as_of.isoformat()}" if self.as_of else ""
        return (
            f"StepSnapshot(step {self.step} of {self.store.url}{when}: {len(self)} records, {self.n_tokens:,} tokens, "
            f"{len(self.commits)} part{'s' if len(self.commits) != 1 else ''}{', sealed' if self.sealed else ''})"
        )

    def _repr_html_(self) -> str:
        facts: list[tuple[str, object]] = [
            ("records", len(self)),
            ("tokens", f"{self.n_tokens:,}"),
            ("parts", len(self.commits)),
            ("sealed", self.sealed),
            ("stored bytes", f"{self.stored_bytes:,}"),
        ]
        if self.as_of:
            facts.append(("as of", self.as_of.isoformat()))
        if self.drops or self.shadowed:
            facts.append(("drops / shadowed copies", f"{len(self.drops)} / {len(self.shadowed)}"))
        rows = [
            (r.sample_id, r.n_tokens, r.prompt_len, r.response_len, r.n_missing, r.policy_version)
            for r in (self._row(i) for i in range(min(10, len(self))))
        ]
        columns = ("sample id", "tokens", "prompt", "response", "missing rows", "policy")
        return html_card(f"step {self.step} of {self.store.url} (first records)", facts, rows, columns)

    def _topk_order(self, part_key: str, stream: str | None) -> str:
        commit = self._commit_for(part_key)
        array = commit.routing if stream is None else commit.streams.get(stream, commit.routing)
        return array.topk_order

    # -- per-token values ------------------------------------------------------------------------------------------
    @property
    def annotations(self) -> list[AnnotationCommit]:
        """The step's annotation commits (per-token columns added after the records; as of :attr:`as_of`)."""
        if self._annotations is None:
            storage = self.store.storage
            names = [n for n in storage.list(keys.annotations_dir(self.step)) if keys.parse_commit_name(n)]
            annotation_keys = [keys.annotation_key(self.step, n) for n in names]
            raw = storage.read_many(annotation_keys)
            docs = []
            for name, key in zip(names, annotation_keys, strict=True):
                doc = parse_document(raw[key], AnnotationCommit, storage.url_of(key))
                check_commit(doc, name, self.step, self.store.model_spec, storage.url_of(key))
                docs.append(doc)
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
        # directory -> the commit declaring a values object there, and its declaration
        holders: dict[str, tuple[CommitRecord | AnnotationCommit, ValuesInfo]] = {}
        for sid in lengths:
            commit = self.commits[self._commit_of(self._position(sid))]
            if commit.values is not None:
                holders[keys.part_dir(self.step, commit.part)] = (commit, commit.values)
        for annotation in self.annotations:
            holders[f"{keys.annotations_dir(self.step)}/{annotation.part}"] = (annotation, annotation.values)
        for base, (holder, declared) in holders.items():
            columns = sorted(wanted & {c.name for c in declared.columns})
            if not columns:
                continue
            for sid, values in self._values_of(base, holder, declared, tuple(columns)).items():
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

    def _values_of(
        self, base: str, holder: CommitRecord | AnnotationCommit, declared: ValuesInfo, columns: tuple[str, ...]
    ) -> dict[str, dict[str, FloatArray]]:
        """One values object's columns, checked against its commit (SHA-256, declared columns, records and token
        hashes), with a small LRU so streaming over a part reads its object once."""
        key = f"{base}/{declared.key}"
        cache_key = (key, columns)
        if cache_key in self._values_cache:
            self._values_cache.move_to_end(cache_key)
            return self._values_cache[cache_key]
        storage = self.store.storage
        where = storage.url_of(key)
        info = object_info(holder, declared.key, where)
        data = storage.read_verified(key, info.size, info.sha256, f"commit {holder.name}")
        contents = values_from_parquet(data, columns, where, declared=[c.name for c in declared.columns])
        if len(contents.token_hashes) != holder.n_records:
            raise CorruptDataError(
                f"{where}: holds {len(contents.token_hashes)} records, its commit says {holder.n_records}"
            )
        own = isinstance(holder, CommitRecord)
        for sid, digest in contents.token_hashes.items():
            position = self._positions.get(sid)
            if position is None or (own and self.commits[self._commit_of(position)] is not holder):
                raise CorruptDataError(f"{where}: holds values of sample {sid!r}, which it may not annotate")
            committed = self.index.column("token_hash")[position].as_py()
            if digest is not None and committed is not None and digest != committed:
                raise CorruptDataError(f"{where}: values of sample {sid!r} were computed on other tokens")
        self._values_cache[cache_key] = contents.values
        while len(self._values_cache) > _VALUES_CACHE:
            self._values_cache.popitem(last=False)
        return contents.values

    def open_zarr(self, part: str) -> zarr.Array[Any]:
        """A part's routing array opened with zarr-python: expert IDs ``[num_moe_layers, n_rows, K]`` for format-2
        parts (through the registered ``routelog.ranked_gaps`` codec); the stored form for format-1 parts (gaps when
        sorted, uint16 as byte planes; see ``schemas/FORMAT.md``). For interoperability; :meth:`read_many` is the
        fast path."""
        import zarr  # loaded here: the readers' own path never needs it

        commit = self._own[keys.part_dir(self.step, part)]
        store = self.store.storage.zarr_store(f"{keys.part_dir(self.step, part)}/{commit.routing.path}")
        return zarr.open_array(store, mode="r")

    def _part_key(self, sample_id: str) -> str:
        return keys.part_dir(self.step, self.commits[self._commit_of(self._position(sample_id))].part)

    def _commit_for(self, part_key: str) -> CommitRecord:
        return self._own.get(part_key) or self._foreign_commit(part_key)

    def _foreign_commit(self, part_key: str) -> CommitRecord:
        """The commit of a part referenced from another step (a shared prefix stored once): it must be committed
        there (and listed by that step's seal, if sealed), and name exactly that part."""
        if part_key in self._foreign:
            return self._foreign[part_key]
        parsed = keys.parse_span_part(part_key)
        if parsed is None:
            raise CorruptDataError(f"span reference {part_key!r} is not a part path of this store")
        step, part = parsed
        if step == self.step:
            raise CorruptDataError(f"span reference {part_key!r} names a part this step does not commit")
        name = part.rsplit(".", 1)[0] + ".json"
        key = keys.commit_key(step, name)
        storage = self.store.storage
        try:
            commit = parse_document(storage.read(key), CommitRecord, storage.url_of(key))
        except FileNotFoundError:
            raise CorruptDataError(f"span reference {part_key!r} points at an uncommitted part") from None
        check_commit(commit, name, step, self.store.model_spec, storage.url_of(key))
        seal = read_seal(self.store, step)
        if commit.part != part or (seal is not None and name not in seal.commits):
            raise CorruptDataError(f"span reference {part_key!r} points at a part that step {step} does not hold")
        self._foreign[part_key] = commit
        return commit


def _check_referenced_rows(part_key: str, array: RoutingArrayInfo, items: list[tuple[str, Span]], where: str) -> None:
    """Spans that point at another part end within its rows (a record's own spans are checked with its index)."""
    for sid, span in items:
        if span.part is not None and span.row + span.n_rows > array.n_rows:
            raise CorruptDataError(
                f"{where}: sample {sid!r} points at rows [{span.row}, {span.row + span.n_rows}) of a part of "
                f"{array.n_rows} rows"
            )


def _restricted(spans: list[Span], needed: npt.NDArray[np.bool_]) -> list[Span]:
    """The parts of ``spans`` whose tokens are ``needed`` (maximal runs)."""
    out = []
    for span in spans:
        inside = needed[span.token_start : span.token_start + span.n_rows]
        if inside.all():
            out.append(span)
            continue
        edges = np.flatnonzero(np.diff(np.concatenate([[False], inside, [False]]).astype(np.int8)))
        for a, b in zip(edges[::2], edges[1::2], strict=True):
            out.append(
                span.model_copy(
                    update={"token_start": span.token_start + int(a), "row": span.row + int(a), "n_rows": int(b - a)}
                )
            )
    return out


def _spans(row: IndexRow, stream: str | None) -> list[Span]:
    """A record's spans of the decoder routing, or of one of its streams (none when it has no such rows)."""
    if stream is None:
        return row.spans
    return next((entry.spans for entry in row.streams or [] if entry.name == stream), [])


def _array(commit: CommitRecord, stream: str | None, where: str) -> RoutingArrayInfo:
    if stream is None:
        return commit.routing
    if stream not in commit.streams:
        raise CorruptDataError(f"{where}: records point into its stream {stream!r}, which its commit does not hold")
    return commit.streams[stream]


def _parquet(data: bytes, where: str) -> pa.Table:
    try:
        table = index_from_parquet(data)
    except (pa.ArrowException, OSError) as exc:
        raise CorruptDataError(f"{where}: unreadable Parquet index ({exc})") from exc
    missing = [name for name, f in IndexRow.model_fields.items() if f.is_required() and name not in table.schema.names]
    if missing:
        raise CorruptDataError(f"{where}: the index lacks the columns {missing}")
    return table


def _concat(tables: list[pa.Table], where: str) -> pa.Table:
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowException as exc:
        raise CorruptDataError(f"{where}: a part's index has columns of the wrong type ({exc})") from exc


@dataclass(frozen=True)
class Shadowed:
    """A sample id committed by two commits: readers read ``kept`` (the earliest); ``shadowed`` is never read."""

    sample_id: str
    kept: str
    """Name of the commit whose record is read."""
    shadowed: str


def read_drops(store: StoreRoot, step: int, as_of: datetime | None = None) -> list[DropRecord]:
    """The step's drop documents (those created by ``as_of``)."""
    storage = store.storage
    names = [n for n in storage.list(keys.drops_dir(step)) if keys.parse_commit_name(n)]
    if not names:
        return []
    drop_keys = [keys.drop_key(step, n) for n in names]
    raw = storage.read_many(drop_keys)
    drops = []
    for name, key in zip(names, drop_keys, strict=True):
        drop = parse_document(raw[key], DropRecord, storage.url_of(key))
        if drop.name != name or drop.step != step:
            raise CorruptDataError(f"{storage.url_of(key)}: the document is drop {drop.name} of step {drop.step}")
        if as_of is None or drop.created_at <= as_of:
            drops.append(drop)
    return drops


def dropped_part(commit: CommitRecord, drops: Sequence[DropRecord]) -> bool:
    """Whether a drop removes the whole part (by part name or by its writer)."""
    return any(commit.part in d.parts or commit.writer_id in d.writers for d in drops)


def _without_dropped_parts(
    commits: list[CommitRecord], index: pa.Table, drops: Sequence[DropRecord]
) -> tuple[list[CommitRecord], pa.Table]:
    """Leave out wholly dropped parts: their commits and their rows (``_commit`` renumbered)."""
    keep = [not dropped_part(c, drops) for c in commits]
    if all(keep):
        return commits, index
    renumber = np.cumsum(keep) - 1
    commit_of = index.column("_commit").to_numpy()
    rows = np.asarray(keep, dtype=bool)[commit_of] if len(commits) else np.zeros(0, bool)
    kept = index.filter(pa.array(rows))
    new_commit = pa.array(renumber[commit_of[rows]].astype(np.int32), pa.int32())
    kept = kept.set_column(kept.schema.get_field_index("_commit"), "_commit", new_commit)
    return [c for c, k in zip(commits, keep, strict=True) if k], kept


# -- checks shared by readers and verify ----------------------------------------------------------------------------
def read_seal(store: StoreRoot, step: int) -> SealRecord | None:
    """The step's seal document, or None when the step is not sealed."""
    storage = store.storage
    key = keys.seal_key(step)
    try:
        data = storage.read(key)
    except FileNotFoundError:
        return None
    seal = parse_document(data, SealRecord, storage.url_of(key))
    if seal.step != step:
        raise CorruptDataError(f"{storage.url_of(key)}: the seal is for step {seal.step}, not {step}")
    return seal


def list_commit_names(store: StoreRoot, step: int) -> list[str]:
    """File names of the step's commit documents (other names in the directory are ignored)."""
    return [n for n in store.storage.list(keys.commits_dir(step)) if keys.parse_commit_name(n)]


def check_commit(commit: CommitRecord | AnnotationCommit, name: str, step: int, spec: ModelSpec, where: str) -> None:
    """A commit read under ``name`` is the commit of that name, of this step, and of the run's model."""
    if commit.name != name:
        raise CorruptDataError(f"{where}: the document is commit {commit.name}, found under the name {name}")
    if commit.step != step:
        raise CorruptDataError(f"{where}: the commit is for step {commit.step}, found in step {step}")
    if isinstance(commit, AnnotationCommit):
        return
    info = commit.routing
    if (info.num_moe_layers, info.topk, info.num_experts) != (spec.num_moe_layers, spec.topk, spec.num_experts):
        raise CorruptDataError(
            f"{where}: routing of L={info.num_moe_layers}, K={info.topk}, E={info.num_experts} does not match the "
            f"run's model spec (L={spec.num_moe_layers}, K={spec.topk}, E={spec.num_experts})"
        )
    attributes = info.zarr_metadata.get("attributes")
    stamped = attributes.get("routelog") if isinstance(attributes, dict) else None
    moe_layers = stamped.get("moe_layers") if isinstance(stamped, dict) else None
    if moe_layers is not None and moe_layers != list(spec.moe_layers):
        raise CorruptDataError(
            f"{where}: the part was written for MoE layers {moe_layers}, the run's model spec has "
            f"{list(spec.moe_layers)}"
        )
    layout = shard_layout(info)
    for key in layout.shard_keys if info.n_rows else []:
        if object_info(commit, f"{info.path}/{key}", where).size < layout.index_nbytes:
            raise CorruptDataError(f"{where}: the routing shard {key!r} is smaller than its own chunk index")


def object_info(commit: CommitRecord | AnnotationCommit, key: str, where: str) -> ObjectInfo:
    """The commit's entry for object ``key``; a commit that does not list an object it needs is damaged."""
    for info in commit.objects:
        if info.key == key:
            return info
    raise CorruptDataError(f"{where}: the commit does not list its object {key!r}")


def check_index(index: pa.Table, commits: Sequence[CommitRecord], step: int, where: str) -> None:
    """The rows agree with their commits: counts, token totals, step, and spans inside the part's rows."""
    commit_of = index.column("_commit").to_numpy(zero_copy_only=False)
    if commit_of.size and (commit_of.min() < 0 or commit_of.max() >= len(commits)):
        raise CorruptDataError(f"{where}: a row names a commit the step does not have")
    counts = np.bincount(commit_of, minlength=len(commits)) if len(commits) else np.zeros(0, np.int64)
    n_tokens = index.column("n_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
    tokens = np.bincount(commit_of, weights=n_tokens, minlength=len(commits)) if len(commits) else counts
    for i, commit in enumerate(commits):
        if counts[i] != commit.n_records or int(tokens[i]) != commit.n_tokens:
            raise CorruptDataError(
                f"{where}: part {commit.part!r} indexes {int(counts[i])} records of {int(tokens[i])} tokens, its "
                f"commit says {commit.n_records} records of {commit.n_tokens} tokens"
            )
    steps = index.column("step").to_numpy(zero_copy_only=False)
    if steps.size and (steps != step).any():
        raise CorruptDataError(f"{where}: index rows of step {int(steps[steps != step][0])} in step {step}")
    limits = np.array([c.routing.n_rows for c in commits], dtype=np.int64)
    _check_span_rows(index.column("spans").combine_chunks(), commit_of, limits, commits, where)
    if "streams" not in index.schema.names:
        return
    streams = index.column("streams").combine_chunks()
    entries = pc.list_flatten(streams)
    if len(entries) == 0:
        return
    entry_commit = np.repeat(commit_of, pc.list_value_length(streams).fill_null(0).to_numpy(zero_copy_only=False))
    names = entries.field("name").to_pylist()
    for i, name in enumerate(names):
        if name not in commits[int(entry_commit[i])].streams:
            raise CorruptDataError(
                f"{where}: a record has rows of stream {name!r}, part {commits[int(entry_commit[i])].part!r} holds none"
            )
    stream_limits = np.array(
        [commits[int(c)].streams[n].n_rows for c, n in zip(entry_commit, names, strict=True)], dtype=np.int64
    )
    _check_span_rows(entries.field("spans"), np.arange(len(names)), stream_limits, None, where)


def _check_span_rows(
    spans: pa.Array,
    owner_of_row: npt.NDArray[Any],
    limits: npt.NDArray[np.int64],
    commits: Sequence[CommitRecord] | None,
    where: str,
) -> None:
    """Own spans (``part`` null) end within their array's rows; ``owner_of_row[i]`` indexes ``limits``."""
    flat = pc.list_flatten(spans)
    if len(flat) == 0:
        return
    owner = np.repeat(owner_of_row, pc.list_value_length(spans).fill_null(0).to_numpy(zero_copy_only=False))
    own = pc.is_null(flat.field("part")).to_numpy(zero_copy_only=False)
    ends = flat.field("row").to_numpy(zero_copy_only=False) + flat.field("n_rows").to_numpy(zero_copy_only=False)
    past = own & (ends > limits[owner])
    if past.any():
        bad = int(np.argmax(past))
        part = f" of part {commits[int(owner[bad])].part!r}" if commits is not None else ""
        raise CorruptDataError(
            f"{where}: a span{part} reaches row {int(ends[bad])}, past the array's {int(limits[owner[bad]])} rows"
        )


def check_seal_counts(seal: SealRecord, index: pa.Table, commits: Sequence[CommitRecord], where: str) -> None:
    if seal.n_records != index.num_rows or seal.n_tokens != sum(c.n_tokens for c in commits):
        raise CorruptDataError(
            f"{where}: the seal says {seal.n_records} records of {seal.n_tokens} tokens, its commits hold "
            f"{index.num_rows} records of {sum(c.n_tokens for c in commits)} tokens"
        )


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
