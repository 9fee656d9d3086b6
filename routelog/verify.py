"""``routelog verify``: re-check a whole store against its own commit records and the format's rules."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from routelog import layout
from routelog.errors import RoutelogError
from routelog.format import CommitRecord, IndexRow, ObjectInfo, SealRecord, parse_document
from routelog.part import BlockRequest, fetch_blocks, index_from_parquet
from routelog.reader import StepSnapshot
from routelog.storage import Storage
from routelog.store import Store
from routelog.values import values_from_parquet


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


def verify_store(store: Store, *, progress: Callable[[str], None] | None = None) -> VerifyReport:
    """Check every step: commit schemas, object sizes and SHA-256s, indexes, spans and every routing row."""
    report = VerifyReport()
    for step in store.steps():
        report.steps += 1
        if progress:
            progress(f"step {step}")
        _verify_step(store, step, report)
    return report


def _verify_step(store: Store, step: int, report: VerifyReport) -> None:
    storage = store.storage
    names = [n for n in storage.list(layout.commits_dir(step)) if layout.parse_commit_name(n)]
    commits: list[CommitRecord] = []
    for name in names:
        key = layout.commit_key(step, name)
        try:
            commits.append(parse_document(storage.read(key), CommitRecord, storage.url_of(key)))
        except RoutelogError as exc:
            report.problems.append(str(exc))
    report.commits += len(commits)
    _verify_seal(store, step, names, report)
    seen: dict[str, str] = {}
    for commit in commits:
        _verify_commit(store, step, commit, seen, report)
    committed = {c.part for c in commits}
    for part in storage.list(layout.parts_dir(step)):
        if part not in committed:
            report.notes.append(
                f"step {step}: part {part!r} has no commit (a writer died before committing); "
                "`routelog gc` removes such orphans"
            )
    try:
        snapshot = StepSnapshot.load(store, step)
    except RoutelogError as exc:
        report.problems.append(f"step {step}: the snapshot cannot be read: {exc}")
        return
    try:
        _verify_values(snapshot, report)
    except RoutelogError as exc:
        report.problems.append(f"step {step}: per-token values: {exc}")


def _verify_values(snapshot: StepSnapshot, report: VerifyReport) -> None:
    """Annotation objects match their commits, name committed records only, and every column of every record
    is given once with one value per token."""
    storage = snapshot.store.storage
    for annotation in snapshot.annotations:
        report.commits += 1
        base = f"{layout.annotations_dir(snapshot.step)}/{annotation.part}"
        for obj in annotation.objects:
            report.objects += 1
            key = f"{base}/{obj.key}"
            data = _read_checked(storage, key, obj, "the annotation commit", report)
            if data is None:
                continue
            # Only the sample ids here: the columns are decoded once, below, through the snapshot.
            strangers = sorted(set(values_from_parquet(data, [], storage.url_of(key))) - set(snapshot.sample_ids))
            if strangers:
                report.problems.append(f"{storage.url_of(key)}: annotates samples not committed: {strangers[:8]}")
    columns = snapshot.value_columns()
    ids = snapshot.sample_ids
    for start in range(0, len(ids) if columns else 0, 1024):
        snapshot.token_values(ids[start : start + 1024], columns)


def _verify_seal(store: Store, step: int, names: list[str], report: VerifyReport) -> None:
    storage = store.storage
    key = layout.seal_key(step)
    try:
        seal = parse_document(storage.read(key), SealRecord, storage.url_of(key))
    except FileNotFoundError:
        return
    except RoutelogError as exc:
        report.problems.append(str(exc))
        return
    if seal.consolidated is not None:
        for info in (seal.consolidated.commits, seal.consolidated.index):
            _read_checked(storage, f"{layout.step_dir(step)}/{info.key}", info, "the seal", report)
    missing = sorted(set(seal.commits) - set(names))
    if missing:
        report.problems.append(f"step {step}: the seal lists commits that do not exist: {missing}")
    late = sorted(set(names) - set(seal.commits))
    if late:
        report.notes.append(f"step {step}: commits made after the seal are not part of the step: {late}")


def _verify_commit(store: Store, step: int, commit: CommitRecord, seen: dict[str, str], report: VerifyReport) -> None:
    storage = store.storage
    spec = store.model_spec
    base = layout.part_dir(step, commit.part)
    where = storage.url_of(base)
    info = commit.routing
    if (info.num_moe_layers, info.topk, info.num_experts) != (spec.num_moe_layers, spec.topk, spec.num_experts):
        report.problems.append(
            f"{where}: routing shape (L={info.num_moe_layers}, K={info.topk}, "
            f"E={info.num_experts}) differs from the run's model spec"
        )
        return
    blobs: dict[str, bytes] = {}
    for obj in commit.objects:
        report.objects += 1
        data = _read_checked(storage, f"{base}/{obj.key}", obj, "the commit", report)
        if data is not None:
            blobs[obj.key] = data
    if layout.INDEX not in blobs:
        return
    rows = [IndexRow.model_validate(r) for r in index_from_parquet(blobs[layout.INDEX]).to_pylist()]
    report.records += len(rows)
    if len(rows) != commit.n_records:
        report.problems.append(f"{where}: index has {len(rows)} records, the commit says {commit.n_records}")
    for row in rows:
        if row.sample_id in seen:
            report.problems.append(
                f"step {step}: sample {row.sample_id!r} is committed twice "
                f"(parts {seen[row.sample_id]!r} and {commit.part!r})"
            )
        seen[row.sample_id] = commit.part
        covered = sum(s.n_rows for s in row.spans)
        if row.n_tokens != row.prompt_len + row.response_len or covered > row.n_tokens:
            report.problems.append(f"{where}: sample {row.sample_id!r} has inconsistent lengths")
        for span in row.spans:
            if span.part is None and span.row + span.n_rows > info.n_rows:
                report.problems.append(
                    f"{where}: sample {row.sample_id!r} span rows [{span.row}, "
                    f"{span.row + span.n_rows}) exceed the part's {info.n_rows} rows"
                )
            if span.token_start + span.n_rows > row.n_tokens:
                report.problems.append(f"{where}: sample {row.sample_id!r} span covers tokens past its length")
    _verify_routing(store, step, commit, report)


def _verify_routing(store: Store, step: int, commit: CommitRecord, report: VerifyReport) -> None:
    """Decode every row (crc32c per chunk is checked by zarr) and check it is a valid top-k set."""
    info = commit.routing
    if info.n_rows == 0:
        return
    part_key = layout.part_dir(step, commit.part)
    where = store.storage.url_of(part_key)
    for start in range(0, info.n_rows, 1 << 16):
        stop = min(start + (1 << 16), info.n_rows)
        request = BlockRequest(part_key, commit, (0, info.num_moe_layers), (start, stop))
        try:
            (block,) = fetch_blocks(store.storage, [request])
        except RoutelogError as exc:
            report.problems.append(str(exc))
            return
        ids = block.reshape(-1, info.topk)
        ordered = ids if info.topk_order == "sorted" else np.sort(ids, axis=1)
        bad = ordered[:, -1] >= info.num_experts
        if info.topk > 1:
            bad |= (ordered[:, 1:] <= ordered[:, :-1]).any(axis=1)
        if bad.any():  # rows are layer-major: [layers, stop - start]
            row = start + int(np.argmax(bad)) % (stop - start)
            report.problems.append(
                f"{where}: routing row {row} decodes to an invalid top-k set {ids[int(np.argmax(bad))].tolist()}"
            )
            return


def _read_checked(storage: Storage, key: str, info: ObjectInfo, owner: str, report: VerifyReport) -> bytes | None:
    """The object if it exists with the size and SHA-256 ``owner`` lists; otherwise a problem and None."""
    try:
        data = storage.read(key)
    except FileNotFoundError:
        report.problems.append(f"{storage.url_of(key)}: missing ({owner} lists it)")
        return None
    if len(data) != info.size or hashlib.sha256(data).hexdigest() != info.sha256:
        report.problems.append(f"{storage.url_of(key)}: size or SHA-256 differs from {owner} (corrupted)")
        return None
    return data
