"""``routelog verify``: re-check a whole store against its own commit records and the format's rules.

Verify reads every step through the same code the readers use (so a store verify calls sound is one every reader
can read, and one a reader fails on is never called sound), and adds what a reader need not look at: objects no
commit lists, the copy of ``zarr.json``, rows no record references, seals against the commit files, and every
decoded row as a valid top-k set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from routelog.errors import CorruptDataError, RoutelogError
from routelog.format import indexer_object, keys
from routelog.format.digest import sample_id_hash
from routelog.format.documents import (
    AnnotationCommit,
    ArchiveRecord,
    CommitRecord,
    IndexRow,
    RoutingArrayInfo,
    SealRecord,
    Span,
    WeightsArrayInfo,
    load_json,
    parse_log_document,
)
from routelog.format.index_rows import IndexRows
from routelog.format.part import commit_digest, shard_layout
from routelog.format.positions import decode_positions, positions_header
from routelog.format.routing import RecordRouting
from routelog.store.history import StepHistory, StepView, parquet_index
from routelog.store.reader import StepSnapshot
from routelog.store.root import StoreRoot
from routelog.store.steplog import Entry, read_seal_marker
from routelog.store.storage import Storage

_BATCH = 64
"""Records read (and decoded) at a time."""


@dataclass
class VerifyReport:
    """What verify checked and found. ``problems`` make the store unsound; ``notes`` do not."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    steps: int = 0
    commits: int = 0
    records: int = 0
    objects: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_store(store: StoreRoot, *, progress: Callable[[str], None] | None = None) -> VerifyReport:
    """Check every step: documents, objects (sizes, SHA-256s, nothing unlisted), indexes, spans, and every row."""
    report = VerifyReport()
    for step in store.steps():
        report.steps += 1
        if progress:
            progress(f"step {step}")
        try:
            _verify_step(store, step, report)
        except RoutelogError as exc:
            report.problems.append(f"step {step}: {exc}")
    return report


def _verify_step(store: StoreRoot, step: int, report: VerifyReport) -> None:
    storage = store.storage
    try:
        history = StepHistory.read(store, step)
        view = history.view()
    except RoutelogError as exc:
        report.problems.append(f"step {step}: the step cannot be read: {exc}")
        return
    commits = history.log.commits()
    report.commits += len(commits)
    indexed: dict[str, list[IndexRow]] = {}
    sources = list({c.part: c for c in view.sources}.values())
    for source in sources:
        rows = _verify_part(store, step, source, report)
        if rows is not None:
            indexed[source.part] = rows
    _verify_coverage(store, step, [c for c in sources if c.part in indexed], indexed, report)
    _verify_seal(store, step, history, view, report)
    _verify_archive(history, view, indexed, report)
    committed = {_commit(e).part for e in commits}
    committed |= {p.commit.part for e in history.log.entries if isinstance(e.doc, ArchiveRecord) for p in e.doc.parts}
    for part in storage.list(keys.parts_dir(step)):
        if part not in committed:
            report.notes.append(
                f"step {step}: part {part!r} has no commit (a writer died before committing); "
                "`routelog gc` removes such orphans"
            )
    snapshot = StepSnapshot.of(history)
    for shadow in snapshot.shadowed:
        report.notes.append(
            f"step {step}: sample {shadow.sample_id!r} was committed by {shadow.kept} and again by {shadow.shadowed} "
            f"(two writers raced on it); readers read {shadow.kept}'s, `routelog gc` reclaims the other once its "
            "part holds nothing else"
        )
    _verify_records(snapshot, report)
    _verify_values(snapshot, report)


def _verify_archive(
    history: StepHistory, view: StepView, indexed: dict[str, list[IndexRow]], report: VerifyReport
) -> None:
    """Each commit an archive part replaces: its rows there are its records (its digest lists exactly them) and,
    where the original index is at hand (the seal's consolidated copy), the same records with the same tokens."""
    if view.archive is None or not isinstance(view.archive.doc, ArchiveRecord):
        return
    content = {e.name: _commit(e) for e in [*view.commits, *view.whole_dropped]}
    for archived in view.archive.doc.parts:
        rows = indexed.get(archived.commit.part)
        if rows is None:
            continue
        start = 0
        for name in archived.replaces:
            commit = content.get(name)
            if commit is None:
                continue  # the history reported it
            mine = rows[start : start + commit.n_records]
            start += commit.n_records
            where = f"step {history.step}: archive part {archived.commit.part!r}, commit {name}"
            _verify_digest(where, commit, mine, report)
            original = history.tables.get(name)
            if original is None:
                continue
            fields = [f for f in ("sample_id", "token_hash", "n_tokens", "prompt_len") if f in original.schema.names]
            before = list(zip(*(original.column(f).to_pylist() for f in fields), strict=True))
            after = [tuple(getattr(r, f) for f in fields) for r in mine]
            if before != after:
                report.problems.append(f"{where}: the archived records differ from the commit's index")


def _commit(entry: Entry) -> CommitRecord:
    if not isinstance(entry.doc, CommitRecord):  # pragma: no cover - callers pass commit entries
        raise TypeError(entry.key)
    return entry.doc


def _verify_part(store: StoreRoot, step: int, commit: CommitRecord, report: VerifyReport) -> list[IndexRow] | None:
    """The part's directory holds exactly the listed objects, intact, and its index agrees with the commit;
    returns its index rows (None when they cannot be read)."""
    storage = store.storage
    base = keys.part_dir(step, commit.part)
    where = storage.url_of(base)
    present = {key[len(base) + 1 :] for key in storage.find(base)}
    listed = {o.key for o in commit.objects}
    if present - listed:
        report.problems.append(f"{where}: objects its commit does not list: {sorted(present - listed)}")
    blobs: dict[str, bytes] = {}
    for obj in commit.objects:
        report.objects += 1
        data = _read_checked(storage, f"{base}/{obj.key}", obj.size, obj.sha256, f"commit {commit.name}", report)
        if data is not None:
            blobs[obj.key] = data
    arrays: list[RoutingArrayInfo | WeightsArrayInfo] = [commit.routing, *commit.streams.values()]
    if commit.weights is not None:
        arrays.append(commit.weights)
    for array in arrays:
        _verify_zarr_json(where, array, blobs.get(f"{array.path}/zarr.json"), report)
    if keys.INDEX not in blobs:
        return None
    try:
        table = parquet_index(blobs[keys.INDEX], where, commit.n_records, commit.n_tokens, len(commit.streams))
        rows = [row for row, _ in IndexRows(table).every()]
    except (ValueError, RoutelogError) as exc:
        report.problems.append(f"{where}: the index does not parse ({str(exc).splitlines()[0]})")
        return None
    report.records += len(rows)
    _verify_digest(where, commit, rows, report)
    _verify_indexer(where, commit, blobs.get(commit.indexer.key) if commit.indexer else None, rows, report)
    return rows


def _verify_indexer(
    where: str, commit: CommitRecord, data: bytes | None, rows: list[IndexRow], report: VerifyReport
) -> None:
    """Every block of the part's indexer object belongs to one of its records and decodes to that record's tokens
    of canonical rows (FORMAT.md section 15)."""
    info = commit.indexer
    if info is None or data is None:
        return
    where = f"{where}/{info.key}"
    try:
        indexer_object.read_head(data[: indexer_object.HEAD_BYTES], len(data), (info.n_records, info.num_layers), where)
        table = data[: indexer_object.table_bytes(info.n_records, info.num_layers)]
        found = indexer_object.entries(table, info.num_layers, len(data), info.table_crc32c, where)
        tokens = {sample_id_hash(row.sample_id): (row.sample_id, row.n_tokens) for row in rows}
        for hashed, blocks in found.items():
            if hashed not in tokens:
                raise CorruptDataError(f"{where}: the table lists a record the part's index does not hold")
            sample_id, n_tokens = tokens[hashed]
            for j, block in enumerate(blocks):
                piece = data[block.offset : block.offset + block.length]
                indexer_object.check_block(piece, block, where)
                if positions_header(piece) != (n_tokens, info.index_topk, 0):
                    raise CorruptDataError(f"{where}: {sample_id!r} layer {j}: the block's header disagrees")
                decode_positions(piece)  # every row checked canonical as it decodes
    except RoutelogError as exc:
        report.problems.append(str(exc))


def _verify_digest(where: str, commit: CommitRecord, rows: list[IndexRow], report: VerifyReport) -> None:
    """A commit's digest lists every record of its index (FORMAT.md section 3.3: a hash missing from it would hide
    a duplicate from every writer that trusts it)."""
    if commit.digest is None:
        return
    expected = commit_digest([r.sample_id for r in rows], [r.token_ids for r in rows])
    if expected != commit.digest:
        which = "sample ids" if expected.sample_ids != commit.digest.sample_ids else "prefixes"
        report.problems.append(f"{where}: the digest of commit {commit.name} does not list its records' {which}")


def _verify_zarr_json(
    where: str, array: RoutingArrayInfo | WeightsArrayInfo, metadata: bytes | None, report: VerifyReport
) -> None:
    """``zarr.json`` equals the commit's copy and describes the array the commit says."""
    if metadata is None:
        return
    try:
        stored = load_json(metadata, f"{where}/{array.path}/zarr.json")
    except ValueError as exc:
        report.problems.append(str(exc))
        return
    expected = shard_layout(array).zarr_metadata(0, {})
    if stored != array.zarr_metadata:
        report.problems.append(f"{where}: {array.path}/zarr.json differs from the copy in its commit")
    if stored.get("shape") != expected["shape"] or stored.get("data_type") != expected["data_type"]:
        report.problems.append(f"{where}: {array.path}/zarr.json describes shape {stored.get('shape')}, not the part's")


def _verify_coverage(
    store: StoreRoot, step: int, commits: list[CommitRecord], indexed: dict[str, list[IndexRow]], report: VerifyReport
) -> None:
    """Every stored row of every part is read by some record of the step: its own part's, or one whose shared
    prefix points at it."""
    routing_spans: dict[str, list[Span]] = {c.part: [] for c in commits}
    for part, rows in indexed.items():
        for span in (s for row in rows for s in row.spans):
            parsed = keys.parse_span_part(span.part) if span.part is not None else (step, part)
            if parsed is not None and parsed[0] == step and parsed[1] in routing_spans:
                routing_spans[parsed[1]].append(span.model_copy(update={"part": None}))
    for commit in commits:
        where = store.storage.url_of(keys.part_dir(step, commit.part))
        _check_coverage(where, "routing", commit.routing.n_rows, routing_spans[commit.part], report)
        for name, array in commit.streams.items():
            rows = indexed[commit.part]
            spans = [s for row in rows for entry in row.streams or [] if entry.name == name for s in entry.spans]
            _check_coverage(where, f"stream {name!r}", array.n_rows, spans, report)


def _check_coverage(where: str, what: str, n_rows: int, spans: list[Span], report: VerifyReport) -> None:
    """Every stored row of an array belongs to a record of the part (several, when a prefix is shared)."""
    covered = np.zeros(n_rows, dtype=bool)
    for span in spans:
        if span.part is None and span.row + span.n_rows <= n_rows:
            covered[span.row : span.row + span.n_rows] = True
    if n_rows and not covered.all():
        first = int(np.argmin(covered))
        report.problems.append(f"{where}: {what} row {first} is read by no record of the step (lost bytes)")


def _verify_seal(store: StoreRoot, step: int, history: StepHistory, view: StepView, report: VerifyReport) -> None:
    """The seal's copy equals its entry, its list names exactly the commits before it (format 3), later commits are
    noted, and its consolidated objects are intact copies of the commit documents."""
    storage = store.storage
    seals = [e for e in history.log.entries if isinstance(e.doc, SealRecord)]
    if view.seal is None or not isinstance(view.seal.doc, SealRecord):
        if storage.exists(keys.seal_key(step)):
            report.problems.append(f"step {step}: {keys.SEAL} exists, but the step's log holds no seal")
        return
    seal = view.seal.doc
    if len(seals) > 1:
        report.problems.append(f"step {step}: the log holds {len(seals)} seals; readers follow the first")
    names = [e.name for e in history.log.commits()]
    if seal.position is not None:
        key = keys.log_key(step, seal.position)
        try:
            entry = parse_log_document(storage.read(key), storage.url_of(key))
        except (FileNotFoundError, RoutelogError) as exc:
            entry = None
            report.problems.append(f"step {step}: the seal entry {view.seal.name} cannot be read ({exc})")
        marker = read_seal_marker(store, step)
        if entry is not None and marker is not None and marker != entry:
            report.problems.append(f"step {step}: {keys.SEAL} differs from the seal entry {view.seal.name}")
        before = [e.name for e in history.log.commits() if e.position < seal.position]
        if seal.commits != before:
            report.problems.append(f"step {step}: the seal lists {seal.commits[:8]}, the log before it {before[:8]}")
    else:
        missing = sorted(set(seal.commits) - set(names))
        if missing:
            report.problems.append(f"step {step}: the seal lists commits whose documents are missing: {missing}")
    late = [e.name for e in view.refused]
    if late:
        report.notes.append(f"step {step}: commits made after the seal are not part of the step: {late}")
    if seal.consolidated is None:
        return
    if view.archive is not None and not storage.exists(f"{keys.step_dir(step)}/{seal.consolidated.index.key}"):
        report.notes.append(f"step {step}: the seal's consolidated copies were reclaimed after the step's archive")
        return
    info = seal.consolidated.commits
    key = f"{keys.step_dir(step)}/{info.key}"
    report.objects += 2
    data = _read_checked(storage, key, info.size, info.sha256, "the seal", report)
    index = seal.consolidated.index
    _read_checked(storage, f"{keys.step_dir(step)}/{index.key}", index.size, index.sha256, "the seal", report)
    if data is None:
        return
    by_name = {e.name: _commit(e).model_dump(mode="json") for e in history.log.commits()}
    try:
        docs = load_json(data, storage.url_of(key))
    except ValueError as exc:
        report.problems.append(str(exc))
        return
    if not isinstance(docs, list) or len(docs) != len(seal.commits):
        report.problems.append(f"{storage.url_of(key)}: not a list of the {len(seal.commits)} commits the seal names")
        return
    for name, doc in zip(seal.commits, docs, strict=True):
        try:  # compared as documents: a field added by a later revision and left out by an earlier writer is equal
            same = name not in by_name or by_name[name] == CommitRecord.model_validate(doc).model_dump(mode="json")
        except ValueError:
            same = False
        if not same:
            report.problems.append(f"{storage.url_of(key)}: commit {name} differs from its document")


def _verify_records(snapshot: StepSnapshot, report: VerifyReport) -> None:
    """Read every record (and every stream the step's parts hold) as a reader does, and check each routed row is
    a valid top-k set."""
    spec = snapshot.store.model_spec
    ids = snapshot.sample_ids
    streams = sorted({name for commit in snapshot.parts for name in commit.streams})
    for stream in [None, *streams]:
        declared = spec.stream(stream) if stream is not None else None
        if stream is not None and declared is None:
            report.problems.append(f"step {snapshot.step}: parts hold stream {stream!r}, the model spec has none")
            continue
        universe = spec.num_experts if declared is None else declared.universe
        weights = stream is None and any(c.weights is not None for c in snapshot.parts)
        for start in range(0, len(ids), _BATCH):
            try:
                routings = snapshot.read_many(ids[start : start + _BATCH], stream=stream, weights=weights)
            except RoutelogError as exc:
                report.problems.append(f"step {snapshot.step}: {exc}")
                return
            for routing in routings:
                problem = _topk_problem(routing, universe)
                if problem:
                    where = f"step {snapshot.step}, sample {routing.sample_id!r}"
                    report.problems.append(f"{where}{f', stream {stream!r}' if stream else ''}: {problem}")
                    return


def _topk_problem(routing: RecordRouting, num_experts: int) -> str | None:
    rows = routing.by_layer[:, routing.valid].reshape(-1, routing.by_layer.shape[-1])
    ordered = rows if routing.topk_order == "sorted" else np.sort(rows, axis=1)
    bad = ordered[:, -1] >= num_experts
    if rows.shape[1] > 1:
        bad |= (ordered[:, 1:] <= ordered[:, :-1]).any(axis=1)
    if bad.any():
        return f"a routed row decodes to an invalid top-k set {rows[int(np.argmax(bad))].tolist()}"
    return None


def _verify_values(snapshot: StepSnapshot, report: VerifyReport) -> None:
    """Annotation objects match their commits, and every column of every record reads as readers read it."""
    storage = snapshot.store.storage
    try:
        annotations = snapshot.annotations
    except RoutelogError as exc:
        report.problems.append(f"step {snapshot.step}: annotations: {exc}")
        return
    for annotation in annotations:
        report.commits += 1
        report.objects += len(annotation.objects)
        _verify_annotation_objects(storage, snapshot.step, annotation, report)
    columns = snapshot.value_columns()
    ids = snapshot.sample_ids
    try:
        for start in range(0, len(ids) if columns else 0, 1024):
            snapshot.token_values(ids[start : start + 1024], columns)
    except RoutelogError as exc:
        report.problems.append(f"step {snapshot.step}: per-token values: {exc}")


def _verify_annotation_objects(storage: Storage, step: int, annotation: AnnotationCommit, report: VerifyReport) -> None:
    base = f"{keys.annotations_dir(step)}/{annotation.part}"
    present = {key[len(base) + 1 :] for key in storage.find(base)}
    extra = present - {o.key for o in annotation.objects}
    if extra:
        report.problems.append(f"{storage.url_of(base)}: objects its annotation commit does not list: {sorted(extra)}")
    for obj in annotation.objects:
        _read_checked(storage, f"{base}/{obj.key}", obj.size, obj.sha256, f"annotation {annotation.name}", report)


def _read_checked(storage: Storage, key: str, size: int, sha256: str, owner: str, report: VerifyReport) -> bytes | None:
    """The object if it exists with the size and SHA-256 ``owner`` lists; otherwise a problem and None."""
    try:
        return storage.read_verified(key, size, sha256, owner)
    except CorruptDataError as exc:
        report.problems.append(str(exc))
        return None
