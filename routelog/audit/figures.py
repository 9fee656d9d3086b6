"""Figures of the audits (matplotlib, off-screen), readable at a glance: titles, axes with units, log scales where
the R3 paper uses them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from routelog.audit.diff import DiffResult
from routelog.audit.drift import DriftResult
from routelog.audit.load import StatsResult
from routelog.audit.mismatch import MismatchResult


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_axis(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _save(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)


def stats_figure(result: StatsResult, path: Path) -> None:
    """Expert load per layer (share of choices relative to uniform) and per-layer imbalance and entropy."""
    plt = _pyplot()
    fig, (heat, lines) = plt.subplots(
        1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]}, layout="constrained"
    )
    load = np.asarray([layer.load for layer in result.layers], np.float64)
    share = load / np.maximum(load.sum(axis=1, keepdims=True), 1) * result.num_experts
    image = heat.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=heat, label="load / uniform load")
    heat.set(
        xlabel="expert id",
        ylabel="MoE layer (global index)",
        title=f"Expert load, {result.records} records, {result.rows} routed tokens",
    )
    heat.set_yticks(range(len(result.layers)), [str(layer.layer) for layer in result.layers])
    if len(result.layers) > 24:
        heat.yaxis.set_major_locator(plt.MaxNLocator(12, integer=True))
    layers = [layer.layer for layer in result.layers]
    lines.plot(layers, [layer.imbalance for layer in result.layers], "o-", color="tab:red", label="max / mean load")
    lines.plot(layers, [1 + layer.cv for layer in result.layers], "s--", color="tab:orange", label="1 + CV of load")
    lines.set(xlabel="MoE layer (global index)", ylabel="imbalance (1 = balanced)", title="Load imbalance and entropy")
    twin = lines.twinx()
    twin.plot(layers, [layer.entropy_normalized for layer in result.layers], "^:", color="tab:blue")
    twin.set_ylabel("routing entropy / log2(E)", color="tab:blue")
    twin.set_ylim(0, 1.05)
    lines.legend(loc="upper left", fontsize=8)
    _integer_axis(lines)
    _save(fig, path)


def diff_figure(result: DiffResult, path: Path) -> None:
    """The R3 paper's Fig. 3: router-, token- and sequence-level routing differences, plus per-layer rates."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2), layout="constrained")
    for ax, hist, title, xlabel in (
        (axes[0], result.router_hist, "Router level", "experts differing per (token, layer)"),
        (axes[1], result.token_hist, "Token level", "experts differing per token (all layers)"),
    ):
        counts = np.asarray(hist, np.float64)
        top = int(np.flatnonzero(counts)[-1]) if counts.any() else 0
        freq = counts[: top + 1] / max(counts.sum(), 1)
        ax.bar(np.arange(top + 1), freq, color="tab:red", alpha=0.75, width=0.9)
        ax.set(yscale="log", title=title, xlabel=xlabel, ylabel="frequency")
    seq = np.asarray(result.sequence_means)
    if seq.size:
        axes[2].hist(seq, bins=30, weights=np.full(seq.shape, 1 / seq.size), color="tab:red", alpha=0.75)
    axes[2].set(yscale="log", title="Sequence level", xlabel="mean experts differing per token", ylabel="frequency")
    layers = [layer.layer for layer in result.layers]
    axes[3].bar(range(len(layers)), [100 * layer.diff_rate for layer in result.layers], color="tab:purple")
    axes[3].set_xticks(range(len(layers)), [str(x) for x in layers], fontsize=7 if len(layers) > 16 else 9)
    axes[3].set(
        title=f"Per layer (router diff {100 * result.router_diff_rate:.2f} %)",
        xlabel="MoE layer (global index)",
        ylabel="decisions differing (%)",
    )
    fig.suptitle(f"Routing differences: {result.a}  vs  {result.b}  ({result.records_compared} records)", fontsize=10)
    _save(fig, path)


def mismatch_figure(result: MismatchResult, path: Path) -> None:
    """The R3 paper's Fig. 5: training-inference KL (k3) and F(t) over training steps."""
    plt = _pyplot()
    fig, (kl_ax, f_ax) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    steps = [s.step for s in result.steps]
    kl_ax.plot(steps, [s.kl_k3 for s in result.steps], "o-", color="tab:blue")
    kl_ax.set(yscale="log", xlabel="training step", ylabel="KL(pi_infer || pi_train), k3 estimate", title="Mismatch KL")
    thresholds = list(result.steps[0].extreme) if result.steps else []
    for t in thresholds:
        # zeros have no place on a log axis: leave a gap rather than draw a fake floor
        f_ax.plot(steps, [s.extreme[t] or np.nan for s in result.steps], "o-", label=f"t = {t}")
    f_ax.set(
        yscale="log", xlabel="training step", ylabel="F(t): tokens with ratio > t either way", title="Extreme tokens"
    )
    f_ax.legend(fontsize=8)
    _integer_axis(kl_ax)
    _integer_axis(f_ax)
    fig.suptitle(f"Training-inference mismatch of {result.url}", fontsize=10)
    _save(fig, path)


def drift_figure(result: DriftResult, path: Path) -> None:
    """Jensen-Shannon divergence of expert load between consecutive steps (per layer), and between runs."""
    plt = _pyplot()
    panels = 2 if result.between_runs else 1
    fig, axes = plt.subplots(1, panels, figsize=(7.5 * panels, 4.5), squeeze=False, layout="constrained")
    ax = axes[0][0]
    if result.consecutive:
        js = np.asarray([pair.js for pair in result.consecutive]).T  # [layers, pairs]
        image = ax.imshow(
            np.maximum(js, 1e-12), aspect="auto", cmap="magma", interpolation="nearest", norm=_lognorm(js)
        )
        fig.colorbar(image, ax=ax, label="Jensen-Shannon divergence (bits)")
        ax.set_xticks(
            range(len(result.consecutive)), [p.b.removeprefix("step ") for p in result.consecutive], fontsize=8
        )
        ax.set_yticks(range(len(result.layers)), [str(x) for x in result.layers], fontsize=7)
    ax.set(
        xlabel="step (vs the previous one)", ylabel="MoE layer (global index)", title="Expert-load drift between steps"
    )
    if result.between_runs:
        other = axes[0][1]
        for pair in result.between_runs:
            other.plot(
                result.layers,
                np.maximum(pair.js, 1e-12),
                "o-",
                label=pair.a.rsplit(" ", 2)[-2] + " " + pair.a.rsplit(" ", 1)[-1],
            )
        other.set(
            yscale="log",
            xlabel="MoE layer (global index)",
            ylabel="Jensen-Shannon divergence (bits)",
            title=f"Between runs (vs {result.other_url})",
        )
        other.legend(fontsize=7)
        _integer_axis(other)
    _save(fig, path)


def _lognorm(values: np.ndarray) -> Any:
    from matplotlib.colors import LogNorm

    positive = values[values > 0]
    low = float(positive.min()) if positive.size else 1e-6
    return LogNorm(vmin=low, vmax=max(float(values.max()), low * 10))
