"""Capture health (``routelog check``): routing an engine or trainer captured wrong while reporting no error.

Each detector looks for the trace one known class of capture bug leaves in stored routing. It reports the step,
sample, layer and token range of what it finds, with a severity: ``error`` where replaying the routing would force
routes the model never took, ``warning`` where the routing is incomplete or only suspicious. The thresholds are
:class:`Thresholds`; docs/audits.md gives each one's reasoning and the false-positive rates measured on the corpora,
the engine fixtures and synthetic routing (``tools/check_rates.py``).

Like every audit it is a fold over work units (:mod:`routelog.audit.units`), exact in any order and on Ray. Row
sets are compared through 64-bit hashes of their sorted IDs (:func:`set_codes`).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel

from routelog.audit import _steps
from routelog.audit.drift import js_divergence
from routelog.audit.kernels import add_expert_counts
from routelog.audit.runner import Progress, run_units
from routelog.audit.units import (
    DEFAULT_BATCH_RECORDS,
    DEFAULT_UNIT_RECORDS,
    Source,
    WorkUnit,
    batches,
    pack,
    plan_units,
    unpack,
)
from routelog.errors import RoutelogError
from routelog.format.documents import IndexRow
from routelog.format.routing import RecordRouting
from routelog.format.spec import MTP_STREAM, ModelSpec

Detector = Literal[
    "routed_rows",
    "stale_rows",
    "constant_layer",
    "constant_rows",
    "duplicate_layer",
    "layer_offset",
    "eplb_replicas",
    "mtp_collision",
]
DETECTORS: tuple[Detector, ...] = get_args(Detector)
Severity = Literal["error", "warning"]
Ints = npt.NDArray[np.int64]
Codes = npt.NDArray[np.uint64]


class CheckConfigError(RoutelogError, ValueError):
    """A threshold outside its range."""


@dataclass(frozen=True)
class Thresholds:
    """What each detector calls a fault (docs/audits.md: why these values, and what they cost)."""

    stale_min_changes: int = 16
    """Stale rows: one set held while the token changes at least this often (the corpora's longest: 8)."""
    stale_min_rows: int = 32
    """Stale rows, records without token ids: every layer holding its set over this many rows (the corpora's
    longest: 22, over repeated spaces)."""
    stale_alpha: float = 1e-3
    """Stale rows: a layer whose sets repeat often needs a longer run, so that healthy routing expects fewer than
    this many such runs per step and layer (a geometric tail: ``pairs * p ** changes < alpha``)."""
    constant_share: float = 0.9
    """Constant layer: one set in at least this share of a step's routed rows (the corpora's largest: 20 %)."""
    constant_min_rows: int = 64
    """Constant layer, constant rows, duplicate layer, MTP collision: rows a step needs before they are judged."""
    constant_rows_share: float = 0.5
    """Constant rows: rows whose every MoE layer holds one set, in at least this share of a record's rows."""
    constant_rows_min: int = 8
    """Constant rows: ... and at least this many of them."""
    duplicate_share: float = 0.9
    """Duplicate layer: two layers with the same set in at least this share of a step's rows (corpora: 0)."""
    offset_ratio: float = 4.0
    """Layer offset: a layer's load profile closer to the previous step's neighbour layer by this factor (JS
    divergence) than to its own layer's, in at least half of the layers (corpora: the own layer is 45-300x closer)."""
    offset_max_js: float = 0.02
    """Layer offset: ... and at most this far from it (bits; the corpora's layers move 0.0008-0.005 bits between
    steps, steps of independent random routers match by chance far less closely)."""
    offset_min_choices: int = 50
    """Layer offset: choices per expert a step needs on average (fewer: sampling noise decides)."""
    replica_min_load: int = 200
    """EPLB replicas: rows each expert of a pair needs."""
    replica_min_expected: float = 20.0
    """EPLB replicas: co-occurrences expected for the pair if independent (so that none is significant)."""
    replica_max_z: float = 5.0
    """EPLB replicas: the pair's co-chosen experts are homogeneous (G-test z below this; healthy pairs in the
    corpora: 31 and above, injected replicas: below 2)."""
    replica_tokens: int = 65_536
    """EPLB replicas: co-occurrence is counted over a step's first records (in sample order) up to this many tokens,
    whatever the units (a table of ``L E**2`` counts is cheap to merge only a few times)."""
    replica_max_bytes: int = 256 << 20
    """EPLB replicas: largest co-occurrence table (``8 L E**2`` bytes) counted; a model beyond it is not checked."""
    mtp_share: float = 0.9
    """MTP collision: an MTP layer with the same set as a decoder layer in at least this share of rows."""
    max_findings: int = 20
    """Findings listed per step and detector (every one is counted)."""

    def __post_init__(self) -> None:
        shares = ("constant_share", "constant_rows_share", "duplicate_share", "mtp_share")
        problems = [
            f"{name} must be in (0, 1], got {getattr(self, name)}"
            for name in shares
            if not 0 < getattr(self, name) <= 1
        ]
        if self.stale_min_rows < 2:
            problems.append(f"stale_min_rows must be an integer >= 2, got {self.stale_min_rows}")
        if not 0 < self.stale_alpha < 1:
            problems.append(f"stale_alpha must be in (0, 1), got {self.stale_alpha}")
        if not 0 < self.offset_max_js <= 1:
            problems.append(f"offset_max_js must be in (0, 1] bits, got {self.offset_max_js}")
        if not self.offset_ratio > 1:
            problems.append(f"offset_ratio must be above 1, got {self.offset_ratio}")
        if not self.replica_max_z > 0 or not self.replica_min_expected > 0:
            problems.append("replica_max_z and replica_min_expected must be above 0")
        counts: tuple[str, ...] = (
            "stale_min_changes",
            "stale_min_rows",
            "constant_min_rows",
            "constant_rows_min",
            "offset_min_choices",
        )
        counts += ("replica_min_load", "replica_tokens", "replica_max_bytes", "max_findings")
        problems += [
            f"{name} must be an integer >= 1, got {getattr(self, name)}" for name in counts if getattr(self, name) < 1
        ]
        if problems:
            raise CheckConfigError("; ".join(problems))


class Finding(BaseModel):
    """One fault found."""

    step: int
    detector: Detector
    severity: Severity
    message: str
    sample_id: str | None = None
    """The record; None for a finding about the step's records together."""
    layer: int | None = None
    """Global index of the MoE layer; None when every MoE layer (or none in particular) is concerned."""
    tokens: tuple[int, int] | None = None
    """Input positions ``[start, stop)`` of the record."""
    records: int = 1
    """Records the finding stands for (the step's, for a finding about the step)."""


class StepHealth(BaseModel):
    step: int
    records: int
    rows: int
    """Routed token rows checked."""
    errors: int
    warnings: int
    by_detector: dict[str, int]
    """Findings per detector, those left out of the list included."""
    stale_changes: list[int | None]
    """Per MoE layer, the token changes a stale run needs in this step, of records with token ids (None: the layer
    repeats every set)."""
    stale_rows: int | None
    """The rows a whole-row stale run needs in this step, of records without token ids."""
    notes: list[str] = []
    """Detectors that could not run on this step, and why."""


class CheckResult(BaseModel):
    url: str
    steps: list[StepHealth]
    findings: list[Finding]
    """At most ``max_findings`` per step and detector, in step, detector, sample, layer, token order."""
    errors: int
    warnings: int
    left_out: int
    """Findings counted but not listed."""
    thresholds: dict[str, float]

    @property
    def ok(self) -> bool:
        """No error-level finding (``routelog check`` exits 1 otherwise)."""
        return self.errors == 0


def check(
    url: str,
    steps: Sequence[int] | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    use_ray: bool = False,
    progress: Progress | None = None,
    thresholds: Thresholds | None = None,
    unit_records: int = DEFAULT_UNIT_RECORDS,
    batch_records: int = DEFAULT_BATCH_RECORDS,
) -> CheckResult:
    """Capture health of ``steps`` (default: all) of the store at ``url``."""
    th = thresholds or Thresholds()
    source = Source.of(url, storage_options)
    chosen = _steps(source, steps)
    plan = plan_units(source, chosen, unit_records=unit_records)
    spec = source.open().model_spec

    def unit_fn(unit: WorkUnit, batch: int) -> bytes:
        return check_unit(unit, batch, th)

    merged: dict[int, _Partial] = {}
    for data in run_units(plan.units, unit_fn, use_ray=use_ray, batch_records=batch_records, progress=progress):
        part = _Partial.from_bytes(data)
        merged[part.step] = merged[part.step].merge(part) if part.step in merged else part
    found: list[Finding] = []
    steps_health = []
    for step in chosen:
        acc = merged.get(step) or _Partial.empty(step, spec)
        step_findings, health = _judge_step(acc, spec, th)
        found += step_findings
        steps_health.append(health)
    found += _layer_offsets({s: merged[s] for s in sorted(chosen) if s in merged}, spec, th)
    return _result(url, found, steps_health, th)


# -- the per-record pass -----------------------------------------------------------------------------------------
_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


def set_codes(ids: npt.NDArray[np.integer[Any]]) -> Codes:
    """``[..., K]`` sets (IDs ascending) -> ``[...]`` 64-bit FNV-1a hashes of their IDs: equal sets, equal codes
    (different sets collide with probability about 2**-64)."""
    codes = np.full(ids.shape[:-1], _FNV_OFFSET, np.uint64)
    for k in range(ids.shape[-1]):
        codes ^= ids[..., k].astype(np.uint64)
        codes *= _FNV_PRIME  # wraps modulo 2**64, as FNV does
    return codes


@dataclass
class _Partial:
    """What a unit learns of its step; merged by exact integer sums."""

    step: int
    loads: Ints
    """``[L, E]`` choices."""
    repeats: Ints
    """``[L + 1]``: per layer, adjacent routed rows of records with token ids holding one set where the token
    changed; last, adjacent rows of records without token ids holding one set in every layer."""
    pairs: Ints
    """``[2]``: adjacent routed rows where the token changed (records with token ids), adjacent rows (without)."""
    pair_equal: Ints
    """``[L, L]``: rows where layer ``b`` holds the same set as layer ``a``, the first layer holding it."""
    mtp_equal: Ints
    """``[MTP layers, L]``: rows where the MTP layer holds the decoder layer's set."""
    cooc: Ints | None = None
    """``[L, E, E]`` (upper triangle): rows choosing both experts, over the step's first ``replica_tokens``."""
    cooc_load: Ints | None = None
    """``[L, E]`` rows choosing each expert, over the same rows."""
    records: int = 0
    rows: int = 0
    cooc_rows: int = 0
    mtp_rows: int = 0
    modes: list[dict[int, int]] = field(default_factory=list)
    """Per layer: rows of each set that held at least half of a record's rows there."""
    mode_ids: dict[int, list[int]] = field(default_factory=dict)
    stale: list[tuple[str, int, int, int, int, bool, float]] = field(default_factory=list)
    """Runs of one set: (sample, layer position or -1 for whole rows without token ids, start, stop, repeats, experts
    0..K-1, the set's share of the record's other rows)."""
    constant_rows: list[tuple[str, int, int, int, int]] = field(default_factory=list)
    """(sample, rows with one set in every layer, routed rows, first such position, last + 1)."""
    findings: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _pending: list[Ints] = field(default_factory=list, repr=False)

    @classmethod
    def empty(cls, step: int, spec: ModelSpec) -> _Partial:
        layers, experts = spec.num_moe_layers, spec.num_experts
        mtp = _mtp_stream(spec)
        return cls(
            step=step,
            loads=np.zeros((layers, experts), np.int64),
            repeats=np.zeros(layers + 1, np.int64),
            pairs=np.zeros(2, np.int64),
            pair_equal=np.zeros((layers, layers), np.int64),
            mtp_equal=np.zeros((0 if mtp is None else mtp, layers), np.int64),
            modes=[{} for _ in range(layers)],
        )

    def merge(self, other: _Partial) -> _Partial:
        for name in ("loads", "repeats", "pairs", "pair_equal", "mtp_equal"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("records", "rows", "cooc_rows", "mtp_rows"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if other.cooc is not None and other.cooc_load is not None:
            self.cooc = other.cooc if self.cooc is None else self.cooc + other.cooc
            self.cooc_load = other.cooc_load if self.cooc_load is None else self.cooc_load + other.cooc_load
        for mine, theirs in zip(self.modes, other.modes, strict=True):
            for code, count in theirs.items():
                mine[code] = mine.get(code, 0) + count
        self.mode_ids.update(other.mode_ids)
        self.stale += other.stale
        self.constant_rows += other.constant_rows
        self.findings += other.findings
        self.notes += [n for n in other.notes if n not in self.notes]
        return self

    def to_bytes(self) -> bytes:
        self.flush_cooc()
        arrays: dict[str, Any] = {
            "loads": self.loads,
            "repeats": self.repeats,
            "pairs": self.pairs,
            "pair_equal": self.pair_equal,
            "mtp_equal": self.mtp_equal,
        }
        if self.cooc is not None:
            arrays |= {"cooc": self.cooc, "cooc_load": self.cooc_load}
        meta = {
            "step": self.step,
            "counts": [self.records, self.rows, self.cooc_rows, self.mtp_rows],
            "modes": [sorted(m.items()) for m in self.modes],
            "mode_ids": sorted(self.mode_ids.items()),
            "stale": self.stale,
            "constant_rows": self.constant_rows,
            "findings": self.findings,
            "notes": self.notes,
        }
        return pack({**arrays, "meta": np.asarray(json.dumps(meta))})  # no pickle: a unicode array

    @classmethod
    def from_bytes(cls, data: bytes) -> _Partial:
        arrays = unpack(data)
        meta = json.loads(str(arrays.pop("meta")))
        records, rows, cooc_rows, mtp_rows = meta["counts"]
        return cls(
            step=int(meta["step"]),
            loads=arrays["loads"],
            repeats=arrays["repeats"],
            pairs=arrays["pairs"],
            pair_equal=arrays["pair_equal"],
            mtp_equal=arrays["mtp_equal"],
            cooc=arrays.get("cooc"),
            cooc_load=arrays.get("cooc_load"),
            records=records,
            rows=rows,
            cooc_rows=cooc_rows,
            mtp_rows=mtp_rows,
            modes=[{int(c): int(n) for c, n in m} for m in meta["modes"]],
            mode_ids={int(c): list(ids) for c, ids in meta["mode_ids"]},
            stale=[tuple(s) for s in meta["stale"]],
            constant_rows=[tuple(c) for c in meta["constant_rows"]],
            findings=meta["findings"],
            notes=meta["notes"],
        )

    def flush_cooc(self) -> None:
        """Count the buffered pair codes (one ``bincount`` for many records: its table is ``L E**2`` long)."""
        if self._pending and self.cooc is not None:
            self.cooc += np.bincount(np.concatenate(self._pending), minlength=self.cooc.size).reshape(self.cooc.shape)
            self._pending = []


def _mtp_stream(spec: ModelSpec) -> int | None:
    """MTP layers whose routing compares with the decoder's (same experts and top-k), or None."""
    mtp = spec.stream(MTP_STREAM)
    if mtp is None or mtp.universe != spec.num_experts or mtp.topk != spec.topk:
        return None
    return mtp.num_layers


def check_unit(unit: WorkUnit, batch_records: int, th: Thresholds) -> bytes:
    """The partial check of one unit (see :class:`_Partial`)."""
    snapshot = unit.snapshot()
    spec = snapshot.store.model_spec
    acc = _Partial.empty(unit.step, spec)
    layers, experts = spec.num_moe_layers, spec.num_experts
    counted = _cooc_records(unit.source, unit.step, unit.plan, th.replica_tokens)
    if spec.topk > 1 and not counted.isdisjoint(unit.sample_ids):
        if 8 * layers * experts * experts <= th.replica_max_bytes:
            acc.cooc = np.zeros((layers, experts, experts), np.int64)
            acc.cooc_load = np.zeros((layers, experts), np.int64)
        else:
            acc.notes.append(f"eplb_replicas: not checked, {layers} layers x {experts}**2 exceed replica_max_bytes")
    if spec.stream(MTP_STREAM) is not None and _mtp_stream(spec) is None:
        acc.notes.append("mtp_collision: not checked, the mtp stream has other experts or top-k than the decoder")
    with_mtp = acc.mtp_equal.shape[0] > 0
    for (batch,) in batches([snapshot], unit.sample_ids, batch_records=batch_records):
        streams: list[RecordRouting | None] = [None] * len(batch)
        if with_mtp:
            streams = list(snapshot.read_many([r.sample_id for r in batch], stream=MTP_STREAM))
        for routing, stream in zip(batch, streams, strict=True):
            _scan(routing, stream, acc, th, experts, routing.sample_id in counted)
    return acc.to_bytes()


@lru_cache(maxsize=8)
def _cooc_records(source: Source, step: int, plan: str, tokens: int) -> frozenset[str]:
    """The step's first records, in sample order, until ``tokens`` tokens (once per process and step)."""
    snapshot = WorkUnit(source, step, (), plan).snapshot()
    chosen: list[str] = []
    seen = 0
    for sid in snapshot.sample_ids:
        if seen >= tokens:
            break
        chosen.append(sid)
        seen += snapshot.info(sid).n_tokens
    return frozenset(chosen)


def _scan(
    routing: RecordRouting, stream: RecordRouting | None, acc: _Partial, th: Thresholds, experts: int, cooc: bool
) -> None:
    info, valid = routing.info, routing.valid
    positions = np.flatnonzero(valid)
    acc.records += 1
    _routed_rows(info, valid, positions, acc)
    if positions.size == 0:
        return
    acc.rows += positions.size
    add_expert_counts(routing.by_layer, valid, acc.loads)
    ids = routing.by_layer[:, positions, :]
    if routing.topk_order != "sorted":
        ids = np.sort(ids, axis=2)
    codes = set_codes(ids)  # [L, R]
    tokens = None if info.token_ids is None else np.asarray(info.token_ids, np.int64)
    _stale_runs(info.sample_id, codes, ids, positions, tokens, acc, th)
    _modes(codes, ids, acc)
    if codes.shape[0] > 1:
        _layer_pairs(codes, acc)
        same = (codes == codes[:1]).all(axis=0)
        n_same = int(same.sum())
        if n_same >= th.constant_rows_min and n_same >= th.constant_rows_share * positions.size:
            where = positions[same]
            acc.constant_rows.append((info.sample_id, n_same, int(positions.size), int(where[0]), int(where[-1]) + 1))
    if cooc and acc.cooc is not None and acc.cooc_load is not None:
        _cooccurrence(ids, acc, acc.cooc_load, experts)
    if stream is not None:
        both = np.flatnonzero(stream.valid[positions])  # indexes into positions
        if both.size:
            mtp_ids = stream.by_layer[:, positions[both], :]
            mtp_codes = set_codes(mtp_ids if stream.topk_order == "sorted" else np.sort(mtp_ids, axis=2))
            acc.mtp_equal += (mtp_codes[:, None, :] == codes[None, :, both]).sum(axis=2)
            acc.mtp_rows += int(both.size)


def _routed_rows(info: IndexRow, valid: npt.NDArray[np.bool_], positions: Ints, acc: _Partial) -> None:
    """Rows due: every position from the first routed one (or the prompt's end, whichever is first) to the last
    but one (engines compute no route for the final sampled token). A missing prefix inside the prompt is no fault:
    prefix caching and a prompt start leave one."""
    n, prompt = info.n_tokens, info.prompt_len
    if n < 2:
        return
    if positions.size == 0:
        message = (
            f"no routed row for its {n} tokens: the capture returned nothing to replay (an engine's all-zero routes "
            "are stored as missing rows: vLLM #54730)"
        )
        acc.findings.append(_record_finding(acc, info, "error", (0, n), message))
        return
    start = min(int(positions[0]), prompt)
    missing = np.flatnonzero(~valid[start : n - 1]) + start
    if missing.size == 0:
        return
    breaks = np.flatnonzero(np.diff(missing) > 1)
    first_stop = int(missing[breaks[0]]) + 1 if breaks.size else int(missing[-1]) + 1
    message = (
        f"{missing.size} of the {n - 1 - start} rows due (prompt {prompt} + response {info.response_len} tokens, from "
        f"position {start}) are missing, {int((missing >= prompt).sum())} in the response, in {breaks.size + 1} "
        "run(s): replay leaves those tokens to its missing-row policy (an engine's all-zero routes, vLLM #54730, and "
        "an incomplete output's tail end up as missing rows)"
    )
    acc.findings.append(_record_finding(acc, info, "warning", (int(missing[0]), first_stop), message))


def _record_finding(
    acc: _Partial, info: IndexRow, severity: Severity, tokens: tuple[int, int], message: str
) -> dict[str, Any]:
    finding = Finding(
        step=acc.step,
        detector="routed_rows",
        severity=severity,
        sample_id=info.sample_id,
        tokens=tokens,
        message=message,
    )
    return finding.model_dump(mode="json")


def _stale_runs(
    sid: str,
    codes: Codes,
    ids: npt.NDArray[np.integer[Any]],
    positions: Ints,
    tokens: Ints | None,
    acc: _Partial,
    th: Thresholds,
) -> None:
    """Runs of one set over adjacent routed positions. A repeated token (indentation, a run of newlines) may
    route the same way at every position; a stale buffer repeats one route over other tokens. So with token ids a
    run is counted in token changes, per layer; without them only whole rows (every layer repeating at once) are
    counted, in rows. Runs reaching the minimum are kept with their set's share of the record's other rows; the
    step decides with its repeat rates (:func:`_needed`)."""
    if positions.size < 2:
        return
    adjacent = np.diff(positions) == 1
    if tokens is None:
        codes = set_codes(codes.T)[None, :]  # one code per whole row
        change, minimum, layer_of = adjacent, th.stale_min_rows - 1, [-1]  # rows held: repeats + 1
    else:
        change = adjacent & (tokens[positions[1:]] != tokens[positions[:-1]])
        minimum, layer_of = th.stale_min_changes, list(range(codes.shape[0]))
    same = (codes[:, 1:] == codes[:, :-1]) & adjacent
    repeat_change = same & change
    counted = repeat_change.sum(axis=1)
    kind = 1 if tokens is None else 0
    acc.pairs[kind] += int(change.sum())
    if tokens is None:
        acc.repeats[-1] += int(counted[0])
    else:
        acc.repeats[:-1] += counted
    for i in np.flatnonzero(counted >= minimum):
        run = np.concatenate(([0], np.cumsum(~same[i])))  # run index of each routed row
        per_run = np.bincount(run[:-1][repeat_change[i]], minlength=int(run[-1]) + 1)
        for r in np.flatnonzero(per_run >= minimum):
            rows = np.flatnonzero(run == r)
            elsewhere = int((codes[i] == codes[i, rows[0]]).sum()) - rows.size
            share = elsewhere / max(1, codes.shape[1] - rows.size)
            first_layer = max(layer_of[i], 0)
            lowest = bool((ids[first_layer, rows[0]] == np.arange(ids.shape[2])).all())
            start, stop = int(positions[rows[0]]), int(positions[rows[-1]]) + 1
            acc.stale.append((sid, layer_of[i], start, stop, int(per_run[r]), lowest, share))


def _modes(codes: Codes, ids: npt.NDArray[np.integer[Any]], acc: _Partial) -> None:
    """Per layer, the record's most common set, counted where it holds at least half of the record's rows (a set
    holding 90 % of a step's rows holds that in nearly every record; healthy layers rarely reach it)."""
    layers, rows = codes.shape
    ordered = np.sort(codes, axis=1).ravel()
    new = np.ones(ordered.size, bool)
    new[1:] = ordered[1:] != ordered[:-1]
    new[::rows] = True
    starts = np.flatnonzero(new)
    counts = np.diff(np.append(starts, ordered.size))
    layer_of = starts // rows
    best = np.zeros(layers, np.int64)
    np.maximum.at(best, layer_of, counts)
    for i in np.flatnonzero((counts == best[layer_of]) & (2 * counts >= rows)):
        j, code = int(layer_of[i]), int(ordered[starts[i]])
        acc.modes[j][code] = acc.modes[j].get(code, 0) + int(counts[i])
        if code not in acc.mode_ids:
            acc.mode_ids[code] = [int(x) for x in ids[j, int(np.argmax(codes[j] == code))]]


def _layer_pairs(codes: Codes, acc: _Partial) -> None:
    """Count, per pair of layers, the rows where the later layer repeats the set of the first layer holding it."""
    layers, rows = codes.shape
    order = np.argsort(codes, axis=0, kind="stable")  # equal sets keep their layers ascending
    ordered = np.take_along_axis(codes, order, axis=0)
    equal = ordered[1:] == ordered[:-1]
    if not equal.any():
        return
    member = np.vstack([np.zeros((1, rows), bool), equal])
    group_start = np.where(member, 0, np.arange(layers)[:, None])
    np.maximum.accumulate(group_start, axis=0, out=group_start)
    first = np.take_along_axis(order, group_start, axis=0)
    pairs = first[member] * layers + order[member]
    acc.pair_equal += np.bincount(pairs, minlength=layers * layers).reshape(layers, layers)


def _cooccurrence(ids: npt.NDArray[np.integer[Any]], acc: _Partial, load: Ints, experts: int) -> None:
    """Add the rows' expert pairs (pending, counted in batches) and their experts' load to ``acc``."""
    layers, rows, topk = ids.shape
    wide = ids.astype(np.int64)
    upper_a, upper_b = np.triu_indices(topk, 1)
    offsets = (np.arange(layers, dtype=np.int64) * experts * experts)[:, None, None]
    acc._pending.append((wide[:, :, upper_a] * experts + wide[:, :, upper_b] + offsets).ravel())
    load += np.bincount(
        (wide + (np.arange(layers, dtype=np.int64) * experts)[:, None, None]).ravel(), minlength=layers * experts
    ).reshape(layers, experts)
    acc.cooc_rows += rows
    if sum(p.size for p in acc._pending) > 1 << 22:
        acc.flush_cooc()


# -- judging a step ----------------------------------------------------------------------------------------------
def _judge_step(acc: _Partial, spec: ModelSpec, th: Thresholds) -> tuple[list[Finding], StepHealth]:
    """The step's findings (all but the layer offsets, judged across steps) and its health without their counts."""
    layers = list(spec.moe_layers)
    notes = list(acc.notes)
    found = [Finding.model_validate(f) for f in acc.findings]
    constant = _constant_layers(acc, spec, th, found)
    stale, stale_changes, stale_rows = _stale_findings(acc, spec, th, constant)
    found += stale
    chance = _chance_same(acc, spec)
    if acc.rows >= th.constant_min_rows and len(layers) > 1:
        found += _constant_rows(acc, th, chance)
        found += _duplicate_layers(acc, spec, th, chance)
    found += _replicas(acc, spec, th)
    found += _mtp_collisions(acc, spec, th)
    health = StepHealth(
        step=acc.step,
        records=acc.records,
        rows=acc.rows,
        errors=0,  # counted with the layer offsets (_result)
        warnings=0,
        by_detector={},
        stale_changes=stale_changes,
        stale_rows=stale_rows,
        notes=notes,
    )
    return found, health


def _lowest_note(ids: Sequence[int]) -> str:
    if list(ids) == list(range(len(ids))):
        return f" (experts 0..{len(ids) - 1}: what top-k of all-zero router logits picks, an all-zero capture)"
    return ""


def _constant_layers(acc: _Partial, spec: ModelSpec, th: Thresholds, found: list[Finding]) -> set[int]:
    constant: set[int] = set()
    if acc.rows < th.constant_min_rows:
        return constant
    for j, modes in enumerate(acc.modes):
        if not modes:
            continue
        code, count = max(modes.items(), key=lambda item: (item[1], item[0]))
        if count < th.constant_share * acc.rows:
            continue
        constant.add(j)
        ids = acc.mode_ids[code]
        ends = {0: "first", spec.num_moe_layers - 1: "last"}
        offset = (
            f"; the {ends[j]} MoE layer: with a dense-first model, a layer map off by one fills it from a dense "
            "layer (verl #5037)"
            if j in ends and spec.num_moe_layers > 1
            else ""
        )
        found.append(
            Finding(
                step=acc.step,
                detector="constant_layer",
                severity="error",
                layer=spec.moe_layers[j],
                records=acc.records,
                sample_id=None,
                message=f"{count / acc.rows:.1%} of the step's {acc.rows:,} routed rows choose experts {ids}"
                f"{_lowest_note(ids)}: the layer's capture is constant{offset}",
            )
        )
    return constant


def _needed(pairs: int, p: float, minimum: int, alpha: float) -> int | None:
    """The repeats a run needs: ``minimum``, or more where sets repeat often enough (probability ``p``) that the
    step's ``pairs`` would show such a run by chance (a geometric tail: ``pairs * p ** m < alpha``); None when
    every pair repeats."""
    if p >= 1:
        return None
    if p <= 0:
        return minimum
    return max(minimum, math.ceil(math.log(max(pairs, 1) / alpha) / math.log(1 / p)))


def _stale_findings(
    acc: _Partial, spec: ModelSpec, th: Thresholds, constant: set[int]
) -> tuple[list[Finding], list[int | None], int | None]:
    """Stale runs, judged with the step's repeat rate of the run's layer (of whole rows, without token ids) or the
    share of the run's set in the rest of its record, whichever is higher: a set a layer chooses for a third of its
    tokens repeats more often than the average set."""
    tokened, untokened = int(acc.pairs[0]), int(acc.pairs[1])
    rates = [r / tokened if tokened else 0.0 for r in acc.repeats[:-1].tolist()]
    rates.append(int(acc.repeats[-1]) / untokened if untokened else 0.0)

    def needed(layer: int, share: float = 0.0) -> int | None:
        if layer < 0:
            return _needed(untokened, max(rates[-1], share), th.stale_min_rows - 1, th.stale_alpha)
        return _needed(tokened, max(rates[layer], share), th.stale_min_changes, th.stale_alpha)

    by_sample: dict[str, list[tuple[int, int, int, int, bool]]] = {}
    for sid, j, start, stop, changes, lowest, share in acc.stale:
        limit = needed(j, share)
        if limit is not None and changes >= limit and j not in constant:
            by_sample.setdefault(sid, []).append((start, stop, j, changes, lowest))
    out: list[Finding] = []
    for sid, runs in by_sample.items():
        runs.sort()
        clusters: list[list[tuple[int, int, int, int, bool]]] = []
        for run in runs:  # runs that overlap are one stale stretch seen in several layers
            if clusters and run[0] < max(r[1] for r in clusters[-1]):
                clusters[-1].append(run)
            else:
                clusters.append([run])
        for cluster in clusters:
            layers = {r[2] for r in cluster}
            whole = -1 in layers or (len(layers) == spec.num_moe_layers > 1)
            parts: list[tuple[int, int, int | None, int]] = (
                [(min(r[0] for r in cluster), max(r[1] for r in cluster), None, min(r[3] for r in cluster))]
                if whole
                else [(r[0], r[1], r[2], r[3]) for r in cluster]
            )
            known = -1 not in layers
            for first, last, position, repeats in parts:
                where = "every MoE layer repeats its set" if position is None else "one set repeats"
                counted = (
                    f"{repeats} token changes"
                    if known
                    else f"{repeats + 1} rows (no token ids are stored to tell it from a repeated token)"
                )
                out.append(
                    Finding(
                        step=acc.step,
                        detector="stale_rows",
                        severity="error" if known else "warning",
                        sample_id=sid,
                        layer=None if position is None else spec.moe_layers[position],
                        tokens=(first, last),
                        message=f"{where} across {counted}"
                        + (" (experts 0..K-1: an all-zero capture)" if any(r[4] for r in cluster) else "")
                        + ": a stale route (SGLang #36404 repeated one over padded rows)",
                    )
                )
    whole_rows = needed(-1)
    return out, [needed(j) for j in range(spec.num_moe_layers)], None if whole_rows is None else whole_rows + 1


def _chance_same(acc: _Partial, spec: ModelSpec) -> npt.NDArray[np.float64]:
    """``[L, L]`` share of rows two independent layers would route alike by chance: for top-1 routing (where a
    collapsed pair of layers may well agree) the overlap of their loads, for top-k sets negligible."""
    layers = spec.num_moe_layers
    if spec.topk > 1 or acc.rows == 0:
        return np.zeros((layers, layers))
    p = acc.loads / acc.rows
    chance: npt.NDArray[np.float64] = p @ p.T
    return chance


def _constant_rows(acc: _Partial, th: Thresholds, chance: npt.NDArray[np.float64]) -> list[Finding]:
    out = []
    for sid, n_same, n_rows, start, stop in acc.constant_rows:
        if n_same / n_rows >= th.constant_rows_share and chance.max() < 0.5 * n_same / n_rows:
            out.append(
                Finding(
                    step=acc.step,
                    detector="constant_rows",
                    severity="error",
                    sample_id=sid,
                    tokens=(start, stop),
                    message=f"{n_same} of its {n_rows} routed rows hold one set in every MoE layer: one layer's route "
                    "recorded for all (a capture whose layer index does not advance)",
                )
            )
    return out


def _duplicate_layers(acc: _Partial, spec: ModelSpec, th: Thresholds, chance: npt.NDArray[np.float64]) -> list[Finding]:
    out = []
    for b in range(1, spec.num_moe_layers):
        a = int(np.argmax(acc.pair_equal[:b, b]))
        share = acc.pair_equal[a, b] / acc.rows
        if share >= th.duplicate_share and chance[a, b] < 0.5 * share:
            out.append(
                Finding(
                    step=acc.step,
                    detector="duplicate_layer",
                    severity="error",
                    layer=spec.moe_layers[b],
                    records=acc.records,
                    message=f"holds the same sets as layer {spec.moe_layers[a]} in {share:.1%} of the step's "
                    f"{acc.rows:,} routed rows: one layer's routing recorded twice (a layer map off by one, verl "
                    "#5037; an MTP layer numbered like a decoder layer, NeMo-RL #3903)",
                )
            )
    return out


def _homogeneity_z(a: Ints, b: Ints) -> float:
    """G-test that two count vectors come from one distribution, as a Wilson-Hilferty z (about N(0, 1) when
    they do; large when they do not)."""
    keep = (a + b) > 0
    a, b = a[keep].astype(np.float64), b[keep].astype(np.float64)
    df = a.size - 1
    if df < 1 or a.sum() == 0 or b.sum() == 0:
        return math.inf
    total = a + b
    expect_a, expect_b = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        g = 2 * float(
            np.where(a > 0, a * np.log(a / expect_a), 0).sum() + np.where(b > 0, b * np.log(b / expect_b), 0).sum()
        )
    return float(((g / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df)))


def _replicas(acc: _Partial, spec: ModelSpec, th: Thresholds) -> list[Finding]:
    """Physical IDs: the replicas of one logical expert split its tokens, so they are never chosen together and
    are chosen alongside the same other experts. Trained routers have many pairs never chosen together (experts
    of different token kinds), but those keep different company: a homogeneity test tells them apart."""
    if acc.cooc is None or acc.cooc_load is None or acc.cooc_rows == 0:
        return []
    out = []
    rows, topk = acc.cooc_rows, spec.topk
    for j in range(spec.num_moe_layers):
        upper = acc.cooc[j]
        together = upper + upper.T
        load = acc.cooc_load[j]
        expected = np.outer(load, load) / rows * (topk - 1) / topk
        busy = load >= th.replica_min_load
        candidates = np.argwhere(
            np.triu(busy[:, None] & busy[None, :] & (together == 0) & (expected >= th.replica_min_expected), 1)
        )
        pairs = []
        for a, b in candidates.tolist():
            others = np.ones(load.size, bool)
            others[[a, b]] = False
            z = _homogeneity_z(together[a, others], together[b, others])
            if z < th.replica_max_z:
                pairs.append((a, b))
        if pairs:
            shown = ", ".join(f"{a} & {b}" for a, b in pairs[:6]) + (", ..." if len(pairs) > 6 else "")
            high = sorted({b for _, b in pairs})
            out.append(
                Finding(
                    step=acc.step,
                    detector="eplb_replicas",
                    severity="error",
                    layer=spec.moe_layers[j],
                    records=acc.records,
                    message=f"{len(pairs)} pair(s) of experts are never chosen together yet chosen alongside the same "
                    f"others, as the replicas of one expert are ({shown}; over {rows:,} rows): physical expert IDs "
                    f"after EPLB stored as logical (vLLM #33013); IDs {high[0]}..{high[-1]} may be replica slots and "
                    f"the model have fewer than {spec.num_experts} logical experts",
                )
            )
    return out


def _mtp_collisions(acc: _Partial, spec: ModelSpec, th: Thresholds) -> list[Finding]:
    out: list[Finding] = []
    if acc.mtp_rows < th.constant_min_rows:
        return out
    for m in range(acc.mtp_equal.shape[0]):
        j = int(np.argmax(acc.mtp_equal[m]))
        share = acc.mtp_equal[m, j] / acc.mtp_rows
        if share >= th.mtp_share:
            out.append(
                Finding(
                    step=acc.step,
                    detector="mtp_collision",
                    severity="error",
                    layer=spec.moe_layers[j],
                    records=acc.records,
                    message=f"MTP layer {m} routes as decoder layer {spec.moe_layers[j]} in {share:.1%} of "
                    f"{acc.mtp_rows:,} rows: one's routing was captured under the other's layer number (NeMo-RL "
                    "#3903)",
                )
            )
    return out


def _layer_offsets(accs: dict[int, _Partial], spec: ModelSpec, th: Thresholds) -> list[Finding]:
    """Between consecutive steps a layer's load profile moves little, and differs from its neighbours': a step
    whose layers match the previous step's neighbours had its layer axis shifted (or the previous step had)."""
    layers = spec.num_moe_layers
    steps = [s for s, acc in accs.items() if acc.rows * spec.topk >= th.offset_min_choices * spec.num_experts]
    out = []
    for a, b in itertools.pairwise(steps):
        prev, cur = accs[a].loads, accs[b].loads
        js = js_divergence(cur[:, None, :], prev[None, :, :])  # [layer of b, layer of a]
        for shift in (1, -1):
            compared = [j for j in range(layers) if 0 <= j - shift < layers]
            matched = [
                j
                for j in compared
                if js[j, j - shift] <= th.offset_max_js
                and js[j, j - shift] * th.offset_ratio < js[j, j]
                and int(np.argmin(js[j])) == j - shift
            ]
            if compared and len(matched) >= max(1, math.ceil(len(compared) / 2)):
                j = matched[0]
                out.append(
                    Finding(
                        step=b,
                        detector="layer_offset",
                        severity="error",
                        layer=spec.moe_layers[j],
                        records=accs[b].records,
                        message=f"{len(matched)} of {len(compared)} MoE layers have the load profile of step {a}'s "
                        f"layer {'before' if shift > 0 else 'after'} them (layer {spec.moe_layers[j]}: JS "
                        f"{js[j, j - shift]:.2g} bits to step {a}'s layer {spec.moe_layers[j - shift]}, "
                        f"{js[j, j]:.2g} to its own): step {a} or {b} has its MoE layers shifted by one (verl #5037)",
                    )
                )
    return out


def _result(url: str, found: list[Finding], health: list[StepHealth], th: Thresholds) -> CheckResult:
    order = {d: i for i, d in enumerate(DETECTORS)}
    found.sort(
        key=lambda f: (
            f.step,
            order[f.detector],
            f.sample_id or "",
            -1 if f.layer is None else f.layer,
            f.tokens or (0, 0),
        )
    )
    listed: list[Finding] = []
    steps = []
    for entry in health:
        mine = [f for f in found if f.step == entry.step]
        by_detector: dict[str, int] = {}
        for f in mine:
            by_detector[f.detector] = by_detector.get(f.detector, 0) + 1
            if by_detector[f.detector] <= th.max_findings:
                listed.append(f)
        errors = sum(f.severity == "error" for f in mine)
        counts = {"errors": errors, "warnings": len(mine) - errors, "by_detector": by_detector}
        steps.append(entry.model_copy(update=counts))
    errors = sum(s.errors for s in steps)
    warnings = sum(s.warnings for s in steps)
    return CheckResult(
        url=url,
        steps=steps,
        findings=listed,
        errors=errors,
        warnings=warnings,
        left_out=errors + warnings - len(listed),
        thresholds={k: float(v) for k, v in asdict(th).items()},
    )
