"""A part's indexer object, ``indexer.bin``: the sparse-attention indexer rows of its records (FORMAT.md section 15).

One positions block (:mod:`routelog.format.positions`) per record and indexer layer, found through a table of the
records' sample-id hashes at the object's head, so a reader fetches the head, then only the blocks of the layers it
needs (and within a block decodes only the keyframe groups of the tokens it needs). Layout, little-endian::

    8 bytes   b"RLIDX\\x00\\x00\\x01"  magic and version 1
    u32       n_records               records with indexer rows, each once
    u32       num_layers              blocks per record (the model spec's indexer layers)
    table     n_records entries ascending by hash: u64 the sample id's hash (routelog.format.digest), then per
              layer u64 offset of the block in the object, u32 its length, u32 its crc32c
    blocks    at the offsets the table gives, each within the object

The commit's ``indexer.table_crc32c`` covers the head and the table: a ranged read checks it before it trusts an
offset, and each block's crc32c before it decodes it.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import google_crc32c

from routelog.errors import CorruptDataError
from routelog.format.digest import sample_id_hash
from routelog.format.limits import check_count

MAGIC = b"RLIDX\x00\x00\x01"
HEAD_BYTES = len(MAGIC) + 8
"""The magic, ``n_records`` and ``num_layers``."""
KEY = "indexer.bin"


def entry_bytes(num_layers: int) -> int:
    """Bytes of one table entry: the hash, then an offset, a length and a crc32c per layer."""
    return 8 + 16 * num_layers


def table_bytes(n_records: int, num_layers: int) -> int:
    """Bytes of the head and the table."""
    return HEAD_BYTES + n_records * entry_bytes(num_layers)


@dataclass(frozen=True)
class Block:
    """Where one record's block of one layer lies in the object."""

    offset: int
    length: int
    crc32c: int


def build(records: Sequence[tuple[str, Sequence[bytes]]], num_layers: int) -> tuple[bytes, int]:
    """The object for ``records`` (sample id, one block per layer), and the crc32c of its head and table."""
    hashed = sorted((sample_id_hash(sid), sid, blocks) for sid, blocks in records)
    for (a, first, _), (b, second, _) in itertools.pairwise(hashed):
        if a == b:  # 64-bit hashes of distinct ids: practically never, and then refused rather than ambiguous
            raise ValueError(f"sample ids {first!r} and {second!r} share a 64-bit hash: write them in separate parts")
    offset = table_bytes(len(hashed), num_layers)
    table = bytearray(MAGIC + struct.pack("<II", len(hashed), num_layers))
    for hashed_id, sid, blocks in hashed:
        if len(blocks) != num_layers:
            raise ValueError(f"sample {sid!r} has {len(blocks)} indexer blocks, not {num_layers}")
        table += struct.pack("<Q", hashed_id)
        for block in blocks:
            table += struct.pack("<QII", offset, len(block), google_crc32c.value(block))
            offset += len(block)
    crc = google_crc32c.value(bytes(table))
    return b"".join([bytes(table), *(b for _, _, blocks in hashed for b in blocks)]), crc


def read_head(head: bytes, object_size: int, declared: tuple[int, int], where: str) -> tuple[int, int]:
    """``(n_records, num_layers)`` of an object's first :data:`HEAD_BYTES`, checked against the commit's
    ``declared`` counts and the object's size before anything is sized by them."""
    if len(head) < HEAD_BYTES or head[: len(MAGIC)] != MAGIC:
        raise CorruptDataError(f"{where}: not a version-1 indexer object (its first bytes are {head[:8]!r})")
    n_records, num_layers = struct.unpack_from("<II", head, len(MAGIC))
    if (n_records, num_layers) != declared:
        raise CorruptDataError(
            f"{where}: the object holds {n_records} records of {num_layers} layers, its commit says "
            f"{declared[0]} of {declared[1]}"
        )
    check_count(
        table_bytes(n_records, num_layers),
        name="table bytes",
        at_most=object_size,
        where=where,
        expected=f"the object's {object_size} bytes",
    )
    return n_records, num_layers


def entries(table: bytes, num_layers: int, object_size: int, crc32c: int, where: str) -> dict[int, list[Block]]:
    """Every record's blocks by the sample id's hash (:func:`routelog.format.digest.sample_id_hash`), from the head and
    table ``table`` whose crc32c the commit gives; each block checked to lie within the object."""
    if google_crc32c.value(table) != crc32c:
        raise CorruptDataError(f"{where}: the head and table fail their crc32c")
    size = entry_bytes(num_layers)
    out: dict[int, list[Block]] = {}
    previous = -1
    for i in range((len(table) - HEAD_BYTES) // size):
        base = HEAD_BYTES + i * size
        (hashed,) = struct.unpack_from("<Q", table, base)
        if hashed <= previous:
            raise CorruptDataError(f"{where}: the table's hashes are not strictly ascending")
        previous = hashed
        blocks = [Block(*struct.unpack_from("<QII", table, base + 8 + 16 * j)) for j in range(num_layers)]
        for j, block in enumerate(blocks):
            if block.offset < len(table) or block.offset + block.length > object_size:
                raise CorruptDataError(f"{where}: entry {i}'s block of layer {j} lies outside the object's blocks")
        out[hashed] = blocks
    return out


def check_block(data: bytes | memoryview, block: Block, where: str) -> None:
    """Raise unless ``data`` is the block the table describes."""
    if len(data) != block.length or google_crc32c.value(bytes(data)) != block.crc32c:
        raise CorruptDataError(f"{where}: a block fails its length or crc32c")
