"""Loading one rank's replay tensors: only its micro-batches' records, only its pipeline stage's layers.

Memory stays O(micro-batches in flight): micro-batch ``m + 1 .. m + prefetch`` are read and aligned in a
background thread while the trainer runs micro-batch ``m``; nothing else of the step is held (peers broadcast
the whole step's payload to every rank and ran hosts out of memory: slime #2384, xtuner #2025).

fsspec and zarr are not fork-safe, so the loader opens its store lazily in the process that iterates it; with a
torch ``DataLoader`` use ``multiprocessing_context="spawn"`` (or ``"forkserver"``) and :class:`ReplayDataset`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

import numpy as np

from routelog.align.plan import AlignmentPlan, MicroBatchReplay, gather
from routelog.align.positions import PAD
from routelog.errors import ModelSpecError
from routelog.store.reader import StepSnapshot
from routelog.store.store import Store, open_store


class ReplayLoader:
    """Iterates one rank's :class:`~routelog.align.plan.MicroBatchReplay` in micro-batch order, prefetching."""

    def __init__(
        self,
        store: Store | str,
        step: int,
        plan: AlignmentPlan,
        *,
        prefetch: int = 2,
        storage_options: Mapping[str, Any] | None = None,
        snapshot: StepSnapshot | None = None,
    ) -> None:
        """``snapshot``: the step already loaded (a caller building a loader per micro-batch reads the step's
        commits and index once)."""
        self._store = store
        self._storage_options = storage_options
        self.step = step
        self.plan = plan
        self.prefetch = max(0, prefetch)
        self._given = snapshot
        self._snapshot: StepSnapshot | None = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def snapshot(self) -> StepSnapshot:
        if self._snapshot is None:
            store = (
                self._store
                if isinstance(self._store, Store)
                else open_store(self._store, storage_options=self._storage_options)
            )
            spec, stored = self.plan.spec, store.model_spec
            # The plan's spec may override the store's layer map, but must describe the same stored axis.
            if (spec.num_moe_layers, spec.num_experts, spec.topk) != (
                stored.num_moe_layers,
                stored.num_experts,
                stored.topk,
            ):
                raise ModelSpecError(
                    f"the plan's model spec ({spec.num_moe_layers} MoE layers, E={spec.num_experts}, K={spec.topk}) "
                    f"does not describe the routing in {store.url} ({stored.num_moe_layers} MoE layers, "
                    f"E={stored.num_experts}, K={stored.topk})"
                )
            self._snapshot = self._given or store.step(self.step)
            self.plan = self.plan.with_lengths(
                {sid: self._snapshot.info(sid).n_tokens for sid in self.plan.sample_ids}
                if self.plan.packing.kind == "nemo" and self.plan.layout.pp > 1
                else {}
            )
        return self._snapshot

    def __len__(self) -> int:
        return len(self.plan.micro_batches)

    def load(self, m: int) -> MicroBatchReplay:
        """Read micro-batch ``m``'s records (this stage's layers only) and align them."""
        batch = self.plan.micro_batches[m]
        snapshot = self.snapshot
        lengths = [snapshot.info(sid).n_tokens for sid in batch.sample_ids]
        # Only the tokens this rank holds (a CP/SP rank holds a fraction of each sequence): only their chunks are
        # fetched.
        positions = self.plan.positions(m, lengths)
        real = positions[positions[:, 0] != PAD]
        needed = {sid: np.zeros(n, dtype=bool) for sid, n in zip(batch.sample_ids, lengths, strict=True)}
        first = self.plan.first_index(m)
        for j, sid in enumerate(batch.sample_ids):
            needed[sid][real[real[:, 0] - first == j, 1]] = True
        routings = snapshot.read_many(batch.sample_ids, moe_layers=self.plan.moe_layers, tokens=needed, max_gap=0)
        return gather(self.plan, m, {r.sample_id: r for r in routings})

    def __iter__(self) -> Iterator[MicroBatchReplay]:
        if self.prefetch == 0:
            for m in range(len(self)):
                yield self.load(m)
            return
        self.snapshot  # noqa: B018  (open the store in this thread, before workers use it)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="routelog-prefetch")
        pending: deque[Future[MicroBatchReplay]] = deque()
        upcoming = iter(range(len(self)))
        for m in upcoming:
            pending.append(self._executor.submit(self.load, m))
            if len(pending) > self.prefetch:
                break
        while pending:
            result = pending.popleft().result()
            nxt = next(upcoming, None)
            if nxt is not None:
                pending.append(self._executor.submit(self.load, nxt))
            yield result

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> ReplayLoader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _ReplayDataset:
    """A torch ``IterableDataset`` over one rank's micro-batches; holds only its configuration (URL, step, plan).

    Use ``DataLoader(dataset, batch_size=None, num_workers=n, multiprocessing_context="spawn")``. Worker ``w``
    of ``n`` loads micro-batches ``w, w + n, ...``, so the loader yields them in order. Items are dicts of
    tensors: ``index``, ``ids`` ``[n_routers, T_local, K]`` int64, ``mask``, ``positions`` and ``layer_numbers``.
    """

    def __init__(
        self,
        url: str,
        step: int,
        plan: AlignmentPlan,
        *,
        storage_options: Mapping[str, Any] | None = None,
        prefetch: int = 1,
    ) -> None:
        super().__init__()
        self.url, self.step, self.plan = url, step, plan
        self.storage_options = dict(storage_options or {})
        self.prefetch = prefetch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        loader = ReplayLoader(self.url, self.step, self.plan, prefetch=0, storage_options=self.storage_options)
        for m in range(worker, len(loader), workers):
            replay = loader.load(m)
            yield {
                "index": m,
                "ids": torch.from_numpy(replay.ids),
                "mask": torch.from_numpy(replay.mask),
                "positions": torch.from_numpy(replay.positions),
                "layer_numbers": torch.from_numpy(np.asarray([r.layer_number for r in replay.routers])),
            }


def __getattr__(name: str) -> Any:
    """``ReplayDataset``, built on first use: it subclasses torch's ``IterableDataset``, and importing torch (about
    a second) is the dataset's cost, not ``routelog.loader``'s (a loader alone never needs torch)."""
    if name != "ReplayDataset":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    bases: tuple[type, ...] = (_ReplayDataset,)
    try:
        from torch.utils.data import IterableDataset

        bases += (IterableDataset,)
    except ImportError:  # pragma: no cover - torch is an optional dependency
        pass
    dataset = type("ReplayDataset", bases, {"__module__": __name__})
    dataset.__doc__ = _ReplayDataset.__doc__
    globals()["ReplayDataset"] = dataset  # one class, so pickle (spawned workers) finds this one by name
    return dataset
