"""How trainers pack a micro-batch: padded length per sequence (THD) or the padded width (BSHD).

Each rule reproduces its framework's packer exactly (read from their sources; see the README), because the routing
rows must land where the trainer puts the tokens. When the trainer can say where it put them, pass its
``cu_seqlens_padded`` instead: never re-derive what the trainer can tell you.

* ``verl`` (``preprocess_packed_seqs`` / ``preprocess_thd_engine``): align ``A = TP*2CP`` with zigzag CP > 1,
  ``TP*CP`` with contiguous CP, else ``TP``; each sequence to a multiple of ``A``. With FP8 (e4m3/hybrid) each
  sequence to ``lcm(16, A)`` and the total, by growing the last sequence, to a multiple of ``A*128``.
* ``slime`` (``get_batch``, zigzag): with CP > 1 each sequence to ``2*CP*ceil(L/2CP)``; after the CP split each
  rank's local stream gets a pad tail up to a multiple of ``TP * data_pad_size_multiplier`` (128).
* ``slime-allgather`` (slime/miles ``--allgather-cp``, DSA models): sequences unpadded, the whole stream padded at
  its end to a multiple of ``CP * TP * data_pad_size_multiplier``, then split contiguously over CP.
* ``nemo`` (NeMo-RL ``_pack_sequences_for_megatron``): each sequence to a multiple of
  ``make_sequence_length_divisible_by`` (which must be a multiple of ``(2CP if CP>1)*(TP if SP)``, the default);
  the total, by growing the last sequence, to a multiple of ``divisor*(2CP if CP>1)*(TP if SP)`` where the divisor
  is the FP8 block (16 tensorwise/delayed, 32 MXFP8, 128 blockwise) or 128 for HybridEP's flex dispatcher (the
  larger); with PP every micro-batch of the step to the same ``pad_to``.
* ``bshd``: a padded ``[B, S]`` batch, ``S`` the longest sequence rounded up to ``(2CP if CP>1)*(TP if SP)``
  unless given; rows are sequence-major (``s*B + b``).
* ``thd``: the trainer's own ``cu_seqlens_padded`` per micro-batch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from routelog.align.layout import CpLayout, ParallelLayout
from routelog.errors import AlignmentError

PackingKind = Literal["verl", "slime", "slime-allgather", "nemo", "bshd", "thd"]
PACKING_KINDS: tuple[PackingKind, ...] = ("verl", "slime", "slime-allgather", "nemo", "bshd", "thd")
FP8_BLOCKS = (16, 32, 128)
"""FP8 recipes' block sizes: 16 tensorwise/delayed, 32 MXFP8, 128 blockwise."""
HYBRID_EP_DIVISOR = 128


@dataclass(frozen=True)
class Packing:
    """The packing convention of the trainer."""

    kind: PackingKind = "verl"
    fp8: bool = False
    """FP8 training (verl and NeMo-RL pad further)."""
    fp8_block: int = 128
    """NeMo-RL: the FP8 recipe's block, 16 (tensorwise/delayed), 32 (MXFP8) or 128 (blockwise)."""
    hybrid_ep: bool = False
    """NeMo-RL with the flex dispatcher's HybridEP backend: the total to a multiple of 128 times the CP/SP factor."""
    divisible_by: int | None = None
    """NeMo-RL ``make_sequence_length_divisible_by``: each sequence's multiple (default: the minimum factor)."""
    slime_pad_multiplier: int = 128
    """slime ``--data-pad-size-multiplier``: the local (zigzag) or global (all-gather CP) stream is padded to
    ``TP * slime_pad_multiplier`` (times CP for all-gather CP)."""

    def __post_init__(self) -> None:
        if self.kind not in PACKING_KINDS:
            raise AlignmentError(f"packing must be one of {', '.join(PACKING_KINDS)}, got {self.kind!r}")
        if self.fp8_block not in FP8_BLOCKS:
            raise AlignmentError(
                f"fp8_block must be one of {FP8_BLOCKS} (the FP8 recipe's block), got {self.fp8_block}"
            )
        if self.divisible_by is not None and self.divisible_by < 1:
            raise AlignmentError(f"divisible_by must be >= 1, got {self.divisible_by}")
        if self.slime_pad_multiplier < 1:
            raise AlignmentError(f"slime_pad_multiplier must be >= 1, got {self.slime_pad_multiplier}")

    def nemo_multiples(self, layout: ParallelLayout, cp: int) -> tuple[int, int]:
        """NeMo-RL's (per-sequence multiple, total multiple) for a CP size."""
        factor = (2 * cp if cp > 1 else 1) * (layout.tp if layout.tp > 1 and layout.sp else 1)
        per_seq = self.divisible_by or factor
        if per_seq % factor:
            raise AlignmentError(
                f"make_sequence_length_divisible_by={per_seq} must be a multiple of {factor} = (2*CP if CP>1) * "
                "(TP if sequence parallel), as NeMo-RL asserts"
            )
        divisor = max(self.fp8_block if self.fp8 else 1, HYBRID_EP_DIVISOR if self.hybrid_ep else 1)
        return per_seq, divisor * factor if divisor > 1 else 1


@dataclass(frozen=True)
class PackedLengths:
    """One micro-batch packed: where each sequence sits before the CP and SP splits."""

    lengths: tuple[int, ...]
    """Tokens of each sequence, as fed."""
    padded: tuple[int, ...]
    """THD: padded length of each sequence (the last may absorb total padding). BSHD: the width S for all."""
    bshd: bool = False
    local_tail: int = 0
    """Padding rows appended to each CP rank's local stream after the split (slime)."""
    cp_layout: CpLayout | None = None
    """A CP split the packing itself implies (slime's all-gather CP is contiguous), overriding the layout's."""

    @property
    def cu_seqlens_padded(self) -> tuple[int, ...]:
        out = [0]
        for p in self.padded:
            out.append(out[-1] + p)
        return tuple(out)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple if multiple > 1 else value


def pack(
    lengths: Sequence[int],
    packing: Packing,
    layout: ParallelLayout,
    *,
    cp: int | None = None,
    cu_seqlens_padded: Sequence[int] | None = None,
    seq_len: int | None = None,
    pad_to: int | None = None,
) -> PackedLengths:
    """Padded geometry of one micro-batch. ``cp`` overrides the layout's CP size (dynamic CP)."""
    lengths = tuple(int(n) for n in lengths)
    cp = layout.cp if cp is None else cp
    tp, sp = layout.tp, layout.sp
    if not lengths:
        raise AlignmentError("a micro-batch needs at least one sequence")
    if cu_seqlens_padded is not None or packing.kind == "thd":
        if cu_seqlens_padded is None:
            raise AlignmentError("packing 'thd' needs the trainer's cu_seqlens_padded for every micro-batch")
        cu = [int(v) for v in cu_seqlens_padded]
        given = tuple(b - a for a, b in itertools.pairwise(cu))
        if len(given) != len(lengths) or cu[0] != 0 or any(p < n for p, n in zip(given, lengths, strict=True)):
            raise AlignmentError(
                f"cu_seqlens_padded {cu} does not hold the {len(lengths)} sequences of lengths {list(lengths)}"
            )
        return PackedLengths(lengths, given)
    if packing.kind == "bshd":
        multiple = (2 * cp if cp > 1 else 1) * (tp if sp else 1)
        width = seq_len if seq_len is not None else _round_up(max(lengths), multiple)
        if width < max(lengths) or width % multiple:
            raise AlignmentError(f"BSHD width {width} must hold {max(lengths)} tokens and divide by {multiple}")
        return PackedLengths(lengths, (width,) * len(lengths), bshd=True)
    if packing.kind == "verl":
        contiguous = layout.cp_layout == "contiguous"
        align = tp * cp * (1 if contiguous else 2) if cp > 1 else tp
        per_seq = math.lcm(16, align) if packing.fp8 else align
        padded = [_round_up(n, per_seq) for n in lengths]
        if packing.fp8:
            padded[-1] += _round_up(sum(padded), align * 128) - sum(padded)
        return PackedLengths(lengths, tuple(padded))
    if packing.kind == "slime":
        padded = [_round_up(n, 2 * cp) if cp > 1 else n for n in lengths]
        local = sum(padded) // cp
        return PackedLengths(
            lengths, tuple(padded), local_tail=_round_up(local, tp * packing.slime_pad_multiplier) - local
        )
    if packing.kind == "slime-allgather":
        total = _round_up(sum(lengths), cp * tp * packing.slime_pad_multiplier)
        padded = [*lengths[:-1], lengths[-1] + total - sum(lengths)]  # the stream's pad tail, after the last one
        return PackedLengths(lengths, tuple(padded), cp_layout="contiguous")
    # nemo
    per_seq, multiple = packing.nemo_multiples(layout, cp)
    padded_nemo = [_round_up(n, per_seq) for n in lengths]
    if pad_to is not None:
        total = _round_up(pad_to, multiple)
        if total < sum(padded_nemo):
            raise AlignmentError(f"pad_to {pad_to} is shorter than the packed micro-batch ({sum(padded_nemo)} tokens)")
        padded_nemo[-1] += total - sum(padded_nemo)
    elif multiple > 1:
        padded_nemo[-1] += _round_up(sum(padded_nemo), multiple) - sum(padded_nemo)
    return PackedLengths(lengths, tuple(padded_nemo))


def nemo_pad_to(lengths_per_micro_batch: Sequence[Sequence[int]], packing: Packing, layout: ParallelLayout) -> int:
    """NeMo-RL with PP: every micro-batch of the step (on this DP rank) is padded to the same total, the largest
    packed micro-batch rounded up to the total multiple."""
    per_seq, multiple = packing.nemo_multiples(layout, layout.cp)
    largest = max(sum(_round_up(n, per_seq) for n in lengths) for lengths in lengths_per_micro_batch)
    return _round_up(largest, multiple)
