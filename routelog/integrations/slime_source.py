"""slime's lazy routing-replay resource, fed from a routelog store: slime pads and slices, routelog reads the rows.

slime's ``RoutingReplay.record`` keeps an object with ``materialize_for_routing_replay(stage)`` as it is, and asks it
for the router's ``[T_local, K]`` tensor when that router's forward pops it (``pop_forward`` in slime's
``replay_forward`` stage, ``pop_backward`` in ``replay_backward``). ``RoutingReplay.register_lazy_resource`` takes an
object with ``begin_pass(release_stage)`` and ``close()``, which ``RoutingReplay.begin_lazy_pass`` and
``RoutingReplay.clear_all`` call (slime from a74ae3a0 on). :class:`RolloutSource` is that resource for one rollout
on one rank, and :class:`LayerRef` what each router records.

**Where each row lands is slime's decision.** slime's own ``prepare_routed_experts_for_routing_replay`` runs on a
code tensor (``[T - 1, 1, 1]`` per sample: each routed row's place in the micro-batch, negative), so each
sequence's final token, zigzag or all-gather CP, the pad multiple and the SP slice come back exactly as slime makes
them, in whatever slime version runs, its pad rows as their index in their pad block (:func:`local_rows`). routelog
then reads only the rows that land on this rank, for its pipeline stage's layers, and fills the pad rows with
slime's pad routes; that formula is checked against slime's own padding once per process (:func:`check_pad_routes`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.align import AlignmentPlan
from routelog.align.plan import dummy_routes
from routelog.errors import ReplayConfigError
from routelog.integrations.readahead import ReadAhead
from routelog.store.reader import StepSnapshot

Prepare = Callable[..., Any]
"""slime's ``prepare_routed_experts_for_routing_replay(experts, tokens, *, num_experts, data_pad_size_multiplier,
sequence_parallel, allgather_cp)``: per-sample ``[T - 1, L, K]`` tensors to this rank's ``[T_local, L, K]``."""
STAGES = ("forward", "backward")
"""The stages slime materializes in: ``pop_forward`` and ``pop_backward``."""
_CODE_EXPERTS = 1 << 62
"""The ``num_experts`` slime pads the code tensor with: a pad row's code is its index in its pad block."""


@dataclass(frozen=True)
class SlimeGeometry:
    """slime's arguments that decide the rows of a rank (``prepare_routed_experts_for_routing_replay``'s keywords)
    and the shape of the routing it pads."""

    num_layers: int
    num_experts: int
    topk: int
    data_pad_size_multiplier: int
    sequence_parallel: bool
    allgather_cp: bool
    row_split: int = 1
    """TP x CP: the ways slime splits a micro-batch's rows between ranks."""

    @classmethod
    def from_args(cls, args: Any, *, num_layers: int, num_experts: int, topk: int) -> SlimeGeometry:
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        return cls(
            num_layers=num_layers,
            num_experts=num_experts,
            topk=topk,
            data_pad_size_multiplier=int(getattr(args, "data_pad_size_multiplier", 128) or 128),
            sequence_parallel=bool(getattr(args, "sequence_parallel", tp > 1)),
            allgather_cp=bool(getattr(args, "allgather_cp", False)),
            row_split=tp * int(getattr(args, "context_parallel_size", 1) or 1),
        )

    def prepare(self, prepare: Prepare, experts: Sequence[Any], tokens: Sequence[Any], *, num_experts: int) -> Any:
        """slime's ``prepare`` on these tensors, with this geometry's keywords."""
        return prepare(
            list(experts),
            list(tokens),
            num_experts=num_experts,
            data_pad_size_multiplier=self.data_pad_size_multiplier,
            sequence_parallel=self.sequence_parallel,
            allgather_cp=self.allgather_cp,
        )


def local_rows(
    prepare: Prepare, geometry: SlimeGeometry, lengths: Sequence[int], tokens: Sequence[Any]
) -> npt.NDArray[np.int64]:
    """``[T_local]``, where slime puts a micro-batch's rows on this rank: per local row, the routed row's index in
    the micro-batch's concatenated sequences (its sample's offset plus its position, ``>= 0``), or ``-1 - p`` for row
    ``p`` of a pad block slime added. ``tokens`` are the sequences the trainer feeds (slime checks their lengths)."""
    import torch

    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    codes = [
        torch.arange(int(start) + 1, int(start) + n, dtype=torch.int64).neg_().reshape(-1, 1, 1)
        for start, n in zip(offsets, lengths, strict=False)
    ]  # row r of a sample at offset o: -(o + r + 1); slime's pad rows come back as 0, 1, 2, ...
    out = geometry.prepare(prepare, codes, tokens, num_experts=_CODE_EXPERTS)
    if out.dim() != 3 or tuple(out.shape[1:]) != (1, 1):
        raise ReplayConfigError(
            f"slime's prepare_routed_experts_for_routing_replay returned shape {tuple(out.shape)} for [T, 1, 1] "
            "inputs (expected [T_local, 1, 1]): slime's API changed since 624b824a"
        )
    code = np.asarray(out.reshape(-1), dtype=np.int64)  # a host tensor: slime pads on the code tensor's device
    rows: npt.NDArray[np.int64] = np.where(code < 0, -code - 1, -1 - code)
    return rows


def pad_routes(
    pad_index: npt.NDArray[np.int64], layers: Sequence[int], geometry: SlimeGeometry
) -> npt.NDArray[np.int64]:
    """``[len(layers), n, K]``: slime's routes for pad rows ``pad_index`` (each row's index in its pad block) at
    global ``layers``: slime pads a block of ``P`` rows with ``arange(P * L * K).reshape(P, L, K) % num_experts``."""
    width = geometry.num_layers * geometry.topk
    values = (
        pad_index[None, :, None] * width
        + np.asarray(layers, np.int64)[:, None, None] * geometry.topk
        + np.arange(geometry.topk, dtype=np.int64)[None, None, :]
    )
    out: npt.NDArray[np.int64] = values % geometry.num_experts
    return out


def check_pad_routes(prepare: Prepare, geometry: SlimeGeometry) -> None:
    """Raise :class:`~routelog.errors.ReplayConfigError` unless slime's ``prepare`` puts, on this rank, the rows of
    a probe micro-batch where :func:`local_rows` says and pads with :func:`pad_routes`' values (one small call on
    an ``[L, K]``-wide probe; a slime whose padding changed is refused before it replays anything). The probe has
    enough two-token samples (a routed row, then a pad row) that every rank's share holds both kinds."""
    import torch

    lengths = [5, 3] + [2] * (geometry.row_split * geometry.data_pad_size_multiplier)
    tokens = [torch.zeros(n, dtype=torch.int64) for n in lengths]
    rows = local_rows(prepare, geometry, lengths, tokens)
    probe = [torch.full((n - 1, geometry.num_layers, geometry.topk), -1, dtype=torch.int32) for n in lengths]
    full = np.asarray(geometry.prepare(prepare, probe, tokens, num_experts=geometry.num_experts))
    pads = np.flatnonzero(rows < 0)
    expected = np.full((rows.size, geometry.num_layers, geometry.topk), -1, np.int64)
    expected[pads] = pad_routes(-1 - rows[pads], range(geometry.num_layers), geometry).transpose(1, 0, 2)
    if full.shape != expected.shape or not np.array_equal(full, expected):
        raise ReplayConfigError(
            "slime's prepare_routed_experts_for_routing_replay pads or places rows otherwise than routelog fills "
            f"them ({geometry}): slime's padding changed since 624b824a. Pin slime, or report it to routelog"
        )


@dataclass(frozen=True)
class PreparedMicroBatch:
    """One micro-batch's routing on this rank, as slime's routers pop it."""

    ids: Any
    """``[n_routers, T_local, K]`` int32 torch tensor (pinned host memory where an accelerator provides it)."""
    mask: npt.NDArray[np.bool_]
    """``[T_local]``: rows that replay a recorded route (not padding, the final tokens, or rows without one)."""


class StoreRows:
    """Builds micro-batch ``m`` of a plan from the store: slime's rows (:func:`local_rows`), the records' routes at
    them for the rank's routers, slime's pad routes at its pad rows, and distinct placeholder routes at rows the
    engine never routed (or that ``replayable`` leaves out)."""

    def __init__(
        self,
        snapshot: StepSnapshot,
        plan: AlignmentPlan,
        fed: Mapping[str, Any],
        replayable: Mapping[str, npt.NDArray[np.bool_]],
        prepare: Prepare,
        geometry: SlimeGeometry,
    ) -> None:
        self.snapshot, self.plan, self.fed, self.replayable = snapshot, plan, fed, replayable
        self.prepare, self.geometry = prepare, geometry
        self.fetched_rows = 0
        """Routed rows fetched so far (a rank's share of its micro-batches' records)."""

    def __call__(self, m: int) -> PreparedMicroBatch:
        import torch

        plan, spec = self.plan, self.plan.spec
        ids_of = plan.micro_batches[m].sample_ids
        lengths = [self.snapshot.info(sid).n_tokens for sid in ids_of]
        rows = local_rows(self.prepare, self.geometry, lengths, [self.fed[sid] for sid in ids_of])
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        real = np.flatnonzero(rows >= 0)
        flat = rows[real]
        sample = np.searchsorted(offsets, flat, side="right") - 1
        needed = {sid: np.zeros(n, dtype=bool) for sid, n in zip(ids_of, lengths, strict=True)}
        for i, sid in enumerate(ids_of):
            needed[sid][flat[sample == i] - offsets[i]] = True
        records = self.snapshot.read_many(ids_of, moe_layers=plan.moe_layers, tokens=needed, max_gap=0)
        self.fetched_rows += len(flat)
        routers = plan.routers
        out = np.empty((len(routers), rows.size, spec.topk), dtype=np.int32)
        out[:] = dummy_routes(rows.size, spec.topk, spec.num_experts)
        keep = np.concatenate([self.replayable[sid] for sid in ids_of])[flat]
        if routers and keep.any():
            axis = [plan.moe_layers.index(r.moe_index) for r in routers]
            stacked = np.concatenate([r.by_layer for r in records], axis=1)  # [layers read, sum T, K]
            out[:, real[keep]] = stacked[axis][:, flat[keep]]
        pads = np.flatnonzero(rows < 0)
        out[:, pads] = pad_routes(-1 - rows[pads], [r.layer for r in routers], self.geometry)
        mask = np.zeros(rows.size, dtype=bool)
        mask[real[keep]] = True
        tensor = torch.from_numpy(out)
        if torch.cuda.is_available():
            tensor = tensor.pin_memory()
        return PreparedMicroBatch(ids=tensor, mask=mask)


class RolloutSource:
    """slime's lazy resource for one rollout on one rank (``RoutingReplay.register_lazy_resource``).

    Micro-batch ``m`` is built (``build(m)``) when a router first pops it, the next ``prefetch`` micro-batches ahead
    of it in a background thread (:class:`~routelog.integrations.readahead.ReadAhead`), and kept until each of the
    ``routers`` has popped it in the release stage (default ``backward``: slime's log-prob pass pops ``forward``, its
    training pass ``backward``; slime's ``begin_lazy_pass(stage)`` changes it). A micro-batch released and popped again
    is built again."""

    def __init__(
        self,
        build: Callable[[int], PreparedMicroBatch],
        micro_batches: int,
        routers: int,
        *,
        prefetch: int = 2,
        release_stage: str = "backward",
        on_build: Callable[[int, PreparedMicroBatch], None] | None = None,
    ) -> None:
        self.micro_batches, self.routers = micro_batches, routers
        self.release_stage = release_stage

        def built(m: int) -> PreparedMicroBatch:
            prepared = build(m)
            if on_build is not None:
                on_build(m, prepared)
            return prepared

        self._reads = ReadAhead(
            built,
            micro_batches,
            window=prefetch,
            closed_error=lambda m: ReplayConfigError(
                f"micro-batch {m} popped after the rollout's routing was closed (slime's RoutingReplay.clear_all "
                "ran, or the rollout ended): slime pops more micro-batches than it recorded"
            ),
            name="routelog-slime",
        )
        self._lock = threading.Lock()
        self._popped: Counter[tuple[int, str]] = Counter()
        self._device: Any = None
        self.materialized = 0
        """Router pops served (none at the end of a rollout: no router took the routing)."""

    @property
    def builds(self) -> int:
        """Micro-batches built so far (one released and popped again counts again)."""
        return self._reads.builds

    @property
    def closed(self) -> bool:
        return self._reads.closed

    def refs(self, m: int) -> list[LayerRef]:
        """What each router records for micro-batch ``m``, in router order."""
        return [LayerRef(self, m, j) for j in range(self.routers)]

    @property
    def host_bytes(self) -> int:
        """Host memory of the micro-batches built and not yet released."""
        return sum(int(p.ids.nbytes) for p in self._reads.held())

    def begin_pass(self, release_stage: str) -> None:
        """slime's ``RoutingReplay.begin_lazy_pass``: release in ``release_stage`` from now on, and build the pass's
        first micro-batches ahead."""
        if release_stage not in STAGES:
            raise ReplayConfigError(f"release stage must be one of {STAGES}, got {release_stage!r}")
        self.release_stage = release_stage
        self._reads.ahead(0)

    def start(self) -> None:
        """Build the first micro-batches ahead (the rollout's reads overlap what slime runs before its replay)."""
        self._reads.ahead(0)

    def close(self) -> None:
        """slime's ``RoutingReplay.clear_all``: stop building and drop every micro-batch (idempotent)."""
        self._reads.close()

    def materialize(self, m: int, router: int, stage: str) -> Any:
        """Router ``router``'s ``[T_local, K]`` int32 tensor of micro-batch ``m`` on the training device."""
        ids = self._reads.get(m).ids[router]
        if self._device is None:
            self._device = _training_device()
        tensor = ids.to(self._device, dtype=_int32(), non_blocking=bool(ids.is_pinned()))
        with self._lock:
            self.materialized += 1
            key = (m, stage)
            self._popped[key] += 1
            release = self._popped[key] >= self.routers
            if release:
                del self._popped[key]
        if release and stage == self.release_stage:
            self._reads.release(m)
        return tensor


class LayerRef:
    """What one router records for one micro-batch: slime asks it for the tensor when the router pops it."""

    __slots__ = ("micro_batch", "router", "source")

    def __init__(self, source: RolloutSource, micro_batch: int, router: int) -> None:
        self.source, self.micro_batch, self.router = source, micro_batch, router

    def materialize_for_routing_replay(self, stage: str) -> Any:
        return self.source.materialize(self.micro_batch, self.router, stage)

    def __repr__(self) -> str:
        return f"LayerRef(micro_batch={self.micro_batch}, router={self.router})"


def _training_device() -> Any:
    """slime's ``accelerator.current_device()`` where slime has one; else the current CUDA device, or the CPU."""
    import torch

    try:
        from slime.utils import accelerator  # type: ignore[import-not-found]
    except ImportError:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return accelerator.current_device()


def _int32() -> Any:
    import torch

    return torch.int32


__all__ = [
    "STAGES",
    "LayerRef",
    "Prepare",
    "PreparedMicroBatch",
    "RolloutSource",
    "SlimeGeometry",
    "StoreRows",
    "check_pad_routes",
    "local_rows",
    "pad_routes",
]
