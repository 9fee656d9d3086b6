"""Read-ahead of a trainer pass's micro-batches: each built on first use, the next few built in the background.

The trainer integrations that hand a framework its routing when the framework asks (slime's lazy references,
NeMo-RL's processed micro-batches) know the pass's micro-batches up front but learn late which one runs next: a
:class:`ReadAhead` builds item ``i`` when it is first asked for and the next ``window`` items ahead of it in one
background thread (a failed build fails only the request that needed it, and is built again on the next), and
keeps each item until it is released.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class ReadAhead(Generic[T]):
    """Items ``0 .. count - 1`` of a pass, built by ``build(i)``. ``closed_error(i)`` is what asking for item ``i``
    after :meth:`close` raises."""

    def __init__(
        self,
        build: Callable[[int], T],
        count: int,
        *,
        window: int,
        closed_error: Callable[[int], Exception],
        name: str = "routelog-read-ahead",
    ) -> None:
        self._build, self.count, self.window = build, count, max(0, window)
        self._closed_error = closed_error
        self._lock = threading.Lock()
        self._ready: dict[int, T] = {}
        self._pending: dict[int, Future[T]] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name) if self.window else None
        self.closed = False
        self.builds = 0
        """Items built so far (an item released and asked for again is built again)."""

    def get(self, i: int) -> T:
        """Item ``i``: kept, being built (waited for), or built now; then the next ``window`` items are built
        ahead."""
        with self._lock:
            if self.closed:
                raise self._closed_error(i)
            ready = self._ready.get(i)
            future = None if ready is not None else self._pending.get(i)
            if ready is None and future is None and self._executor is not None:
                future = self._pending[i] = self._executor.submit(self._counted, i)
        if ready is None:
            try:
                ready = self._counted(i) if future is None else future.result()
            finally:
                with self._lock:
                    self._pending.pop(i, None)
            with self._lock:
                if not self.closed:
                    self._ready[i] = ready
        self.ahead(i + 1)
        return ready

    def ahead(self, start: int) -> None:
        """Build items ``start .. start + window - 1`` in the background (those neither kept nor being built)."""
        if self._executor is None:
            return
        with self._lock:
            if self.closed:
                return
            for i in range(start, min(self.count, start + self.window)):
                if i not in self._ready and i not in self._pending:
                    self._pending[i] = self._executor.submit(self._counted, i)

    def release(self, i: int) -> None:
        """Drop item ``i`` (asked for again, it is built again)."""
        with self._lock:
            self._ready.pop(i, None)

    def held(self) -> list[T]:
        """The items kept now."""
        with self._lock:
            return list(self._ready.values())

    def close(self) -> None:
        """Stop building and drop every item (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._ready.clear()
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.cancel()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def _counted(self, i: int) -> T:
        item = self._build(i)
        with self._lock:
            self.builds += 1
        return item


__all__ = ["ReadAhead"]
