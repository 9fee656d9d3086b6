"""Expert-load drift: Jensen-Shannon divergence of each layer's load between steps and between runs."""

from __future__ import annotations

import itertools

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel

from routelog.audit.load import StepLoad
from routelog.errors import RecordNotFoundError


def js_divergence(p: npt.ArrayLike, q: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Per row, Jensen-Shannon divergence (base 2, in [0, 1]) of two count or probability arrays ``[..., E]``."""
    a, b = np.asarray(p, np.float64), np.asarray(q, np.float64)
    a = a / np.maximum(a.sum(axis=-1, keepdims=True), 1e-300)
    b = b / np.maximum(b.sum(axis=-1, keepdims=True), 1e-300)
    m = (a + b) / 2

    def kl(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(x > 0, x * np.log2(x / m), 0.0)
        out: npt.NDArray[np.float64] = terms.sum(axis=-1)
        return out

    result: npt.NDArray[np.float64] = np.clip((kl(a) + kl(b)) / 2, 0.0, 1.0)
    return result


class DriftPair(BaseModel):
    a: str
    """``step S`` or ``URL step S``."""
    b: str
    js: list[float]
    """Per MoE layer."""
    mean_js: float
    max_js: float


class DriftResult(BaseModel):
    url: str
    layers: list[int]
    """Global indices of the MoE layers."""
    consecutive: list[DriftPair]
    """Step ``s_i`` vs ``s_{i+1}`` of ``url``."""
    other_url: str | None = None
    between_runs: list[DriftPair] = []
    """Same step in both runs, then all common steps pooled."""


def drift_pair(a: str, b: str, load_a: StepLoad, load_b: StepLoad) -> DriftPair:
    js = js_divergence(load_a.array(), load_b.array())
    return DriftPair(a=a, b=b, js=[float(x) for x in js], mean_js=float(js.mean()), max_js=float(js.max()))


def drift(
    url: str, layers: list[int], loads: dict[int, StepLoad], other_url: str | None, other: dict[int, StepLoad] | None
) -> DriftResult:
    steps = sorted(loads)
    consecutive = [drift_pair(f"step {s}", f"step {t}", loads[s], loads[t]) for s, t in itertools.pairwise(steps)]
    between = []
    if other is not None:
        common = [s for s in steps if s in other]
        between = [drift_pair(f"{url} step {s}", f"{other_url} step {s}", loads[s], other[s]) for s in common]
        if len(common) > 1:
            pooled_a = StepLoad(counts=sum(loads[s].array() for s in common).tolist())  # type: ignore[union-attr]
            pooled_b = StepLoad(counts=sum(other[s].array() for s in common).tolist())  # type: ignore[union-attr]
            between.append(
                drift_pair(f"{url} steps {common[0]}-{common[-1]}", f"{other_url} (same steps)", pooled_a, pooled_b)
            )
    if not consecutive and not between:  # as every audit: nothing to compute is refused, naming what it needs
        held = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps}"
        with_other = f" and {other_url} holds none of them" if other_url is not None else " and no --other run"
        raise RecordNotFoundError(
            f"{url}: {held}{with_other}: nothing to compare; drift needs two steps of a run (--step A --step B), "
            "or the same step in two runs (--other URL)"
        )
    return DriftResult(url=url, layers=layers, consecutive=consecutive, other_url=other_url, between_runs=between)
