"""``routelog gc``: remove what dead writers and sealers left behind, never what is committed.

An object is garbage only when no commit record names its part (a writer died between upload and commit, or its
commit lost a conflict) or no seal names its consolidated file (a sealer died or lost), and it is older than the
grace period: a live writer's part is uncommitted only for the seconds between its upload and its commit.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from routelog import layout
from routelog.errors import RoutelogError
from routelog.format import AnnotationCommit, CommitRecord, SealRecord, parse_document
from routelog.seal import SEALED_DIR
from routelog.store import Store

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
    deleted: bool = False

    @property
    def bytes(self) -> int:
        return sum(self.orphans.values())


def _referenced_parts(store: Store, directory: str, model: type[CommitRecord] | type[AnnotationCommit]) -> set[str]:
    """Part names claimed by the commit documents in ``directory``. An unreadable commit still claims every part
    of its writer and sequence number (as a prefix ending in '.'): deleting data because of a damaged commit would
    lose committed records. `routelog verify` reports it."""
    storage = store.storage
    claimed = set()
    for name in storage.list(directory):
        if layout.parse_commit_name(name) is None:
            continue
        key = f"{directory}/{name}"
        try:
            claimed.add(parse_document(storage.read(key), model, storage.url_of(key)).part)
        except RoutelogError:
            claimed.add(name.rsplit(".", 1)[0] + ".")
    return claimed


def collect_garbage(store: Store, older_than: float, *, delete: bool = False, now: float | None = None) -> GcReport:
    """Find (and with ``delete``, remove) unreferenced part and seal objects older than ``older_than`` seconds."""
    storage = store.storage
    now = time.time() if now is None else now
    report = GcReport()
    for step in store.steps():
        referenced = _referenced_parts(store, layout.commits_dir(step), CommitRecord)
        annotated = _referenced_parts(store, layout.annotations_dir(step), AnnotationCommit)
        sealed: set[str] = set()
        seal_key = layout.seal_key(step)
        try:
            seal = parse_document(storage.read(seal_key), SealRecord, storage.url_of(seal_key))
            if seal.consolidated is not None:
                sealed = {seal.consolidated.commits.key, seal.consolidated.index.key}
        except FileNotFoundError:
            pass
        base = layout.step_dir(step)
        # Candidates by unit of deletion: a whole part directory, or one consolidated seal object.
        candidates: dict[str, list[tuple[str, int, float]]] = {}
        for directory, claimed in ((layout.parts_dir(step), referenced), (layout.annotations_dir(step), annotated)):
            for key, stat in storage.find(directory).items():
                rest = key[len(directory) + 1 :]
                if "/" not in rest:  # a commit document itself, not data
                    continue
                part = rest.split("/", 1)[0]
                if part in claimed or any(part.startswith(prefix) for prefix in claimed if prefix.endswith(".")):
                    continue
                candidates.setdefault(f"{directory}/{part}", []).append((key, stat.size, stat.modified))
        for key, stat in storage.find(f"{base}/{SEALED_DIR}").items():
            if key[len(base) + 1 :] not in sealed:
                candidates.setdefault(key, []).append((key, stat.size, stat.modified))
        for unit, objects in candidates.items():
            newest = max(modified for _, _, modified in objects)
            if now - newest < older_than:
                report.kept_young += len(objects)
                continue
            report.orphans.update({key: size for key, size, _ in objects})
            if not unit.startswith(f"{base}/{SEALED_DIR}"):
                report.trees.append(unit)
    if delete and report.orphans:
        storage.delete([k for k in report.orphans if not any(k.startswith(t + "/") for t in report.trees)])
        for tree in report.trees:
            storage.delete_tree(tree)
        report.deleted = True
    return report
