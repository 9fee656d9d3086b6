"""The audits on the command line: ``stats``, ``diff``, ``mismatch`` and ``drift`` (each with ``--json`` and
``--plot``; ``--ray`` spreads the work over a Ray cluster)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.table import Table
from rich.text import Text

from routelog.cli.app import (
    JsonFlag,
    StorageOptions,
    UrlArgument,
    app,
    console,
    labeled,
    plural,
    progress_bar,
    storage_options,
)
from routelog.format.limits import MAX_STEP

if TYPE_CHECKING:
    from routelog.audit.check import CheckResult

StepsOption = Annotated[
    list[int] | None,
    typer.Option("--step", help="Step to include (repeatable; default: all).", min=0, max=MAX_STEP),
]
FIGURE_SUFFIXES = (".png", ".svg", ".pdf")


def _figure_path(path: Path | None) -> Path | None:
    if path is not None and path.suffix.lower() not in FIGURE_SUFFIXES:
        raise typer.BadParameter(f"{path}: a figure is written as {', '.join(FIGURE_SUFFIXES)}; name it so")
    return path


PlotOption = Annotated[
    Path | None, typer.Option("--plot", help="Write a figure here (.png, .svg or .pdf).", callback=_figure_path)
]
R = TypeVar("R")
RayFlag = Annotated[
    bool, typer.Option("--ray", help="Spread the work over a Ray cluster (RAY_ADDRESS, or a local one).")
]


class _AuditProgress:
    """A progress bar over records on stderr (only when it is a terminal); an audit calls it with
    (records done, records planned)."""

    def __init__(self, label: str) -> None:
        self.bar = progress_bar()
        self.task = self.bar.add_task(label, total=None)

    def __enter__(self) -> _AuditProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def __call__(self, done: int, total: int) -> None:
        self.bar.update(self.task, completed=done, total=total)


def _run(audit: Callable[..., R], *args: Any, use_ray: bool, storage_options_: str | None, **kwargs: Any) -> R:
    """Run one audit with the command's storage options, Ray choice and a progress bar."""
    with _AuditProgress(audit.__name__) as progress:
        options = storage_options(storage_options_)
        return audit(*args, storage_options=options, use_ray=use_ray, progress=progress, **kwargs)


def _report(result: Any, json_out: bool, plot: Path | None, draw: Any, lines: list[str]) -> None:
    if plot is not None:
        draw(result, plot)
    if json_out:
        typer.echo(result.model_dump_json(indent=1))
        return
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)
    if plot is not None:
        console.print(f"figure: {plot}", highlight=False)


@app.command()
def stats(
    url: UrlArgument,
    step: StepsOption = None,
    json_out: JsonFlag = False,
    plot: PlotOption = None,
    use_ray: RayFlag = False,
    storage_options_: StorageOptions = None,
) -> None:
    """Per MoE layer: expert load, imbalance (max/mean, CV) and routing entropy; totals."""
    from routelog import audit
    from routelog.audit.figures import stats_figure

    result = _run(audit.stats, url, step, use_ray=use_ray, storage_options_=storage_options_)
    table = Table("layer", "imbalance (max/mean)", "CV", "entropy / log2 E", "busiest expert")
    for layer in result.layers:
        table.add_row(
            str(layer.layer),
            f"{layer.imbalance:.3f}",
            f"{layer.cv:.3f}",
            f"{layer.entropy_normalized:.4f}",
            str(max(range(len(layer.load)), key=layer.load.__getitem__)),
        )
    summary = (
        f"{result.url}: steps {result.steps}, {result.records:,} records, {result.tokens:,} tokens "
        f"({result.rows:,} routed), {result.stored_bytes:,} bytes stored; routing {result.bytes_per_token_layer:.3f} "
        "bytes/token-layer (the same numbers as routelog inspect: its per-step bytes, its total for every step)"
    )
    _report(result, json_out, plot, stats_figure, [summary])
    if not json_out:
        console.print(table)


@app.command()
def diff(
    url_a: Annotated[str, typer.Argument(help="First store URL (e.g. the inference recording).")],
    url_b: Annotated[str, typer.Argument(help="Second store URL (e.g. a training-side recording); may be the same.")],
    step: Annotated[int, typer.Option(help="Step of the first store.", min=0, max=MAX_STEP)],
    step_b: Annotated[
        int | None, typer.Option(help="Step of the second store (default: --step).", min=0, max=MAX_STEP)
    ] = None,
    json_out: JsonFlag = False,
    plot: PlotOption = None,
    use_ray: RayFlag = False,
    storage_options_: StorageOptions = None,
) -> None:
    """Routing differences of the same records (router, token and sequence level; per layer): paper Fig. 3."""
    from routelog import audit
    from routelog.audit.figures import diff_figure

    result = _run(audit.diff, url_a, url_b, step, step_b=step_b, use_ray=use_ray, storage_options_=storage_options_)
    lines = [
        f"{result.a} vs {result.b}: {result.records_compared} records compared ({result.only_a} only in the first, "
        f"{result.only_b} only in the second), {result.rows_compared} routed tokens",
        f"router-level diff {100 * result.router_diff_rate:.2f} %, token-level {100 * result.token_diff_rate:.2f} %, "
        f"mean sequence-level {result.mean_sequence_diff:.3f} experts/token",
    ]
    _report(result, json_out, plot, diff_figure, lines)


@app.command()
def mismatch(
    url: Annotated[str, typer.Argument(help="Store URL with logprob_infer and logprob_train columns.")],
    step: StepsOption = None,
    json_out: JsonFlag = False,
    plot: PlotOption = None,
    use_ray: RayFlag = False,
    storage_options_: StorageOptions = None,
) -> None:
    """Per step: training-inference KL (k3) and F(t) for t in 1.5, 2, 5 from stored log-probs (paper Fig. 5), and the
    router diff the trainer measured while replaying, per layer (published with routelog.store.fidelity)."""
    from routelog import audit
    from routelog.audit.figures import mismatch_figure

    result = _run(audit.mismatch, url, step, use_ray=use_ray, storage_options_=storage_options_)
    lines = [
        f"step {s.step}: {s.tokens} tokens, KL k3 {s.kl_k3:.3e}, "
        + ", ".join(f"F({t}) {v:.3e}" for t, v in s.extreme.items())
        for s in result.steps
    ]
    if result.steps_without_logprobs:
        lines.append(f"steps without both log-prob columns (left out): {result.steps_without_logprobs}")
    for d in result.router_diff:
        worst = max(d.by_layer, key=d.by_layer.__getitem__) if d.by_layer else None
        lines.append(
            f"step {d.step}: the trainer's routers disagree with the replayed routing on "
            f"{100 * d.router_diff:.2f} % of {d.replayed_rows:,} replayed rows"
            + (f" (most: layer {worst}, {100 * d.by_layer[worst]:.2f} %)" if worst is not None else "")
            + (f"; {d.token_mismatches} records had other tokens" if d.token_mismatches else "")
        )
    _report(result, json_out, plot, mismatch_figure, lines)


@app.command()
def drift(
    url: UrlArgument,
    other: Annotated[str | None, typer.Option(help="Another run's store: compare the same steps.")] = None,
    step: StepsOption = None,
    json_out: JsonFlag = False,
    plot: PlotOption = None,
    use_ray: RayFlag = False,
    storage_options_: StorageOptions = None,
) -> None:
    """Expert-load shift: Jensen-Shannon divergence per layer between consecutive steps and between two runs."""
    from routelog import audit
    from routelog.audit.figures import drift_figure

    result = _run(audit.drift, url, other, step, use_ray=use_ray, storage_options_=storage_options_)
    lines = [f"{p.a} -> {p.b}: mean JS {p.mean_js:.3e}, max {p.max_js:.3e} bits" for p in result.consecutive]
    lines += [f"{p.a} vs {p.b}: mean JS {p.mean_js:.3e}, max {p.max_js:.3e} bits" for p in result.between_runs]
    _report(result, json_out, plot, drift_figure, lines)


MaxFindings = Annotated[
    int,
    typer.Option(help="Findings listed per step and detector (every one is counted).", min=1, max=1_000_000),
]


@app.command()
def check(
    url: UrlArgument,
    step: StepsOption = None,
    max_findings: MaxFindings = 20,
    json_out: JsonFlag = False,
    use_ray: RayFlag = False,
    storage_options_: StorageOptions = None,
) -> None:
    """Capture health: routing captured wrong without an error (missing, stale, constant or duplicated rows and
    layers, a layer axis shifted between steps, physical EPLB IDs, MTP rows of a decoder layer); exit 1 on an
    error-level finding."""
    from routelog.audit.check import Thresholds
    from routelog.audit.check import check as run_check

    thresholds = Thresholds(max_findings=max_findings)
    result = _run(run_check, url, step, use_ray=use_ray, storage_options_=storage_options_, thresholds=thresholds)
    report_check(result, json_out)
    if not result.ok:
        raise typer.Exit(1)


def report_check(result: CheckResult, json_out: bool) -> None:
    """A check's findings (stdout, one line each) and its verdict, or its JSON."""
    if json_out:
        typer.echo(result.model_dump_json(indent=1))
        return
    for f in result.findings:
        where = [f"step {f.step}", f.detector]
        if f.sample_id is not None:
            where.append(f"sample {f.sample_id}")
        if f.layer is not None:
            where.append(f"layer {f.layer}")
        elif f.detector == "stale_rows":
            where.append("every MoE layer")
        if f.tokens is not None:
            where.append(f"tokens [{f.tokens[0]}, {f.tokens[1]})")
        style = "bold red" if f.severity == "error" else "yellow"
        labeled(f.severity, style, f"{', '.join(where)}: {f.message}", stderr=False)
    for health in result.steps:
        for note in health.notes:
            labeled("note", "yellow", f"step {health.step}: {note}")
    records = sum(s.records for s in result.steps)
    rows = sum(s.rows for s in result.steps)
    more = f" ({result.left_out:,} not listed: raise --max-findings)" if result.left_out else ""
    verdict = ("healthy", "green") if not result.errors and not result.warnings else ("", "")
    console.print(
        Text.assemble(
            f"{result.url}: {plural(len(result.steps), 'step')}, {plural(records, 'record')}, "
            f"{plural(rows, 'routed row')} checked: {plural(result.errors, 'error')}, "
            f"{plural(result.warnings, 'warning')}{more} ",
            verdict,
        ),
        highlight=False,
        soft_wrap=True,
    )
