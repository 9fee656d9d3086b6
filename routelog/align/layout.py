"""The trainer's parallel layout, and which decoder layers (hence which routers) each pipeline rank builds.

Layer indices are global and 0-based; Megatron's ``TopKRouter.layer_number`` is the index plus one. The layer split
follows megatron-core 0.16 (``get_transformer_layer_offset`` / ``get_num_layers_to_build``): uniform stages,
optionally accounting the embedding and the loss as a layer each, uneven first/last stages, interleaved virtual
stages, or an explicit list of layers per (pipeline rank, virtual stage). MTP layers are never part of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from routelog.errors import AlignmentError
from routelog.format.spec import ModelSpec

CpLayout = Literal["zigzag", "contiguous"]


@dataclass(frozen=True)
class ParallelLayout:
    """Megatron's parallel sizes and the options that change which rank holds which token and layer."""

    tp: int = 1
    """Tensor parallel size; with MoE and TP > 1 training requires sequence parallelism."""
    cp: int = 1
    """Context parallel size."""
    pp: int = 1
    """Pipeline parallel size."""
    vpp: int = 1
    """Virtual pipeline stages (model chunks) per pipeline rank."""
    cp_layout: CpLayout = "zigzag"
    """``zigzag``: each sequence split in 2*CP chunks, rank r keeps chunks r and 2CP-1-r (Megatron/TE default).
    ``contiguous``: the packed stream split in CP equal parts."""
    sequence_parallel: bool | None = None
    """Defaults to ``tp > 1``."""
    first_stage_layers: int | None = None
    """``num_layers_in_first_pipeline_stage`` (uneven pipeline)."""
    last_stage_layers: int | None = None
    """``num_layers_in_last_pipeline_stage``."""
    account_for_embedding: bool = False
    """``account_for_embedding_in_pipeline_split``."""
    account_for_loss: bool = False
    """``account_for_loss_in_pipeline_split``."""
    stage_layers: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    """Explicit layout: ``stage_layers[pp_rank][vp_stage]`` = global layer indices of that model chunk."""

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "pp", "vpp"):
            if getattr(self, name) < 1:
                raise AlignmentError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tp > 1 and self.sequence_parallel is False:
            raise AlignmentError(
                "MoE training with tensor parallelism requires sequence parallelism (megatron-core refuses "
                "MoE + TP > 1 without it); set sequence_parallel=True"
            )
        if self.cp_layout not in ("zigzag", "contiguous"):
            raise AlignmentError(f"cp_layout must be 'zigzag' or 'contiguous', got {self.cp_layout!r}")

    @property
    def sp(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline rank (virtual stages only exist with PP > 1)."""
        return self.vpp if self.pp > 1 else 1


@dataclass(frozen=True)
class RankCoords:
    """One trainer rank's position in the TP, CP and PP groups (the DP rank is in its micro-batches)."""

    tp: int = 0
    cp: int = 0
    pp: int = 0

    def check(self, layout: ParallelLayout) -> None:
        for name, size in (("tp", layout.tp), ("cp", layout.cp), ("pp", layout.pp)):
            if not 0 <= getattr(self, name) < size:
                raise AlignmentError(f"{name} rank {getattr(self, name)} outside [0, {size})")

    @classmethod
    def parse(cls, text: str) -> RankCoords:
        """``tp=I,cp=J,pp=K`` (any subset; missing ranks are 0)."""
        values: dict[str, int] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = item.partition("=")
            if key not in ("tp", "cp", "pp") or not value.isdigit():
                raise AlignmentError(f"rank {text!r}: expected tp=I,cp=J,pp=K")
            values[key] = int(value)
        return cls(**values)


def chunk_layers(layout: ParallelLayout, num_layers: int, pp_rank: int, vp_stage: int) -> range:
    """Global decoder layers built by (``pp_rank``, ``vp_stage``), as megatron-core computes them."""
    if layout.stage_layers is not None:
        try:
            explicit = tuple(layout.stage_layers[pp_rank][vp_stage])
        except IndexError:
            raise AlignmentError(f"stage_layers has no entry for pp rank {pp_rank}, virtual stage {vp_stage}") from None
        if explicit and list(explicit) != list(range(explicit[0], explicit[-1] + 1)):
            raise AlignmentError(f"stage_layers[{pp_rank}][{vp_stage}] must be consecutive layers, got {explicit}")
        return range(explicit[0], explicit[-1] + 1) if explicit else range(0)
    offset = _layer_offset(layout, num_layers, pp_rank, vp_stage)
    return range(offset, offset + _layers_to_build(layout, num_layers, pp_rank, vp_stage))


def _layer_offset(layout: ParallelLayout, num_layers: int, pp_rank: int, vp_stage: int) -> int:
    pp, vp = layout.pp, layout.virtual_stages
    if pp == 1:
        return 0
    first, last = layout.first_stage_layers, layout.last_stage_layers
    if first is not None or last is not None:
        middle_stages = pp - (first is not None) - (last is not None)
        first_n, last_n = first or 0, last or 0
        middle_layers = num_layers - first_n - last_n
        middle_rank = pp_rank if first is None else pp_rank - 1
        if vp > 1:
            per_chunk_first, per_chunk_last = first_n // vp, last_n // vp
            per_chunk_middle = middle_layers // vp
            chunk = per_chunk_first + per_chunk_middle + per_chunk_last
            if pp_rank == 0:
                return vp_stage * chunk
            return vp_stage * chunk + per_chunk_first + middle_rank * (per_chunk_middle // middle_stages)
        per_rank = middle_layers // middle_stages if middle_stages > 0 else 0
        return 0 if pp_rank == 0 else middle_rank * per_rank + first_n
    total = num_layers + layout.account_for_embedding + layout.account_for_loss
    per_rank = total // pp
    offset = vp_stage * (total // vp) + pp_rank * (per_rank // vp) if vp > 1 else pp_rank * per_rank
    if layout.account_for_embedding and not (vp_stage == 0 and pp_rank == 0):
        offset -= 1
    return offset


def _layers_to_build(layout: ParallelLayout, num_layers: int, pp_rank: int, vp_stage: int) -> int:
    pp, vp = layout.pp, layout.virtual_stages
    first, last = layout.first_stage_layers, layout.last_stage_layers
    if first is not None or last is not None:
        if layout.account_for_embedding or layout.account_for_loss:
            raise AlignmentError("uneven first/last stages cannot be combined with embedding/loss accounting")
        remaining = num_layers - (first or 0) - (last or 0)
        stages = pp - (first is not None) - (last is not None)
        if stages > 0 and remaining % stages:
            raise AlignmentError(f"{remaining} middle layers do not split evenly over {stages} middle stages")
        per_rank = remaining // stages if stages > 0 else 0
        if pp_rank == 0 and first is not None:
            per_rank = first
        if pp_rank == pp - 1 and last is not None:
            per_rank = last
    else:
        total = num_layers + layout.account_for_embedding + layout.account_for_loss
        if total % pp:
            raise AlignmentError(f"{total} layers (embedding/loss accounted) do not split over {pp} pipeline stages")
        per_rank = total // pp
    if vp > 1:
        if per_rank % vp:
            raise AlignmentError(f"{per_rank} layers per pipeline rank do not split over {vp} virtual stages")
        per_rank //= vp
    if layout.account_for_embedding and vp_stage == 0 and pp_rank == 0:
        per_rank -= 1
    if layout.account_for_loss and vp_stage == vp - 1 and pp_rank == pp - 1:
        per_rank -= 1
    return per_rank


@dataclass(frozen=True)
class LocalRouter:
    """One MoE router of a rank, in forward order."""

    vp_stage: int
    layer: int
    """Global 0-based decoder layer."""
    moe_index: int
    """Position on the stored MoE-only axis."""

    @property
    def layer_number(self) -> int:
        """Megatron's ``TopKRouter.layer_number`` (1-based)."""
        return self.layer + 1


def rank_layers(layout: ParallelLayout, num_layers: int, pp_rank: int) -> list[tuple[int, int]]:
    """``(vp_stage, layer)`` of every decoder layer a pipeline rank builds, model chunk by model chunk (VPP order):
    what both the routers and the sparse-attention indexers of the rank are picked from."""
    built = []
    for vp_stage in range(layout.virtual_stages):
        for layer in chunk_layers(layout, num_layers, pp_rank, vp_stage):
            if not 0 <= layer < num_layers:
                raise AlignmentError(f"pipeline layout places layer {layer} outside the model's {num_layers}")
            built.append((vp_stage, layer))
    return built


def local_routers(layout: ParallelLayout, spec: ModelSpec, pp_rank: int) -> list[LocalRouter]:
    """The MoE routers a pipeline rank builds, model chunk by model chunk (VPP order), dense layers skipped."""
    return [
        LocalRouter(vp_stage, layer, spec.moe_index(layer))
        for vp_stage, layer in rank_layers(layout, spec.num_layers, pp_rank)
        if spec.is_moe(layer)
    ]


def all_chunks(layout: ParallelLayout, num_layers: int) -> Sequence[tuple[int, int, range]]:
    """Every (pp_rank, vp_stage, layers) of the layout."""
    return [
        (p, v, chunk_layers(layout, num_layers, p, v)) for p in range(layout.pp) for v in range(layout.virtual_stages)
    ]
