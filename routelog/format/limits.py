"""The format's version, the sizes a model spec may have, and the bound every count read from storage is checked
against before it sizes an allocation or a loop (FORMAT.md sections 1 and 9): constants and :func:`check_count` with
the bounds it takes (:func:`most_items`), so that the command line reads them (``routelog --version``, its options'
bounds) without loading the format's models."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from routelog.errors import CorruptDataError

FORMAT_VERSION: Final = 4
"""The format this routelog writes, and the newest it reads (it reads every older one too)."""

MAX_STEP: Final = 10**10 - 1
"""The highest step a store keeps (step directories are named with ten digits)."""
MAX_RECORD_TOKENS: Final = 1 << 22
"""Tokens of one record (prompt and response); 4 Mi tokens, far above any context length in use."""
MAX_EXPERTS: Final = 65536
"""Routed experts of a MoE layer, and the universe of a stream: IDs are stored as uint16."""
MAX_TOPK: Final = 1024
MAX_INDEX_TOPK: Final = 1 << 16
"""Key positions a sparse-attention indexer selects per token and layer (``index_topk``; 2048 in DeepSeek-V3.2)."""
"""Experts chosen per token per layer (the routing array's last axis), for the decoder and for every stream."""
MAX_MOE_LAYERS: Final = 4096
"""MoE layers of a model (the routing array's layer axis), layers of a stream and MTP layers."""
MAX_LAYERS: Final = 1 << 16
"""Decoder layers of a model, dense and MoE (``num_layers``): far above any model's depth, and a bound on every
per-layer list routelog builds from a spec or a config, checked before the list is built."""


# -- counts read from storage, against the bytes that hold them (FORMAT.md section 9) --------------------------------
MAX_ZSTD_EXPANSION: Final = 1 << 15
"""Bytes one stored byte of a zstd frame decodes to at most: a block decodes to at most 128 KiB and takes 4 bytes at
least (its 3-byte header and one byte of an RLE block), so no frame, however crafted, expands more (zeros compress
about 32 500 : 1 at every level)."""
MIN_DECISION_BITS: Final = 0.01
"""What one decision of routelog's binary range coders costs at least: their probabilities stop adapting at
2033/2048 (11-bit contexts) and 32513/32768 (counted contexts), 0.0106 and 0.0113 bits."""
RANGE_CODER_SLACK_BITS: Final = 64
"""Bits a range-coded stream holds beyond its bytes: the coder's 32-bit register and the final range's zero bytes,
which writers leave out (readers read bytes past a stream's end as zeros)."""
MIN_RECORD_BITS: Final = 1
"""Bits of its Parquet object a record (an index or values row) takes at least: each holds its own sample id,
distinct from its part-mates' (routelog's indexes take 1.4 bytes a record at the least, 200 000 records of one
token; 1 million sequential ids in brotli, 3 bits)."""


def most_items(nbytes: int, *, bits_each: float, slack_bits: int = 0) -> int:
    """The most items ``nbytes`` bytes can hold when each takes at least ``bits_each`` bits (and ``slack_bits`` come
    free): what bounds a count read beside them."""
    return int((8 * max(nbytes, 0) + slack_bits) // bits_each)


def most_decisions(nbytes: int) -> int:
    """The most decisions a range-coded stream of ``nbytes`` codes up to its last 1. (Decisions of 0 after it leave
    the coder's low end in place: they code as zero bytes, which writers leave out, so a stream has room for any
    number of them. A count bounded by this is of items each coding a 1, or all but one, as distinct sets do.)"""
    return most_items(nbytes, bits_each=MIN_DECISION_BITS, slack_bits=RANGE_CODER_SLACK_BITS)


def check_count(
    value: int,
    *,
    name: str,
    at_most: int,
    where: str,
    expected: str,
    error: Callable[[str], Exception] = CorruptDataError,
) -> int:
    """``value``, a count read from storage, once it is in ``[0, at_most]``; else ``error`` (by default
    :class:`~routelog.errors.CorruptDataError`; a codec's own error, which its caller turns into one naming the
    object) naming ``where`` (the object), the field ``name``, the value and the bound, and why the bound holds
    (``expected``). Check a count with it before anything is allocated or looped over for it."""
    if not 0 <= value <= at_most:
        raise error(f"{where}: {name} = {value}, expected at most {at_most} ({expected})")
    return value
