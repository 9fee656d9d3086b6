"""``routelog gc``: remove what dead writers and sealers left behind, never what is committed.

An object is garbage only when gc can prove nothing references it: no commit record names its part (a writer died
between upload and commit, or its commit lost a conflict), or no seal names its consolidated file (a sealer died or
lost), and it is older than the grace period. Proof needs every document: if any commit, annotation or seal
document of the store fails to parse or names data that is not there, gc reports it and deletes nothing.

The grace period covers a live writer: its part is uncommitted only between its upload and its commit, and a writer
never creates a commit later than :data:`routelog.store.writer.MAX_COMMIT_DELAY` after its upload started, so a grace of
at least :data:`MIN_GRACE` cannot collect a part that is about to be committed. Every age is measured on the
storage's clock (its objects' and log entries' timestamps, and its time now), never a writer's nor gc's own.
Shorter grace periods need ``force`` (no writer may be running).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import numpy as np

from routelog.errors import GcRefusedError, RoutelogError, UnsafeKeyError
from routelog.format import keys
from routelog.format.arrow import to_numpy
from routelog.format.documents import AnnotationCommit, ArchiveRecord, CommitRecord, DropRecord, SealRecord
from routelog.store.drop import write_drop
from routelog.store.history import COMMIT_COLUMN, StepHistory, dropped_whole
from routelog.store.reader import StepSnapshot
from routelog.store.root import StoreRoot
from routelog.store.steplog import Entry, StepLog
from routelog.store.storage import ObjectStat
from routelog.store.writer import MAX_COMMIT_DELAY

MIN_GRACE = 3600.0
"""The shortest grace period gc accepts without ``force``: :data:`~routelog.store.writer.MAX_COMMIT_DELAY` plus
margin for retries."""

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``6h``, ``2d``, ``1w`` -> seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"duration {text!r}: expected a number with an optional unit s, m, h, d or w (e.g. 6h)")
    return float(match[1]) * _UNITS[match[2]]


@dataclass
class GcReport:
    """What is garbage (and, unless a dry run, was deleted)."""

    orphans: dict[str, int] = field(default_factory=dict)
    """Object key -> size in bytes."""
    trees: list[str] = field(default_factory=list)
    """Orphaned part directories (removed whole)."""
    kept_young: int = 0
    """Unreferenced objects younger than the grace period (possibly a live writer's), left alone."""
    damaged: list[str] = field(default_factory=list)
    """Documents that could not be read or name missing data: while any exists, gc deletes nothing."""
    dead_parts: list[str] = field(default_factory=list)
    """Parts none of whose records is live any more (all dropped, or shadowed by an earlier commit of the same
    sample id). With ``delete`` gc drops them whole (a drop by writer ``gc``); a later gc, once that drop is older
    than the grace period, reclaims their bytes."""
    deleted: bool = False

    @property
    def bytes(self) -> int:
        return sum(self.orphans.values())


@dataclass
class _StepSurvey:
    """What one step references, and what it holds."""

    claimed: set[str] = field(default_factory=set)
    """Part and annotation directories named by a document."""
    protected: set[str] = field(default_factory=set)
    """``<writer>.<seq>.`` prefixes of format-1/2 commits a seal names whose documents are missing."""
    consolidated: set[str] = field(default_factory=set)
    """Consolidated objects the seal names (relative to the step directory)."""
    consolidated_since: float | None = None
    """When an archive made the seal's consolidated objects unneeded (the storage's time of its entry): they go
    with the parts it replaced, once the grace has passed."""
    reclaimable: dict[str, float] = field(default_factory=dict)
    """Parts no reader can ever need again, with the time from which the grace period counts (the storage's time of
    the entry: the earliest drop naming them, or their commit after the seal; never a writer's clock)."""
    dead: list[str] = field(default_factory=list)
    """Parts of the step's content none of whose records is live or read through a shared prefix."""
    present: list[CommitRecord] = field(default_factory=list)
    """Commits whose parts must hold every object they list."""


def collect_garbage(
    store: StoreRoot, older_than: float, *, delete: bool = False, now: float | None = None, force: bool = False
) -> GcReport:
    """Find (and with ``delete``, remove) unreferenced part and seal objects older than ``older_than`` seconds.

    Ages are the storage's: each object's and log entry's time as the storage stored it (S3 ``LastModified``, a
    file's mtime) against the storage's time now, read by creating an object (:meth:`Storage.clock`) when
    deleting, so neither a writer's nor this host's clock decides what is deleted; a dry run, which writes
    nothing, takes this host's clock for now. ``now`` (seconds since the epoch) replaces both, for tests and
    reproducible runs. Raises :class:`GcRefusedError` for a grace period under :data:`MIN_GRACE` without ``force``,
    and, when ``delete`` is asked, if any document is damaged (:attr:`GcReport.damaged` lists them in a dry run).
    """
    if older_than < MIN_GRACE and not force:
        raise GcRefusedError(
            f"a grace period of {older_than:.0f} s could delete a live writer's part before its commit (writers "
            f"commit up to {MAX_COMMIT_DELAY:.0f} s after reading the step); use at least {MIN_GRACE:.0f} s (1h), "
            "or pass force (--force) when no writer is running"
        )
    storage = store.storage
    if now is None:  # what is compared with the storage's times of its objects: its own clock, when deleting
        now = storage.clock() if delete else time.time()
    report = GcReport()
    dead: dict[int, tuple[StepLog, list[str]]] = {}
    for step in store.steps():
        base = keys.step_dir(step)
        survey = _survey(store, step, report.damaged)
        if survey is None:
            continue
        log, found_survey = survey
        for part, since in found_survey.reclaimable.items():  # once no reader can still be reading them
            if now - since >= older_than:
                found_survey.claimed.discard(part)
        if found_survey.consolidated_since is not None and now - found_survey.consolidated_since >= older_than:
            found_survey.consolidated = set()
        dead[step] = (log, found_survey.dead)
        report.dead_parts += [keys.part_dir(step, p) for p in found_survey.dead]
        try:
            found = {d: storage.find(d) for d in (keys.parts_dir(step), keys.annotations_dir(step))}
            sealed_objects = storage.find(f"{base}/{keys.SEALED_DIR}")
        except UnsafeKeyError as exc:
            report.damaged.append(str(exc))
            continue
        _check_claims(store, found_survey, found[keys.parts_dir(step)], report.damaged)
        # Candidates by unit of deletion: a whole part directory, or one consolidated seal object.
        candidates: dict[str, list[tuple[str, int, float]]] = {}
        for directory, listing in found.items():
            for key, stat in listing.items():
                rest = key[len(directory) + 1 :]
                if "/" not in rest:  # a format-1/2 annotation document itself, not data
                    continue
                part = rest.split("/", 1)[0]
                if part in found_survey.claimed or any(part.startswith(p) for p in found_survey.protected):
                    continue
                candidates.setdefault(f"{directory}/{part}", []).append((key, stat.size, stat.modified))
        for key, stat in sealed_objects.items():
            if key[len(base) + 1 :] not in found_survey.consolidated:
                candidates.setdefault(key, []).append((key, stat.size, stat.modified))
        for unit, objects in candidates.items():
            newest = max(modified for _, _, modified in objects)
            if now - newest < older_than:
                report.kept_young += len(objects)
                continue
            report.orphans.update({key: size for key, size, _ in objects})
            if not unit.startswith(f"{base}/{keys.SEALED_DIR}"):
                report.trees.append(unit)
    if delete and report.damaged:
        raise GcRefusedError(
            f"{store.url}: gc deletes nothing while documents are damaged (run routelog verify): "
            + "; ".join(report.damaged[:8])
        )
    if delete and report.orphans:
        storage.delete([k for k in report.orphans if not any(k.startswith(t + "/") for t in report.trees)])
        for tree in report.trees:  # the index first: a part whose index is there is whole (as-of views rely on it)
            index = f"{tree}/{keys.INDEX}"
            if index in report.orphans:
                storage.delete([index])
            storage.delete_tree(tree)
        report.deleted = True
    if delete:
        for log, parts in dead.values():
            if parts:
                write_drop(log, sample_ids=[], parts=parts, writers=[], reason=DEAD_REASON, writer_id=GC_WRITER)
    return report


GC_WRITER = "gc"
DEAD_REASON = "every record dropped or shadowed: reclaimed by gc"


def _survey(store: StoreRoot, step: int, damaged: list[str]) -> tuple[StepLog, _StepSurvey] | None:
    """Read ``step``'s history and what it references; a step that cannot be read goes to ``damaged`` (None)."""
    try:
        history = StepHistory.read(store, step, columns=("sample_id", "token_hash", "n_tokens", "spans"))
        view = history.view()
        snapshot = StepSnapshot.of(history)
        referenced = snapshot.referenced_parts()
    except (RoutelogError, ValueError) as exc:
        damaged.append(f"step {step}: {exc}")
        return None
    survey = _StepSurvey()
    entries = history.log.entries
    for entry in entries:
        if isinstance(entry.doc, (CommitRecord, AnnotationCommit)):
            survey.claimed.add(entry.doc.part)
    drops = [e for e in entries if isinstance(e.doc, DropRecord)]
    for entry in view.whole_dropped:
        commit = _commit(entry)
        if commit.part in referenced:
            continue  # a live record reads through it
        naming = [d for d in drops if d.position > entry.position and dropped_whole(commit, [_drop(d)])]
        survey.reclaimable[commit.part] = min(_stored_at(d) for d in naming)
    for entry in view.refused:
        survey.reclaimable[_commit(entry).part] = _stored_at(entry)
    _survey_archives(entries, view.archive, survey)
    survey.present = list({c.part: c for c in view.sources}.values())
    live = {_commit(view.commits[int(i)]).part for i in np.unique(to_numpy(view.index.column(COMMIT_COLUMN)))}
    survey.dead = sorted(
        _commit(e).part for e in view.commits if _commit(e).part not in live and _commit(e).part not in referenced
    )
    seal = view.seal.doc if view.seal is not None else None
    if isinstance(seal, SealRecord):
        if seal.position is None:  # format 1-2: the seal's list protects parts whose commit documents are missing
            existing = {e.name for e in history.log.commits()}
            survey.protected.update(n.removesuffix("json") for n in seal.commits if n not in existing)
        if seal.consolidated is not None:
            survey.consolidated = {seal.consolidated.commits.key, seal.consolidated.index.key}
            if view.archive is not None:
                survey.consolidated_since = _stored_at(view.archive)
    return history.log, survey


def _survey_archives(entries: list[Entry], latest: Entry | None, survey: _StepSurvey) -> None:
    """Archive parts are claimed by their entry; once a later archive supersedes them, and the original parts of
    the commits an archive replaced, are reclaimable from the time the storage stored the (later) archive entry:
    as-of views before it read them until its grace has passed."""
    archives = [e for e in entries if isinstance(e.doc, ArchiveRecord)]
    for i, entry in enumerate(archives):
        archive = _archive(entry)
        for archived in archive.parts:
            survey.claimed.add(archived.commit.part)
            if entry is not latest:
                survey.reclaimable[archived.commit.part] = _stored_at(archives[i + 1])
    if latest is None:
        return
    replaced = {name for p in _archive(latest).parts for name in p.replaces}
    for entry in entries:
        if isinstance(entry.doc, CommitRecord) and entry.name in replaced:
            since = survey.reclaimable.get(entry.doc.part, 0.0)
            survey.reclaimable[entry.doc.part] = max(since, _stored_at(latest))


def _archive(entry: Entry) -> ArchiveRecord:
    if not isinstance(entry.doc, ArchiveRecord):  # pragma: no cover - callers pass archive entries
        raise TypeError(entry.key)
    return entry.doc


def _stored_at(entry: Entry) -> float:
    """When the storage stored ``entry`` (format-1/2 documents, which have no log object listed with its time:
    their writer's ``created_at``)."""
    if entry.stored_at is not None:
        return entry.stored_at
    doc = entry.doc
    return (doc.sealed_at if isinstance(doc, SealRecord) else doc.created_at).timestamp()


def _commit(entry: Entry) -> CommitRecord:
    if not isinstance(entry.doc, CommitRecord):  # pragma: no cover - views list commit entries only
        raise TypeError(entry.key)
    return entry.doc


def _drop(entry: Entry) -> DropRecord:
    if not isinstance(entry.doc, DropRecord):  # pragma: no cover - callers pass drop entries
        raise TypeError(entry.key)
    return entry.doc


def _check_claims(store: StoreRoot, survey: _StepSurvey, parts: dict[str, ObjectStat], damaged: list[str]) -> None:
    """Every live commit's part holds the objects it lists, at their sizes: a commit whose ``part`` was damaged
    names a directory that is not there, and the real part must not then look unreferenced."""
    for commit in survey.present:
        base = keys.part_dir(commit.step, commit.part)
        wrong = [o.key for o in commit.objects if (stat := parts.get(f"{base}/{o.key}")) is None or stat.size != o.size]
        if wrong:
            damaged.append(
                f"commit {commit.name} of step {commit.step}: its part {commit.part!r} lacks (or has other "
                f"sizes of) {wrong}"
            )
