"""Reading committed records: a step snapshot, then routing for chosen records and chosen layers.

A snapshot is a step's history evaluated (:mod:`routelog.store.history`): the live records of the commits that make up
the step, and the union of their parts' Parquet indexes. Routing reads go straight to the chunks that hold the
requested rows and layers (ranged reads of the sharded array; the array metadata comes embedded in the commit),
concurrently across parts.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from routelog.display import html_card
from routelog.errors import CorruptDataError, DuplicateSampleError, RecordNotFoundError, ValuesNotFoundError
from routelog.format import indexer_object, keys
from routelog.format.arrow import numeric_array, string_array, to_numpy
from routelog.format.codec import storage_dtype
from routelog.format.context import MODEL_KEY
from routelog.format.digest import sample_id_hash
from routelog.format.documents import (
    AnnotationCommit,
    CommitRecord,
    DropRecord,
    IndexerInfo,
    IndexRow,
    RoutingArrayInfo,
    Span,
    ValuesInfo,
)
from routelog.format.index_rows import IndexRows, RowTokens, part_row_tokens
from routelog.format.limits import check_count
from routelog.format.positions import decode_positions, positions_header
from routelog.format.routing import ROUTING_TABLE_SCHEMA, RecordRouting
from routelog.format.values import FloatArray, values_from_parquet
from routelog.format.weights import from_storage
from routelog.store.blocks import MAX_GAP, BlockRequest, Destination, ReadCache, fetch_blocks
from routelog.store.history import COMMIT_COLUMN, StepHistory, read_commit_index
from routelog.store.root import StoreRoot
from routelog.store.steplog import Entry, object_info

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
    """The committed records of one step at the time it was loaded (see :mod:`routelog.store.history` for the rules).

    A record is live unless a drop after its commit names it (by sample id, part or writer) or it is shadowed: the
    same sample id was committed earlier in the step's log (two writers raced on it), and readers read the
    earliest, so every reader reads the same record forever; ``routelog verify`` reports the shadowed copies and
    ``routelog gc`` reclaims them.

    A snapshot may be shared by threads (a data loader's workers): its caches (decoded chunks, each part's row
    tokens, decoded values objects) are looked up and changed under locks, and every read returns arrays of its own.
    """

    store: StoreRoot
    step: int
    commits: list[CommitRecord]
    """The commits of the step's content whose parts are not dropped whole, in log order."""
    index: pa.Table
    """The live records' index rows, plus ``_commit``: the position of the row's commit in :attr:`commits`."""
    sealed: bool
    as_of: datetime | None = None
    drops: list[DropRecord] = field(default_factory=list)
    """The drop documents applied (as of :attr:`as_of`)."""
    dropped_commits: list[CommitRecord] = field(default_factory=list)
    """Commits of wholly dropped parts: none of their records is read, but live records' shared prefixes may
    still point at their rows."""
    shadowed: list[Shadowed] = field(default_factory=list)
    """Records committed again by a later commit: the copies no reader reads."""
    stored: pa.Table | None = None
    """Every index row of :attr:`commits` (dropped and shadowed records too), with ``_commit``."""
    positions: list[int] = field(default_factory=list)
    """Log position of each of :attr:`commits` (negative for format-1/2 documents)."""
    annotation_entries: list[tuple[int, AnnotationCommit]] = field(default_factory=list)
    """The annotations applied (as of :attr:`as_of`), with their log positions."""
    sources: list[CommitRecord] = field(default_factory=list)
    """Where each of :attr:`commits` has its records stored: its own part, or the archive part holding them once
    the step is archived (FORMAT.md section 3.15); :attr:`commits` when empty."""
    part_indexes: dict[str, pa.Table] = field(default_factory=dict)
    """The whole index of each archive part (every record it holds, of commits dropped whole since too), by part
    name: its rows' token ids decode its context-coded chunks."""
    _positions: dict[str, int] = field(init=False, repr=False)
    _commit_column: npt.NDArray[np.int32] = field(init=False, repr=False)
    _n_tokens: npt.NDArray[np.int32] = field(init=False, repr=False)
    _own: dict[str, tuple[int, CommitRecord]] = field(init=False, repr=False)
    _index_cache: ReadCache = field(default_factory=ReadCache, init=False, repr=False)
    _row_tokens: dict[str, RowTokens] = field(default_factory=dict, init=False, repr=False)
    _values_cache: OrderedDict[tuple[str, tuple[str, ...]], dict[str, tuple[str | None, dict[str, FloatArray]]]] = (
        field(default_factory=OrderedDict, init=False, repr=False)
    )
    _indexer_tables: dict[str, dict[int, list[indexer_object.Block]]] = field(
        default_factory=dict, init=False, repr=False
    )
    _cache_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    """Held for every look-up and change of the caches above (never across I/O): a snapshot is shared by threads."""

    def __post_init__(self) -> None:
        if not self.sources:
            self.sources = list(self.commits)
        self._commit_column = to_numpy(self.index.column(COMMIT_COLUMN))
        self._n_tokens = to_numpy(self.index.column("n_tokens"))
        # each part's commit and its place among the commits (their list is in log order: position, then slot)
        self._own = {keys.part_dir(self.step, c.part): (-(1 << 62), c) for c in self.dropped_commits}
        # a dropped part's place is only compared with the records pointing at it: before every record
        for i, source in reversed(list(enumerate(self.sources))):  # an archive part's place: its first commit's
            self._own[keys.part_dir(self.step, source.part)] = (i, source)
        self._positions = {sid: i for i, sid in enumerate(self.index.column("sample_id").to_pylist())}

    # -- loading -------------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, store: StoreRoot, step: int, *, as_of: datetime | None = None) -> StepSnapshot:
        """The step's committed records; with ``as_of``, the step as it was then (the log's entries the storage
        held then, by its own timestamps; naive times are read as UTC).

        Everything used is checked before use: each entry against its name, its step and the run's model spec, each
        index against the SHA-256 its commit (or the seal) lists, and the rows against the commit's counts.
        """
        return cls.of(StepHistory.read(store, step, as_of=as_of))

    @classmethod
    def of(cls, history: StepHistory) -> StepSnapshot:
        """The snapshot of a history read already (:mod:`routelog.store.history`)."""
        view = history.view()
        commits = [_commit_doc(e) for e in view.commits]
        stored = view.stored
        sids = stored.column("sample_id").to_pylist() if view.shadowed.any() else []
        commit_of = to_numpy(stored.column(COMMIT_COLUMN))
        winner = {sids[r]: int(r) for r in np.flatnonzero(view.live)} if sids else {}
        shadowed = [
            Shadowed(sids[r], commits[int(commit_of[winner[sids[r]]])].name, commits[int(commit_of[r])].name)
            for r in np.flatnonzero(view.shadowed)
            if sids[r] in winner
        ]
        return cls(
            history.store,
            history.step,
            commits,
            view.index,
            view.seal is not None,
            history.as_of,
            [d.doc for d in view.drops if isinstance(d.doc, DropRecord)],
            [_commit_doc(e) for e in view.whole_dropped],
            shadowed,
            stored,
            [e.position for e in view.commits],
            [(e.position, e.doc) for e in view.annotations if isinstance(e.doc, AnnotationCommit)],
            view.sources,
            view.archive_indexes,
        )

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
    def parts(self) -> list[CommitRecord]:
        """The commits of the parts the records are read from, each once: :attr:`commits`, or the archive parts that
        hold their records."""
        return list({c.part: c for c in self.sources}.values())

    @property
    def stored_bytes(self) -> int:
        """Every object of the step's parts: routing, values, streams and indexes."""
        return sum(o.size for c in self.parts for o in c.objects)

    @property
    def routing_bytes(self) -> int:
        """The routing arrays' chunks (and models, for context-coded arrays) only: what the codec is measured by."""
        return sum(
            o.size
            for c in self.parts
            for o in c.objects
            if o.key.startswith(c.routing.path + "/c/") or o.key == f"{c.routing.path}/{MODEL_KEY}"
        )

    @property
    def stored_rows(self) -> int:
        """Token rows stored in the routing arrays (a record's missing final rows are not stored; a prefix shared
        by several records of a part is stored once)."""
        return sum(c.routing.n_rows for c in self.parts)

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
        parts = {self.sources[int(i)].part for i in np.unique(self._commit_column)}
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

    @functools.cached_property
    def _rows(self) -> IndexRows:
        return IndexRows(self.index, skip=[COMMIT_COLUMN])

    def _row(self, position: int) -> IndexRow:
        try:
            return self._rows.row(position)[0]
        except ValueError as exc:
            part = self.commits[self._commit_of(position)].part
            raise CorruptDataError(
                f"step {self.step} of {self.store.url}, part {part!r}: index row "
                f"{self._rows.fields(position).get('sample_id')!r} breaks "
                f"the format ({exc})"
            ) from None

    # -- the sparse-attention indexer ----------------------------------------------------------------------------
    def read_indexer(
        self, sample_id: str, *, layers: Sequence[int] | None = None, tokens: tuple[int, int] | None = None
    ) -> npt.NDArray[np.int32]:
        """The indexer rows of one record, int32 ``[tokens, layers, index_topk]`` as :attr:`Record.indexer` holds
        them: ``layers`` are positions on the stored indexer axis (the model spec's ``indexer.layers``; default all),
        ``tokens`` a ``(start, stop)`` range of the record's positions (default all). At most two requests: the head
        of the part's indexer object (once per snapshot), then the blocks of those layers, each decoded from the
        keyframe before ``start``. Raises :class:`~routelog.errors.ValuesNotFoundError` for a record stored without
        indexer rows."""
        position = self._position(sample_id)
        n_tokens = int(self._n_tokens[position])
        commit = self.sources[self._commit_of(position)]
        part_key = keys.part_dir(self.step, commit.part)
        info = commit.indexer
        if info is None:
            raise ValuesNotFoundError(
                f"sample {sample_id!r} of step {self.step} of {self.store.url} was stored without indexer rows"
            )
        chosen = list(range(info.num_layers)) if layers is None else [int(j) for j in layers]
        if any(not 0 <= j < info.num_layers for j in chosen):
            raise IndexError(f"indexer layers {chosen}: the stored axis has positions 0..{info.num_layers - 1}")
        start, stop = (0, n_tokens) if tokens is None else (int(tokens[0]), int(tokens[1]))
        if not 0 <= start <= stop <= n_tokens:
            raise IndexError(f"tokens [{start}, {stop}): sample {sample_id!r} has positions 0..{n_tokens - 1}")
        where = f"step {self.step} of {self.store.url}, part {commit.part!r}, {info.key}"
        key, size = f"{part_key}/{info.key}", object_info(commit, info.key, where).size
        storage = self.store.storage
        blocks = self._indexer_table(key, size, info, where).get(sample_id_hash(sample_id))
        if not blocks:
            raise ValuesNotFoundError(f"sample {sample_id!r}: {where} holds no indexer rows of it")
        wanted = [blocks[j] for j in chosen]
        out = np.empty((stop - start, len(chosen), info.index_topk), np.int32)
        for j, (block, data) in enumerate(
            zip(wanted, storage.read_ranges([(key, b.offset, b.offset + b.length) for b in wanted]), strict=True)
        ):
            indexer_object.check_block(data, block, where)
            if positions_header(data) != (n_tokens, info.index_topk, 0):
                raise CorruptDataError(
                    f"{where}: the block of {sample_id!r} at layer {chosen[j]} holds (rows, k, first position) "
                    f"{positions_header(data)}, not ({n_tokens}, {info.index_topk}, 0)"
                )
            out[:, j, :] = decode_positions(data, start=start, stop=stop)
        return out

    def _indexer_table(
        self, key: str, size: int, info: IndexerInfo, where: str
    ) -> dict[int, list[indexer_object.Block]]:
        """A part's indexer object's table, read (one request) and checked once per snapshot."""
        with self._cache_lock:
            found = self._indexer_tables.get(key)
        if found is None:
            head_and_table = indexer_object.table_bytes(info.n_records, info.num_layers)
            check_count(head_and_table, name="table bytes", at_most=size, where=where, expected="its size")
            (table,) = self.store.storage.read_ranges([(key, 0, head_and_table)])
            indexer_object.read_head(table, size, (info.n_records, info.num_layers), where)
            found = indexer_object.entries(bytes(table), info.num_layers, size, info.table_crc32c, where)
            with self._cache_lock:
                found = self._indexer_tables.setdefault(key, found)
        return found

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
        rows = [self.info(sid) for sid in sample_ids]
        return self._read_rows(
            rows,
            {r.sample_id: self._part_key(r.sample_id) for r in rows},
            moe_layers=moe_layers,
            stream=stream,
            weights=weights,
            tokens=tokens,
            max_gap=max_gap,
        )

    def read_stored(self, commit: int, *, stream: str | None = None, weights: bool = False) -> list[RecordRouting]:
        """Every record ``commits[commit]`` holds, in its index's order, dropped and shadowed ones too (what an
        archive re-codes), every layer; ``stream`` and ``weights`` as in :meth:`read_many`."""
        stored = self.stored if self.stored is not None else self.index
        table = stored.filter(pc.equal(stored.column(COMMIT_COLUMN), commit))
        rows = IndexRows(table, skip=[COMMIT_COLUMN])
        infos = [rows.row(i)[0] for i in range(table.num_rows)]
        part_key = keys.part_dir(self.step, self.sources[commit].part)
        return self._read_rows(
            infos, {r.sample_id: part_key for r in infos}, stream=stream, weights=weights, own_commit=commit
        )

    def stored_indexer_blocks(self, commit: int, sample_id: str) -> list[bytes]:
        """The coded indexer blocks (one per indexer layer, FORMAT.md section 15) of the record ``sample_id`` of
        ``commits[commit]``, as stored; empty for a record stored without indexer rows."""
        source = self.sources[commit]
        info = source.indexer
        if info is None:
            return []
        where = f"step {self.step} of {self.store.url}, part {source.part!r}, {info.key}"
        key = f"{keys.part_dir(self.step, source.part)}/{info.key}"
        blocks = self._indexer_table(key, object_info(source, info.key, where).size, info, where).get(
            sample_id_hash(sample_id)
        )
        if not blocks:
            return []
        data = self.store.storage.read_ranges([(key, b.offset, b.offset + b.length) for b in blocks])
        for block, piece in zip(blocks, data, strict=True):
            indexer_object.check_block(piece, block, where)
        return [bytes(piece) for piece in data]

    def stored_values(self, commit: int) -> dict[str, dict[str, FloatArray]]:
        """The per-token columns ``commits[commit]``'s part stored with its records, by sample id (annotations'
        columns are not the part's: they stay in their own objects)."""
        source = self.sources[commit]
        if source.values is None:
            return {}
        columns = tuple(sorted(c.name for c in source.values.columns))
        found = self._values_of(keys.part_dir(self.step, source.part), source, source.values, columns)
        return {sid: values for sid, (_, values) in found.items()}

    def _read_rows(
        self,
        rows: list[IndexRow],
        own_part: dict[str, str],
        *,
        moe_layers: Sequence[int] | None = None,
        stream: str | None = None,
        weights: bool = False,
        tokens: Mapping[str, npt.NDArray[np.bool_]] | None = None,
        max_gap: int = MAX_GAP,
        own_commit: int | None = None,
    ) -> list[RecordRouting]:
        """:meth:`read_many` of index rows whose sample ids are distinct, each read from ``own_part[sample_id]``
        (and the parts its spans name); ``own_commit`` is their commit's place when they are not live records."""
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
        # Every valid row is written below, every layer of it; the others are zeroed at the end (np.zeros would
        # write each page twice: measured 2.3 x the time of np.empty for a 1.5 MB record).
        out = {r.sample_id: np.empty((len(wanted), r.n_tokens, topk), dtype=dtype) for r in rows}
        valid = {r.sample_id: np.zeros(r.n_tokens, dtype=bool) for r in rows}
        by_part: dict[str, list[tuple[str, Span]]] = defaultdict(list)
        for r in rows:
            needed = None if tokens is None else tokens.get(r.sample_id)
            if needed is not None and needed.shape != (r.n_tokens,):
                raise ValueError(f"tokens[{r.sample_id!r}] has shape {needed.shape}, the record {r.n_tokens} tokens")
            spans = _spans(r, stream)
            self._check_references(r.sample_id, spans, own_commit)
            for span in spans if needed is None else _restricted(spans, needed):
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
        # Each record's rows are decoded into its own array (a chunk wholly inside one record in place, no copy).
        into: list[list[Destination] | None] = [
            [
                (span.row, out[sid][read.out_start : read.out_stop, span.token_start : span.token_start + span.n_rows])
                for sid, span in read.members
            ]
            for read in reads
        ]
        into += [None] * len(with_weights)  # the weights are read into blocks (converted below)
        blocks = fetch_blocks(self.store.storage, requests, self._index_cache, max_gap, into, self._tokens_of)
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
        for sid, computed in valid.items():
            if not computed.all():
                out[sid][:, ~computed] = 0
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
        """The index (one row per record: the columns of :class:`~routelog.format.documents.IndexRow`, plus ``part``),
        or with ``routing=True`` the decoded routing in long form
        (:data:`~routelog.format.routing.ROUTING_TABLE_SCHEMA`: sample_id, token, layer, k, expert; routed rows only) of
        ``sample_ids`` (default: every record; the long form takes about 12 bytes per token, layer and slot, so choose
        the records for a large step)."""
        ids = self.sample_ids if sample_ids is None else list(sample_ids)
        if not routing:
            positions = numeric_array([self._position(sid) for sid in ids])
            table = self.index.take(positions)
            parts = string_array([self.commits[i].part for i in table.column("_commit").to_pylist()])
            return table.drop_columns(["_commit"]).append_column("part", parts)
        tables = [
            routing_.to_arrow()
            for start in range(0, len(ids), batch_records)
            for routing_ in self.read_many(ids[start : start + batch_records], moe_layers=moe_layers)
        ]
        return pa.concat_tables(tables) if tables else pa.Table.from_batches([], schema=ROUTING_TABLE_SCHEMA)

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
        return [doc for _, doc in self.annotation_entries]

    def value_columns(self) -> list[str]:
        """Names of the per-token columns present in the step (in parts or annotations)."""
        names = {c.name for commit in self.commits if commit.values for c in commit.values.columns}
        names.update(c.name for a in self.annotations for c in a.values.columns)
        return sorted(names)

    def token_values(self, sample_ids: Iterable[str], names: Sequence[str]) -> dict[str, dict[str, FloatArray]]:
        """``{sample_id: {name: float32 [n_tokens]}}`` for the named columns each record has (a column a record
        lacks is absent from its dict). Only the values objects of the records' parts are fetched, and only the
        named columns of them; a column given twice for one record (in its part and an annotation, or two
        annotations) raises :class:`DuplicateSampleError`.

        A part's values belong to its live records (a dropped or shadowed part-mate's are skipped); an annotation's
        values belong to a record live now that was committed before the annotation, with the token hash they were
        computed on (a record dropped, or written again, after the annotation has none of them)."""
        wanted = set(names)
        # Only the token counts are needed: read them from the index column, not by building index rows.
        lengths = {sid: int(self._n_tokens[self._position(sid)]) for sid in sample_ids}
        out: dict[str, dict[str, FloatArray]] = {sid: {} for sid in lengths}
        sources: dict[tuple[str, str], str] = {}
        # directory -> the commit declaring a values object there, its declaration and its log position
        holders: dict[str, tuple[CommitRecord | AnnotationCommit, ValuesInfo, int | None]] = {}
        for sid in lengths:
            commit = self.sources[self._commit_of(self._position(sid))]
            if commit.values is not None:
                holders[keys.part_dir(self.step, commit.part)] = (commit, commit.values, None)
        for at, annotation in self.annotation_entries:
            holders[f"{keys.annotations_dir(self.step)}/{annotation.part}"] = (annotation, annotation.values, at)
        for base, (holder, declared, position) in holders.items():
            columns = sorted(wanted & {c.name for c in declared.columns})
            if not columns:
                continue
            for sid, (digest, values) in self._values_of(base, holder, declared, tuple(columns)).items():
                if sid not in out or not self._values_apply(sid, digest, holder, position):
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

    def _values_apply(
        self, sid: str, digest: str | None, holder: CommitRecord | AnnotationCommit, position: int | None
    ) -> bool:
        """Whether a values row of ``holder`` belongs to the live record ``sid`` (see :meth:`token_values`)."""
        live = self._positions.get(sid)
        if live is None:
            return False
        commit = self._commit_of(live)
        if position is None:  # the record's own part
            return self.sources[commit] is holder
        committed = self.index.column("token_hash")[live].as_py()
        before = (self.positions[commit] if self.positions else -1) < position
        return before and (digest is None or committed is None or digest == committed)

    def _values_of(
        self, base: str, holder: CommitRecord | AnnotationCommit, declared: ValuesInfo, columns: tuple[str, ...]
    ) -> dict[str, tuple[str | None, dict[str, FloatArray]]]:
        """One values object's columns by sample id, with the token hash each row was computed on, checked
        against its commit (SHA-256, declared columns, record count; a part's rows name its own records), with
        a small LRU so streaming over a part reads its object once."""
        key = f"{base}/{declared.key}"
        cache_key = (key, columns)
        with self._cache_lock:  # another thread may evict it between a look-up and its use
            cached = self._values_cache.get(cache_key)
            if cached is not None:
                self._values_cache.move_to_end(cache_key)
                return cached
        storage = self.store.storage
        where = storage.url_of(key)
        info = object_info(holder, declared.key, where)
        data = storage.read_verified(key, info.size, info.sha256, f"commit {holder.name}")
        contents = values_from_parquet(
            data,
            columns,
            where,
            declared=[c.name for c in declared.columns],
            max_records=holder.n_records,
            max_tokens=holder.n_tokens,
        )
        if len(contents.token_hashes) != holder.n_records:
            raise CorruptDataError(
                f"{where}: holds {len(contents.token_hashes)} records, its commit says {holder.n_records}"
            )
        if isinstance(holder, CommitRecord):
            own = self._part_records(holder)
            stranger = next((sid for sid in contents.token_hashes if sid not in own), None)
            if stranger is not None:
                raise CorruptDataError(f"{where}: holds values of sample {stranger!r}, which its part does not hold")
            changed = next((sid for sid, d in contents.token_hashes.items() if not _same_hash(d, own[sid])), None)
            if changed is not None:
                raise CorruptDataError(f"{where}: values of sample {changed!r} were computed on other tokens")
        rows = {sid: (digest, contents.values.get(sid, {})) for sid, digest in contents.token_hashes.items()}
        with self._cache_lock:
            self._values_cache[cache_key] = rows
            while len(self._values_cache) > _VALUES_CACHE:
                self._values_cache.popitem(last=False)
        return rows

    def _part_records(self, commit: CommitRecord) -> dict[str, str | None]:
        """``{sample_id: token_hash}`` of every record ``commit``'s part holds (dropped and shadowed ones too)."""
        rows = self._part_index(commit)
        return dict(zip(rows.column("sample_id").to_pylist(), rows.column("token_hash").to_pylist(), strict=True))

    def _part_index(self, commit: CommitRecord) -> pa.Table:
        """The index rows of every record ``commit``'s part holds (an archive part's from its own index)."""
        if commit.part in self.part_indexes:
            return self.part_indexes[commit.part]
        stored = self.stored if self.stored is not None else self.index
        position = next((i for i, c in enumerate(self.sources) if c.part == commit.part), None)
        if position is None:  # a part dropped whole: its index is read for it
            return read_commit_index(self.store, self.step, commit)
        return stored.filter(pc.equal(stored.column(COMMIT_COLUMN), position))

    def open_zarr(self, part: str) -> zarr.Array[Any]:
        """A part's routing array opened with zarr-python: expert IDs ``[num_moe_layers, n_rows, K]`` for format-2
        parts (through the registered ``routelog.ranked_gaps`` codec); the stored form for format-1 parts (gaps when
        sorted, uint16 as byte planes; see ``schemas/FORMAT.md``). For interoperability; :meth:`read_many` is the
        fast path."""
        import zarr  # loaded here: the readers' own path never needs it

        commit = self._commit_for(keys.part_dir(self.step, part))
        store = self.store.storage.zarr_store(f"{keys.part_dir(self.step, part)}/{commit.routing.path}")
        return zarr.open_array(store, mode="r")

    def _part_key(self, sample_id: str) -> str:
        return keys.part_dir(self.step, self.sources[self._commit_of(self._position(sample_id))].part)

    def _commit_for(self, part_key: str) -> CommitRecord:
        return self._own[part_key][1]

    def _tokens_of(self, part_key: str) -> RowTokens:
        """The token id of each row of a part's routing array (context-coded chunks decode with them), from every
        record its index holds; a part dropped whole has its index read for them."""
        with self._cache_lock:
            found = self._row_tokens.get(part_key)
        if found is None:  # two threads may both compute it: the same value, kept once
            commit = self._commit_for(part_key)
            found = part_row_tokens(self._part_index(commit), commit.routing.n_rows)
            with self._cache_lock:
                found = self._row_tokens.setdefault(part_key, found)
        return found

    def _check_references(self, sample_id: str, spans: Iterable[Span], own_commit: int | None = None) -> None:
        """A record's shared prefix points at a part of this step committed before its own (or dropped whole and
        kept for it): never at another step, a later commit, or a part the step does not hold."""
        if own_commit is None:
            own = self._own[self._part_key(sample_id)][0]
        else:
            own = self._own[keys.part_dir(self.step, self.sources[own_commit].part)][0]
        for span in spans:
            if span.part is None:
                continue
            held = self._own.get(span.part)
            if held is None or held[0] >= own:
                parsed = keys.parse_span_part(span.part)
                where = f"another step's part {span.part!r}" if parsed and parsed[0] != self.step else span.part
                raise CorruptDataError(
                    f"step {self.step} of {self.store.url}: sample {sample_id!r} points at rows of {where}, which "
                    "is not a part committed before it in this step (shared rows never reach outside their step)"
                )


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


@dataclass(frozen=True)
class Shadowed:
    """A sample id committed by two commits: readers read ``kept`` (the earliest); ``shadowed`` is never read."""

    sample_id: str
    kept: str
    """Name of the commit whose record is read."""
    shadowed: str


def _commit_doc(entry: Entry) -> CommitRecord:
    if not isinstance(entry.doc, CommitRecord):  # pragma: no cover - views list commit entries only
        raise TypeError(f"{entry.key} is not a commit")
    return entry.doc


def _same_hash(a: str | None, b: str | None) -> bool:
    return a is None or b is None or a == b


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
