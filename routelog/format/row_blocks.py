"""The rows a part encodes, ``[layers, rows, K]``, held so that the build never holds them twice.

A part's routing rows arrive one record at a time. Copying them into one array before encoding held every row
twice (the records, then the part) for the whole build. :class:`RowBlocks` keeps the blocks as they came instead,
and gathers a chunk that crosses a record boundary alone (one chunk's bytes, never the part's).

When nothing else needs the rows (:meth:`RowBlocks.consume`), each layer chunk's rows are given back to the OS as
soon as its chunks are compressed (shards are encoded one layer chunk after the other, and each record's rows are
layer-major in memory mapped for them, see :func:`routelog.format.mapped.discard`): the part's raw rows shrink while
its compressed bytes grow, with no copy.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.format import mapped


class RowBlocks:
    """Blocks ``[layers, m_i, K]`` of one dtype, read as their concatenation on axis 1."""

    def __init__(self, layers: int, topk: int, dtype: np.dtype[Any]) -> None:
        self.layers, self.topk, self.dtype = layers, topk, np.dtype(dtype)
        self._blocks: list[npt.NDArray[Any]] = []
        self._starts: list[int] = []
        self._consumed = False
        self._on_release: Callable[[int], None] | None = None
        self.n = 0

    @classmethod
    def of(cls, array: npt.NDArray[Any]) -> RowBlocks:
        """One array as a single block."""
        blocks = cls(array.shape[0], array.shape[2], array.dtype)
        blocks.append(array)
        return blocks

    def append(self, block: npt.NDArray[Any]) -> int:
        """Add ``block`` (kept, not copied: it must not change afterwards); returns the row of its first row."""
        start = self.n
        if block.shape[0] != self.layers or block.shape[2] != self.topk or block.dtype != self.dtype:
            raise ValueError(
                f"a block of {block.shape} {block.dtype} does not fit rows of "
                f"[{self.layers}, *, {self.topk}] {self.dtype}"
            )
        if block.shape[1]:
            self._blocks.append(block)
            self._starts.append(start)
            self.n += block.shape[1]
        return start

    def rows(self, start: int, stop: int, layers: slice = slice(None)) -> npt.NDArray[Any]:
        """Rows ``[start, stop)`` of ``layers``: a view where one block holds them, else a gathered copy."""
        if not 0 <= start <= stop <= self.n:
            raise IndexError(f"rows [{start}, {stop}) outside [0, {self.n})")
        first = max(0, bisect.bisect_right(self._starts, start) - 1)
        if first < len(self._blocks) and stop <= self._starts[first] + self._blocks[first].shape[1]:
            base = self._starts[first]
            return self._blocks[first][layers, start - base : stop - base]
        out = np.empty((len(range(self.layers)[layers]), stop - start, self.topk), self.dtype)
        at, i = start, first
        while at < stop:
            block, base = self._blocks[i], self._starts[i]
            end = min(stop, base + block.shape[1])
            out[:, at - start : end - start] = block[layers, at - base : end - base]
            at, i = end, i + 1
        return out

    def take(self, rows: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
        """Rows at the given positions (a view where they are consecutive within one block)."""
        at = consecutive(rows) if rows.size else slice(0, 0)
        if isinstance(at, slice):
            return self.rows(at.start, at.stop)
        runs = np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1)
        return np.concatenate([self.rows(int(run[0]), int(run[-1]) + 1) for run in runs], axis=1)

    def consume(self, on_release: Callable[[int], None] | None = None) -> None:
        """From now on :meth:`release` gives the released layers' memory back: nothing else reads these rows.
        ``on_release`` is told how many bytes each release gave back."""
        self._consumed = True
        self._on_release = on_release

    def release(self, layers: slice) -> None:
        """The encoder is done with these layers: their memory goes back to the OS once consumed."""
        if self._consumed:
            released = 0
            for block in self._blocks:
                done = block[layers]
                mapped.discard(done)
                released += done.nbytes
            if self._on_release is not None:
                self._on_release(released)

    @property
    def nbytes(self) -> int:
        return sum(int(block.nbytes) for block in self._blocks)


def consecutive(rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int64] | slice:
    """``rows`` as a slice where they are consecutive, so that taking them copies nothing."""
    if rows[-1] - rows[0] == rows.size - 1 and (rows.size < 2 or bool((np.diff(rows) == 1).all())):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows
