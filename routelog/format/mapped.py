"""Large buffers mapped straight from the OS, so that their memory goes back to it when they are freed.

malloc keeps the blocks it frees for later use, and after the first large block is freed it serves blocks of that
size from its heap too (glibc raises its mmap threshold), where a freed block in the middle never goes back: a
writer that allocates and frees a flush buffer's worth of record rows per part measured a peak RSS of 4 x its
flush buffer, of which 1.5 x was such freed heap. An anonymous mapping is unmapped when its array is collected, and
:func:`discard` gives part of one back before that (a part's layers, once they are encoded).
"""

from __future__ import annotations

import math
import mmap
from typing import Any

import numpy as np
import numpy.typing as npt

Bytes = mmap.mmap
"""An object's bytes in an anonymous mapping: bytes-like (``len``, slices, hashing, file writes; an HTTP client
needs a copy as ``bytes``)."""

MAPPED_MIN_BYTES = 1 << 18
"""Smaller buffers come from malloc (a mapping costs a system call and whole pages)."""
HUGE_MIN_BYTES = 4 << 20
"""An :func:`empty` array this large asks for transparent huge pages, as numpy does for its own arrays from 4 MiB:
the sort writes the rows once, and faulting them in 4 KiB at a time took as long as the sorting (a uniform 16k
tokens x 48 layers, top-8 of 128, encoded in 14.4-15.9 ms rather than 16.4-16.7 on the 2-core AMD EPYC; 0.53-0.60 x
zstd-3's speed, against 0.49-0.51). A writer's records are mostly smaller, and its peak RSS was unchanged (1.81 x
its flush buffer, two runs each). A :class:`Buffer` keeps small pages: huge ones there sped the encode as much
again, but held up to a huge page past the bytes written, and a writer to S3 peaked at 4.0 x its flush buffer in
two runs of four, against 3.3."""


def empty(shape: tuple[int, ...], dtype: np.dtype[Any] | type[Any]) -> npt.NDArray[Any]:
    """``np.empty(shape, dtype)``, mapped from the OS when it is large (its memory is freed with the array)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MAPPED_MIN_BYTES:
        return np.empty(shape, dtype)
    return np.frombuffer(_anonymous(nbytes, huge=True), dtype=dtype).reshape(shape)


def _anonymous(nbytes: int, *, huge: bool = False) -> mmap.mmap:
    """Private anonymous memory, as malloc maps it (Python's default, a shared mapping, is shared memory: slower to
    fault in, and :func:`discard` cannot free it); ``huge``: in transparent huge pages where the kernel has them
    and the mapping is large enough (:data:`HUGE_MIN_BYTES`)."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and nbytes >= HUGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping


def discard(view: npt.NDArray[Any]) -> None:
    """Give the whole pages under ``view`` back to the OS, when it lies in a mapping (:func:`empty`; else nothing
    happens): they read as zeros afterwards, so only for rows that are never read again. A view that is not
    contiguous is discarded one contiguous run of its first axis at a time."""
    owner: Any = view
    while owner is not None and not isinstance(owner, mmap.mmap):  # arrays -> the memoryview -> its mapping
        owner = owner.obj if isinstance(owner, memoryview) else getattr(owner, "base", None)
    if owner is None or not view.size:
        return
    if not view.flags.c_contiguous:
        for run in view:
            discard(run)
        return
    start = view.ctypes.data - np.frombuffer(owner, np.uint8, count=1).ctypes.data
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        owner.madvise(mmap.MADV_DONTNEED, first, last - first)


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""Linux 5.14+: fault a range of pages in, writable, in one call (Python names it from 3.13)."""
POPULATE_BYTES = 1 << 20
"""A :class:`Buffer` faults its next pages in this many bytes at a time, ahead of the pieces copied into them: the
4.3 MB of a shard's 52 chunks took 1.05-1.09 ms to write rather than 1.44-1.51 one page fault at a time (2-core AMD
EPYC; 4 MiB at a time was slower than none, pages past the end faulted in for nothing)."""


class Buffer:
    """Bytes written in order into a mapping as large as they can get (pages never written cost nothing), then cut
    to the size written."""

    _populates = True
    """Whether the kernel takes MADV_POPULATE_WRITE (cleared for the process at its first refusal)."""

    def __init__(self, capacity: int, start: int = 0) -> None:
        self._map = _anonymous(max(1, capacity))
        self._populated = 0
        self.size = start
        """Bytes written so far (the first ``start`` are left for :meth:`finish`'s head)."""

    def add(self, piece: bytes) -> None:
        end = self.size + len(piece)
        if end > self._populated and Buffer._populates:
            length = min(max(POPULATE_BYTES, end - self._populated), len(self._map) - self._populated)
            try:
                self._map.madvise(MADV_POPULATE_WRITE, self._populated, length)
            except OSError:  # an older kernel: the pages fault in one at a time
                Buffer._populates = False
            self._populated += length
        self._map[self.size : end] = piece
        self.size = end

    def finish(self, head: bytes = b"") -> Bytes:
        """The bytes written, with ``head`` written over their start."""
        self._map[: len(head)] = head
        self._map.resize(max(1, self.size))
        return self._map
