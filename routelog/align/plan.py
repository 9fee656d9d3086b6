"""Alignment as a pure function: records in the trainer's order -> one rank's replay tensors per micro-batch.

``positions`` (which sequence and token each local row is) depends only on lengths and the layout; ``gather``
then fills, for each local router in forward order, an int64 ``[T_local, K]`` tensor in Megatron's row order.
Padding rows and rows the engine never computed get **distinct valid dummy expert IDs** (row ``i`` takes experts
``(i*K + j) mod E``: never duplicates, which would collapse Megatron's routing map and break the alltoall
dispatcher; never all zeros; spread over the experts) and ``mask = False``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

import numpy as np
import numpy.typing as npt

from routelog.align.layout import LocalRouter, ParallelLayout, RankCoords, local_routers
from routelog.align.packing import PackedLengths, Packing, nemo_pad_to, pack
from routelog.align.positions import PAD, rank_positions
from routelog.errors import AlignmentError, StaleRoutingError
from routelog.format.documents import IndexRow
from routelog.format.routing import RecordRouting
from routelog.format.spec import ModelSpec

_Record = TypeVar("_Record")


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the trainer split it: its samples, in the order they are packed."""

    sample_ids: tuple[str, ...]
    cu_seqlens_padded: tuple[int, ...] | None = None
    """The trainer's packed boundaries (preferred over re-deriving them with a packing rule)."""
    cp: int | None = None
    """Dynamic CP: this micro-batch's CP group size (default: the layout's)."""
    cp_rank: int | None = None
    """Dynamic CP: this rank's position in that group (default: the rank's CP rank)."""
    seq_len: int | None = None
    """BSHD: the padded width S (default: the longest sequence, rounded up)."""
    pad_to: int | None = None
    """NeMo-RL with PP: the total packed length every micro-batch is padded to."""


def parse_micro_batches(text: str) -> list[MicroBatch]:
    """``"id1,id2|id3"``: micro-batches separated by ``|``, sample ids by ``,``."""
    batches = [tuple(s.strip() for s in group.split(",") if s.strip()) for group in text.strip().split("|")]
    if not batches or any(not b for b in batches):
        raise AlignmentError(f"micro-batches {text!r}: expected 'id1,id2|id3' with no empty micro-batch")
    return [MicroBatch(b) for b in batches]


MissingPolicy = Literal["dummy", "router"]
OtherVersions = Literal["refuse", "missing"]
PolicyVersions = Literal["step", "any"] | Callable[[int], Collection[int]]
"""Which policy versions a trainer's replay of step ``s`` takes: ``"step"`` (the default of every integration:
records written by step ``s``'s rollout carry version ``s``, which routelog's writers for the trainers set), a
function of the step (e.g. ``lambda s: {s - 1}`` for one-step off-policy training), or ``"any"``: nothing checked,
an explicit opt-out."""


def versions_for(rule: PolicyVersions, step: int) -> frozenset[int] | None:
    """The versions a replay of ``step`` takes under ``rule`` (None: any)."""
    if rule == "any":
        return None
    if rule == "step":
        return frozenset({step})
    if callable(rule):
        return frozenset(int(v) for v in rule(step))
    raise AlignmentError(f"policy_versions must be 'step', 'any' or a function of the step, got {rule!r}")


@dataclass(frozen=True)
class AlignmentPlan:
    """Everything that decides one rank's rows and routers; a pure description, cheap to pickle."""

    spec: ModelSpec
    layout: ParallelLayout
    packing: Packing
    rank: RankCoords
    micro_batches: tuple[MicroBatch, ...]
    missing: MissingPolicy = "dummy"
    """Rows without a recorded route (padding, tokens the engine never computed): ``dummy`` forces distinct
    placeholder experts on them (what native megatron-core can take); ``router`` lets the router choose its own
    top-k for exactly those rows (NeMo-RL's policy; the installer wraps each router's replay to do it)."""
    policy_versions: frozenset[int] | None = None
    """If given, the policy versions whose routing this plan replays (per record segment; a record without one
    has none). Routing of any other version is stale: see :attr:`other_versions`."""
    other_versions: OtherVersions = "refuse"
    """Tokens generated under a version outside :attr:`policy_versions`: ``refuse`` (the default) raises
    :class:`~routelog.store.fidelity.StaleRoutingError` naming the sample; ``missing`` treats them as rows without a
    recorded route (partial rollouts resumed after a weight update, where only the new version's tokens replay)."""

    def __post_init__(self) -> None:
        if self.missing not in ("dummy", "router"):
            raise AlignmentError(f"missing must be 'dummy' or 'router', got {self.missing!r}")
        if self.other_versions not in ("refuse", "missing"):
            raise AlignmentError(f"other_versions must be 'refuse' or 'missing', got {self.other_versions!r}")
        self.rank.check(self.layout)
        seen: set[str] = set()
        for batch in self.micro_batches:
            for sid in batch.sample_ids:
                if sid in seen:
                    raise AlignmentError(f"sample {sid!r} appears in two micro-batches (or twice in one)")
                seen.add(sid)

    @property
    def sample_ids(self) -> list[str]:
        """All samples, flattened in micro-batch order (the index used in ``positions``)."""
        return [sid for batch in self.micro_batches for sid in batch.sample_ids]

    @property
    def routers(self) -> list[LocalRouter]:
        """This rank's MoE routers in forward order (model chunk by model chunk)."""
        return local_routers(self.layout, self.spec, self.rank.pp)

    @property
    def moe_layers(self) -> list[int]:
        """MoE-axis positions this rank needs, ascending: the only layers the loader reads."""
        return sorted({r.moe_index for r in self.routers})

    def with_lengths(self, n_tokens: Mapping[str, int]) -> AlignmentPlan:
        """The plan with what depends on the whole step's lengths filled in: NeMo-RL with PP pads every
        micro-batch to one total (``MicroBatch.pad_to``), computed here unless given."""
        if self.packing.kind != "nemo" or self.layout.pp == 1 or all(b.pad_to is not None for b in self.micro_batches):
            return self
        missing = [sid for sid in self.sample_ids if sid not in n_tokens]
        if missing:
            raise AlignmentError(f"no lengths for samples {missing[:5]}")
        total = nemo_pad_to(
            [[n_tokens[sid] for sid in b.sample_ids] for b in self.micro_batches], self.packing, self.layout
        )
        batches = tuple(b if b.pad_to is not None else replace(b, pad_to=total) for b in self.micro_batches)
        return replace(self, micro_batches=batches)

    def first_index(self, m: int) -> int:
        """Flat index of micro-batch ``m``'s first sample."""
        return sum(len(b.sample_ids) for b in self.micro_batches[:m])

    def packed(self, m: int, lengths: Sequence[int]) -> PackedLengths:
        """Micro-batch ``m`` packed (before the CP and SP splits): each sequence's padded length and, through
        ``cu_seqlens_padded``, where it starts in the packed stream."""
        batch = self.micro_batches[m]
        if len(lengths) != len(batch.sample_ids):
            raise AlignmentError(f"micro-batch {m}: {len(lengths)} lengths for {len(batch.sample_ids)} samples")
        return pack(
            lengths,
            self.packing,
            self.layout,
            cp=batch.cp or self.layout.cp,
            cu_seqlens_padded=batch.cu_seqlens_padded,
            seq_len=batch.seq_len,
            pad_to=batch.pad_to,
        )

    def positions(
        self, m: int, lengths: Sequence[int], *, split_sequence_parallel: bool = True
    ) -> npt.NDArray[np.int64]:
        """``[T_local, 2]`` for micro-batch ``m``: (flat sample index, token position), ``-1`` for padding.
        ``split_sequence_parallel=False``: the rows of every TP rank of this CP rank (see :func:`rank_positions`)."""
        batch = self.micro_batches[m]
        cp = batch.cp or self.layout.cp
        cp_rank = self.rank.cp if batch.cp_rank is None else batch.cp_rank
        rows = rank_positions(
            self.packed(m, lengths),
            self.layout,
            tp_rank=self.rank.tp,
            cp_rank=cp_rank,
            cp=cp,
            split_sequence_parallel=split_sequence_parallel,
        )
        real = rows[:, 0] != PAD
        rows[real, 0] += self.first_index(m)
        return rows


def replayable_rows(record: RecordRouting, plan: AlignmentPlan) -> npt.NDArray[np.bool_]:
    """The record's computed rows, less those generated by a policy version the plan does not replay (or, by
    default, a refusal naming the first such span)."""
    return replayable_tokens(record.info, record.valid, plan)


def replayable_tokens(info: IndexRow, valid: npt.NDArray[np.bool_], plan: AlignmentPlan) -> npt.NDArray[np.bool_]:
    """``valid`` (a record's ``[n_tokens]`` rows holding something to replay: routes, indexer selections) less the
    tokens generated by a policy version the plan does not replay (or, by default, a refusal naming the first such
    span)."""
    versions = plan.policy_versions
    if versions is None:
        return valid
    default = info.policy_version
    spans = [(s.start, s.end, s.policy_version if s.policy_version is not None else default) for s in info.segments]
    covered = np.zeros(info.n_tokens, dtype=bool)
    for start, end, _ in spans:
        covered[start:end] = True
    uncovered = np.flatnonzero(~covered)
    if uncovered.size:
        spans.append((int(uncovered[0]), int(uncovered[-1]) + 1, default))
    keep = valid.copy()
    for start, end, version in spans:
        if version in versions or not keep[start:end].any():
            continue
        if plan.other_versions == "refuse":
            raise StaleRoutingError(
                f"sample {info.sample_id!r}: tokens {start}..{end} were routed by "
                + ("no recorded policy version" if version is None else f"policy version {version}")
                + f", and this replay takes version {', '.join(map(str, sorted(versions)))} only: stale routing "
                "(another step's or another policy's) is refused. Write records with the policy_version of the "
                "weights that generated them; for partial rollouts pass other_versions='missing' (routelog align: "
                "--other-versions missing) to leave those rows to the missing rule"
            )
        keep[start:end] = False
    return keep


def dummy_routes(n_rows: int, topk: int, num_experts: int) -> npt.NDArray[np.int64]:
    """Distinct, valid, expert-balanced placeholder routes for rows that must not be replayed."""
    out: npt.NDArray[np.int64] = (np.arange(n_rows)[:, None] * topk + np.arange(topk)[None, :]) % num_experts
    return out


@dataclass
class MicroBatchReplay:
    """One micro-batch's replay tensors for one rank."""

    index: int
    sample_ids: tuple[str, ...]
    positions: npt.NDArray[np.int64]
    """``[T_local, 2]``: (flat sample index, token position); ``-1`` for padding rows."""
    routers: tuple[LocalRouter, ...]
    ids: npt.NDArray[np.int64]
    """``[n_routers, T_local, K]`` int64, router ``j`` = ``routers[j]``; dummies where ``mask`` is False."""
    mask: npt.NDArray[np.bool_]
    """``[T_local]``: rows that replay a recorded route."""
    token_hashes: tuple[str | None, ...] = ()
    tokens: npt.NDArray[np.int64] | None = None
    """``[T_local]``: the token id each row's record was written with at that position; -1 for padding rows and
    rows of records stored without token ids (:attr:`unverified`)."""
    unverified: tuple[str, ...] = ()
    """Sample ids of the micro-batch stored without token ids: nothing proves their routing belongs to the tokens
    fed."""
    first_index: int = 0
    """The flat index of ``sample_ids[0]`` in :attr:`positions`."""

    def sample_at(self, row: int) -> tuple[str, int]:
        """(sample id, token position) of a non-padding row."""
        sample, position = (int(v) for v in self.positions[row])
        return self.sample_ids[sample - self.first_index], position

    def layer_ids(self, layer_number: int) -> npt.NDArray[np.int64]:
        """The ``[T_local, K]`` tensor of the router with Megatron ``layer_number``."""
        for j, router in enumerate(self.routers):
            if router.layer_number == layer_number:
                layer: npt.NDArray[np.int64] = self.ids[j]
                return layer
        raise KeyError(f"layer_number {layer_number} is not a router of this rank")

    def to_torch(self, *, pin_memory: bool = False) -> tuple[Any, Any]:
        """``(ids, mask)`` as torch tensors (optionally in pinned host memory for asynchronous copies)."""
        import torch

        ids, mask = torch.from_numpy(self.ids), torch.from_numpy(self.mask)
        if pin_memory and torch.cuda.is_available():
            ids, mask = ids.pin_memory(), mask.pin_memory()
        return ids, mask


@dataclass(frozen=True)
class PlacedRows:
    """Where each of a rank's rows of one micro-batch comes from in its records: the placement routing rows and
    indexer rows share (:func:`place_rows`)."""

    positions: npt.NDArray[np.int64]
    """``[T_local, 2]``: (flat sample index, token position); ``-1`` for padding rows."""
    real: npt.NDArray[np.int64]
    """The local rows that hold a token of a sample, ascending."""
    source: npt.NDArray[np.int64]
    """For each of :attr:`real`: its row in the micro-batch's records concatenated in order."""
    tokens: npt.NDArray[np.int64]
    """``[T_local]``: the token id each row's record was written with; -1 for padding and records without ids."""
    first_index: int
    """The flat index of the micro-batch's first sample."""


def micro_batch_records(plan: AlignmentPlan, m: int, records: Mapping[str, _Record], what: str) -> list[_Record]:
    """Micro-batch ``m``'s records, in its order (a refusal naming the samples ``records`` lacks)."""
    batch = plan.micro_batches[m]
    missing = [sid for sid in batch.sample_ids if sid not in records]
    if missing:
        raise AlignmentError(f"micro-batch {m}: no {what} for samples {missing[:5]}")
    return [records[sid] for sid in batch.sample_ids]


def place_rows(
    plan: AlignmentPlan,
    m: int,
    infos: Sequence[IndexRow],
    positions: npt.NDArray[np.int64] | None = None,
    *,
    split_sequence_parallel: bool = True,
) -> PlacedRows:
    """Micro-batch ``m``'s rows on the plan's rank (or at ``positions``, where the trainer placed them) and where
    each comes from in the records ``infos`` (the micro-batch's, in order)."""
    if positions is None:
        positions = plan.positions(
            m, [info.n_tokens for info in infos], split_sequence_parallel=split_sequence_parallel
        )
    first = plan.first_index(m)
    real = np.flatnonzero(positions[:, 0] != PAD)
    offsets = np.cumsum([0] + [info.n_tokens for info in infos])
    source = offsets[positions[real, 0] - first] + positions[real, 1]
    tokens = np.full(positions.shape[0], -1, dtype=np.int64)
    if infos:
        stored = [
            np.full(info.n_tokens, -1, np.int64) if info.token_ids is None else np.asarray(info.token_ids, np.int64)
            for info in infos
        ]
        tokens[real] = np.concatenate(stored)[source]
    return PlacedRows(positions, real, source, tokens, first)


def gather(
    plan: AlignmentPlan,
    m: int,
    routings: Mapping[str, RecordRouting],
    positions: npt.NDArray[np.int64] | None = None,
) -> MicroBatchReplay:
    """Micro-batch ``m``'s tensors from its records' routing (read with ``moe_layers=plan.moe_layers``), at the
    plan's rows, or at ``positions`` (``[T_local, 2]`` as :meth:`AlignmentPlan.positions` gives them) where the
    trainer itself placed the rows."""
    spec = plan.spec
    batch = plan.micro_batches[m]
    records = micro_batch_records(plan, m, routings, "routing")
    placed = place_rows(plan, m, [r.info for r in records], positions)
    routers = plan.routers
    n_rows = placed.positions.shape[0]
    ids = np.empty((len(routers), n_rows, spec.topk), dtype=np.int64)
    ids[:] = dummy_routes(n_rows, spec.topk, spec.num_experts)
    mask = np.zeros(n_rows, dtype=bool)
    if routers and records:
        wanted = plan.moe_layers
        for record in records:
            if list(record.moe_layers) != wanted:
                raise AlignmentError(
                    f"sample {record.sample_id!r} was read with MoE layers {list(record.moe_layers)}, "
                    f"the plan needs {wanted}"
                )
        axis = [wanted.index(r.moe_index) for r in routers]
        stacked = np.concatenate([r.by_layer for r in records], axis=1)  # [L_read, sum T, K]
        valid = np.concatenate([replayable_rows(r, plan) for r in records])
        replay = valid[placed.source]
        rows, source = placed.real[replay], placed.source[replay]
        mask[rows] = True
        ids[:, rows] = stacked[axis][:, source]
    return MicroBatchReplay(
        index=m,
        sample_ids=batch.sample_ids,
        positions=placed.positions,
        routers=tuple(routers),
        ids=ids,
        mask=mask,
        token_hashes=tuple(r.info.token_hash for r in records),
        tokens=placed.tokens,
        unverified=tuple(r.sample_id for r in records if r.info.token_ids is None),
        first_index=placed.first_index,
    )
