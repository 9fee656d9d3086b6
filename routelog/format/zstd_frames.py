"""zstd frames for the stored chunks: one compression and one decompression context per thread, reused.

Every inner chunk is one or two small frames (at most 128 KiB), so the per-call cost of a binding matters as much
as zstd itself: numcodecs creates a context on each call (measured on the development machine: 13 us to compress
and 16 us to decompress a 300-byte frame, against 2.6 and 1.1 us with a reused context; per format-2 chunk that
is about a fifth of the decode). python-zstandard's contexts are reused here, one set per thread because a
context must not serve two threads at once (readers and writers run chunks on several).

Decompression is bounded before it starts: a frame that declares more than its caller allows in its header is
refused without allocating it (routelog's writers always declare the size, as do numcodecs and zarr), as is one
declaring more than its own bytes can expand to; a frame that declares none is decoded into at most that many
bytes.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard

from routelog.format.limits import MAX_ZSTD_EXPANSION, check_count


class FrameError(ValueError):
    """A zstd frame that is damaged or larger than its caller allows (callers wrap it as corrupt data)."""


class _Contexts(threading.local):
    def __init__(self) -> None:
        self.compressors: dict[tuple[int, int | None], zstandard.ZstdCompressor] = {}
        self.decompressor = zstandard.ZstdDecompressor()

    def compressor(self, level: int, min_match: int | None) -> zstandard.ZstdCompressor:
        found = self.compressors.get((level, min_match))
        if found is None:
            if min_match is None:
                found = zstandard.ZstdCompressor(level=level, write_content_size=True)
            else:
                params = zstandard.ZstdCompressionParameters.from_level(
                    level, min_match=min_match, write_content_size=True
                )
                found = zstandard.ZstdCompressor(compression_params=params)
            self.compressors[(level, min_match)] = found
        return found


_CONTEXTS = _Contexts()


def compress(data: bytes | memoryview | npt.NDArray[Any], level: int, *, min_match: int | None = None) -> bytes:
    """One zstd frame of ``data``'s bytes at ``level``, its size declared in the header; ``min_match``: the
    shortest match zstd looks for (3 to 7; None: the level's own)."""
    return _CONTEXTS.compressor(level, min_match).compress(_buffer(data))


def _buffer(data: bytes | memoryview | npt.NDArray[Any]) -> bytes | memoryview:
    """``data``'s bytes without a copy (an array as a flat byte view; a flat uint8 array takes the short way)."""
    if not isinstance(data, np.ndarray):
        return data
    if data.ndim == 1 and data.dtype == np.uint8 and data.flags.c_contiguous:
        return data.data
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8).data


def compress_bound(n: int) -> int:
    """The most bytes :func:`compress` can produce for ``n`` input bytes (zstd's own bound, rounded up)."""
    return n + (n >> 8) + 64


def decompress(
    frame: bytes | memoryview | npt.NDArray[np.uint8],
    limit: int,
    what: str,
    *,
    exact: bool = False,
    sized: bool = False,
) -> npt.NDArray[np.uint8]:
    """The bytes of one zstd frame (read-only), at most ``limit`` of them (with ``exact``, exactly ``limit``);
    raises :class:`FrameError`, before decoding when the header declares a size out of bounds (or, ``sized``,
    none)."""
    # Called twice per stored chunk, so kept to the checks around the decompression (per chunk, this wrapper took
    # as long as decompressing a small section: keywords, a bytes -> array view and calls add up to microseconds).
    if isinstance(frame, np.ndarray):
        frame = _buffer(frame)
    try:
        size = _content_size(frame)
    except zstandard.ZstdError:  # no frame header: the decompressor says why below
        size = -1
    if size < 0:
        if sized:
            raise FrameError(f"the {what} frame declares no content size")
    elif size > limit or (exact and size != limit):
        raise FrameError(f"the {what} frame declares {size} bytes; a chunk holds {_allowed(limit, exact)}")
    elif size == 0:
        return np.empty(0, dtype=np.uint8)
    elif size > len(frame) * MAX_ZSTD_EXPANSION:  # zstandard would allocate it before finding the blocks short
        check_count(  # raises (compared here first: this runs twice a chunk)
            size,
            name="its content size",
            at_most=len(frame) * MAX_ZSTD_EXPANSION,
            where=f"the {what} frame of {len(frame)} bytes",
            expected=f"zstd expands a byte {MAX_ZSTD_EXPANSION} times at most",
            error=FrameError,
        )
    try:  # positional: (data, max_output_size, read_across_frames, allow_extra_data)
        data = _CONTEXTS.decompressor.decompress(frame, limit if size < 0 else 0, False, False)
    except zstandard.ZstdError as exc:
        raise FrameError(f"the {what} frame cannot be decoded ({exc})") from exc
    n = len(data)
    if n > limit or (exact and n != limit) or (size >= 0 and n != size):
        raise FrameError(f"the {what} frame decodes to {n} bytes ({_allowed(limit, exact)} allowed)")
    return np.frombuffer(data, np.uint8)


def _allowed(limit: int, exact: bool) -> str:
    return f"exactly {limit}" if exact else f"at most {limit}"


_content_size = zstandard.frame_content_size
"""The decompressed size a zstd frame header declares (RFC 8878 3.1.1.1): -1 when it declares none; raises
``zstandard.ZstdError`` when the bytes are no frame header."""
