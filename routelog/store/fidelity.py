"""Replay fidelity, measured while training: how often the trainer's own router disagrees with the replayed route.

While routing is replayed, each router still computes its own top-k (:class:`routelog.megatron.MaskedTopk` counts
the rows whose own set differs from the installed one). That is the R3 paper's "router diff" where it matters: in
the trainer, on the trainer's weights. A rank sums its counts over the step and publishes them as one small
:class:`~routelog.format.documents.FidelityRecord`; ``routelog fidelity`` (and ``routelog drift --fidelity``) show them
per layer over training: how far the trainer's routing has drifted from the engine's. A replay of sparse-attention
indexer selections counts the same per DSA layer (the indexer diff: rows whose indexer's own top-k set differs from
the replayed selection), published beside it.

A :class:`FidelityGate` fails closed: it raises :class:`ReplayFidelityError` (or warns) when a layer's router diff
exceeds a threshold, or when a rank was about to install routing recorded for other tokens.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from routelog.errors import ReplayFidelityError, RoutelogError, StaleRoutingError
from routelog.format import keys
from routelog.format.documents import FidelityRecord, parse_document, utc_now
from routelog.store.numbered import create_numbered
from routelog.store.root import StoreRoot


@dataclass
class StepFidelity:
    """One rank's counts for one step, per global layer index."""

    replayed: dict[int, int] = field(default_factory=dict)
    differing: dict[int, int] = field(default_factory=dict)
    fallback: dict[int, int] = field(default_factory=dict)
    samples: int = 0
    token_mismatches: int = 0
    indexer_replayed: dict[int, int] = field(default_factory=dict)
    """Per DSA layer: query rows whose recorded indexer selection was replayed."""
    indexer_differing: dict[int, int] = field(default_factory=dict)
    """Per DSA layer: of those, rows whose indexer's own top-k set differs from the replayed selection."""

    def add(self, layer: int, replayed: int, differing: int, fallback: int = 0) -> None:
        self.replayed[layer] = self.replayed.get(layer, 0) + replayed
        self.differing[layer] = self.differing.get(layer, 0) + differing
        self.fallback[layer] = self.fallback.get(layer, 0) + fallback

    def add_indexer(self, layer: int, replayed: int, differing: int) -> None:
        self.indexer_replayed[layer] = self.indexer_replayed.get(layer, 0) + replayed
        self.indexer_differing[layer] = self.indexer_differing.get(layer, 0) + differing

    def router_diff(self) -> dict[int, float]:
        """Per layer, the fraction of replayed rows whose router would have chosen another set."""
        return _ratios(self.differing, self.replayed)

    def indexer_diff(self) -> dict[int, float]:
        """Per DSA layer, the fraction of replayed rows whose indexer would have selected other keys."""
        return _ratios(self.indexer_differing, self.indexer_replayed)

    def merge(self, other: StepFidelity) -> StepFidelity:
        out = StepFidelity(samples=self.samples + other.samples, token_mismatches=self.token_mismatches)
        out.token_mismatches += other.token_mismatches
        for source in (self, other):
            for layer, rows in source.replayed.items():
                out.add(layer, rows, source.differing.get(layer, 0), source.fallback.get(layer, 0))
            for layer, rows in source.indexer_replayed.items():
                out.add_indexer(layer, rows, source.indexer_differing.get(layer, 0))
        return out

    @classmethod
    def of(cls, record: FidelityRecord) -> StepFidelity:
        out = cls(samples=record.samples, token_mismatches=record.token_mismatches)
        fallback = record.fallback_rows or [0] * len(record.layers)
        for layer, rows, differing, missing in zip(
            record.layers, record.replayed_rows, record.differing_rows, fallback, strict=True
        ):
            out.add(layer, rows, differing, missing)
        for layer, rows, differing in zip(
            record.indexer_layers, record.indexer_replayed_rows, record.indexer_differing_rows, strict=True
        ):
            out.add_indexer(layer, rows, differing)
        return out


def _ratios(differing: Mapping[int, int], replayed: Mapping[int, int]) -> dict[int, float]:
    return {layer: differing[layer] / rows for layer, rows in sorted(replayed.items()) if rows}


def wilson_lower_bound(successes: int, trials: int, z: float) -> float:
    """The lower end of the Wilson score interval of a binomial proportion, ``z`` standard deviations wide: the
    smallest rate the counts are consistent with (0 without trials or successes: exactly, where the formula's
    rounding leaves a few 1e-17 that a gate of 0 would take for a disagreement)."""
    if trials <= 0 or successes <= 0:
        return 0.0
    p = successes / trials
    z2 = z * z
    centre = p + z2 / (2 * trials)
    spread = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials))
    return max(0.0, (centre - spread) / (1 + z2 / trials))


@dataclass(frozen=True)
class FidelityGate:
    """When to stop training: a layer whose router diff is above ``max_router_diff`` beyond doubt (a DSA layer
    whose indexer diff is above ``max_indexer_diff``, when given), or routing recorded for other tokens. ``"warn"``
    reports instead of raising.

    A layer fails when even the lower end of its router diff's Wilson score interval (``z`` standard deviations)
    is above the threshold: a few rows that happen to differ cannot trip the gate, and a disagreement far above it
    trips it on a small step (with ``z = 3``, three rows that all differ are enough for a 20 % gate)."""

    max_router_diff: float | None = 0.5
    z: float = 3.0
    on_exceed: Literal["raise", "warn"] = "raise"
    on_token_mismatch: Literal["raise", "warn"] = "raise"
    max_indexer_diff: float | None = None

    def __post_init__(self) -> None:
        for name, limit in (("max_router_diff", self.max_router_diff), ("max_indexer_diff", self.max_indexer_diff)):
            if limit is not None and not 0.0 <= limit <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {limit}")
        if not 0.0 <= self.z <= 10.0:
            raise ValueError(f"z must lie in [0, 10] standard deviations, got {self.z}")
        if self.on_exceed not in ("raise", "warn") or self.on_token_mismatch not in ("raise", "warn"):
            raise ValueError("on_exceed and on_token_mismatch take 'raise' or 'warn'")

    def exceeded(self, counts: StepFidelity) -> dict[int, float]:
        """Per layer over the gate beyond doubt, its router diff."""
        return self._over(self.max_router_diff, counts.differing, counts.replayed)

    def indexer_exceeded(self, counts: StepFidelity) -> dict[int, float]:
        """Per DSA layer over ``max_indexer_diff`` beyond doubt, its indexer diff."""
        return self._over(self.max_indexer_diff, counts.indexer_differing, counts.indexer_replayed)

    def _over(self, limit: float | None, differing: Mapping[int, int], replayed: Mapping[int, int]) -> dict[int, float]:
        if limit is None:
            return {}
        return {
            layer: diff
            for layer, diff in _ratios(differing, replayed).items()
            if wilson_lower_bound(differing[layer], replayed[layer], self.z) > limit
        }

    def check(self, counts: StepFidelity, where: str) -> None:
        """Raise (or warn) when a layer's router diff (or indexer diff) is above the threshold beyond doubt."""
        over = self.exceeded(counts)
        if over and self.max_router_diff is not None:
            worst = max(over, key=over.__getitem__)
            self._act(
                self.on_exceed,
                f"{where}: the trainer's router disagrees with the replayed routing on {over[worst]:.1%} of layer "
                f"{worst}'s {counts.replayed[worst]} rows (gate: {self.max_router_diff:.1%}; {len(over)} layers "
                "over it). The trainer's "
                "weights or numerics have drifted far from the engine's, or the routing belongs to other tokens: "
                "check the policy version of the rollout, the model spec and the alignment",
            )
        over = self.indexer_exceeded(counts)
        if over and self.max_indexer_diff is not None:
            worst = max(over, key=over.__getitem__)
            self._act(
                self.on_exceed,
                f"{where}: the trainer's sparse-attention indexer disagrees with the replayed selections on "
                f"{over[worst]:.1%} of layer {worst}'s {counts.indexer_replayed[worst]} rows (gate: "
                f"{self.max_indexer_diff:.1%}; {len(over)} layers over it). The trainer's weights or numerics have "
                "drifted far from the engine's, or the selections belong to other tokens: check the policy version "
                "of the rollout, the model spec and the alignment",
            )

    def token_mismatch(self, message: str) -> None:
        self._act(self.on_token_mismatch, message)

    @staticmethod
    def _act(mode: str, message: str) -> None:
        if mode == "raise":
            raise ReplayFidelityError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def write_fidelity(
    store: StoreRoot,
    step: int,
    writer_id: str,
    counts: StepFidelity,
    *,
    trainer_step: int | None = None,
    phase: str | None = None,
) -> FidelityRecord:
    """Publish one rank's counts for ``step`` (the writer's next fidelity document, created exclusively)."""
    layers, indexer_layers = sorted(counts.replayed), sorted(counts.indexer_replayed)
    return create_numbered(
        store.storage,
        keys.fidelity_dir(keys.check_step(step)),
        keys.check_writer_id(writer_id),
        lambda seq: FidelityRecord(
            step=step,
            writer_id=writer_id,
            seq=seq,
            created_at=utc_now(),
            trainer_step=trainer_step,
            phase=phase,
            layers=layers,
            replayed_rows=[counts.replayed[n] for n in layers],
            differing_rows=[counts.differing[n] for n in layers],
            fallback_rows=[counts.fallback.get(n, 0) for n in layers],
            samples=counts.samples,
            token_mismatches=counts.token_mismatches,
            indexer_layers=indexer_layers,
            indexer_replayed_rows=[counts.indexer_replayed[n] for n in indexer_layers],
            indexer_differing_rows=[counts.indexer_differing[n] for n in indexer_layers],
        ),
    )


def read_fidelity(store: StoreRoot, step: int, *, phase: str | None = None) -> list[FidelityRecord]:
    """The step's fidelity documents (of one ``phase`` when given), in name order."""
    storage = store.storage
    directory = keys.fidelity_dir(step)
    names = [n for n in storage.list(directory) if keys.parse_commit_name(n)]
    raw = storage.read_many([f"{directory}/{n}" for n in names]) if names else {}
    records = []
    for name in names:
        key = f"{directory}/{name}"
        record = parse_document(raw[key], FidelityRecord, storage.url_of(key))
        if record.step != step or record.name != name:
            raise RoutelogError(f"{storage.url_of(key)}: the document is {record.name} of step {record.step}")
        if phase is None or record.phase == phase:
            records.append(record)
    return records


def step_fidelity(records: Sequence[FidelityRecord]) -> StepFidelity:
    """All ranks' counts of a step added up. Ranks of different data, CP/SP shards and pipeline stages count
    disjoint rows; tensor-parallel ranks without sequence parallelism count the same rows again, which scales a
    layer's replayed and differing counts alike: the router diff (their ratio) is exact either way."""
    total = StepFidelity()
    for record in records:
        total = total.merge(StepFidelity.of(record))
    return total


def fidelity_over_steps(
    store: StoreRoot, steps: Sequence[int], *, phase: str | None = None
) -> Mapping[int, StepFidelity]:
    """Per step that has fidelity documents, the summed counts."""
    out = {}
    for step in steps:
        records = read_fidelity(store, step, phase=phase)
        if records:
            out[step] = step_fidelity(records)
    return out


__all__ = [
    "FidelityGate",
    "ReplayFidelityError",
    "StaleRoutingError",
    "StepFidelity",
    "fidelity_over_steps",
    "read_fidelity",
    "step_fidelity",
    "wilson_lower_bound",
    "write_fidelity",
]
