"""The audits' compiled passes against their numpy ones (``routelog.audit.kernels``): the same counts and
histograms on random routing of every shape and layout the reader hands out, and the same refusal of an ID out of
range."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routelog.audit import kernels


def test_the_compiled_audit_kernels_are_built() -> None:
    """pip builds them beside the codec's wherever a compiler exists (setup.py); a build that failed silently would
    leave every audit on numpy."""
    if os.environ.get("ROUTELOG_KERNELS", "").lower() == "numpy":
        pytest.skip("ROUTELOG_KERNELS=numpy chooses the numpy kernels")
    assert kernels._COMPILED is not None


compiled_only = pytest.mark.skipif(kernels._COMPILED is None, reason="the compiled audit kernels are not built")


@contextmanager
def numpy_kernels() -> Iterator[None]:
    compiled, kernels._COMPILED = kernels._COMPILED, None
    try:
        yield
    finally:
        kernels._COMPILED = compiled


@st.composite
def routings(draw: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Two routings of the same tokens ``[L, T, K]`` (b differs from a in some rows, sorted or not), the valid
    tokens, and E; sometimes views into a larger block, as the reader's records are."""
    wide = draw(st.booleans())
    experts = draw(st.integers(300, 2000) if wide else st.sampled_from([8, 64, 128, 256]))
    k = draw(st.integers(1, min(8, experts)))
    layers, tokens = draw(st.integers(1, 5)), draw(st.integers(0, 70))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    dtype = np.uint16 if wide else np.uint8
    a = np.argsort(rng.random((layers, tokens, experts)), axis=-1)[..., :k].astype(dtype)
    if draw(st.booleans()):
        a.sort(axis=-1)
    b = a.copy()
    change = rng.random((layers, tokens)) < draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    b[change] = np.argsort(rng.random((int(change.sum()), experts)), axis=-1)[:, :k]
    if draw(st.booleans()):  # the same sets in another order
        b = b[..., ::-1]
    valid = rng.random(tokens) < draw(st.sampled_from([0.0, 0.7, 1.0]))
    if draw(st.booleans()) and tokens > 2:  # views into a larger block
        block_a = np.zeros((layers, tokens + 5, k), dtype)
        block_b = np.zeros((layers, tokens + 5, k), dtype)
        block_a[:, 2 : tokens + 2], block_b[:, 2 : tokens + 2] = a, b
        a, b = block_a[:, 2 : tokens + 2], block_b[:, 2 : tokens + 2]
    return a, b, valid, experts


@compiled_only
@settings(max_examples=300, deadline=None)
@given(routings())
def test_expert_counts_match_numpy(case: tuple[np.ndarray, np.ndarray, np.ndarray, int]) -> None:
    a, _, valid, experts = case
    compiled = np.full((a.shape[0], experts), 3, np.int64)
    kernels.add_expert_counts(a, valid, compiled)
    with numpy_kernels():
        reference = np.full((a.shape[0], experts), 3, np.int64)
        kernels.add_expert_counts(a, valid, reference)
    assert np.array_equal(compiled, reference)
    expected = np.array([np.bincount(a[j][valid].ravel(), minlength=experts) for j in range(a.shape[0])]) + 3
    assert np.array_equal(compiled, expected.reshape(compiled.shape))


@compiled_only
@settings(max_examples=300, deadline=None)
@given(routings())
def test_differences_match_numpy(case: tuple[np.ndarray, np.ndarray, np.ndarray, int]) -> None:
    a, b, both, _ = case
    layers, _, k = a.shape
    compiled = kernels.Differences(layers, k)
    first = compiled.add(a, b, both)
    second = compiled.add(b, a, both)
    with numpy_kernels():
        reference = kernels.Differences(layers, k)
        assert reference.add(a, b, both) == first
        assert reference.add(b, a, both) == second
    for name in ("router_hist", "token_hist", "layer_diff"):
        assert np.array_equal(getattr(compiled, name), getattr(reference, name)), name
    # against the definition: |A \ B| per row, by Python sets
    lacking = [
        [len(set(a[j, t].tolist()) - set(b[j, t].tolist())) for t in np.flatnonzero(both)] for j in range(layers)
    ]
    assert first == (int(both.sum()), sum(map(sum, lacking)))
    assert compiled.layer_diff.tolist() == [2 * sum(d > 0 for d in row) for row in lacking]


@compiled_only
@pytest.mark.parametrize(("dtype", "experts"), [(np.uint8, 100), (np.uint16, 1000)])
def test_an_id_out_of_range_is_named_by_both(dtype: type, experts: int) -> None:
    ids = np.tile(np.arange(4, dtype=dtype), (3, 6, 1))
    ids[1, 4, 2] = experts
    valid = np.ones(6, bool)
    messages = []
    for context in (numpy_kernels, nullcontext):
        counts = np.zeros((3, experts), np.int64)
        with context(), pytest.raises(ValueError, match="at or above") as raised:
            kernels.add_expert_counts(ids, valid, counts)
        messages.append(str(raised.value))
        assert counts[0].sum() == 24 and counts[1:].sum() == 0  # the layers before the bad one are counted
    assert messages[0] == messages[1]
    assert "layer 1, token 4" in messages[0]
    valid[4] = False  # an invalid token is never read
    counts = np.zeros((3, experts), np.int64)
    kernels.add_expert_counts(ids, valid, counts)
    assert counts.sum() == 3 * 5 * 4


def test_shapes_that_disagree_are_refused() -> None:
    differences = kernels.Differences(2, 4)
    with pytest.raises(ValueError, match="expected"):
        differences.add(np.zeros((2, 5, 4), np.uint8), np.zeros((2, 6, 4), np.uint8), np.ones(5, bool))
