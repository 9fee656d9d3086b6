"""Ctrl-C deferred to the gaps between records (routelog.interrupts): a SIGINT that arrives while the main thread is
inside a lock takes effect at the next check, outside it; a second SIGINT interrupts at once."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from routelog import interrupts


def _interrupted(body: Callable[[interrupts.Deferred], None]) -> bool:
    """Run ``body`` in a deferred block; whether it ended in KeyboardInterrupt."""
    try:
        with interrupts.deferred() as interrupt:
            body(interrupt)
    except KeyboardInterrupt:
        return True
    return False


def _sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs here


def test_a_sigint_inside_a_lock_takes_effect_at_the_next_check_outside_it() -> None:
    lock, reached, before = threading.Lock(), [], signal.getsignal(signal.SIGINT)

    def body(interrupt: interrupts.Deferred) -> None:
        with lock:
            _sigint()  # a KeyboardInterrupt here would leave a writer's state half-done
            reached.append("the locked block ran to its end")
        reached.append(f"lock free: {not lock.locked()}, requested: {interrupt.requested.is_set()}")
        interrupt.check()
        reached.append("never: check raised")

    assert _interrupted(body)
    assert reached == ["the locked block ran to its end", "lock free: True, requested: True"]
    assert signal.getsignal(signal.SIGINT) is before, "the handler in place before is back"


def test_a_second_sigint_interrupts_at_once() -> None:
    reached = []

    def body(interrupt: interrupts.Deferred) -> None:
        _sigint()
        reached.append("after the first")
        _sigint()
        reached.append("never: the second interrupted")

    assert _interrupted(body)
    assert reached == ["after the first"]


def test_a_sigint_with_no_check_left_lands_as_the_block_ends() -> None:
    finished = []

    def body(interrupt: interrupts.Deferred) -> None:
        _sigint()
        finished.append("the block finished its work")

    assert _interrupted(body)
    assert finished == ["the block finished its work"]
    assert not _interrupted(lambda interrupt: interrupt.check()), "no SIGINT: nothing raised"


def test_outside_the_main_thread_sigint_keeps_pythons_behaviour() -> None:
    seen: list[object] = []
    before = signal.getsignal(signal.SIGINT)

    def body() -> None:
        with interrupts.deferred() as interrupt:
            seen.append(interrupt)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(10)
    assert len(seen) == 1 and signal.getsignal(signal.SIGINT) is before
