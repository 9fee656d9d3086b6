"""How trainers pack a micro-batch: padded length per sequence (THD) or the padded width (BSHD).

Each rule reproduces its framework's packer exactly, because the routing rows must land where the trainer puts
the tokens. When the trainer can say where it put them, pass its ``cu_seqlens_padded`` instead: never re-derive
what the trainer can tell you.

* ``verl`` (``preprocess_packed_seqs``): align ``A = TP*CP*2`` if CP > 1 else ``TP``; with FP8 each sequence to
  ``lcm(16, A)`` and the total, by growing the last sequence, to a multiple of ``A*128``.
* ``slime`` (``get_batch``): with CP > 1 each sequence to ``2*CP*ceil(L/2CP)``; after the CP split the local stream
  is padded at its end to a multiple of ``TP*128``.
* ``nemo`` (NeMo-RL ``_pack_sequences_for_megatron``): each sequence to a multiple of ``(2CP if CP>1)*(TP if SP)``;
  with FP8 the total, by growing the last sequence, to a multiple of that times the FP8 block (128 blockwise,
  16 otherwise); with PP the total to the trainer's ``pad_to``.
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

from routelog.align.layout import ParallelLayout
from routelog.errors import AlignmentError

PackingKind = Literal["verl", "slime", "nemo", "bshd", "thd"]


@dataclass(frozen=True)
class Packing:
    """The packing convention of the trainer."""

    kind: PackingKind = "verl"
    fp8: bool = False
    """FP8 training (verl and NeMo-RL pad further)."""
    fp8_block: int = 128
    """NeMo-RL: 128 for blockwise FP8 recipes, 16 for the others."""
    slime_pad_multiplier: int = 128
    """slime: the local stream is padded to ``TP * slime_pad_multiplier``."""

    def __post_init__(self) -> None:
        if self.kind not in ("verl", "slime", "nemo", "bshd", "thd"):
            raise AlignmentError(f"packing must be verl, slime, nemo, bshd or thd, got {self.kind!r}")


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
        align = tp * cp * 2 if cp > 1 else tp
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
    # nemo
    factor = (2 * cp if cp > 1 else 1) * (tp if tp > 1 and sp else 1)
    padded_nemo = [_round_up(n, factor) for n in lengths]
    multiple = packing.fp8_block * factor if packing.fp8 else 1
    if pad_to is not None:
        total = _round_up(pad_to, multiple)
        if total < sum(padded_nemo):
            raise AlignmentError(f"pad_to {pad_to} is shorter than the packed micro-batch ({sum(padded_nemo)} tokens)")
        padded_nemo[-1] += total - sum(padded_nemo)
    elif multiple > 1:
        padded_nemo[-1] += _round_up(sum(padded_nemo), multiple) - sum(padded_nemo)
    return PackedLengths(lengths, tuple(padded_nemo))
