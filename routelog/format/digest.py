"""A commit's records in a few bytes each: what a process deciding duplicates or looking for shared prefixes needs
to know of other writers' parts without reading their indexes.

A format-4 commit carries two sorted sets of 64-bit hashes (FORMAT.md section 3.3): of its records' sample ids, and
of the first :data:`MIN_SHARED_TOKENS` token ids of each record that has that many (the probe the prefix index keys
its candidates by, :func:`prefix_probe`). A hash that matches is a *maybe*: the part's index decides. A hash that
does not match is a *no*: a commit whose digest misses a sample id does not hold it (``routelog verify`` checks the
digests against the indexes), so a writer among a thousand reads only the indexes of the commits it collides with.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from routelog.errors import CorruptDataError

MIN_SHARED_TOKENS = 16
"""Shorter shared prefixes are stored again: the spans that point at them would cost about what they save."""
HASH_BYTES = 8
DIGEST_PATTERN = r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?"
"""Standard base64 (RFC 4648, padded): what a digest field holds."""

Hashes = npt.NDArray[np.uint64]


def sample_id_hash(sample_id: str) -> int:
    """The 64-bit hash of a sample id (BLAKE2b of its UTF-8 bytes, the first 8 bytes little-endian)."""
    return int.from_bytes(hashlib.blake2b(sample_id.encode("utf-8"), digest_size=HASH_BYTES).digest(), "little")


def sample_id_hashes(sample_ids: Iterable[str]) -> Hashes:
    return np.fromiter((sample_id_hash(s) for s in sample_ids), dtype=np.uint64)


def prefix_probe(tokens: npt.NDArray[np.int64]) -> bytes:
    """What the prefix index keys candidates by: a hash of a record's first :data:`MIN_SHARED_TOKENS` token ids
    (int64)."""
    return hashlib.blake2b(tokens[:MIN_SHARED_TOKENS].tobytes(), digest_size=16).digest()


def probe_hash(token_ids: npt.NDArray[np.int64]) -> int | None:
    """The 64-bit probe of a record's first token ids (the prefix index's own probe, cut to 8 bytes); None for a
    record too short to share a prefix."""
    if token_ids.size < MIN_SHARED_TOKENS:
        return None
    return int.from_bytes(prefix_probe(np.asarray(token_ids, dtype=np.int64))[:HASH_BYTES], "little")


def encode_hashes(hashes: Iterable[int] | Hashes) -> str:
    """The sorted distinct hashes as base64 of their little-endian bytes."""
    values = np.unique(np.asarray(list(hashes) if not isinstance(hashes, np.ndarray) else hashes, dtype=np.uint64))
    return base64.b64encode(values.astype("<u8").tobytes()).decode("ascii")


def decode_hashes(text: str, max_count: int, where: str) -> Hashes:
    """The hashes a digest field holds, refused (:class:`CorruptDataError`) when they are more than ``max_count``
    (the records the commit vouches for), not whole 8-byte words, or not sorted and distinct. The length is checked
    before anything is decoded."""
    if len(text) > 4 * -(-HASH_BYTES * max_count // 3):
        raise CorruptDataError(f"{where}: the digest holds more hashes than the commit's {max_count} records")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise CorruptDataError(f"{where}: the digest is not base64 ({exc})") from None
    if len(raw) % HASH_BYTES:
        raise CorruptDataError(f"{where}: the digest is not a whole number of {HASH_BYTES}-byte hashes")
    values = np.frombuffer(raw, dtype="<u8").astype(np.uint64)
    if values.size > 1 and not (values[1:] > values[:-1]).all():
        raise CorruptDataError(f"{where}: the digest's hashes are not sorted and distinct")
    return values
