"""The demo's results and its report figure in the style of the R3 paper (matplotlib, drawn off-screen)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.audit.figures import SERIES_STYLES, count_bars, sequence_panel
from routelog.audit.r3 import RoutingComparison
from routelog.format.spec import ModelSpec
from routelog.outputs import written_whole


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


def _kl_panel(ax: Any, metrics: dict[str, Any], dense_kl: float) -> None:
    """KL (k3) without and with R3 next to a dense model's. The dense model has no router: its KL is what bf16
    inference against fp32 training costs a model of that size on its own. It is another model with other weights,
    a scale for the MoE's numbers, not a floor under them (with R3 an MoE model can sit below it)."""
    labels = ["without R3", "with R3", "dense model\n(no router;\nfor scale)"]
    values = [metrics["no_replay"]["kl_k3"], metrics["replay"]["kl_k3"], dense_kl]
    colors = [SERIES_STYLES[0]["color"], SERIES_STYLES[1]["color"], "tab:gray"]
    hatches = [SERIES_STYLES[0]["hatch"], SERIES_STYLES[1]["hatch"], ""]
    bars = ax.bar(range(3), values, color=colors, hatch=hatches, edgecolor="white")
    # A linear axis from zero: bar heights compare as the values do (a log axis would blow 2x up to look like 20x).
    base = values[0]
    ax.bar_label(
        bars, [f"{v:.1e}" + ("" if i == 0 or not base else f"\n{v / base:.2f}x") for i, v in enumerate(values)],
        fontsize=8,
    )  # fmt: skip
    ax.set_xticks(range(3), labels)
    ax.set(
        title="KL (k3), a dense model for scale\n(linear; ratio to without R3)",
        ylabel="KL(pi_infer || pi_train)",
    )
    ax.set_ylim(0, max(values) * 1.25 or 1.0)


def demo_report(results: list[ModelResult], dense: dict[str, float], path: Path) -> None:
    """One row per MoE model: inference-vs-training probability without and with R3 (paper Fig. 2), the
    router-, token- and sequence-level routing differences (Fig. 3), and the KL against a dense model's."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(results), 6, figsize=(29, 5 * len(results)), squeeze=False)
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
        modes = {"without R3": levels["no_replay"], "with R3": levels["replay"]}
        count_bars(
            row[2],
            {label: np.bincount(c.router_counts) for label, c in modes.items()},
            title=f"router level: {m['no_replay']['router_diff_rate']:.1%} -> {m['replay']['router_diff_rate']:.1%}",
            xlabel="experts differing per token per layer",
        )
        count_bars(
            row[3],
            {label: np.bincount(c.token_counts) for label, c in modes.items()},
            title=f"token level: {m['no_replay']['token_diff_rate']:.1%} -> {m['replay']['token_diff_rate']:.1%}",
            xlabel="experts differing per token (all layers)",
        )
        sequence_panel(
            row[4],
            {label: c.sequence_means for label, c in modes.items()},
            title=f"sequence level: mean {m['no_replay']['mean_sequence_diff']:.2f} -> "
            f"{m['replay']['mean_sequence_diff']:.2f}",
            xlabel="mean experts differing per token",
        )
        _kl_panel(row[5], m, dense["kl_k3"])
    fig.suptitle("Rollout Routing Replay on CPU: tiny random MoE models, bf16 inference vs fp32 training", fontsize=14)
    fig.tight_layout()
    with written_whole(path) as partial:
        fig.savefig(partial, dpi=90, format=path.suffix.lstrip(".") or None)
    plt.close(fig)
