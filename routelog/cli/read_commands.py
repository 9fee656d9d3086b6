"""Commands that read a store: ``inspect``, ``ls``, ``cat``, ``convert``, ``verify``; and ``spec``."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, cast

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
    load_spec,
    open_url,
    plural,
    print_json,
    say,
)
from routelog.format.limits import MAX_RECORD_TOKENS, MAX_STEP


def _blank(value: Any) -> str:
    """A table cell: empty for None only (0 is a value)."""
    return "" if value is None else str(value)


@app.command()
def inspect(url: UrlArgument, json_out: JsonFlag = False, storage_options_: StorageOptions = None) -> None:
    """Steps, records, tokens, stored bytes and the model spec of a store."""
    summary = open_url(url, storage_options_).summary()
    if json_out:
        print_json(summary)
        return
    spec = summary["model_spec"]
    console.print(
        Text.assemble((str(summary["url"]), "bold"), f"  run {summary['run_id']}  format v{summary['format_version']}")
    )
    moe = list(spec["moe_layers"])
    console.print(
        f"model {spec['name']}: {spec['num_layers']} layers, {len(moe)} MoE {moe[:12]}{'...' if len(moe) > 12 else ''}"
        f", E={spec['num_experts']}, K={spec['topk']}",
        highlight=False,
    )
    table = Table(
        "step", "records", "tokens", "routed rows", "stored rows", "parts", "stored bytes", "routing bytes", "sealed"
    )
    for s in summary["per_step"]:
        table.add_row(
            str(s["step"]),
            f"{s['records']:,}",
            f"{s['tokens']:,}",
            f"{s['routed_rows']:,}",
            f"{s['stored_rows']:,}",
            str(s["parts"]),
            f"{s['stored_bytes']:,}",
            f"{s['routing_bytes']:,}",
            "yes" if s["sealed"] else "",
        )
    console.print(table)
    bptl = summary["bytes_per_token_layer"]
    console.print(
        f"total: {plural(summary['records'], 'record')}, {plural(summary['tokens'], 'token')}, "
        f"{summary['stored_bytes']:,} bytes stored in the steps' parts (+ {summary['run_document_bytes']:,} bytes "
        "of run document)"
        + (f"; routing {bptl:.3f} bytes/token-layer (routing bytes / routed token rows x MoE layers)" if bptl else ""),
        highlight=False,
    )
    if summary["dedup_ratio"]:
        console.print(
            f"shared prefixes stored once: {summary['routed_rows']:,} routed rows in {summary['stored_rows']:,} "
            f"stored ({summary['dedup_ratio']:.2f}x)",
            highlight=False,
        )
    if summary["codecs"]:
        codecs = ", ".join(f"{name} ({plural(n, 'part')})" for name, n in sorted(summary["codecs"].items()))
        console.print(f"routing codecs: {codecs}", highlight=False)


@app.command(name="ls")
def ls_records(
    url: UrlArgument,
    step: Annotated[int, typer.Option(help="Step to list.", min=0, max=MAX_STEP)],
    as_of: Annotated[
        datetime | None,
        typer.Option(
            "--as-of",
            help="The step as it was at this UTC time (ISO 8601): the entries the storage held then (by its clock).",
        ),
    ] = None,
    json_out: JsonFlag = False,
    storage_options_: StorageOptions = None,
) -> None:
    """List the records of a step."""
    from routelog.store.summary import record_listing

    when = None if as_of is None else (as_of if as_of.tzinfo else as_of.replace(tzinfo=UTC))
    snapshot = open_url(url, storage_options_).step(step, as_of=when)
    rows = record_listing(snapshot)
    if json_out:
        print_json(rows)
        return
    table = Table("sample id", "group", "tokens", "prompt", "response", "missing rows", "policy", "engine")
    for r in rows:
        table.add_row(
            r["sample_id"],
            _blank(r["group_id"]),
            str(r["tokens"]),
            str(r["prompt_len"]),
            str(r["response_len"]),
            str(r["missing_rows"]),
            _blank(r["policy_version"]),
            _blank(r["engine"]),
        )
    console.print(table)
    say(f"{plural(len(rows), 'record')} in step {step}{f' as of {when.isoformat()}' if when else ''}")


@app.command()
def cat(
    url: UrlArgument,
    step: Annotated[int, typer.Option(help="Step of the record.", min=0, max=MAX_STEP)],
    sample: Annotated[str, typer.Option(help="Sample id.")],
    npy: Annotated[Path, typer.Option(help="Output .npy file.")],
    layer_axis: Annotated[str, typer.Option(help="'moe' (MoE layers only) or 'full' (every layer).")] = "moe",
    json_out: JsonFlag = False,
    storage_options_: StorageOptions = None,
) -> None:
    """Write one record's expert IDs as .npy: n_tokens x layers x K, -1 for missing rows (and dense layers)."""
    from routelog.engines.common import to_full_axis

    if layer_axis not in ("moe", "full"):
        raise typer.BadParameter("--layer-axis must be 'moe' or 'full'")
    store = open_url(url, storage_options_)
    ids = store.step(step).read(sample).expert_ids
    if layer_axis == "full":
        ids = to_full_axis(ids, store.model_spec, fill=-1)
    import numpy as np

    from routelog.outputs import written_whole

    with written_whole(npy) as partial, partial.open("wb") as file:
        np.save(file, ids, allow_pickle=False)
    if json_out:
        print_json({"npy": str(npy), "dtype": str(ids.dtype), "shape": list(ids.shape)})
    say(f"wrote {npy} {ids.dtype} {list(ids.shape)}")


@app.command()
def spec(
    hf_config: Annotated[Path, typer.Option("--hf-config", help="A HF config.json.")],
    json_out: Annotated[bool, typer.Option("--json", help="JSON on stdout (what spec always prints).")] = False,
) -> None:
    """Print the model spec (layer map) derived from a HF config.json, as JSON (``--model-spec`` reads it)."""
    del json_out
    typer.echo(load_spec(hf_config).model_dump_json(indent=1))


@app.command()
def convert(
    url: UrlArgument,
    to: Annotated[
        str,
        typer.Option(
            "--to", help="vllm | vllm-0.21 | sglang | nemo-rl | ms-swift | megatron | verl | slime | full | moe"
        ),
    ],
    step: Annotated[int, typer.Option(help="Step to export.", min=0, max=MAX_STEP)],
    out: Annotated[
        Path,
        typer.Argument(
            help=".jsonl for an engine's HTTP form (vllm, vllm-0.21, sglang, nemo-rl, ms-swift, megatron): one line "
            'per record, {"sample_id", "request", "response"}, the response the engine sends for it (megatron: the '
            "response alone), which ingest --engine reads back; .npz for arrays (verl, slime, full, moe, "
            "vllm, sglang): one array per record named by its sample id ('<sample id>/<field>' for slime), or one "
            "padded batch for verl."
        ),
    ],
    prompt_length: Annotated[
        int | None,
        typer.Option(help="verl: padded prompt width (max_prompt_length).", min=0, max=MAX_RECORD_TOKENS),
    ] = None,
    response_length: Annotated[
        int | None,
        typer.Option(help="verl: padded response width (max_response_length).", min=0, max=MAX_RECORD_TOKENS),
    ] = None,
    json_out: JsonFlag = False,
    storage_options_: StorageOptions = None,
) -> None:
    """Export a step in an engine or trainer layout.

    Byte for byte what the engine sent only for records ingested with --topk-order score (stored sets keep the
    experts, not their order).
    """
    from routelog.ingest import ARRAY_LAYOUTS, WIRE_LAYOUTS, export_step

    layouts = sorted(set(WIRE_LAYOUTS) | set(ARRAY_LAYOUTS))
    if to not in layouts:
        raise typer.BadParameter(f"--to must be one of {', '.join(layouts)}")
    snapshot = open_url(url, storage_options_).step(step)
    count = export_step(snapshot, cast(Any, to), out, prompt_length=prompt_length, response_length=response_length)
    reordered = to not in ("full", "moe") and any(c.routing.topk_order == "sorted" for c in snapshot.parts)
    if json_out:
        print_json({"step": step, "layout": to, "out": str(out), "records": count, "sorted_topk": reordered})
    say(f"wrote {plural(count, 'record')} of step {step} as {to} to {out}")
    if reordered:
        say(
            "note: these records are stored as sorted top-k sets (the default): the experts are the engine's, their "
            "order is not; ingest with --topk-order score to reproduce the payload byte for byte"
        )


@app.command()
def verify(url: UrlArgument, json_out: JsonFlag = False, storage_options_: StorageOptions = None) -> None:
    """Check schemas, checksums, indexes and every routing row; exit 1 if the store is unsound."""
    store = open_url(url, storage_options_)
    report = store.verify()
    if json_out:
        print_json(
            {
                "ok": report.ok,
                "problems": report.problems,
                "notes": report.notes,
                "steps": report.steps,
                "commits": report.commits,
                "records": report.records,
                "objects": report.objects,
            }
        )
    else:
        for note in report.notes:
            labeled("note", "yellow", note)
        for problem in report.problems:
            labeled("problem", "bold red", problem)
        verdict = ("sound", "green") if report.ok else (plural(len(report.problems), "problem"), "red")
        console.print(
            Text.assemble(
                f"{store.url}: {plural(report.steps, 'step')}, {plural(report.commits, 'commit')}, "
                f"{plural(report.records, 'record')}, {plural(report.objects, 'object')} checked: ",
                verdict,
            ),
            highlight=False,
        )
    if not report.ok:
        raise typer.Exit(1)
