"""Which (sequence, token position) each of a rank's rows is, after the CP split and the SP split.

Megatron computes router logits on ``[S_local, B, H]`` and flattens them sequence-major, so row ``i`` of a
router's input is ``s * B + b``; with THD packing ``B = 1`` and rows are the packed local tokens. Context
parallelism splits first (per sequence in zigzag, or the whole stream contiguously), then sequence parallelism
hands each TP rank a contiguous ``1/TP`` of the local rows.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from routelog.align.layout import ParallelLayout
from routelog.align.packing import PackedLengths
from routelog.errors import AlignmentError

PAD = -1


def zigzag_chunks(padded: int, cp: int, cp_rank: int) -> npt.NDArray[np.int64]:
    """Positions of one sequence of padded length ``padded`` on CP rank ``cp_rank``: chunks r and 2CP-1-r."""
    if padded % (2 * cp):
        raise AlignmentError(
            f"a sequence padded to {padded} tokens cannot be split in 2*CP = {2 * cp} equal chunks; the packing rule "
            "must pad each sequence to a multiple of 2*CP"
        )
    half = padded // (2 * cp)
    first = np.arange(cp_rank * half, (cp_rank + 1) * half)
    second = np.arange((2 * cp - 1 - cp_rank) * half, (2 * cp - cp_rank) * half)
    return np.concatenate([first, second])


def rank_positions(
    packed: PackedLengths,
    layout: ParallelLayout,
    *,
    tp_rank: int,
    cp_rank: int,
    cp: int | None = None,
    split_sequence_parallel: bool = True,
) -> npt.NDArray[np.int64]:
    """``[T_local, 2]``: (sequence index in the micro-batch, token position) of each local row; ``-1`` marks padding.
    ``split_sequence_parallel=False`` keeps the CP-local rows of every TP rank (what a module that all-gathers the
    sequence-parallel shards sees, such as a sparse-attention indexer)."""
    cp = layout.cp if cp is None else cp
    if not 0 <= cp_rank < cp:
        raise AlignmentError(f"cp rank {cp_rank} outside [0, {cp})")
    rows = _bshd(packed, layout, cp, cp_rank) if packed.bshd else _thd(packed, layout, cp, cp_rank)
    if layout.sp and layout.tp > 1 and split_sequence_parallel:
        if rows.shape[0] % layout.tp:
            raise AlignmentError(
                f"{rows.shape[0]} local rows do not split over TP = {layout.tp} for sequence parallelism; the packing "
                "must pad to a multiple of TP"
            )
        share = rows.shape[0] // layout.tp
        rows = rows[tp_rank * share : (tp_rank + 1) * share]
    return rows


def _mark(seq: int, positions: npt.NDArray[np.int64], length: int) -> npt.NDArray[np.int64]:
    out = np.empty((positions.shape[0], 2), dtype=np.int64)
    real = positions < length
    out[:, 0] = np.where(real, seq, PAD)
    out[:, 1] = np.where(real, positions, PAD)
    return out


def _thd(packed: PackedLengths, layout: ParallelLayout, cp: int, cp_rank: int) -> npt.NDArray[np.int64]:
    if cp == 1 or (packed.cp_layout or layout.cp_layout) == "zigzag":
        parts = [
            _mark(s, zigzag_chunks(p, cp, cp_rank) if cp > 1 else np.arange(p), n)
            for s, (n, p) in enumerate(zip(packed.lengths, packed.padded, strict=True))
        ]
        stream = np.concatenate(parts) if parts else np.zeros((0, 2), np.int64)
    else:
        whole = np.concatenate(
            [_mark(s, np.arange(p), n) for s, (n, p) in enumerate(zip(packed.lengths, packed.padded, strict=True))]
        )
        if whole.shape[0] % cp:
            raise AlignmentError(f"{whole.shape[0]} packed tokens do not split over CP = {cp} contiguous parts")
        share = whole.shape[0] // cp
        stream = whole[cp_rank * share : (cp_rank + 1) * share]
    if packed.local_tail:
        stream = np.concatenate([stream, np.full((packed.local_tail, 2), PAD, np.int64)])
    return stream


def _bshd(packed: PackedLengths, layout: ParallelLayout, cp: int, cp_rank: int) -> npt.NDArray[np.int64]:
    width = packed.padded[0]
    if cp == 1:
        columns = np.arange(width)
    elif layout.cp_layout == "zigzag":
        columns = zigzag_chunks(width, cp, cp_rank)
    else:
        if width % cp:
            raise AlignmentError(f"BSHD width {width} does not split over CP = {cp}")
        columns = np.arange(cp_rank * width // cp, (cp_rank + 1) * width // cp)
    if layout.sp and layout.tp > 1 and columns.shape[0] % layout.tp:
        raise AlignmentError(f"{columns.shape[0]} local positions do not split over TP = {layout.tp}")
    batch = len(packed.lengths)
    lengths = np.asarray(packed.lengths)[None, :]
    seq = np.broadcast_to(np.arange(batch)[None, :], (columns.shape[0], batch))
    pos = np.broadcast_to(columns[:, None], (columns.shape[0], batch))
    real = pos < lengths
    out = np.stack([np.where(real, seq, PAD), np.where(real, pos, PAD)], axis=-1)  # [S_local, B, 2]
    return out.reshape(-1, 2)  # sequence-major: row s * B + b
