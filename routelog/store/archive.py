"""Archiving a sealed step: its records re-coded into archive-codec parts by one entry of its log.

A step written for the trainer uses format 2's fast codec; once sealed, its history can be kept smaller. Archiving
reads every record the step holds (live, shadowed and dropped-by-sample ones alike: a later drop may reveal a
shadowed copy), writes them again with the ``ranked_context`` codec into fresh part directories, and appends one
archive entry naming, for each new part, the commits whose records it holds (``schemas/FORMAT.md`` section 3.15):

- a view whose entries include the archive reads those commits from the archive parts, and a view without it (as
  of an earlier time) reads the original parts, so a reader sees one or the other, never both nor neither;
- a commit keeps its place, writer and part name, so drops, winners and annotations mean what they meant;
- nothing changes before the entry exists: Ctrl-C or a crash leaves uploaded parts no entry names (gc reclaims
  them) and the step as it was; running it again starts over, and on an archived step it does nothing;
- gc reclaims the original parts once the entry is older than its grace period.

An archive part holds whole commits and never two records of one sample id (shadowed copies go to a later part),
up to :data:`ARCHIVE_PART_BYTES` of raw routing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pyarrow.compute as pc

from routelog.errors import RecordNotFoundError, StepNotSealedError
from routelog.format import keys
from routelog.format.codec import IdArray
from routelog.format.documents import (
    ARCHIVE_FEATURE,
    ARCHIVE_WRITER,
    ArchivedPart,
    ArchiveRecord,
    CommitRecord,
    Span,
    StreamSpans,
    utc_now,
)
from routelog.format.part import PartOptions, build_part
from routelog.format.record import PreparedRecord
from routelog.format.routing import RecordRouting
from routelog.format.weights import to_storage
from routelog.store.history import COMMIT_COLUMN, StepHistory
from routelog.store.reader import StepSnapshot
from routelog.store.root import StoreRoot
from routelog.store.steplog import Entry
from routelog.store.writer import part_commit, upload_part

ARCHIVE_OPTIONS = PartOptions(transform="ranked_context", dedup="part", chunk_rows=16384, chunk_layers=16)
"""How archive parts are written: the archive codec, a prefix shared by records of one part stored once, and
chunks 16 times the writer's (2 MiB of uint8 IDs at K = 8): an archive is read whole records at a time, and fewer,
larger chunks code smaller (the corpora archived: 2.6 % and 1.9 % fewer bytes in all than with 4096 x 4 chunks)."""
ARCHIVE_PART_BYTES = 256 << 20
"""Raw routing (one byte per expert ID) an archive part holds at most, unless one commit alone holds more: the
codec's model learns from the whole part, and building it holds the part's rows in memory."""

Progress = Callable[[int, int, int], None]
"""Told the records and raw routing bytes re-coded so far, and the records to re-code in all."""


@dataclass
class ArchiveOutcome:
    """What archiving a step did."""

    step: int
    entry: ArchiveRecord | None
    """The archive entry appended; None when nothing was written (archived already, or no record to re-code)."""
    records: int
    """Records the step's parts hold (re-coded, or archived already)."""
    raw_bytes: int
    """Raw routing bytes of those records (one byte per expert ID of every stored row)."""
    bytes_before: int
    """Bytes of the parts the records were read from."""
    bytes_after: int
    """Bytes of the archive parts."""
    archived_already: bool = False
    """The step was archived before: nothing to do."""


def archive_step(
    store: StoreRoot,
    step: int,
    *,
    options: PartOptions = ARCHIVE_OPTIONS,
    part_bytes: int = ARCHIVE_PART_BYTES,
    progress: Progress | None = None,
    check: Callable[[], None] | None = None,
) -> ArchiveOutcome:
    """Re-code sealed ``step``'s records into archive parts and make them its content (see the module docs).

    Raises :class:`StepNotSealedError` for a step that is not sealed. ``check`` is called between records (a
    command's Ctrl-C check); ``progress`` as records are re-coded."""
    history = StepHistory.read(store, step)
    view = history.view()
    if view.seal is None and not history.log.entries:
        raise RecordNotFoundError(
            f"step {step} of {store.url} holds nothing to archive (steps: {store.steps()[:20]}); pick one with --step"
        )
    if view.seal is None:
        raise StepNotSealedError(
            f"step {step} of {store.url} is not sealed: only a sealed step's records are fixed; seal it first "
            f"(routelog seal {store.url} --step {step})"
        )
    snapshot = StepSnapshot.of(history)
    before = _stored_bytes(snapshot.parts)
    raw = _raw_bytes(snapshot)
    if view.archive is not None:
        return ArchiveOutcome(step, None, _n_rows(snapshot), raw, before, before, archived_already=True)
    entries = view.commits
    if not entries:  # every part dropped whole: no record a reader could read
        return ArchiveOutcome(step, None, 0, 0, 0, 0)
    built: list[tuple[list[str], CommitRecord]] = []
    tally = _Tally(_n_rows(snapshot), progress, check)
    try:  # until the entry is appended no reader knows of these parts: on any failure they go again
        for group in _groups(snapshot, part_bytes):
            records = [rec for i in group for rec in _prepared(snapshot, i, tally)]
            sources = [snapshot.sources[i] for i in group]
            layout = replace(
                options,
                topk_order=sources[0].routing.topk_order,
                weights_dtype=next((s.weights.dtype for s in sources if s.weights), options.weights_dtype),
            )
            part = build_part(records, store.model_spec, layout)
            del records
            name = keys.new_part_name(ARCHIVE_WRITER, len(built))
            infos = upload_part(store.storage, step, name, part)
            # No digest: decisions about sample ids read the replaced commits' (FORMAT.md section 3.15).
            commit = part_commit(part, ARCHIVE_WRITER, len(built), name, step, infos).model_copy(
                update={"digest": None}
            )
            built.append(([entries[i].name for i in group], commit))
    except BaseException:
        _delete_parts(store, step, [c.part for _, c in built])
        raise
    # An append whose answer is lost may still have created the entry: its parts stay (gc reclaims them if not).
    entry = _append(history, view.seal, built, before)
    if entry is None:  # another process archived the step meanwhile: its archive stands
        _delete_parts(store, step, [c.part for _, c in built])
        return ArchiveOutcome(step, None, _n_rows(snapshot), raw, before, before, archived_already=True)
    after = _stored_bytes([c for _, c in built])
    return ArchiveOutcome(step, entry, tally.records, tally.raw, before, after)


class _LogMovedError(Exception):
    """Another archive entry appeared while this one was being written."""


def _append(
    history: StepHistory, seal: Entry, built: Sequence[tuple[list[str], CommitRecord]], before: int
) -> ArchiveRecord | None:
    """Append the archive entry after everything the log holds; None when another archive got there first (a drop
    or an annotation meanwhile changes nothing: the archive holds every record they may name)."""

    def build(position: int) -> ArchiveRecord:
        now = utc_now()
        parts = [
            ArchivedPart(
                replaces=names,
                commit=commit.model_copy(update={"position": position, "slot": slot, "created_at": now}),
            )
            for slot, (names, commit) in enumerate(built)
        ]
        return ArchiveRecord(
            features=sorted({ARCHIVE_FEATURE, *(f for _, c in built for f in c.features)}),
            step=history.step,
            position=position,
            created_at=now,
            writer_id=ARCHIVE_WRITER,
            seal=seal.name,
            parts=parts,
            bytes_before=before,
        )

    def moved(new: Sequence[Entry]) -> None:
        if any(isinstance(e.doc, ArchiveRecord) for e in new):
            raise _LogMovedError

    try:
        [entry] = history.log.append(build, check=moved)
    except _LogMovedError:
        return None
    if not isinstance(entry.doc, ArchiveRecord):  # pragma: no cover - append returns what build made
        raise TypeError(entry.key)
    return entry.doc


def _groups(snapshot: StepSnapshot, part_bytes: int) -> Iterator[list[int]]:
    """The commits (places in ``snapshot.commits``) of each archive part, in log order: whole commits of one top-k
    order, no sample id twice, at most ``part_bytes`` of raw routing unless one commit alone holds more."""
    stored = snapshot.stored if snapshot.stored is not None else snapshot.index
    commit_of = stored.column(COMMIT_COLUMN).to_numpy(zero_copy_only=False)
    sample_ids = stored.column("sample_id").to_pylist()
    tokens = stored.column("n_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
    per_token = snapshot.store.model_spec.num_moe_layers * snapshot.store.model_spec.topk
    group: list[int] = []
    seen: set[str] = set()
    size = 0
    order, weights = None, None
    for i, source in enumerate(snapshot.sources):
        mine = np.flatnonzero(commit_of == i)
        ids = {sample_ids[r] for r in mine}
        nbytes = int(tokens[mine].sum()) * per_token
        its_weights = None if source.weights is None else source.weights.dtype
        fits = (
            size + nbytes <= part_bytes
            and not (ids & seen)
            and source.routing.topk_order == order
            and (its_weights is None or weights is None or its_weights == weights)
        )
        if group and not fits:
            yield group
            group, seen, size, weights = [], set(), 0, None
        group.append(i)
        seen |= ids
        size += nbytes
        order, weights = source.routing.topk_order, weights or its_weights
    if group:
        yield group


@dataclass
class _Tally:
    """Records and raw routing re-coded so far, told to ``progress``; ``check`` runs before each record."""

    total: int
    progress: Progress | None
    check: Callable[[], None] | None
    records: int = 0
    raw: int = 0

    def before_record(self) -> None:
        if self.check is not None:
            self.check()

    def add(self, ids: int) -> None:
        self.records += 1
        self.raw += ids
        if self.progress is not None:
            self.progress(self.records, self.raw, self.total)


def _prepared(snapshot: StepSnapshot, commit: int, tally: _Tally) -> list[PreparedRecord]:
    """Every record of ``snapshot.commits[commit]`` in stored form, as the writer would have prepared it."""
    routed = snapshot.read_stored(commit, weights=snapshot.sources[commit].weights is not None)
    streams = {name: snapshot.read_stored(commit, stream=name) for name in snapshot.sources[commit].streams}
    values = snapshot.stored_values(commit)
    out = []
    for i, routing in enumerate(routed):
        tally.before_record()
        sid = routing.info.sample_id
        rows, spans = _stored_form(routing)
        stream_rows, stream_spans = {}, []
        for name, records in streams.items():
            if records[i].valid.any():
                stream_rows[name], its_spans = _stored_form(records[i])
                stream_spans.append(StreamSpans(name=name, spans=its_spans))
        weights = None
        stored_weights = snapshot.sources[commit].weights
        if routing.weights is not None and stored_weights is not None and not np.isnan(routing.weights).all():
            weights = to_storage(np.ascontiguousarray(routing.weights[:, routing.valid, :]), stored_weights.dtype)
        row = routing.info.model_copy(update={"spans": spans, "streams": stream_spans or None})
        raw = rows.nbytes + sum(r.nbytes for r in stream_rows.values())
        out.append(
            PreparedRecord(
                row=row,
                rows=rows,
                values=values.get(sid, {}),
                streams=stream_rows,
                raw_nbytes=raw,
                weights=weights,
                indexer=snapshot.stored_indexer_blocks(commit, sid),
            )
        )
        tally.add(int(rows.size))
    return out


def _stored_form(routing: RecordRouting) -> tuple[IdArray, list[Span]]:
    """A record's computed rows, layer-major, and the spans placing them (one per run of computed tokens)."""
    valid = routing.valid
    rows = np.ascontiguousarray(routing.by_layer[:, valid, :])
    edges = np.flatnonzero(np.diff(np.concatenate([[0], valid.view(np.int8), [0]])))
    spans, offset = [], 0
    for start, stop in zip(edges[::2], edges[1::2], strict=True):
        spans.append(Span(token_start=int(start), n_rows=int(stop - start), row=offset))
        offset += int(stop - start)
    return rows, spans


def _n_rows(snapshot: StepSnapshot) -> int:
    table = snapshot.stored if snapshot.stored is not None else snapshot.index
    return int(table.num_rows)


def _raw_bytes(snapshot: StepSnapshot) -> int:
    """Raw routing of the records the step holds: one byte per expert ID of each record's routed rows (a shared
    prefix counted in every record that has it, as re-coding counts it)."""
    spec = snapshot.store.model_spec
    table = snapshot.stored if snapshot.stored is not None else snapshot.index
    spans = pc.list_flatten(table.column("spans").combine_chunks())
    rows = int(pc.sum(spans.field("n_rows")).as_py() or 0) if len(spans) else 0
    return rows * spec.num_moe_layers * spec.topk


def _stored_bytes(commits: Sequence[CommitRecord]) -> int:
    return sum(o.size for c in commits for o in c.objects)


def _delete_parts(store: StoreRoot, step: int, parts: Sequence[str]) -> None:
    """Remove archive parts no entry names (best effort: gc reclaims what is left)."""
    for part in parts:
        with contextlib.suppress(Exception):  # the part is garbage either way
            store.storage.delete_tree(keys.part_dir(step, part))
