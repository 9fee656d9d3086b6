"""Figures of the audits (matplotlib, off-screen), readable at a glance: titles, axes with units, log scales where
the R3 paper uses them.

Conventions shared with the demo's report: series are told apart by colour *and* marker or hatch, side by side
(never overlaid into a blend the legend lacks); integer quantities get integer ticks; values spanning decades get
a log axis (symmetric-log where some are zero, so a zero is drawn at 0), values within 2x of each other a linear
axis from 0 with their spread in the title; a log axis says so; a single step is a point with its own tick.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from routelog.audit.diff import DiffResult
from routelog.audit.drift import DriftResult
from routelog.audit.load import StatsResult
from routelog.audit.mismatch import MismatchResult
from routelog.outputs import written_whole


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


SERIES_STYLES = (
    {"color": "tab:red", "marker": "o", "hatch": ""},
    {"color": "tab:blue", "marker": "s", "hatch": "//"},
    {"color": "tab:green", "marker": "^", "hatch": ".."},
    {"color": "tab:purple", "marker": "D", "hatch": "xx"},
)
FEW_SEQUENCES = 64
"""Up to this many sequences a panel shows each one as a point; beyond, a histogram."""
FEW_COUNTS = 8
"""Up to this many count values a bar panel prints each bar's share on it."""


def _integer_axis(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def step_axis(ax: Any, steps: Sequence[int]) -> None:
    """Integer ticks at the steps (every step when few), with room around a single one."""
    if len(steps) <= 12:
        ax.set_xticks(list(steps))
    else:
        _integer_axis(ax)
    if len(steps) == 1:
        ax.set_xlim(steps[0] - 1, steps[0] + 1)


NARROW_SPAN = 2.0
"""Values within this factor of each other are drawn on a linear axis from 0: on a log axis a 0.002 % change fills
the frame and reads as a cliff."""


def value_axis(ax: Any, values: np.ndarray, axis: str = "y") -> str:
    """The axis for non-negative values that may span decades or barely differ; returns the scale chosen.

    Linear from 0 when every value is zero (0 to 1) or the positive values lie within :data:`NARROW_SPAN` of each
    other; otherwise log, symmetric-log (linear below the smallest positive decade) when some values are zero so a
    zero is drawn at 0 instead of vanishing, and the axis label (set before) says "(log scale)"."""
    set_scale, set_lim = (ax.set_yscale, ax.set_ylim) if axis == "y" else (ax.set_xscale, ax.set_xlim)
    finite = np.asarray(values, np.float64)
    finite = finite[np.isfinite(finite)]
    positive = finite[finite > 0]
    if positive.size == 0:  # every value is 0 (or none): a linear axis from 0, no negative ticks
        set_lim(-0.03, 1)  # a zero sits just above the frame
        return "linear"
    top = float(positive.max())
    if top < NARROW_SPAN * float(positive.min()):
        set_lim(-0.03 * top if positive.size < finite.size else 0.0, top * 1.15)
        return "linear"
    label = ax.yaxis.label if axis == "y" else ax.xaxis.label
    label.set_text(f"{label.get_text()} (log scale)".strip())
    if positive.size == finite.size:
        set_scale("log")
        return "log"
    set_scale("symlog", linthresh=float(10 ** np.floor(np.log10(positive.min()))))
    return "symlog"


def spread_note(values: np.ndarray) -> str:
    """How far apart the values are, for a title over a linear axis on which they look alike: ``"within 0.0018 %"``
    of the largest."""
    finite = np.asarray(values, np.float64)
    finite = finite[np.isfinite(finite)]
    if finite.size < 2 or finite.max() <= 0:
        return ""
    if finite.max() == finite.min():
        return "every value equal"
    return f"values within {100 * (finite.max() - finite.min()) / finite.max():.2g} % of each other"


def count_bars(ax: Any, histograms: Mapping[str, np.ndarray], *, title: str, xlabel: str) -> None:
    """Distributions of an integer count (``histograms[label][c]`` = how often the count was ``c``) as side-by-side
    bars on a log axis of shares, one colour and hatch per series; with few counts each bar's share printed on it."""
    counts = {label: np.asarray(h, np.float64) for label, h in histograms.items()}
    top = max((int(np.flatnonzero(h)[-1]) for h in counts.values() if h.any()), default=0)
    width = 0.8 / max(len(counts), 1)
    for i, (label, hist) in enumerate(counts.items()):
        style = SERIES_STYLES[i % len(SERIES_STYLES)]
        freq = np.zeros(top + 1)
        freq[: min(top + 1, hist.size)] = hist[: top + 1] / max(hist.sum(), 1)
        x = np.arange(top + 1) + (i - (len(counts) - 1) / 2) * width
        shown = freq > 0
        bars = ax.bar(
            x[shown], freq[shown], width, color=style["color"], hatch=style["hatch"], edgecolor="white", label=label
        )
        if top < FEW_COUNTS:  # on a log axis a 9 % bar looks small beside a 91 % one: print each share
            ax.bar_label(bars, [f"{100 * f:.3g}%" for f in freq[shown]], fontsize=6, rotation=90, padding=2)
    ax.set(yscale="log", title=title, xlabel=xlabel, ylabel="share (log scale)")
    ax.set_ylim(top=8.0)  # room above a share near 1 for its label
    if top < 16:
        ax.set_xticks(range(top + 1))
    else:
        _integer_axis(ax)
    if len(counts) > 1:
        ax.legend(fontsize=8)


def sequence_panel(ax: Any, series: Mapping[str, np.ndarray], *, title: str, xlabel: str) -> None:
    """Per-sequence values: each sequence as a point on its series' row (with the mean as a bar) when there are few,
    else outlined histograms on a linear count axis."""
    values = {label: np.asarray(v, np.float64) for label, v in series.items()}
    if max((v.size for v in values.values()), default=0) <= FEW_SEQUENCES:
        rng = np.random.default_rng(0)
        for i, (label, v) in enumerate(values.items()):
            style = SERIES_STYLES[i % len(SERIES_STYLES)]
            jitter = rng.uniform(-0.12, 0.12, v.size)
            ax.scatter(
                v, i + jitter, s=28, color=style["color"], marker=style["marker"], alpha=0.8, label=label, zorder=3
            )
            if v.size:  # the mean as a bar under the points' band, so it never hides a point (all at 0 included)
                ax.plot([v.mean()] * 2, [i - 0.42, i - 0.2], color="black", lw=2)
        ax.set_yticks(range(len(values)), list(values))
        ax.set_ylim(-0.6, len(values) - 0.4)
        ax.set(title=f"{title}\n(each point a sequence, bar below = mean)", xlabel=xlabel)
        top = max((float(v.max()) for v in values.values() if v.size), default=0.0)
        ax.set_xlim(min(0.0, ax.get_xlim()[0]), top * 1.08 if top > 0 else 1.0)  # room for the largest point
        return
    top = max((float(v.max()) for v in values.values() if v.size), default=1.0)
    bins = np.linspace(0, max(top, 1e-9), 30)
    for i, (label, v) in enumerate(values.items()):
        style = SERIES_STYLES[i % len(SERIES_STYLES)]
        ax.hist(
            v, bins=bins, histtype="step", lw=1.8, color=style["color"], ls=("-", "--", ":", "-.")[i % 4], label=label
        )
    ax.set(title=title, xlabel=xlabel, ylabel="sequences")
    ax.legend(fontsize=8)


def _save(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with written_whole(path) as partial:
        fig.savefig(partial, dpi=120, format=path.suffix.lstrip(".") or None)
    _pyplot().close(fig)


def stats_figure(result: StatsResult, path: Path) -> None:
    """Expert load per layer (share of choices relative to uniform) and per-layer imbalance and entropy."""
    plt = _pyplot()
    from matplotlib.colors import TwoSlopeNorm

    fig, (heat, lines) = plt.subplots(
        1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]}, layout="constrained"
    )
    load = np.asarray([layer.load for layer in result.layers], np.float64)
    share = load / np.maximum(load.sum(axis=1, keepdims=True), 1) * result.num_experts
    # Diverging around uniform load (white = 1.0), at least as far above 1 as below: an idle expert and one with
    # twice its share are equally strong colours.
    highest = max(float(share.max()), 2.0)
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=highest)
    image = heat.imshow(share, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest")
    colorbar = fig.colorbar(image, ax=heat, label="load / uniform load (1 = uniform)")
    colorbar.set_ticks([0.0, 0.5, *np.round(np.linspace(1.0, highest, 4), 2)])  # each half of the bar evenly
    heat.set(
        xlabel="expert id",
        ylabel="MoE layer (global index)",
        title=f"Expert load, {result.records} records, {result.rows} routed tokens",
    )
    heat.set_yticks(range(len(result.layers)), [str(layer.layer) for layer in result.layers])
    if len(result.layers) > 24:
        heat.yaxis.set_major_locator(plt.MaxNLocator(12, integer=True))
    layers = [layer.layer for layer in result.layers]
    drawn = lines.plot(
        layers, [layer.imbalance for layer in result.layers], "o-", color="tab:red", label="max / mean load"
    )
    drawn += lines.plot(
        layers, [1 + layer.cv for layer in result.layers], "s--", color="tab:orange", label="1 + CV of load"
    )
    lines.set(xlabel="MoE layer (global index)", ylabel="imbalance (1 = balanced)", title="Load imbalance and entropy")
    worst = max((max(layer.imbalance, 1 + layer.cv) for layer in result.layers), default=1.0)
    lines.set_ylim(1.0, max(worst * 1.05, 1.1))  # from balanced: distance from 1 is the imbalance
    twin = lines.twinx()
    drawn += twin.plot(
        layers, [layer.entropy_normalized for layer in result.layers], "^:", color="tab:blue", label="entropy / log2 E"
    )
    twin.set_ylabel("routing entropy / log2(E)", color="tab:blue")
    twin.set_ylim(0, 1.05)
    # below the axes: inside, a legend covers a line whatever corner it takes
    lines.legend(
        drawn, [d.get_label() for d in drawn], loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8
    )
    _integer_axis(lines)
    _save(fig, path)


def diff_figure(result: DiffResult, path: Path) -> None:
    """The R3 paper's Fig. 3: router-, token- and sequence-level routing differences, plus per-layer rates."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.4), layout="constrained")
    count_bars(
        axes[0],
        {"": np.asarray(result.router_hist)},
        title=f"Router level ({100 * result.router_diff_rate:.2f} % differ)",
        xlabel="experts differing per (token, layer)",
    )
    count_bars(
        axes[1],
        {"": np.asarray(result.token_hist)},
        title=f"Token level ({100 * result.token_diff_rate:.2f} % differ)",
        xlabel="experts differing per token (all layers)",
    )
    sequence_panel(
        axes[2],
        {"sequences": np.asarray(result.sequence_means)},
        title=f"Sequence level (mean {result.mean_sequence_diff:.3f})",
        xlabel="mean experts differing per token",
    )
    layers = [layer.layer for layer in result.layers]
    axes[3].bar(range(len(layers)), [100 * layer.diff_rate for layer in result.layers], color="tab:purple")
    axes[3].set_xticks(range(len(layers)), [str(x) for x in layers], fontsize=7 if len(layers) > 16 else 9)
    axes[3].set(
        title=f"Per layer (router diff {100 * result.router_diff_rate:.2f} %)",
        xlabel="MoE layer (global index)",
        ylabel="decisions differing (%)",
    )
    if result.router_diff_rate == 0:  # all bars are zero-height: say so instead of an empty panel
        axes[3].set_ylim(0, 1)
        axes[3].text(0.5, 0.5, "no decision differs", ha="center", va="center", transform=axes[3].transAxes)
    fig.suptitle(
        f"Routing differences: {short_name(result.a)}  vs  {short_name(result.b)}  ({result.records_compared} records)",
        fontsize=10,
    )
    _save(fig, path)


def mismatch_figure(result: MismatchResult, path: Path) -> None:
    """The R3 paper's Fig. 5: training-inference KL (k3) and F(t) over training steps; with published replay
    fidelity, the trainer's router diff beside them."""
    plt = _pyplot()
    panels = (2 if result.steps else 0) + (1 if result.router_diff else 0)
    fig, axes = plt.subplots(1, panels, figsize=(max(6 * panels, 10), 4.2), squeeze=False, layout="constrained")
    if result.router_diff:
        _router_diff_panel(axes[0][-1], result)
    if result.steps:
        _logprob_panels(axes[0][0], axes[0][1], result)
    fig.suptitle(f"Training-inference mismatch of {short_name(result.url)}", fontsize=10)
    _save(fig, path)


def _logprob_panels(kl_ax: Any, f_ax: Any, result: MismatchResult) -> None:
    steps = [s.step for s in result.steps]
    kl = np.asarray([s.kl_k3 for s in result.steps])
    kl_ax.plot(steps, kl, "o-", color="tab:blue")
    kl_ax.set(xlabel="training step", ylabel="KL(pi_infer || pi_train), k3 estimate", title="Mismatch KL")
    if value_axis(kl_ax, kl) == "linear" and (note := spread_note(kl)):
        kl_ax.set_title(f"Mismatch KL\n(linear from 0: {note})")
    thresholds = list(result.steps[0].extreme) if result.steps else []
    every = []
    for i, t in enumerate(thresholds):
        style = SERIES_STYLES[i % len(SERIES_STYLES)]
        shares = np.asarray([s.extreme[t] for s in result.steps])
        every.append(shares)
        # a small sideways offset per series keeps equal values (often all zero) from hiding each other
        dodge = (i - (len(thresholds) - 1) / 2) * 0.08 if len(steps) <= 12 else 0.0
        x = np.asarray(steps, np.float64) + dodge
        f_ax.plot(x, shares, "-", marker=style["marker"], color=style["color"], label=f"t = {t}")
    f_ax.set(xlabel="training step", ylabel="F(t): tokens with ratio > t either way", title="Extreme tokens")
    value_axis(f_ax, np.concatenate(every) if every else np.zeros(0))
    f_ax.legend(fontsize=8)
    step_axis(kl_ax, steps)
    step_axis(f_ax, steps)


def _router_diff_panel(ax: Any, result: MismatchResult) -> None:
    """Per layer (thin lines) and overall (bold), the share of replayed rows the trainer's router would have
    routed elsewhere, over training steps."""
    steps = [d.step for d in result.router_diff]
    layers = sorted({int(layer) for d in result.router_diff for layer in d.by_layer})
    for layer in layers:
        values = [d.by_layer.get(str(layer), np.nan) for d in result.router_diff]
        ax.plot(steps, values, ".-" if len(steps) <= 12 else "-", color="tab:gray", alpha=0.35, linewidth=0.8)
    overall = [d.router_diff for d in result.router_diff]
    ax.plot(steps, overall, "o-" if len(steps) <= 12 else "-", color="tab:red", label="all layers")
    ax.set(xlabel="training step", ylabel="replayed rows the trainer would route elsewhere", title="Router diff")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, title=f"{len(layers)} layers (grey)", title_fontsize=8)
    step_axis(ax, steps)


def drift_figure(result: DriftResult, path: Path) -> None:
    """Jensen-Shannon divergence of expert load between consecutive steps (per layer), and between runs. The
    colour scale is linear from 0 (no drift) to the largest value (JS is at most 1 bit)."""
    plt = _pyplot()
    panels = [
        p for p in ("consecutive", "between") if (result.consecutive if p == "consecutive" else result.between_runs)
    ]
    fig, axes = plt.subplots(
        1, max(len(panels), 1), figsize=(7.5 * max(len(panels), 1), 4.5), squeeze=False, layout="constrained"
    )
    for ax, panel in zip(axes[0], panels, strict=False):
        if panel == "consecutive":
            js = np.asarray([pair.js for pair in result.consecutive]).T  # [layers, pairs]
            top = float(js.max())
            image = ax.imshow(js, aspect="auto", cmap="magma", interpolation="nearest", vmin=0.0, vmax=top or 1.0)
            fig.colorbar(image, ax=ax, label="Jensen-Shannon divergence (bits, 0 = none)")
            ax.set_xticks(
                range(len(result.consecutive)), [p.b.removeprefix("step ") for p in result.consecutive], fontsize=8
            )
            ax.set_yticks(range(len(result.layers)), [str(x) for x in result.layers], fontsize=7)
            ax.set(
                xlabel="step (vs the previous one)",
                ylabel="MoE layer (global index)",
                title="Expert-load drift between steps",
            )
            if top == 0:
                ax.text(0.5, 0.5, "no drift: every step's load is the same", ha="center", va="center",
                        color="white", transform=ax.transAxes)  # fmt: skip
            continue
        every = []
        for i, pair in enumerate(result.between_runs):
            style = SERIES_STYLES[i % len(SERIES_STYLES)]
            values = np.asarray(pair.js)
            every.append(values)
            label = pair.a.rsplit(" ", 2)[-2] + " " + pair.a.rsplit(" ", 1)[-1]
            ax.plot(result.layers, values, "-", marker=style["marker"], color=style["color"], label=label)
        title = f"Between runs (vs {short_name(result.other_url or '')})"
        ax.set(xlabel="MoE layer (global index)", ylabel="Jensen-Shannon divergence (bits)", title=title)
        if value_axis(ax, np.concatenate(every)) == "linear" and (note := spread_note(np.concatenate(every))):
            ax.set_title(f"{title}\n(linear from 0: {note})")
        ax.legend(fontsize=7)
        _integer_axis(ax)
    _save(fig, path)


def short_name(url: str) -> str:
    """A store URL as a figure shows it: its last path component (the run), with what follows it (a step)."""
    head, _, tail = url.partition(" ")
    name = head.rstrip("/").rsplit("/", 1)[-1] or head
    return f"{name} {tail}".strip()
