"""``routelog demo``: the R3 pipeline end to end on tiny CPU models, then the commands to explore its stores."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

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
        bool, typer.Option(help="Smaller models and batch (about 10 s instead of 23 s on 2 cores).")
    ] = False,
    json_out: JsonFlag = False,
) -> None:
    """Record -> store -> load aligned -> replay on tiny CPU MoE models, with the R3 paper's metrics."""
    started = time.perf_counter()
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
    seconds = time.perf_counter() - started
    if json_out:
        print_json(metrics | {"wall_seconds": seconds})
        return
    table = Table("model", "", "router diff", "token diff", "mean seq diff", "KL (k3)", "F(t=2)")
    for name in ("qwen3_moe", "deepseek_v3"):
        for mode in ("no_replay", "replay"):
            m = metrics[name][mode]
            table.add_row(
                name if mode == "no_replay" else "",
                "without R3" if mode == "no_replay" else "with R3",
                f"{m['router_diff_rate']:.2%}",
                f"{m['token_diff_rate']:.2%}",
                f"{m['mean_sequence_diff']:.2f}",
                f"{m['kl_k3']:.2e}",
                f"{m['f_t2']:.2%}",
            )
    dense = metrics["dense"]
    table.add_row("dense", "bf16 vs fp32 only", "", "", "", f"{dense['kl_k3']:.2e}", f"{dense['f_t2']:.2%}")
    console.print(table)
    infer, train = metrics["qwen3_moe"]["store"], metrics["qwen3_moe"]["train_store"]
    console.print(
        f"wrote {out / 'metrics.json'} and {out / 'report.png'} in {seconds:.0f} s (wall clock, imports included)\n"
        f"stores: {', '.join(metrics[n]['store'] for n in ('qwen3_moe', 'deepseek_v3'))}\n"
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
