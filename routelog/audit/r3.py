"""The R3 paper's diagnostics (arXiv 2510.11370, section 3) as plain numpy functions.

* ``k3_kl``: the k3 estimator of the training-inference KL over sampled tokens (eq. 2): with
  ``r = pi_train / pi_infer`` on tokens drawn from the inference policy, ``KL ~ mean(r - 1 - log r)``.
* ``extreme_fraction``: F(t), the share of tokens whose probability ratio exceeds ``t`` either way (eq. 3).
* ``routing_differences``: per (token, layer), how many of the K experts differ between two routings of the same
  tokens (Fig. 3: router level; summed over layers: token level; averaged per sequence: sequence level).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.floating[Any]]


def k3_kl(logp_train: npt.ArrayLike, logp_infer: npt.ArrayLike) -> float:
    """k3 estimate of KL(pi_infer || pi_train) from the log-probabilities of the sampled tokens."""
    log_ratio = np.asarray(logp_train, np.float64) - np.asarray(logp_infer, np.float64)
    if log_ratio.size == 0:
        return float("nan")
    return float(np.mean(np.expm1(log_ratio) - log_ratio))


def extreme_fraction(logp_train: npt.ArrayLike, logp_infer: npt.ArrayLike, t: float) -> float:
    """F(t): fraction of tokens with ``max(pi_train / pi_infer, pi_infer / pi_train) > t``."""
    log_ratio = np.abs(np.asarray(logp_train, np.float64) - np.asarray(logp_infer, np.float64))
    if log_ratio.size == 0:
        return float("nan")
    return float(np.mean(log_ratio > np.log(t)))


def routing_differences(a: npt.ArrayLike, b: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """``[..., L]``: experts of ``a`` not chosen by ``b`` per row (``[..., L, K]`` IDs, any order within a row)."""
    left, right = np.asarray(a), np.asarray(b)
    if left.shape != right.shape:
        raise ValueError(f"routings of different shapes {left.shape} and {right.shape}")
    k = left.shape[-1]
    diff: npt.NDArray[np.int64] = np.zeros(left.shape[:-1], np.int64)
    # Most rows agree: compare rows first, then count |A \\ B| = K - |A & B| with a K x K broadcast on the
    # differing rows only (rows that are the same set in another order come out 0 there).
    differs = (left != right).any(axis=-1)
    if differs.any():
        rows_a, rows_b = left[differs], right[differs]
        diff[differs] = k - (rows_a[:, :, None] == rows_b[:, None, :]).any(axis=-1).sum(axis=-1)
    return diff


@dataclass(frozen=True)
class RoutingComparison:
    """Router-, token- and sequence-level routing differences over a set of sequences."""

    router_counts: npt.NDArray[np.int64]
    """Per (token, layer) of every sequence, flattened: differing experts."""
    token_counts: npt.NDArray[np.int64]
    """Per token: differing experts summed over layers."""
    sequence_means: FloatArray
    """Per sequence: mean over its tokens of the token-level count."""

    @property
    def router_diff_rate(self) -> float:
        """Share of router decisions (token x layer) that picked a different set of experts."""
        return float(np.mean(self.router_counts > 0)) if self.router_counts.size else float("nan")

    @property
    def token_diff_rate(self) -> float:
        """Share of tokens with a different set of experts in at least one layer."""
        return float(np.mean(self.token_counts > 0)) if self.token_counts.size else float("nan")

    @property
    def mean_sequence_diff(self) -> float:
        return float(np.mean(self.sequence_means)) if self.sequence_means.size else float("nan")


def compare_routings(pairs: list[tuple[npt.ArrayLike, npt.ArrayLike, npt.ArrayLike]]) -> RoutingComparison:
    """Compare routings sequence by sequence: ``(a [T, L, K], b [T, L, K], valid [T])`` per sequence."""
    router, token, means = [], [], []
    for a, b, valid in pairs:
        keep = np.asarray(valid, bool)
        counts = routing_differences(np.asarray(a)[keep], np.asarray(b)[keep])  # [T_valid, L]
        router.append(counts.reshape(-1))
        per_token = counts.sum(axis=-1)
        token.append(per_token)
        if per_token.size:
            means.append(float(per_token.mean()))
    empty = np.zeros(0, np.int64)
    return RoutingComparison(
        router_counts=np.concatenate(router) if router else empty,
        token_counts=np.concatenate(token) if token else empty,
        sequence_means=np.asarray(means, np.float64),
    )


def indexer_diff_rate(pairs: Sequence[tuple[npt.ArrayLike, npt.ArrayLike]]) -> float:
    """The sparse-attention indexer's counterpart of the router diff: over the rows (token, indexer layer) where
    both selections are known and the indexer had a choice (``p + 1 > index_topk``: a full row), the share of the
    selected key positions of the first that the second did not select. Rows are canonical
    (:mod:`routelog.format.positions`): ascending positions, then -1."""
    differing = total = 0
    for a, b in pairs:
        first, second = np.asarray(a), np.asarray(b)
        k = first.shape[-1]
        full = (first[..., -1] >= 0) & (second[..., -1] >= 0)  # a full row has no -1 padding
        if not full.any():
            continue
        x, y = first[full], second[full]  # [rows, k]
        both = np.sort(np.concatenate([x, y], axis=1), axis=1)
        shared = (both[:, 1:] == both[:, :-1]).sum(axis=1)  # a position both select appears twice, side by side
        differing += int((k - shared).sum())
        total += int(x.size)
    return differing / total if total else 0.0
