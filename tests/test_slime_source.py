"""The lazy replay resource slime's routers pop (``routelog.integrations.slime_source``), proven against a model.

A hypothesis state machine interleaves every operation slime and a failing store can apply: a router popping any
micro-batch in either stage, ``begin_lazy_pass`` switching the release stage, a read that fails, and
``clear_all`` closing the resource. Whatever the order, each pop returns exactly micro-batch ``m``'s tensor of
router ``j``; a micro-batch is kept until each router popped it in the release stage, then dropped and read again
when popped again; a failed read fails only the pop that needed it; nothing is served after close.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from routelog.errors import ReplayConfigError
from routelog.integrations.slime_source import STAGES, PreparedMicroBatch, RolloutSource

torch = pytest.importorskip("torch")

MICRO_BATCHES, ROUTERS, K = 3, 2, 2


def tensor_of(m: int) -> Any:
    """Micro-batch ``m``'s routing: ``[routers, m + 2 rows, K]``, every value naming (m, router, row, slot)."""
    values = np.arange(ROUTERS * (m + 2) * K, dtype=np.int32).reshape(ROUTERS, m + 2, K) + 1000 * m
    return torch.from_numpy(values)


class InjectedReadError(RuntimeError):
    pass


class LazyReplayMachine(RuleBasedStateMachine):
    @initialize(prefetch=st.integers(0, 2), release=st.sampled_from(STAGES))
    def start(self, prefetch: int, release: str) -> None:
        self.prefetch = prefetch
        self.failing = threading.Lock()
        self.fail_next = 0  # reads still to fail (the next builds, whichever thread runs them)
        self.injected = self.failed = 0
        self.built: list[int] = []
        self.source = RolloutSource(self.build, MICRO_BATCHES, ROUTERS, prefetch=prefetch, release_stage=release)
        self.release = release
        self.kept: set[int] = set()  # the model: micro-batches built and not released (exact without read-ahead)
        self.pops: dict[tuple[int, str], int] = {}
        self.closed = False

    def build(self, m: int) -> PreparedMicroBatch:
        with self.failing:
            fail, self.fail_next = self.fail_next > 0, max(0, self.fail_next - 1)
        if fail:
            raise InjectedReadError(f"read of micro-batch {m} failed")
        self.built.append(m)
        return PreparedMicroBatch(ids=tensor_of(m), mask=np.ones(m + 2, dtype=bool))

    @precondition(lambda self: not self.closed)
    @rule(m=st.integers(0, MICRO_BATCHES - 1), router=st.integers(0, ROUTERS - 1), stage=st.sampled_from(STAGES))
    def pop(self, m: int, router: int, stage: str) -> None:
        try:
            got = self.source.materialize(m, router, stage)
        except InjectedReadError:
            self.failed += 1
            assert m not in self.kept, "only a read fails, never a kept micro-batch"
            assert self.failed <= self.injected, "a failed read is read again, not kept failing"
            return
        assert torch.equal(got, tensor_of(m)[router]) and got.dtype == torch.int32
        self.kept.add(m)
        count = self.pops.get((m, stage), 0) + 1
        if count >= ROUTERS:
            count = 0
            if stage == self.release:
                self.kept.discard(m)
        self.pops[(m, stage)] = count

    @precondition(lambda self: not self.closed)
    @rule()
    def fail_next_read(self) -> None:
        with self.failing:
            self.fail_next += 1
        self.injected += 1

    @precondition(lambda self: not self.closed)
    @rule(stage=st.sampled_from(STAGES))
    def begin_pass(self, stage: str) -> None:
        self.source.begin_pass(stage)
        self.release = stage

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self) -> None:
        self.source.close()
        self.source.close()  # slime's clear_all and routelog's end of rollout both close it
        self.closed = True
        self.kept.clear()

    @precondition(lambda self: self.closed)
    @rule(m=st.integers(0, MICRO_BATCHES - 1))
    def pop_after_close(self, m: int) -> None:
        with pytest.raises(ReplayConfigError, match="after the rollout's routing was closed"):
            self.source.materialize(m, 0, "forward")

    @invariant()
    def keeps_what_the_model_keeps(self) -> None:
        if not hasattr(self, "source"):
            return
        if self.prefetch == 0:
            assert self.source.host_bytes == sum(tensor_of(m).nbytes for m in self.kept)
            assert self.source.builds == len(self.built)
        else:
            assert self.source.host_bytes >= sum(tensor_of(m).nbytes for m in self.kept)

    def teardown(self) -> None:
        if hasattr(self, "source"):
            self.source.close()


LazyReplayMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_lazy_replay_protocol = LazyReplayMachine.TestCase


def test_begin_pass_refuses_an_unknown_stage_and_reads_ahead() -> None:
    built: list[int] = []

    def build(m: int) -> PreparedMicroBatch:
        built.append(m)
        return PreparedMicroBatch(ids=tensor_of(m), mask=np.ones(m + 2, dtype=bool))

    source = RolloutSource(build, MICRO_BATCHES, ROUTERS, prefetch=2)
    with pytest.raises(ReplayConfigError, match="release stage must be one of"):
        source.begin_pass("sideways")
    source.begin_pass("forward")
    source.materialize(0, 0, "forward")  # waits for the read-ahead of 0, then reads 1 and 2 ahead
    source.close()
    assert sorted(built)[:2] == [0, 1] and all(built.count(m) == 1 for m in built)
