"""A small model of the store protocol (``schemas/FORMAT.md`` section 3), written apart from routelog's own code.

The model keeps a step's log as a list of entries and evaluates it by the format's rules: the entries are in log
order (position, then slot: the commits of one commit entry share its position); the content is the commits before
the first seal; a drop removes, among the commits before it, the records it names; of the records
of one sample id no drop removed, the earliest is live; an annotation gives values to the live record of each
sample id it names when that record precedes it with the same tokens; a view as of T evaluates the log up to the
last entry the storage stored by T (by the storage's timestamps, whatever the writers' clocks said).
``tests/test_protocol.py`` drives the real store and this model side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from functools import cache

import numpy as np

from routelog import Record
from routelog.format.values import LOGPROB_INFER
from routelog.synth import synthetic_spec

SPEC = synthetic_spec(layers=3, experts=16, topk=2)
SAMPLES = tuple(f"s{i}" for i in range(4))
"""The sample ids the machine writes, drops and annotates (few, so operations meet on the same ones)."""
VARIANTS = 3
"""Variants of a record per sample id: 0 and 1 have other tokens; 2 has variant 0's tokens routed otherwise (two
engines routing the same tokens differently): the same record for the protocol, which copy is read shows."""
_PROMPT_TOKENS = 18
"""Longer than routelog's shortest shared prefix, so records of one prompt share their prompt's stored rows."""


@dataclass(frozen=True)
class ModelRecord:
    """What a reader must read for a record: sorted IDs (-1 where missing), the routed mask and its values."""

    sample_id: str
    variant: int
    tokens: tuple[int, ...]
    ids: np.ndarray
    valid: np.ndarray
    logprob_infer: np.ndarray

    def train_values(self) -> np.ndarray:
        """The ``logprob_train`` an annotation gives this record."""
        return (self.logprob_infer - 0.25).astype(np.float32)


@cache
def record_of(sample_id: str, variant: int) -> tuple[Record, ModelRecord]:
    """The record written for ``sample_id`` in ``variant``: a shared prompt (one of two, with fixed routing) and a
    response of its own; the final token is never routed, as engines leave it."""
    index = int(sample_id[1:])
    rng = np.random.default_rng(1000 + prompt_of(sample_id))
    prompt_tokens = rng.integers(0, 500, _PROMPT_TOKENS)
    prompt_routes = _routes(rng, _PROMPT_TOKENS)
    own = np.random.default_rng(10_000 + 100 * index + variant % 2)
    length = int(own.integers(3, 8))
    tokens = np.concatenate([prompt_tokens, own.integers(500, 1000, length)])
    response_routes = _routes(own if variant < 2 else np.random.default_rng(20_000 + index), length)
    routes = np.concatenate([prompt_routes, response_routes])
    n = tokens.size
    valid = np.ones(n, bool)
    valid[-1] = False
    infer = np.where(np.arange(n) < _PROMPT_TOKENS, np.nan, -own.random(n)).astype(np.float32)
    record = Record(
        sample_id=sample_id,
        expert_ids=routes,
        prompt_len=_PROMPT_TOKENS,
        response_len=n - _PROMPT_TOKENS,
        valid=valid,
        token_ids=tokens,
        policy_version=1,
        token_values={LOGPROB_INFER: infer},
    )
    ids = np.sort(routes, axis=-1).astype(np.int16)
    ids[~valid] = -1
    return record, ModelRecord(sample_id, variant, tuple(int(t) for t in tokens), ids, valid, infer)


def prompt_of(sample_id: str) -> int:
    """Which of two prompts a sample's records start with: records of one prompt share their first tokens."""
    return int(sample_id[1:]) % 2


def _routes(rng: np.random.Generator, tokens: int) -> np.ndarray:
    keys = rng.random((tokens * SPEC.num_moe_layers, SPEC.num_experts))
    return np.argsort(keys, axis=1)[:, : SPEC.topk].reshape(tokens, SPEC.num_moe_layers, SPEC.topk)


@dataclass
class Entry:
    """One entry of the model's log. ``kind``: commit, drop, seal, annotation or archive (its ``parts`` are the
    archive parts; it changes no record, only where readers find them)."""

    kind: str
    stored_at: float | None = None
    """When the storage stored the real entry's object, by its own clock (read back from the log's listing)."""
    position: int = 0
    """The log position of the real entry (commits of one commit entry share it)."""
    writer_id: str = ""
    part: str = ""
    records: dict[str, ModelRecord] = field(default_factory=dict)
    """A commit's records; an annotation's records (the values it gives are ``train_values``)."""
    sample_ids: frozenset[str] = frozenset()
    parts: frozenset[str] = frozenset()
    writers: frozenset[str] = frozenset()


@dataclass(frozen=True)
class View:
    """A step as the model says a reader reads it."""

    live: dict[str, tuple[int, ModelRecord]]
    """Sample id -> (position of its commit, record)."""
    sealed: bool
    trained: dict[str, np.ndarray]
    """Sample id -> the ``logprob_train`` values an annotation gives its live record."""
    held: set[str]
    """Sample ids of the content's records (live, dropped or shadowed) in parts not dropped whole."""
    parts: dict[str, bool]
    """Parts of the content -> whether they are dropped whole."""
    writers: dict[str, bool]
    """Writers of the content's parts -> whether every one of their parts is dropped whole."""
    whole_dropped: set[str]
    needed_parts: set[str]
    """Parts whose records the view reads (the parts of its live records)."""


@dataclass
class Model:
    entries: list[Entry] = field(default_factory=list)

    def view(self, upto: int | None = None, as_of: datetime | None = None) -> View:
        """The step after its first ``upto`` entries (all by default); as of ``as_of``, the log up to the last
        entry the storage stored by then (every earlier position existed before it was created)."""
        last = max(
            (e.position for e in self.entries if as_of is None or (e.stored_at or 1e300) <= as_of.timestamp()),
            default=-1,
        )
        entries = [(i, e) for i, e in enumerate(self.entries[:upto]) if e.position <= last]
        seal = next((i for i, e in entries if e.kind == "seal"), None)
        content = [(i, e) for i, e in entries if e.kind == "commit" and (seal is None or i < seal)]
        drops = [(i, e) for i, e in entries if e.kind == "drop"]

        def whole(i: int, commit: Entry) -> bool:
            return any(j > i and (commit.part in d.parts or commit.writer_id in d.writers) for j, d in drops)

        def removed(i: int, sid: str) -> bool:
            return any(j > i and sid in d.sample_ids for j, d in drops)

        live: dict[str, tuple[int, ModelRecord]] = {}
        held: set[str] = set()
        for i, commit in content:
            if whole(i, commit):
                continue
            for sid, record in commit.records.items():
                held.add(sid)
                if not removed(i, sid) and sid not in live:
                    live[sid] = (i, record)
        trained: dict[str, np.ndarray] = {}
        for j, annotation in entries:
            if annotation.kind != "annotation":
                continue
            for sid, record in annotation.records.items():
                found = live.get(sid)
                if found is not None and found[0] < j and found[1].tokens == record.tokens:
                    trained[sid] = record.train_values()
        parts = {c.part: whole(i, c) for i, c in content}
        writers: dict[str, bool] = {}
        for i, c in content:
            writers[c.writer_id] = writers.get(c.writer_id, True) and whole(i, c)
        needed = {self.entries[i].part for i, _ in live.values()}
        return View(live, seal is not None, trained, held, parts, writers, {p for p, w in parts.items() if w}, needed)

    def commits(self) -> list[Entry]:
        return [e for e in self.entries if e.kind == "commit"]

    def archive(self, as_of: datetime | None = None) -> Entry | None:
        """The archive entry a view (as of ``as_of``) reads through, if any."""
        last = max(
            (e.position for e in self.entries if as_of is None or (e.stored_at or 1e300) <= as_of.timestamp()),
            default=-1,
        )
        return next((e for e in reversed(self.entries) if e.kind == "archive" and e.position <= last), None)

    @property
    def next_position(self) -> int:
        """The log position the next entry takes."""
        return self.entries[-1].position + 1 if self.entries else 0

    def index_at(self, position: int) -> int:
        """How many model entries precede the log position ``position``."""
        return sum(1 for e in self.entries if e.position < position)
