"""Running an audit's work units here, one after another, or spread over a Ray cluster with Ray Data.

Both paths run the same unit function on the same units and merge the same partial results exactly, so they give
the same numbers. Partial results travel as ``.npz`` bytes (no pickle in the data path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from routelog.audit.units import DEFAULT_BATCH_RECORDS, WorkUnit

UnitFunction = Callable[[WorkUnit, int], bytes]
Progress = Callable[[int, int], None]
"""Called after each unit with (records done, records in all units)."""


def run_units(
    units: Sequence[WorkUnit],
    fn: UnitFunction,
    *,
    use_ray: bool = False,
    batch_records: int = DEFAULT_BATCH_RECORDS,
    progress: Progress | None = None,
) -> list[bytes]:
    """The partial result of every unit (in no particular order when on Ray)."""
    total = sum(len(u.sample_ids) for u in units)
    done = 0

    def finished(records: int) -> None:
        nonlocal done
        done += records
        if progress is not None:
            progress(done, total)

    if use_ray:
        return _run_on_ray(units, fn, batch_records, finished)
    out = []
    for unit in units:
        out.append(fn(unit, batch_records))
        finished(len(unit.sample_ids))
    return out


def _run_on_ray(
    units: Sequence[WorkUnit], fn: UnitFunction, batch_records: int, finished: Callable[[int], None]
) -> list[bytes]:
    from routelog.ray_session import ray_session

    ray = ray_session()
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the caller's progress callback reports
    if not units:
        return []

    def apply(row: dict[str, Any]) -> dict[str, Any]:
        unit = WorkUnit.from_json(row["unit"])
        return {"result": fn(unit, batch_records), "records": len(unit.sample_ids)}

    dataset = ray.data.from_items([{"unit": u.to_json()} for u in units], override_num_blocks=len(units))
    out = []
    for row in dataset.map(apply).iter_rows():
        out.append(bytes(row["result"]))
        finished(int(row["records"]))
    return out
