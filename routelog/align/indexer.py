"""Placing a DSA model's sparse-attention indexer rows on a trainer's ranks (pure functions).

**Rows** (queries) are placed exactly as routing rows are, by the same code (:func:`~routelog.align.plan.place_rows`):
micro-batches, packing, the CP split (zigzag or contiguous) and pipeline stages, one row per local query, padding
and tokens without a recorded selection as rows of -1 (``mask`` False). One difference is sequence parallelism:
megatron-core 0.16.1's ``DSAIndexer`` all-gathers its inputs over TP before scoring (``dsa.py`` L557-559) and miles
replays indexer rows outside the SP region (``IndexerReplayManager.if_sp_region = False``), so by default every TP
rank gets all the rows of its CP rank (``sequence_parallel="gathered"``); ``"split"`` gives routing's per TP rank
share, for an indexer that runs on the SP shard.

**Keys** (the positions in each row) are rewritten into the coordinates the trainer's attention addresses keys in:

- BSHD: each sequence is its own batch row, so positions stay positions in the sequence.
- THD (every other packing): keys are rows of the packed stream, so each sequence's packed start
  (``cu_seqlens_padded[i]``) is added to its non-negative positions and -1 stays -1, as miles does
  (``torch.where(r != -1, r + offset, r)``).
- CP: a rank's rows are split like routing rows, but the positions keep their packed *global* coordinates: a query
  on CP rank r attends to keys that live on every CP rank (context-parallel attention exchanges keys and values
  between the ranks; Megatron-LM's THD/CP DSA masks each row by bounds on the packed global key axis), so a key has
  no rank-local coordinate to rewrite it into, and the global one is what each rank's scatter into its mask reads.

**Layers**: a pipeline stage gets the rows of its own layers only: each layer with an indexer it builds, a shared
layer (GLM-5) taking the stored rows of its source (:meth:`~routelog.format.spec.IndexerSpec.source_of`), which
may be computed on an earlier stage; the stage reads just those stored layers (:func:`stored_indexer_layers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from routelog.align.layout import ParallelLayout, rank_layers
from routelog.align.packing import PackedLengths
from routelog.align.plan import AlignmentPlan, micro_batch_records, place_rows, replayable_tokens
from routelog.align.positions import PAD
from routelog.errors import AlignmentError, InvalidRecordError
from routelog.format.documents import IndexRow
from routelog.format.positions import check_position_rows
from routelog.format.spec import IndexerSpec, ModelSpec

IndexerQueryRows = Literal["gathered", "split"]
"""Which of a CP rank's rows a TP rank's indexer sees: ``gathered`` (all: megatron-core's DSA, miles) or ``split``
(its sequence-parallel share, as routing rows)."""
MISSING = -1
"""A slot with no key position (fewer keys than ``index_topk`` before the query, or no recorded selection)."""


def indexer_of(spec: ModelSpec) -> IndexerSpec:
    if spec.indexer is None:
        raise AlignmentError(f"model {spec.name!r} declares no sparse-attention indexer (ModelSpec.indexer)")
    return spec.indexer


@dataclass(frozen=True)
class LocalIndexer:
    """One decoder layer with a sparse-attention indexer on a rank, in forward order."""

    vp_stage: int
    layer: int
    """Global 0-based decoder layer."""
    stored_index: int
    """Position on the stored (computing) indexer axis of the rows it replays: its own, or its source's."""
    shared: bool
    """The layer reuses the selection of an earlier computing layer (GLM-5)."""

    @property
    def layer_number(self) -> int:
        """Megatron's 1-based ``layer_number`` of the layer."""
        return self.layer + 1


def local_indexers(layout: ParallelLayout, spec: ModelSpec, pp_rank: int) -> list[LocalIndexer]:
    """The indexer layers (computing and shared) a pipeline rank builds, model chunk by model chunk."""
    declared = indexer_of(spec)
    with_indexer = set(declared.layers) | set(declared.shared)
    return [
        LocalIndexer(vp_stage, layer, declared.source_of(layer), layer in declared.shared)
        for vp_stage, layer in rank_layers(layout, spec.num_layers, pp_rank)
        if layer in with_indexer
    ]


def stored_indexer_layers(plan: AlignmentPlan) -> list[int]:
    """Positions on the stored indexer axis the plan's rank needs, ascending: the only ones its loader reads
    (``StepSnapshot.read_indexer(..., layers=...)``)."""
    return sorted({i.stored_index for i in local_indexers(plan.layout, plan.spec, plan.rank.pp)})


def key_offsets(packed: PackedLengths) -> npt.NDArray[np.int64]:
    """Per sequence of a packed micro-batch, what its key positions gain in the trainer's key coordinates: its
    start in the packed stream (``cu_seqlens_padded[i]``) for THD, 0 for BSHD (a batch row per sequence)."""
    if packed.bshd:
        return np.zeros(len(packed.lengths), np.int64)
    return np.asarray(packed.cu_seqlens_padded[:-1], np.int64)


def rebase_positions(rows: npt.NDArray[np.integer], offsets: npt.ArrayLike) -> npt.NDArray[np.int32]:
    """``rows`` (``[..., k]``) with ``offsets`` (broadcast over the last axis) added to their non-negative
    positions only: -1 stays -1."""
    shifted = np.asarray(rows).astype(np.int64) + np.asarray(offsets, np.int64)[..., None]
    return np.where(np.asarray(rows) != MISSING, shifted, MISSING).astype(np.int32)


@dataclass(frozen=True)
class RecordIndexer:
    """The indexer rows of one record as a loader read them."""

    info: IndexRow
    rows: npt.NDArray[np.integer]
    """``[n_tokens, len(stored_layers), index_topk]`` canonical rows (``StepSnapshot.read_indexer``)."""
    stored_layers: tuple[int, ...]
    """Positions on the stored indexer axis of axis 1."""

    @property
    def sample_id(self) -> str:
        return self.info.sample_id


@dataclass
class MicroBatchIndexer:
    """One micro-batch's indexer rows for one rank: per stored layer it needs, one row per local query."""

    index: int
    sample_ids: tuple[str, ...]
    positions: npt.NDArray[np.int64]
    """``[T_local, 2]``: (flat sample index, token position) of each query row; ``-1`` for padding rows."""
    layers: tuple[LocalIndexer, ...]
    stored_layers: tuple[int, ...]
    """Positions on the stored indexer axis of :attr:`rows` axis 0."""
    rows: npt.NDArray[np.int32]
    """``[len(stored_layers), T_local, index_topk]``: the key positions each query attends to, in the trainer's
    key coordinates (packed for THD), ascending, then -1; all -1 where :attr:`mask` is False."""
    mask: npt.NDArray[np.bool_]
    """``[len(stored_layers), T_local]``: rows that replay a recorded selection."""
    key_offsets: npt.NDArray[np.int64]
    """``[T_local]``: what each row's positions were shifted by (its sequence's packed start); -1 on padding."""
    batch_size: int
    """``B`` of the rows' sequence-major order ``s * B + b``: the sequences for BSHD, 1 for THD."""
    query_rows: IndexerQueryRows
    tokens: npt.NDArray[np.int64]
    """``[T_local]``: the token id each row's record was written with; -1 for padding and records without ids."""
    token_hashes: tuple[str | None, ...] = ()
    unverified: tuple[str, ...] = ()
    """Sample ids stored without token ids: nothing proves their rows belong to the tokens fed."""
    first_index: int = 0

    def sample_at(self, row: int) -> tuple[str, int]:
        """(sample id, token position) of a non-padding row."""
        sample, position = (int(v) for v in self.positions[row])
        return self.sample_ids[sample - self.first_index], position

    def stored_of(self, layer_number: int) -> int:
        """The index into :attr:`rows` of the layer with Megatron ``layer_number`` (a shared layer: its source's)."""
        for layer in self.layers:
            if layer.layer_number == layer_number:
                return self.stored_layers.index(layer.stored_index)
        raise KeyError(f"layer_number {layer_number} is not an indexer layer of this rank")


def gather_indexer(
    plan: AlignmentPlan,
    m: int,
    records: Mapping[str, RecordIndexer],
    positions: npt.NDArray[np.int64] | None = None,
    *,
    sequence_parallel: IndexerQueryRows = "gathered",
) -> MicroBatchIndexer:
    """Micro-batch ``m``'s indexer rows on the plan's rank, from its records' rows (read with
    ``layers=stored_indexer_layers(plan)``), at the plan's rows or at ``positions`` where the trainer placed them.
    Tokens the plan does not replay (a policy version it leaves to the ``missing`` rule) and padding get rows of -1,
    masked; a stale version is refused as for routing."""
    declared = indexer_of(plan.spec)
    if sequence_parallel not in ("gathered", "split"):
        raise AlignmentError(f"sequence_parallel must be 'gathered' or 'split', got {sequence_parallel!r}")
    k = declared.index_topk
    wanted = stored_indexer_layers(plan)
    batch = plan.micro_batches[m]
    chosen = micro_batch_records(plan, m, records, "indexer rows")
    for record in chosen:
        if list(record.stored_layers) != wanted:
            raise AlignmentError(
                f"sample {record.sample_id!r} was read with indexer layers {list(record.stored_layers)}, the plan "
                f"needs {wanted}"
            )
        if record.rows.shape != (record.info.n_tokens, len(wanted), k):
            raise AlignmentError(
                f"sample {record.sample_id!r}: indexer rows of shape {record.rows.shape}, expected "
                f"{(record.info.n_tokens, len(wanted), k)} [n_tokens, stored layers read, index_topk]"
            )
    infos = [r.info for r in chosen]
    packed = plan.packed(m, [info.n_tokens for info in infos])
    placed = place_rows(plan, m, infos, positions, split_sequence_parallel=sequence_parallel == "split")
    n_rows = placed.positions.shape[0]
    offsets = np.full(n_rows, -1, np.int64)
    offsets[placed.real] = key_offsets(packed)[placed.positions[placed.real, 0] - placed.first_index]
    rows = np.full((len(wanted), n_rows, k), MISSING, np.int32)
    mask = np.zeros((len(wanted), n_rows), bool)
    if chosen and wanted:
        selected = [(r.rows != MISSING).any(axis=2) for r in chosen]  # [n_tokens, layers]: a selection recorded
        replayed = np.concatenate(
            [replayable_tokens(r.info, s.any(axis=1), plan) for r, s in zip(chosen, selected, strict=True)]
        )[placed.source]
        present = np.concatenate(selected)[placed.source]
        for j in range(len(wanted)):  # a layer at a time: k = 2048 rows are large
            taken = replayed & present[:, j]
            layer_rows = np.concatenate([r.rows[:, j, :] for r in chosen])[placed.source[taken]]
            rows[j, placed.real[taken]] = rebase_positions(layer_rows, offsets[placed.real[taken]])
            mask[j, placed.real[taken]] = True
    return MicroBatchIndexer(
        index=m,
        sample_ids=batch.sample_ids,
        positions=placed.positions,
        layers=tuple(local_indexers(plan.layout, plan.spec, plan.rank.pp)),
        stored_layers=tuple(wanted),
        rows=rows,
        mask=mask,
        key_offsets=offsets,
        batch_size=len(batch.sample_ids) if packed.bshd else 1,
        query_rows=sequence_parallel,
        tokens=placed.tokens,
        token_hashes=tuple(info.token_hash for info in infos),
        unverified=tuple(info.sample_id for info in infos if info.token_ids is None),
        first_index=placed.first_index,
    )


def check_indexer_rows(mb: MicroBatchIndexer, stored: int, layer_number: int) -> None:
    """Refuse rows ``mb.rows[stored]`` that are not a valid top-k for their query, naming ``layer_number``, the
    sample, the query's position and local row: a padding row selecting keys, a key before its sequence's packed
    start (another sequence's), and, shifted back to the sequence's own positions, any row that is not canonical
    (:func:`~routelog.format.positions.check_position_rows`: a position past the query, a duplicate, a wrong count,
    unsorted)."""
    rows = mb.rows[stored]
    real = mb.positions[:, 0] != PAD
    padding_selects = np.flatnonzero(~real & (rows != MISSING).any(axis=1))
    if padding_selects.size:
        row = int(padding_selects[0])
        raise AlignmentError(
            f"layer {layer_number}: local row {row} is padding (no sample's token), yet its replayed row selects "
            f"keys {rows[row][rows[row] != MISSING][:8].tolist()}"
        )
    outside = (rows < MISSING) | ((rows >= 0) & (rows < mb.key_offsets[:, None]))
    wrong = np.flatnonzero(real & outside.any(axis=1))
    if wrong.size:
        row = int(wrong[0])
        sample, position = mb.sample_at(row)
        key = int(rows[row][outside[row]][0])
        raise InvalidRecordError(
            sample,
            f"indexer (layer {layer_number})",
            f"the replayed selection of the query at position {position} (local row {row}) is not a valid "
            f"top-{rows.shape[1]}: it selects key {key}, "
            + (
                "and key positions are >= 0 with only -1 padding"
                if key < 0
                else f"before its sequence's first key {int(mb.key_offsets[row])} in the packed stream (another "
                "sequence's)"
            ),
            "replay rows aligned by routelog.align.indexer.gather_indexer for this micro-batch and packing",
        )
    local = np.flatnonzero(real)
    if not local.size:
        return
    sample, position = mb.positions[local, 0], mb.positions[local, 1]
    order = local[np.lexsort((position, sample))]  # each sample's rows by position: runs of consecutive queries
    sorted_sample, sorted_position = mb.positions[order, 0], mb.positions[order, 1]
    breaks = np.flatnonzero((np.diff(sorted_sample) != 0) | (np.diff(sorted_position) != 1)) + 1
    own = rebase_positions(rows[order], -mb.key_offsets[order])  # back to positions in the sequence
    for start, stop in zip([0, *breaks.tolist()], [*breaks.tolist(), order.size], strict=True):
        first = int(sorted_position[start])
        try:
            check_position_rows(own[start:stop], first)
        except InvalidRecordError as exc:
            bad, problem = next(
                (i, found)
                for i in range(start, stop)
                if (found := _row_problem(own[i], int(sorted_position[i]))) is not None
            )
            sid, p = mb.sample_at(int(order[bad]))
            raise InvalidRecordError(
                sid,
                f"indexer (layer {layer_number})",
                f"the replayed selection of the query at position {p} (local row {int(order[bad])}) is not a valid "
                f"top-{rows.shape[1]}: {problem}",
                exc.fix,
            ) from None


def _row_problem(row: npt.NDArray[np.int32], position: int) -> str | None:
    """What :func:`check_position_rows` finds wrong with one row (without its "row 0 (...)" preamble), or None."""
    try:
        check_position_rows(row[None], position)
    except InvalidRecordError as exc:
        return exc.problem.partition("): ")[2] or exc.problem
    return None
