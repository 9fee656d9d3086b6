"""Realigning stored routing to a trainer's micro-batches, packing and parallel layout (pure functions).

:func:`~routelog.align.plan.gather` turns records into one rank's replay tensors; the loader
(:mod:`routelog.loader`) reads only what it needs and the Megatron installer (:mod:`routelog.megatron`) hands the
tensors to megatron-core's ``RouterReplay``.
"""

from routelog.align.layout import LocalRouter, ParallelLayout, RankCoords, chunk_layers, local_routers
from routelog.align.packing import PackedLengths, Packing, pack
from routelog.align.plan import (
    AlignmentPlan,
    MicroBatch,
    MicroBatchReplay,
    dummy_routes,
    gather,
    parse_micro_batches,
)
from routelog.align.positions import rank_positions, zigzag_chunks

__all__ = [
    "AlignmentPlan",
    "LocalRouter",
    "MicroBatch",
    "MicroBatchReplay",
    "PackedLengths",
    "Packing",
    "ParallelLayout",
    "RankCoords",
    "chunk_layers",
    "dummy_routes",
    "gather",
    "local_routers",
    "pack",
    "parse_micro_batches",
    "rank_positions",
    "zigzag_chunks",
]
