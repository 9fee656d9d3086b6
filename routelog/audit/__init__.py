"""Audits of routing after the fact: expert load (``stats``), routing differences (``diff``), training-inference
mismatch from stored log-probs (``mismatch``) and expert-load drift (``drift``).

Each audit is a fold over work units (:mod:`routelog.audit.units`): memory stays bounded by a unit's batch
whatever the store size, and ``use_ray=True`` runs the same units on a Ray cluster with the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from routelog.audit.diff import DiffResult, TokenMismatchError, diff_unit, merge_diffs
from routelog.audit.drift import DriftResult, js_divergence
from routelog.audit.drift import drift as _drift
from routelog.audit.load import StatsResult, StepLoad, layer_stats, load_unit, merge_loads
from routelog.audit.mismatch import MismatchResult, merge_mismatch, mismatch_unit, router_diffs
from routelog.audit.runner import Progress, run_units
from routelog.audit.units import DEFAULT_BATCH_RECORDS, DEFAULT_UNIT_RECORDS, Plan, Source, plan_units
from routelog.errors import RecordNotFoundError
from routelog.store.summary import bytes_per_token_layer

__all__ = [
    "DiffResult",
    "DriftResult",
    "MismatchResult",
    "Progress",
    "StatsResult",
    "TokenMismatchError",
    "diff",
    "drift",
    "js_divergence",
    "mismatch",
    "stats",
]


def _steps(source: Source, steps: Sequence[int] | None) -> list[int]:
    """The steps asked for, refusing ones the store does not hold (and a store with none)."""
    held = sorted(source.open().steps())
    if not held:
        raise RecordNotFoundError(f"{source.url} holds no records yet: nothing to audit")
    if steps is None:
        return held
    missing = sorted(set(steps) - set(held))
    if missing:
        raise RecordNotFoundError(f"{source.url} has no step {', '.join(map(str, missing))}; its steps are {held}")
    return list(dict.fromkeys(steps))


def _loads(plan: Plan, use_ray: bool, progress: Progress | None, batch_records: int) -> dict[int, StepLoad]:
    return merge_loads(
        run_units(plan.units, load_unit, use_ray=use_ray, batch_records=batch_records, progress=progress)
    )


def stats(
    url: str,
    steps: Sequence[int] | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    use_ray: bool = False,
    progress: Progress | None = None,
    unit_records: int = DEFAULT_UNIT_RECORDS,
    batch_records: int = DEFAULT_BATCH_RECORDS,
) -> StatsResult:
    """Expert load, imbalance and routing entropy per MoE layer over ``steps`` (default: all)."""
    source = Source.of(url, storage_options)
    plan = plan_units(source, _steps(source, steps), unit_records=unit_records)
    loads = _loads(plan, use_ray, progress, batch_records)
    spec = source.open().model_spec
    counts = np.zeros((spec.num_moe_layers, spec.num_experts), np.int64)
    for load in loads.values():
        counts += load.array()
    rows = sum(load.rows for load in loads.values())
    snapshots = list(plan.snapshots.values())
    return StatsResult(
        url=url,
        steps=list(plan.snapshots),
        records=sum(load.records for load in loads.values()),
        tokens=sum(load.tokens for load in loads.values()),
        rows=rows,
        stored_bytes=sum(snapshot.stored_bytes for snapshot in snapshots),
        bytes_per_token_layer=bytes_per_token_layer(snapshots, spec.num_moe_layers) or 0.0,
        num_experts=spec.num_experts,
        topk=spec.topk,
        layers=[layer_stats(layer, counts[j]) for j, layer in enumerate(spec.moe_layers)],
    )


def diff(
    url_a: str,
    url_b: str,
    step: int,
    *,
    step_b: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    use_ray: bool = False,
    progress: Progress | None = None,
    unit_records: int = DEFAULT_UNIT_RECORDS,
    batch_records: int = DEFAULT_BATCH_RECORDS,
) -> DiffResult:
    """Routing differences of the records of ``step`` of ``url_a`` and ``step_b`` (default ``step``) of
    ``url_b`` (which may be the same store), matched by sample id."""
    a, b = Source.of(url_a, storage_options), Source.of(url_b, storage_options)
    other_step = step if step_b is None else step_b
    _steps(a, [step]), _steps(b, [other_step])
    plan = plan_units(a, [step], unit_records=unit_records, other=b, other_steps=[other_step])
    partials = run_units(plan.units, diff_unit, use_ray=use_ray, batch_records=batch_records, progress=progress)
    snap_a, snap_b = plan.snapshots[step], plan.other_snapshots[other_step]
    only_b = sum(1 for sid in snap_b.sample_ids if sid not in snap_a)
    spec = snap_a.store.model_spec
    return merge_diffs(
        partials, f"{url_a} step {step}", f"{url_b} step {other_step}", only_b, list(spec.moe_layers), spec.topk
    )


def mismatch(
    url: str,
    steps: Sequence[int] | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    use_ray: bool = False,
    progress: Progress | None = None,
    unit_records: int = DEFAULT_UNIT_RECORDS,
) -> MismatchResult:
    """Per step, k3 KL and F(t) between the stored ``logprob_infer`` and ``logprob_train`` columns, and the router
    diff training ranks published (:mod:`routelog.store.fidelity`)."""
    source = Source.of(url, storage_options)
    chosen = _steps(source, steps)
    plan = plan_units(source, chosen, unit_records=unit_records)
    partials = run_units(plan.units, mismatch_unit, use_ray=use_ray, progress=progress)
    return merge_mismatch(partials, url, router_diffs(source.open(), chosen))


def drift(
    url: str,
    other: str | None = None,
    steps: Sequence[int] | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    use_ray: bool = False,
    progress: Progress | None = None,
    unit_records: int = DEFAULT_UNIT_RECORDS,
    batch_records: int = DEFAULT_BATCH_RECORDS,
) -> DriftResult:
    """Jensen-Shannon divergence of each layer's expert load between consecutive steps, and with ``other``
    between the same steps of two runs."""
    source = Source.of(url, storage_options)
    chosen = _steps(source, steps)
    loads = _loads(plan_units(source, chosen, unit_records=unit_records), use_ray, progress, batch_records)
    other_loads = None
    if other is not None:
        other_source = Source.of(other, storage_options)
        common = [s for s in chosen if s in set(other_source.open().steps())]
        other_plan = plan_units(other_source, common, unit_records=unit_records)
        other_loads = _loads(other_plan, use_ray, progress, batch_records)
    return _drift(url, list(source.open().model_spec.moe_layers), loads, other, other_loads)
