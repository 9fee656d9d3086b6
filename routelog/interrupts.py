"""Ctrl-C that lands between records, never inside a writer's locks.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be, including between a lock's acquire and
the block that releases it: a writer interrupted there keeps its lock forever, and its background threads, and the
``abort`` that waits for them, hang with it (seen: ``routelog synth`` never ending after SIGINT). A command that
writes runs its loop inside :func:`deferred`: the first SIGINT only raises a flag, which the loop checks between
records (:meth:`Deferred.check`) and which takes effect once the record in hand is appended; a second SIGINT
interrupts at once, as Python would.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


class Deferred:
    """What :func:`deferred` yields: whether Ctrl-C was pressed, and the check that acts on it."""

    def __init__(self) -> None:
        self.requested = threading.Event()

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if Ctrl-C was pressed since the block began."""
        if self.requested.is_set():
            raise KeyboardInterrupt


@contextlib.contextmanager
def deferred() -> Iterator[Deferred]:
    """Within the block the first SIGINT is deferred to the next :meth:`Deferred.check` (and to the block's end, if
    none comes); a second one interrupts at once. Outside the main thread, where no handler can be installed, SIGINT
    keeps Python's behaviour."""
    state = Deferred()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return
    previous = signal.getsignal(signal.SIGINT)

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if state.requested.is_set():
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt
        state.requested.set()

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield state
    finally:
        signal.signal(signal.SIGINT, previous)
    state.check()
