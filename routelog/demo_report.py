"""The demo's results and its report figure in the style of the R3 paper (matplotlib, drawn off-screen)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.audit.r3 import RoutingComparison
from routelog.spec import ModelSpec


@dataclass
class ModelResult:
    """Everything measured for one MoE model."""

    name: str
    spec: ModelSpec
    comparisons: dict[str, RoutingComparison] = field(default_factory=dict)
    logp: dict[str, npt.NDArray[np.float64]] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _scatter(ax: Any, infer: np.ndarray, train: np.ndarray, title: str, kl: float) -> None:
    """Inference vs. training probability of each sampled token (log axes: small models spread probabilities
    over decades; the paper's linear axes would pile them at the origin)."""
    x, y = np.exp(infer), np.exp(train)
    low = max(1e-6, float(min(x.min(initial=1.0), y.min(initial=1.0))) / 2)
    ax.scatter(x, y, s=3, alpha=0.35, color="tab:blue", rasterized=True)
    ax.plot([low, 1], [low, 1], color="black", lw=0.8, ls="--", label="y = x")
    ax.set(
        xscale="log",
        yscale="log",
        xlim=(low, 1),
        ylim=(low, 1),
        xlabel="inference probability",
        ylabel="training probability",
        title=f"{title}\nKL (k3) = {kl:.2e}",
    )
    ax.set_aspect("equal")


def _histogram(ax: Any, data: dict[str, np.ndarray], title: str, xlabel: str, integer: bool) -> None:
    top = max((float(v.max()) for v in data.values() if v.size), default=1.0)
    bins = np.arange(0, int(top) + 2) - 0.5 if integer else np.linspace(0, max(top, 1e-9), 30)
    for (label, values), color in zip(data.items(), ("tab:red", "tab:green"), strict=False):
        if values.size:
            weights = np.full(values.shape, 1.0 / values.size)
            ax.hist(values, bins=bins, weights=weights, alpha=0.6, color=color, label=label)
    ax.set_yscale("log")
    if integer:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(title=title, xlabel=xlabel, ylabel="frequency")
    ax.legend(fontsize=8)


def demo_report(results: list[ModelResult], dense: dict[str, float], path: Path) -> None:
    """One row per MoE model: inference-vs-training probability without and with R3 (paper Fig. 2) and the
    router-, token- and sequence-level routing differences (Fig. 3)."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(results), 5, figsize=(24, 5 * len(results)), squeeze=False)
    for row, result in zip(axes, results, strict=True):
        m = result.metrics
        _scatter(
            row[0],
            result.logp["infer"],
            result.logp["no_replay"],
            f"{result.name}: without R3",
            m["no_replay"]["kl_k3"],
        )
        _scatter(row[1], result.logp["infer"], result.logp["replay"], f"{result.name}: with R3", m["replay"]["kl_k3"])
        levels = result.comparisons
        _histogram(
            row[2],
            {"without R3": levels["no_replay"].router_counts, "with R3": levels["replay"].router_counts},
            f"router level: {m['no_replay']['router_diff_rate']:.1%} -> {m['replay']['router_diff_rate']:.1%}",
            "experts differing per token per layer",
            integer=True,
        )
        _histogram(
            row[3],
            {"without R3": levels["no_replay"].token_counts, "with R3": levels["replay"].token_counts},
            f"token level: {m['no_replay']['token_diff_rate']:.1%} -> {m['replay']['token_diff_rate']:.1%}",
            "experts differing per token (all layers)",
            integer=True,
        )
        _histogram(
            row[4],
            {"without R3": levels["no_replay"].sequence_means, "with R3": levels["replay"].sequence_means},
            "sequence level",
            "mean experts differing per token",
            integer=False,
        )
    fig.suptitle(f"Rollout Routing Replay on CPU (dense baseline KL k3 = {dense['kl_k3']:.2e})", fontsize=14)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
