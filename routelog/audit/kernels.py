"""The per-record passes of the audits: expert load (``routelog stats``) and set differences (``routelog diff``).

Compiled (``routelog/audit/_ckernels.c``, built by pip beside the codec's kernels), or numpy where it is not built
or ``ROUTELOG_KERNELS=numpy`` asks for it; ``tests/test_audit_kernels.py`` proves the two equal. Both take routing
as the reader hands it out, layer-major ``[L, T, K]`` with any strides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.audit.r3 import routing_differences
from routelog.format.kernels import compiled_module

Counts = npt.NDArray[np.int64]

_COMPILED = compiled_module("routelog.audit._ckernels")


def add_expert_counts(
    by_layer: npt.NDArray[np.unsignedinteger[Any]], valid: npt.NDArray[np.bool_], counts: Counts
) -> None:
    """Add to ``counts`` ``[L, E]`` how often each expert of each layer is chosen in ``by_layer`` ``[L, T, K]``
    over the tokens in ``valid`` ``[T]``. Raises :class:`ValueError` naming an ID at or above E (the layers before
    it are counted)."""
    if _COMPILED is not None and by_layer.dtype.itemsize <= 2:
        bad = _COMPILED.count_experts(by_layer, np.ascontiguousarray(valid, np.bool_), counts)
        if bad >= 0:
            layer, rest = divmod(bad, by_layer.shape[1] * by_layer.shape[2])
            _out_of_range(layer, rest // by_layer.shape[2], counts.shape[1])
        return
    layers, experts = counts.shape
    for layer in range(layers):
        chosen = by_layer[layer][valid]
        if chosen.size and int(chosen.max()) >= experts:
            token = int(np.flatnonzero((by_layer[layer] >= experts).any(axis=1) & valid)[0])
            _out_of_range(layer, token, experts)
        counts[layer] += np.bincount(chosen.ravel(), minlength=experts)


def _out_of_range(layer: int, token: int, experts: int) -> None:
    raise ValueError(f"layer {layer}, token {token}: an expert ID at or above the model's {experts} experts")


@dataclass
class Differences:
    """Histograms of the set differences between two routings of the same tokens, added to record by record."""

    layers: int
    topk: int
    router_hist: Counts = field(init=False)
    """``router_hist[d]``: (token, layer) decisions where ``d`` of the K experts differ."""
    token_hist: Counts = field(init=False)
    """``token_hist[d]``: tokens with ``d`` differing experts summed over layers."""
    layer_diff: Counts = field(init=False)
    """Per layer: rows whose set differs."""

    def __post_init__(self) -> None:
        self.router_hist = np.zeros(self.topk + 1, np.int64)
        self.token_hist = np.zeros(self.layers * self.topk + 1, np.int64)
        self.layer_diff = np.zeros(self.layers, np.int64)

    def add(
        self, a: npt.NDArray[np.unsignedinteger[Any]], b: npt.NDArray[np.unsignedinteger[Any]], both: npt.NDArray[Any]
    ) -> tuple[int, int]:
        """Compare ``a`` and ``b`` ``[L, T, K]`` (IDs in any order within a row) on the tokens in ``both`` ``[T]``;
        returns the rows compared and the differing experts summed over them (a record's per-token mean is their
        ratio)."""
        if a.shape != b.shape or a.shape[0] != self.layers or a.shape[2] != self.topk:
            raise ValueError(f"routings of shapes {a.shape} and {b.shape}, expected [{self.layers}, T, {self.topk}]")
        if _COMPILED is not None and a.dtype.itemsize <= 2 and a.dtype == b.dtype:
            rows, differing = _COMPILED.compare_rows(
                a, b, np.ascontiguousarray(both, np.bool_), self.router_hist, self.token_hist, self.layer_diff
            )
            return int(rows), int(differing)
        counts = routing_differences(a[:, both], b[:, both])  # [L, T]
        self.router_hist += np.bincount(counts.ravel(), minlength=self.topk + 1)
        per_token = counts.sum(axis=0)
        self.token_hist += np.bincount(per_token, minlength=self.layers * self.topk + 1)
        self.layer_diff += (counts > 0).sum(axis=1)
        return int(per_token.size), int(per_token.sum())
