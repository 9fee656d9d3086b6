"""Work units of an audit: slices of a step's records, small enough to bound memory, plain enough to ship to Ray.

An audit is a fold over units: each unit reads its records in batches and returns a partial result (an
accumulator), and partial results merge by exact arithmetic (integer counts, and float partial sums combined with
``math.fsum`` at the end), so the numbers do not depend on how units were spread over processes or machines.
Accumulators cross process boundaries as ``.npz`` bytes loaded with ``allow_pickle=False``: no pickle.
"""

from __future__ import annotations

import io
import json
import secrets
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.format.routing import RecordRouting
from routelog.store.reader import StepSnapshot
from routelog.store.store import Store, open_store

DEFAULT_UNIT_RECORDS = 256
"""Records per work unit (the grain of parallelism)."""
DEFAULT_BATCH_RECORDS = 32
"""Records read at once inside a unit: bounds memory to about this many records' routing."""


@dataclass(frozen=True)
class Source:
    """A store to audit, as something a remote worker can open."""

    url: str
    options: str = "{}"
    """``storage_options`` as JSON."""

    @classmethod
    def of(cls, url: str, storage_options: Mapping[str, Any] | None = None) -> Source:
        return cls(url, json.dumps(dict(storage_options or {}), sort_keys=True))

    def open(self) -> Store:
        return _open(self.url, self.options)


@lru_cache(maxsize=8)
def _open(url: str, options: str) -> Store:
    return open_store(url, storage_options=json.loads(options))


@lru_cache(maxsize=4)
def _snapshot(url: str, options: str, step: int, plan: str) -> StepSnapshot:
    # Keyed by the plan too: one audit reads each step once per process, a later audit sees later commits.
    return _open(url, options).step(step)


@dataclass(frozen=True)
class WorkUnit:
    """Some records of ``step`` of ``source``, named explicitly (commits that appear after planning are in no
    unit, so every unit sees exactly the planned records); ``other``/``other_step`` name what a diff compares
    against."""

    source: Source
    step: int
    sample_ids: tuple[str, ...]
    plan: str
    """Identifies the audit run (snapshots are cached per run in each process)."""
    other: Source | None = None
    other_step: int | None = None

    def snapshot(self) -> StepSnapshot:
        return _snapshot(self.source.url, self.source.options, self.step, self.plan)

    def other_snapshot(self) -> StepSnapshot:
        if self.other is None or self.other_step is None:
            raise ValueError("this unit compares nothing")
        return _snapshot(self.other.url, self.other.options, self.other_step, self.plan)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkUnit:
        raw = json.loads(text)
        other = raw.pop("other")
        return cls(
            source=Source(**raw.pop("source")),
            sample_ids=tuple(raw.pop("sample_ids")),
            other=None if other is None else Source(**other),
            **raw,
        )


@dataclass(frozen=True)
class Plan:
    """The work units of one audit, and the step snapshots they were cut from (loaded once, here)."""

    units: list[WorkUnit]
    snapshots: dict[int, StepSnapshot]
    other_snapshots: dict[int, StepSnapshot]

    @property
    def records(self) -> int:
        return sum(len(u.sample_ids) for u in self.units)


def plan_units(
    source: Source,
    steps: Sequence[int],
    *,
    unit_records: int = DEFAULT_UNIT_RECORDS,
    other: Source | None = None,
    other_steps: Sequence[int] | None = None,
) -> Plan:
    """Units covering every record of ``steps`` (paired with ``other_steps`` of ``other`` for diffs)."""
    plan = secrets.token_hex(8)
    units = []
    snapshots, other_snapshots = {}, {}
    for i, step in enumerate(steps):
        snapshots[step] = _snapshot(source.url, source.options, step, plan)
        ids = snapshots[step].sample_ids
        other_step = None if other is None else (other_steps or steps)[i]
        if other is not None and other_step is not None:
            other_snapshots[other_step] = _snapshot(other.url, other.options, other_step, plan)
        for start in range(0, len(ids), unit_records):
            units.append(WorkUnit(source, step, tuple(ids[start : start + unit_records]), plan, other, other_step))
    return Plan(units, snapshots, other_snapshots)


def batches(
    snapshots: Sequence[StepSnapshot], sample_ids: Sequence[str], *, batch_records: int = DEFAULT_BATCH_RECORDS
) -> Iterator[list[list[RecordRouting]]]:
    """The routing of ``sample_ids`` in each of ``snapshots``, ``batch_records`` records at a time: for each batch,
    one list per snapshot.

    The next batch is read in the background while the caller works on this one, each snapshot's part of it on a
    thread of its own: a read spends most of its time in file reads, zstd and the decoding kernel, which release
    the GIL, so the caller's pass over a batch and the reads of the next overlap, and a diff reads its two steps at
    once (one batch more is held)."""
    starts = range(0, len(sample_ids), batch_records)
    with ThreadPoolExecutor(max(1, len(snapshots)), thread_name_prefix="routelog-audit-read") as pool:

        def read(start: int) -> list[Future[list[RecordRouting]]]:
            ids = sample_ids[start : start + batch_records]
            return [pool.submit(snapshot.read_many, ids) for snapshot in snapshots]

        pending = [read(start) for start in starts[:1]]
        for start in starts[1:]:
            batch = [future.result() for future in pending.pop()]
            pending.append(read(start))
            yield batch
        for last in pending:
            yield [future.result() for future in last]


def pack(arrays: Mapping[str, npt.ArrayLike]) -> bytes:
    sink = io.BytesIO()
    np.savez(sink, **{k: np.asarray(v) for k, v in arrays.items()})  # type: ignore[arg-type]
    return sink.getvalue()


def unpack(data: bytes) -> dict[str, npt.NDArray[Any]]:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}
