"""``routelog demo``: the R3 pipeline end to end on tiny CPU models, then the commands to explore its stores."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from routelog.cli.app import JsonFlag, app, console, err_console, print_json, progress_bar, say


def _interrupted(out: Path, stores: list[str]) -> None:
    from routelog.errors import WriteInterruptedError

    wrote = (
        f"it had begun the stores {', '.join(stores)} (and their -train twins)" if stores else "it had written no store"
    )
    raise WriteInterruptedError(
        f"interrupted: routelog demo stopped before {out / 'report.png'}; {wrote}. Run `routelog demo --out {out}` "
        "again to start over (each run writes new stores; the interrupted run's can be deleted)"
    ) from None


MODEL_LABELS = {
    "qwen3_moe": "Qwen3-MoE style (7 MoE layers, top-8 of 64)",
    "deepseek_v3": "DeepSeek-V3 style (sigmoid, group-limited, bias)",
    "deepseek_v32": "DeepSeek-V3.2 style (V3 + sparse-attention indexer, top-16 keys)",
}
DENSE_LABEL = "dense baseline (no router: bf16 vs fp32 only)"


def _short_e(value: float) -> str:
    """``4.4e-4``: two digits, the exponent without its padding zero (as the README writes it)."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _percent(value: float, digits: int) -> str:
    return "0" if value == 0 else f"{100 * value:.{digits}f} %"


def readme_table(metrics: dict[str, Any]) -> Table:
    """The demo's results in the README's table: per model, without R3 -> with R3."""
    table = Table("model", "router diff (no R3 -> R3)", "token diff", "indexer diff", "KL k3 (no R3 -> R3)")
    for name, label in MODEL_LABELS.items():
        off, on = metrics[name]["no_replay"], metrics[name]["replay"]
        indexer = (
            f"{_percent(off['indexer_diff_rate'], 1)} -> {_percent(on['indexer_diff_rate'], 1)}"
            if "indexer_diff_rate" in off
            else ""
        )
        table.add_row(
            label,
            f"{_percent(off['router_diff_rate'], 1)} -> {_percent(on['router_diff_rate'], 1)}",
            f"{_percent(off['token_diff_rate'], 0)} -> {_percent(on['token_diff_rate'], 0)}",
            indexer,
            f"{_short_e(off['kl_k3'])} -> {_short_e(on['kl_k3'])}",
        )
    table.add_row(DENSE_LABEL, "", "", "", _short_e(metrics["dense"]["kl_k3"]))
    return table


@app.command()
def demo(
    out: Annotated[
        Path, typer.Option(help="Directory for metrics.json, report.png and (by default) the stores.")
    ] = Path("routelog-demo"),
    store: Annotated[
        str | None,
        typer.Option(
            help="Base URL the demo's stores are created under, one per model and seed (default: <out>/store); "
            "e.g. s3://bucket/demo with the AWS_* environment."
        ),
    ] = None,
    quick: Annotated[
        bool, typer.Option(help="Smaller models and batch (about 7 s instead of 15 s on 2 idle cores).")
    ] = False,
    json_out: JsonFlag = False,
) -> None:
    """Record -> store -> load aligned -> replay on tiny CPU MoE models, with the R3 paper's metrics."""
    started = time.perf_counter()
    if store is not None:  # refused at once, not once the models have run
        from routelog.store.storage import check_url

        check_url(store)
    say("routelog demo: loading torch and transformers, then three tiny MoE models and a dense one on CPU")
    from routelog.demo import STAGES, run_demo

    with progress_bar() as progress:
        task = progress.add_task("routelog demo", total=STAGES)
        done = 0

        def stage(message: str) -> None:
            nonlocal done
            done += 1
            progress.update(task, description=message, completed=done - 1)
            if not err_console.is_terminal:  # redirected: one line per stage instead of a bar
                say(f"[{done}/{STAGES}] {message} ({time.perf_counter() - started:.0f} s)")

        started_stores: list[str] = []
        try:
            metrics = run_demo(out, store_url=store, quick=quick, progress=stage, started=started_stores)
        except KeyboardInterrupt:
            _interrupted(out, started_stores)
        progress.update(task, completed=STAGES)
    try:
        _summarize(metrics, out, time.perf_counter() - started, json_out)
    except KeyboardInterrupt:  # everything is written: say so rather than a bare "interrupted"
        from routelog.errors import WriteInterruptedError

        raise WriteInterruptedError(
            f"interrupted while printing the summary: the demo had finished; {out / 'metrics.json'} holds its "
            f"numbers and {out / 'report.png'} its figure"
        ) from None


def _summarize(metrics: dict[str, Any], out: Path, seconds: float, json_out: bool) -> None:
    if json_out:
        print_json(metrics | {"wall_seconds": seconds})
        return
    console.print(readme_table(metrics))
    infer, train = metrics["qwen3_moe"]["store"], metrics["qwen3_moe"]["train_store"]
    console.print(
        f"wrote {out / 'metrics.json'} and {out / 'report.png'} in {seconds:.0f} s (wall clock, imports included)\n"
        f"stores: {', '.join(metrics[n]['store'] for n in MODEL_LABELS)}\n"
        "  each with a <store>-train twin: the training forward's own routing, no replay\n"
        "next, on the qwen3_moe stores:\n"
        f"  routelog inspect {infer}\n"
        f"  routelog stats {infer} --plot stats.png\n"
        f"  routelog diff {infer} {train} --step 0 --plot diff.png      # the router diff without R3, from storage\n"
        f"  routelog mismatch {infer} --plot mismatch.png               # KL (k3) without R3, from stored log-probs\n"
        f"  routelog drift {infer} --other {train} --plot drift.png",
        highlight=False,
        soft_wrap=True,
    )
