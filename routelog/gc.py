"""``routelog gc``: remove what dead writers and sealers left behind, never what is committed.

An object is garbage only when gc can prove nothing references it: no commit record names its part (a writer died
between upload and commit, or its commit lost a conflict), or no seal names its consolidated file (a sealer died or
lost), and it is older than the grace period. Proof needs every document: if any commit, annotation or seal
document of the store fails to parse or names data that is not there, gc reports it and deletes nothing.

The grace period covers a live writer: its part is uncommitted only between its upload and its commit, and a writer
never creates a commit later than :data:`routelog.writer.MAX_COMMIT_DELAY` after its upload started, so a grace of
at least :data:`MIN_GRACE` (which also absorbs clock skew between gc's host and the storage service) cannot collect
a part that is about to be committed. Shorter grace periods need ``force`` (no writer may be running).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import datetime

from routelog import keys
from routelog.drop import write_drop
from routelog.errors import GcRefusedError, RoutelogError
from routelog.format import AnnotationCommit, CommitRecord, load_json, validate_document
from routelog.reader import StepSnapshot, check_commit, dropped_part, read_drops, read_seal
from routelog.root import StoreRoot
from routelog.storage import ObjectStat
from routelog.writer import MAX_COMMIT_DELAY

MIN_GRACE = 3600.0
"""The shortest grace period gc accepts without ``force``: :data:`~routelog.writer.MAX_COMMIT_DELAY` plus
margin for retries and for clock skew between this host and the storage service."""

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
    """``<writer>.<seq>.`` prefixes of commits a seal names whose documents are missing."""
    consolidated: set[str] = field(default_factory=set)
    """Consolidated objects the seal names (relative to the step directory)."""
    commits: dict[str, CommitRecord] = field(default_factory=dict)
    """The step's readable commit documents by key."""


def collect_garbage(
    store: StoreRoot, older_than: float, *, delete: bool = False, now: float | None = None, force: bool = False
) -> GcReport:
    """Find (and with ``delete``, remove) unreferenced part and seal objects older than ``older_than`` seconds.

    Raises :class:`GcRefusedError` for a grace period under :data:`MIN_GRACE` without ``force``, and, when
    ``delete`` is asked, if any document is damaged (:attr:`GcReport.damaged` lists them in a dry run).
    """
    if older_than < MIN_GRACE and not force:
        raise GcRefusedError(
            f"a grace period of {older_than:.0f} s could delete a live writer's part before its commit (writers "
            f"commit up to {MAX_COMMIT_DELAY:.0f} s after uploading); use at least {MIN_GRACE:.0f} s (1h), or pass "
            "force (--force) when no writer is running"
        )
    storage = store.storage
    now = time.time() if now is None else now
    report = GcReport()
    dead: dict[int, list[str]] = {}
    for step in store.steps():
        base = keys.step_dir(step)
        survey = _survey(store, step, report.damaged)
        dropped = _dropped_parts(store, step, survey, report.damaged)
        referenced = _referenced_parts(store, step, report.damaged)
        for part, when in dropped.items():  # reclaimable once no reader can still be reading them
            if now - when.timestamp() >= older_than and referenced is not None and part not in referenced:
                survey.claimed.discard(part)
        dead[step] = _dead_parts(survey, dropped, referenced)
        report.dead_parts += [keys.part_dir(step, p) for p in dead[step]]
        found = {directory: storage.find(directory) for directory in (keys.parts_dir(step), keys.annotations_dir(step))}
        _check_claims(store, survey, found[keys.parts_dir(step)], set(dropped), report.damaged)
        # Candidates by unit of deletion: a whole part directory, or one consolidated seal object.
        candidates: dict[str, list[tuple[str, int, float]]] = {}
        for directory, listing in found.items():
            for key, stat in listing.items():
                rest = key[len(directory) + 1 :]
                if "/" not in rest:  # a commit document itself, not data
                    continue
                part = rest.split("/", 1)[0]
                if part in survey.claimed or any(part.startswith(prefix) for prefix in survey.protected):
                    continue
                candidates.setdefault(f"{directory}/{part}", []).append((key, stat.size, stat.modified))
        for key, stat in storage.find(f"{base}/{keys.SEALED_DIR}").items():
            if key[len(base) + 1 :] not in survey.consolidated:
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
        for tree in report.trees:
            storage.delete_tree(tree)
        report.deleted = True
    if delete:
        for step, parts in dead.items():
            if parts:
                write_drop(store, step, sample_ids=[], parts=parts, writers=[], reason=DEAD_REASON, writer_id=GC_WRITER)
    return report


GC_WRITER = "gc"
DEAD_REASON = "every record dropped or shadowed: reclaimed by gc"


def _dropped_parts(store: StoreRoot, step: int, survey: _StepSurvey, damaged: list[str]) -> dict[str, datetime]:
    """Parts dropped whole, with the time of the earliest drop naming them (by part or by writer)."""
    try:
        drops = read_drops(store, step)
    except RoutelogError as exc:
        damaged.append(str(exc))
        return {}
    when: dict[str, datetime] = {}
    for commit in survey.commits.values():
        for drop in drops:
            if dropped_part(commit, [drop]) and (commit.part not in when or drop.created_at < when[commit.part]):
                when[commit.part] = drop.created_at
    return when


def _referenced_parts(store: StoreRoot, step: int, damaged: list[str]) -> set[str] | None:
    """The step's parts live records read rows from (None when the step cannot be read: nothing is reclaimed)."""
    try:
        return StepSnapshot.load(store, step).referenced_parts()
    except RoutelogError as exc:
        damaged.append(f"step {step}: {exc}")
        return None


def _dead_parts(survey: _StepSurvey, dropped: dict[str, datetime], referenced: set[str] | None) -> list[str]:
    """Committed parts not yet dropped whole from which no live record reads a row (their records dropped by
    sample id or shadowed, and no shared prefix of another record points at them)."""
    if referenced is None:
        return []
    return sorted(c.part for c in survey.commits.values() if c.part not in referenced and c.part not in dropped)


def _survey(store: StoreRoot, step: int, damaged: list[str]) -> _StepSurvey:
    """Parse every commit, annotation and seal document of ``step``; unreadable ones go to ``damaged``."""
    storage = store.storage
    survey = _StepSurvey()
    for directory in (keys.commits_dir(step), keys.annotations_dir(step)):
        for name in storage.list(directory):
            if not name.endswith(".json"):
                continue
            key = f"{directory}/{name}"
            try:
                if keys.parse_commit_name(name) is None:
                    raise GcRefusedError(f"{storage.url_of(key)}: not a commit name")
                raw = load_json(storage.read(key), storage.url_of(key))
                doc: CommitRecord | AnnotationCommit = (
                    validate_document(raw, CommitRecord, storage.url_of(key))
                    if directory == keys.commits_dir(step)
                    else validate_document(raw, AnnotationCommit, storage.url_of(key))
                )
                check_commit(doc, name, step, store.model_spec, storage.url_of(key))
            except (RoutelogError, ValueError) as exc:
                damaged.append(str(exc))
                continue
            survey.claimed.add(doc.part)
            if isinstance(doc, CommitRecord):
                survey.commits[key] = doc
    try:
        seal = read_seal(store, step)
    except RoutelogError as exc:
        damaged.append(str(exc))
        return survey
    if seal is None:
        return survey
    existing = set(storage.list(keys.commits_dir(step)))
    survey.protected.update(name.removesuffix("json") for name in seal.commits if name not in existing)
    if seal.consolidated is not None:
        info = seal.consolidated.commits
        survey.consolidated = {info.key, seal.consolidated.index.key}
        key = f"{keys.step_dir(step)}/{info.key}"
        try:
            docs = load_json(storage.read_verified(key, info.size, info.sha256, "the seal"), storage.url_of(key))
            if not isinstance(docs, list):
                raise GcRefusedError(f"{storage.url_of(key)}: not a list of commit records")
            survey.claimed.update(validate_document(d, CommitRecord, storage.url_of(key)).part for d in docs)
        except (RoutelogError, ValueError) as exc:
            damaged.append(str(exc))
    return survey


def _check_claims(
    store: StoreRoot, survey: _StepSurvey, parts: dict[str, ObjectStat], dropped: set[str], damaged: list[str]
) -> None:
    """Every commit's part holds the objects it lists, at their sizes: a commit whose ``part`` was damaged names a
    directory that is not there, and the real part must not then look unreferenced. (A part dropped whole may be
    gone already.)"""
    for key, commit in survey.commits.items():
        if commit.part in dropped:
            continue
        base = keys.part_dir(commit.step, commit.part)
        wrong = [o.key for o in commit.objects if (stat := parts.get(f"{base}/{o.key}")) is None or stat.size != o.size]
        if wrong:
            url = store.storage.url_of(key)
            damaged.append(f"{url}: its part {commit.part!r} lacks (or has other sizes of) {wrong}")
