"""The codec kernels as installed: compiled where a compiler exists (this machine, CI), writing the reference bytes
(``tests/fixtures/kernels/reference.npz``, ``tools/make_kernel_fixtures.py``) and reading them back through both
the compiled and the numpy kernels."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from routelog.format import kernels, kernels_numpy

REFERENCE = Path(__file__).parent / "fixtures" / "kernels" / "reference.npz"


def _reference() -> list[tuple[np.ndarray[Any, Any], int, int, int, int, np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
    stored = np.load(REFERENCE)
    count = sum(name.startswith("ids_") for name in stored.files)
    out = []
    for n in range(count):
        experts, policy, placed, matched = (int(v) for v in stored[f"meta_{n}"])
        out.append((stored[f"ids_{n}"], experts, policy, placed, matched, stored[f"gaps_{n}"], stored[f"rest_{n}"]))
    return out


def test_the_compiled_kernels_are_built() -> None:
    """pip builds the C kernels wherever a compiler exists; a build that failed silently would leave every process
    on the numpy kernels."""
    if os.environ.get("ROUTELOG_KERNELS", "").lower() == "numpy":
        pytest.skip("ROUTELOG_KERNELS=numpy chooses the numpy kernels")
    assert kernels.IMPLEMENTATION == "compiled"


def test_the_compiled_constants_are_the_python_ones() -> None:
    from routelog.format import _ckernels  # type: ignore[attr-defined]

    compiled: dict[str, float] = _ckernels.CONSTANTS
    assert len(compiled) == 26
    assert {name: getattr(kernels, name) for name in compiled} == compiled


@pytest.mark.skipif(kernels.IMPLEMENTATION != "compiled", reason="the numpy kernels write a simpler encoding")
def test_the_encoder_writes_the_reference_bytes() -> None:
    reference = _reference()
    assert sum(rest[-1] == 2 for *_, rest in reference) > 10  # chunks with dictionaries
    for ids, experts, policy, placed, matched, gaps, rest in reference:
        got = kernels.encode_chunk(ids, experts, policy)
        assert np.array_equal(got[0], gaps) and np.array_equal(got[1], rest)
        assert got[2:] == (placed, matched)


@pytest.mark.parametrize("implementation", ["compiled", "numpy"])
def test_both_kernels_read_the_reference_chunks(implementation: str) -> None:
    decode = kernels.decode_chunk if implementation == "compiled" else kernels_numpy.decode_chunk
    if implementation == "compiled" and kernels.IMPLEMENTATION != "compiled":
        pytest.skip("the compiled kernels are not built here")
    for ids, experts, _, _, _, gaps, rest in _reference():
        layers, rows = ids.shape[:2]
        out = np.zeros_like(ids)
        args = (gaps, rest, experts, layers, rows, out)
        tail = (0, 0, kernels.ANY_ROWS, 0)
        status = decode(*args, *tail) if implementation == "compiled" else decode(*args, None, *tail)
        assert tuple(status) == (kernels.OK, 0)
        assert np.array_equal(out, ids)
