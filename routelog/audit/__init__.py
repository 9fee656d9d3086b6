"""Audits of routing after the fact: expert load (``stats``), routing differences (``diff``), training-inference
mismatch from stored log-probs (``mismatch``) and expert-load drift (``drift``).

Each audit is a fold over work units (:mod:`routelog.audit.units`): memory stays bounded by a unit's batch
whatever the store size, and ``use_ray=True`` runs the same units on a Ray cluster with the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from routelog.audit.diff import DiffResult, TokenMismatchError, diff_unit, merge_diffs
from routelog.audit.drift import DriftResult, js_divergence
from routelog.audit.drift import drift as _drift
from routelog.audit.load import StatsResult, StepLoad, layer_stats, load_unit, merge_loads
from routelog.audit.mismatch import MismatchResult, merge_mismatch, mismatch_unit
from routelog.audit.runner import Progress, run_units
from routelog.audit.units import DEFAULT_BATCH_RECORDS, DEFAULT_UNIT_RECORDS, Source, plan_units

__all__ = [
    "DiffResult",
    "DriftResult",
    "MismatchResult",
    "StatsResult",
    "TokenMismatchError",
    "diff",
    "drift",
    "js_divergence",
    "mismatch",
    "stats",
]


class _Run:
    """Options every audit takes."""

    def __init__(
        self,
        storage_options: Mapping[str, Any] | None,
        use_ray: bool,
        progress: Progress | None,
        unit_records: int,
        batch_records: int,
    ) -> None:
        self.storage_options = storage_options
        self.use_ray = use_ray
        self.progress = progress
        self.unit_records = unit_records
        self.batch_records = batch_records

    def source(self, url: str) -> Source:
        return Source.of(url, self.storage_options)

    def steps(self, source: Source, steps: Sequence[int] | None) -> list[int]:
        return sorted(source.open().steps()) if steps is None else list(steps)

    def loads(self, source: Source, steps: Sequence[int]) -> dict[int, StepLoad]:
        units = plan_units(source, steps, unit_records=self.unit_records)
        return merge_loads(self._run(units, load_unit))

    def _run(self, units: Any, fn: Any) -> list[bytes]:
        return run_units(units, fn, use_ray=self.use_ray, batch_records=self.batch_records, progress=self.progress)


def total_records(
    url: str, steps: Sequence[int] | None = None, storage_options: Mapping[str, Any] | None = None
) -> int:
    """Records an audit of these steps visits (for a progress bar's total)."""
    source = Source.of(url, storage_options)
    store = source.open()
    return sum(len(store.step(s)) for s in (store.steps() if steps is None else steps))


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
    run = _Run(storage_options, use_ray, progress, unit_records, batch_records)
    source = run.source(url)
    chosen = run.steps(source, steps)
    loads = run.loads(source, chosen)
    store = source.open()
    spec = store.model_spec
    counts = sum(
        (load.array() for load in loads.values()),
        start=StepLoad(counts=[[0] * spec.num_experts] * spec.num_moe_layers).array(),
    )
    rows = sum(load.rows for load in loads.values())
    stored = sum(store.step(s).stored_bytes for s in chosen)
    return StatsResult(
        url=url,
        steps=chosen,
        records=sum(load.records for load in loads.values()),
        tokens=sum(load.tokens for load in loads.values()),
        rows=rows,
        stored_bytes=stored,
        bytes_per_token_layer=stored / (rows * spec.num_moe_layers) if rows else float("nan"),
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
    run = _Run(storage_options, use_ray, progress, unit_records, batch_records)
    a, b = run.source(url_a), run.source(url_b)
    other_step = step if step_b is None else step_b
    units = plan_units(a, [step], unit_records=unit_records, other=b, other_steps=[other_step])
    partials = run._run(units, diff_unit)
    snap_a, snap_b = a.open().step(step), b.open().step(other_step)
    only_b = sum(1 for sid in snap_b.sample_ids if sid not in snap_a)
    if not partials:  # an empty step A: still report what B has
        from routelog.audit.units import pack

        spec = a.open().model_spec
        partials = [
            pack(
                {
                    "router_hist": [0] * (spec.topk + 1),
                    "token_hist": [0] * (spec.num_moe_layers * spec.topk + 1),
                    "layer_diff": [0] * spec.num_moe_layers,
                    "rows": 0,
                    "seq_means": [],
                    "matched": 0,
                    "only_a": 0,
                }
            )
        ]
    return merge_diffs(
        partials, f"{url_a} step {step}", f"{url_b} step {other_step}", only_b, list(a.open().model_spec.moe_layers)
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
    """Per step, k3 KL and F(t) between the stored ``logprob_infer`` and ``logprob_train`` columns."""
    run = _Run(storage_options, use_ray, progress, unit_records, DEFAULT_BATCH_RECORDS)
    source = run.source(url)
    units = plan_units(source, run.steps(source, steps), unit_records=unit_records)
    return merge_mismatch(run._run(units, mismatch_unit), url)


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
    run = _Run(storage_options, use_ray, progress, unit_records, batch_records)
    source = run.source(url)
    chosen = run.steps(source, steps)
    loads = run.loads(source, chosen)
    other_loads = None
    if other is not None:
        other_source = run.source(other)
        common = [s for s in chosen if s in set(other_source.open().steps())]
        other_loads = run.loads(other_source, common)
    return _drift(url, list(source.open().model_spec.moe_layers), loads, other, other_loads)
