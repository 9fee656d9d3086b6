"""The ``routelog`` command line."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import numpy as np
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from routelog.errors import RoutelogError
from routelog.spec import ModelSpec

if TYPE_CHECKING:
    from routelog.ingest import Engine, ExportLayout
    from routelog.store import Store

app = typer.Typer(
    name="routelog",
    help="Record, store, audit and replay MoE routing decisions (Rollout Routing Replay).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

StorageOptions = Annotated[
    str | None,
    typer.Option("--storage-options", help='fsspec storage options as JSON, e.g. \'{"endpoint_url": "..."}\'.'),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def main() -> None:
    """Entry point: typed routelog errors become a one-line message and exit code 2."""
    try:
        app()
    except RoutelogError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)


def _options(text: str | None) -> dict[str, Any]:
    from routelog.storage import parse_storage_options

    return parse_storage_options(text)


def _load_spec(path: Path) -> ModelSpec:
    from routelog.errors import ModelSpecError

    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelSpecError(f"cannot read model spec {path}: {exc}") from exc
    if "moe_layers" in raw:
        return ModelSpec.model_validate(raw)
    return ModelSpec.from_hf_config(raw)


def _print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=1, default=str))


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    )


def _try_open(url: str, options: dict[str, Any]) -> Store | None:
    from routelog.errors import StoreNotFoundError
    from routelog.store import open_store

    try:
        return open_store(url, storage_options=options)
    except StoreNotFoundError:
        return None


# -- demo -------------------------------------------------------------------------------------------------------
@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="Directory for metrics.json, report.png and the default store.")] = Path(
        "routelog-demo"
    ),
    store: Annotated[str | None, typer.Option(help="Store URL (default: a local store under --out).")] = None,
    quick: Annotated[bool, typer.Option(help="Small models and batch (about a minute).")] = False,
    storage_options: StorageOptions = None,
) -> None:
    """Record -> store -> load aligned -> replay on tiny CPU MoE models, with the R3 paper's metrics."""
    from routelog.demo import run_demo

    if storage_options:
        raise typer.BadParameter("the demo takes credentials from the environment; --storage-options is not used")
    with _progress() as progress:
        task = progress.add_task("routelog demo", total=9)

        def step(message: str) -> None:
            progress.update(task, description=message)
            progress.advance(task)

        metrics = run_demo(out, store_url=store, quick=quick, progress=step)
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
    table.add_row(
        "dense", "baseline", "", "", "", f"{metrics['dense']['kl_k3']:.2e}", f"{metrics['dense']['f_t2']:.2%}"
    )
    console.print(table)
    console.print(f"wrote {out / 'metrics.json'} and {out / 'report.png'} in {metrics['seconds']:.0f} s")


# -- synth ------------------------------------------------------------------------------------------------------
@app.command()
def synth(
    url: Annotated[str, typer.Argument(help="Store URL (file://, memory://, s3:// or a local path).")],
    step: Annotated[int, typer.Option(help="RL step to write.")] = 0,
    records: Annotated[int, typer.Option(help="Records to write.")] = 16,
    tokens: Annotated[int, typer.Option(help="Tokens per record (the mean with --ragged).")] = 512,
    layers: Annotated[
        int | None, typer.Option(help="MoE layers, all layers MoE (default 8, or the existing store's spec).")
    ] = None,
    experts: Annotated[int | None, typer.Option(help="Routed experts per layer (default 64).")] = None,
    topk: Annotated[int | None, typer.Option(help="Experts per token per layer (default 8).")] = None,
    model_spec: Annotated[
        Path | None, typer.Option(help="Model spec JSON (or a HF config.json) instead of --layers/--experts/--topk.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    skew: Annotated[float, typer.Option(help="Expert popularity skew (0 = uniform).")] = 0.0,
    locality: Annotated[float, typer.Option(help="Probability a token reuses the previous token's experts.")] = 0.0,
    ragged: Annotated[bool, typer.Option(help="Ragged lengths around --tokens.")] = False,
    sample_prefix: Annotated[str, typer.Option(help="Prefix of sample ids (lets processes share a step).")] = "",
    writer_id: Annotated[str | None, typer.Option(help="Writer id (default: random).")] = None,
    with_token_ids: Annotated[bool, typer.Option(help="Store token ids, not only their hash.")] = False,
    topk_order: Annotated[str, typer.Option(help="'sorted' (canonical, smallest) or 'score'.")] = "sorted",
    logprob_noise: Annotated[
        float | None,
        typer.Option(help="Attach logprob_infer, then annotate logprob_train with this log-scale noise."),
    ] = None,
    storage_options: StorageOptions = None,
) -> None:
    """Write synthetic routing to a store (creating it if needed)."""
    from routelog.part import PartOptions
    from routelog.store import create_store
    from routelog.synth import SynthConfig, synth_records, synth_training_logprobs, synthetic_spec
    from routelog.values import LOGPROB_INFER, LOGPROB_TRAIN

    options_ = _options(storage_options)
    if model_spec is not None:
        spec = _load_spec(model_spec)
    elif layers is None and experts is None and topk is None and (existing := _try_open(url, options_)):
        spec = existing.model_spec
    else:
        spec = synthetic_spec(layers or 8, experts or 64, topk or 8)
    store = create_store(url, spec, storage_options=options_)
    config = SynthConfig(
        records=records,
        tokens=tokens,
        seed=seed,
        ragged=ragged,
        skew=skew,
        locality=locality,
        sample_prefix=sample_prefix,
        step=step,
        with_token_ids=with_token_ids,
        logprob_noise=logprob_noise,
    )
    options = PartOptions(topk_order="score" if topk_order == "score" else "sorted")
    train: dict[str, Any] = {}  # what a trainer would report later: annotated once the records are committed
    with _progress() as progress, store.writer(step, writer_id, options=options) as writer:
        task = progress.add_task(f"synth step {step}", total=records)
        for i, record in enumerate(synth_records(store.model_spec, config)):
            writer.append(record)
            if logprob_noise is not None and record.token_values:
                train[record.sample_id] = synth_training_logprobs(
                    np.asarray(record.token_values[LOGPROB_INFER], np.float32), logprob_noise, seed + i
                )
            progress.advance(task)
    err_console.print(f"wrote {records} records to step {step} of {store.url} in {len(writer.commits)} part(s)")
    if train:
        with store.annotate(step, f"{writer.writer_id[:58]}-train") as annotator:
            for sample_id, values in train.items():
                annotator.add(sample_id, {LOGPROB_TRAIN: values})


# -- inspect / ls / cat -----------------------------------------------------------------------------------------
@app.command()
def inspect(
    url: Annotated[str, typer.Argument(help="Store URL.")],
    json_out: JsonFlag = False,
    storage_options: StorageOptions = None,
) -> None:
    """Steps, records, tokens, stored bytes and the model spec of a store."""
    from routelog.store import open_store
    from routelog.summary import store_summary

    summary = store_summary(open_store(url, storage_options=_options(storage_options)))
    if json_out:
        _print_json(summary)
        return
    spec = summary["model_spec"]
    console.print(f"[bold]{summary['url']}[/]  run {summary['run_id']}  format v{summary['format_version']}")
    console.print(
        f"model {spec['name']}: {spec['num_layers']} layers, {len(spec['moe_layers'])} MoE "
        f"{list(spec['moe_layers'])[:12]}{'...' if len(spec['moe_layers']) > 12 else ''}, "
        f"E={spec['num_experts']}, K={spec['topk']}"
    )
    table = Table("step", "records", "tokens", "parts", "stored bytes", "sealed")
    for s in summary["per_step"]:
        table.add_row(
            str(s["step"]),
            str(s["records"]),
            str(s["tokens"]),
            str(s["parts"]),
            f"{s['stored_bytes']:,}",
            "yes" if s["sealed"] else "",
        )
    console.print(table)
    bptl = summary["bytes_per_token_layer"]
    console.print(
        f"total: {summary['records']} records, {summary['tokens']:,} tokens, {summary['stored_bytes']:,} bytes"
        + (f", {bptl:.3f} bytes/token-layer" if bptl else "")
    )


@app.command(name="ls")
def ls_records(
    url: Annotated[str, typer.Argument(help="Store URL.")],
    step: Annotated[int, typer.Option(help="Step to list.")],
    as_of: Annotated[
        datetime | None,
        typer.Option("--as-of", help="The step as it was at this UTC time (ISO 8601): commits made by then only."),
    ] = None,
    json_out: JsonFlag = False,
    storage_options: StorageOptions = None,
) -> None:
    """List the records of a step."""
    from routelog.store import open_store
    from routelog.summary import record_listing

    when = None if as_of is None else (as_of if as_of.tzinfo else as_of.replace(tzinfo=UTC))
    rows = record_listing(open_store(url, storage_options=_options(storage_options)).step(step, as_of=when))
    if json_out:
        _print_json(rows)
        return
    table = Table("sample id", "group", "tokens", "prompt", "response", "missing rows", "policy")
    for r in rows:
        table.add_row(
            r["sample_id"],
            r["group_id"] or "",
            str(r["tokens"]),
            str(r["prompt_len"]),
            str(r["response_len"]),
            str(r["missing_rows"]),
            str(r["policy_version"] or ""),
        )
    console.print(table)


@app.command()
def cat(
    url: Annotated[str, typer.Argument(help="Store URL.")],
    step: Annotated[int, typer.Option(help="Step of the record.")],
    sample: Annotated[str, typer.Option(help="Sample id.")],
    npy: Annotated[Path, typer.Option(help="Output .npy file.")],
    layer_axis: Annotated[str, typer.Option(help="'moe' (MoE layers only) or 'full' (every layer).")] = "moe",
    storage_options: StorageOptions = None,
) -> None:
    """Write one record's expert IDs as .npy ([n_tokens, layers, K]; -1 = missing row or dense layer)."""
    from routelog.store import open_store

    store = open_store(url, storage_options=_options(storage_options))
    routing = store.step(step).read(sample)
    ids = routing.expert_ids
    if layer_axis == "full":
        spec = store.model_spec
        full = np.full((ids.shape[0], spec.num_layers, spec.topk), -1, dtype=ids.dtype)
        full[:, list(spec.moe_layers)] = ids
        ids = full
    elif layer_axis != "moe":
        raise typer.BadParameter("--layer-axis must be 'moe' or 'full'")
    np.save(npy, ids, allow_pickle=False)
    err_console.print(f"wrote {npy} {ids.dtype} {list(ids.shape)}")


# -- engines ----------------------------------------------------------------------------------------------------
@app.command()
def spec(
    hf_config: Annotated[Path, typer.Option("--hf-config", help="A HF config.json.")],
) -> None:
    """Print the model spec (layer map) derived from a HF config.json."""
    typer.echo(_load_spec(hf_config).model_dump_json(indent=1))


@app.command()
def ingest(
    inputs: Annotated[
        list[Path],
        typer.Argument(
            help="JSONL of HTTP responses (vllm, sglang, nemo-rl, ms-swift); .npz/.safetensors (verl, slime)."
        ),
    ],
    engine: Annotated[str, typer.Option(help="vllm | sglang | nemo-rl | ms-swift | verl | slime")],
    to: Annotated[str, typer.Option("--to", help="Store URL.")],
    step: Annotated[int, typer.Option(help="RL step the records belong to.")],
    model_spec: Annotated[
        Path | None, typer.Option(help="Model spec JSON or HF config.json (default: the existing store's spec).")
    ] = None,
    sample_id_field: Annotated[
        str | None,
        typer.Option(
            help="Dotted path of the sample id in each JSONL line, e.g. request.metadata.uid "
            "(default: the response id, plus /<choice> with several choices)."
        ),
    ] = None,
    policy_version: Annotated[int | None, typer.Option(help="Policy (weights) version that generated them.")] = None,
    engine_version: Annotated[
        str | None,
        typer.Option(help="Engine version, e.g. 0.21.0: decides version-dependent layouts (see the README's table)."),
    ] = None,
    eplb: Annotated[
        bool,
        typer.Option("--eplb", help="The engine ran with EPLB (vLLM 0.14-0.15 and 0.21 then report physical IDs)."),
    ] = False,
    eplb_map: Annotated[
        Path | None,
        typer.Option(
            help="Physical-to-logical expert table (.npy or JSON): [num_physical], or vLLM's per-layer "
            "[num_moe_layers, num_physical]."
        ),
    ] = None,
    skip_absent: Annotated[
        bool,
        typer.Option(help="Skip samples the engine returned no routing for (aborted, ...) and count them."),
    ] = False,
    stream_request: Annotated[
        Path | None,
        typer.Option(
            "--stream-request",
            help="Each input is one streamed vLLM generate response (its chunks, one per line) for this request JSON.",
        ),
    ] = None,
    writer_id: Annotated[str | None, typer.Option(help="Writer id (default: random).")] = None,
    topk_order: Annotated[
        str,
        typer.Option(
            help="'sorted' (canonical sets: the smallest) or 'score' (keep the engine's order: needed to export the "
            "payload back byte for byte; about 1.3x the bytes)."
        ),
    ] = "sorted",
    storage_options: StorageOptions = None,
) -> None:
    """Ingest routing as an engine or trainer logged it into a store."""
    from routelog.errors import RoutingAbsentError
    from routelog.ingest import read_records
    from routelog.part import PartOptions
    from routelog.store import create_store

    if engine not in ("vllm", "sglang", "nemo-rl", "ms-swift", "verl", "slime"):
        raise typer.BadParameter("--engine must be vllm, sglang, nemo-rl, ms-swift, verl or slime")
    options_ = _options(storage_options)
    if model_spec is not None:
        spec_ = _load_spec(model_spec)
    elif existing := _try_open(to, options_):
        spec_ = existing.model_spec
    else:
        raise typer.BadParameter("--model-spec is needed to create a new store")
    table = None
    if eplb_map is not None:
        table = np.load(eplb_map, allow_pickle=False) if eplb_map.suffix == ".npy" else json.loads(eplb_map.read_text())
    request = json.loads(stream_request.read_text()) if stream_request is not None else None
    absent: dict[str, int] = {}

    def count_absent(error: RoutingAbsentError) -> None:
        absent[error.reason] = absent.get(error.reason, 0) + 1

    store = create_store(to, spec_, storage_options=options_)
    count = 0
    options = PartOptions(topk_order="score" if topk_order == "score" else "sorted")
    with _progress() as progress, store.writer(step, writer_id, options=options) as writer:
        task = progress.add_task(f"ingest {engine}", total=None)
        for record in read_records(
            cast("Engine", engine),
            inputs,
            spec_,
            sample_id_field=sample_id_field,
            policy_version=policy_version,
            physical_to_logical=table,
            engine_version=engine_version,
            eplb=eplb,
            stream_request=request,
            on_absent=count_absent if skip_absent else None,
        ):
            writer.append(record)
            count += 1
            progress.advance(task)
    skipped = f"; skipped {sum(absent.values())} without routing ({absent})" if absent else ""
    err_console.print(f"ingested {count} records into step {step} of {store.url}{skipped}")


@app.command()
def convert(
    url: Annotated[str, typer.Argument(help="Store URL.")],
    to: Annotated[
        str, typer.Option("--to", help="vllm | vllm-0.21 | sglang | nemo-rl | ms-swift | verl | slime | full | moe")
    ],
    step: Annotated[int, typer.Option(help="Step to export.")],
    out: Annotated[
        Path,
        typer.Argument(
            help="Output: .jsonl for an engine's HTTP form (vllm, vllm-0.21, sglang, nemo-rl, ms-swift), else .npz."
        ),
    ],
    prompt_length: Annotated[int | None, typer.Option(help="verl: padded prompt width (max_prompt_length).")] = None,
    response_length: Annotated[
        int | None, typer.Option(help="verl: padded response width (max_response_length).")
    ] = None,
    storage_options: StorageOptions = None,
) -> None:
    """Export a step in an engine or trainer layout. Byte for byte what the engine sent only for records ingested
    with --topk-order score (stored sets keep the experts, not their order)."""
    from routelog.ingest import ARRAY_LAYOUTS, WIRE_LAYOUTS, export_step
    from routelog.store import open_store

    if to not in set(WIRE_LAYOUTS) | set(ARRAY_LAYOUTS):
        raise typer.BadParameter(f"--to must be one of {sorted(set(WIRE_LAYOUTS) | set(ARRAY_LAYOUTS))}")
    snapshot = open_store(url, storage_options=_options(storage_options)).step(step)
    count = export_step(
        snapshot, cast("ExportLayout", to), out, prompt_length=prompt_length, response_length=response_length
    )
    err_console.print(f"wrote {count} records of step {step} as {to} to {out}")
    if to not in ("full", "moe") and any(c.routing.topk_order == "sorted" for c in snapshot.commits):
        err_console.print(
            "note: these records are stored as sorted top-k sets (the default): the experts are the engine's, their "
            "order is not; ingest with --topk-order score to reproduce the payload byte for byte"
        )


# -- alignment ---------------------------------------------------------------------------------------------------
@app.command()
def align(
    url: Annotated[str, typer.Argument(help="Store URL.")],
    step: Annotated[int, typer.Option(help="Step to align.")],
    micro_batches: Annotated[
        str, typer.Option(help="Sample ids per micro-batch: 'id1,id2|id3', or @FILE holding that text.")
    ],
    out: Annotated[Path, typer.Option(help="Output .npz file.")],
    packing: Annotated[str, typer.Option(help="verl | slime | slime-allgather | nemo | bshd | thd")] = "verl",
    fp8: Annotated[bool, typer.Option(help="FP8 padding (verl, nemo).")] = False,
    fp8_block: Annotated[int, typer.Option(help="nemo: FP8 block, 16 tensorwise, 32 MXFP8, 128 blockwise.")] = 128,
    hybrid_ep: Annotated[
        bool, typer.Option(help="nemo: the flex dispatcher's HybridEP backend (total to 128x).")
    ] = False,
    divisible_by: Annotated[
        int | None, typer.Option(help="nemo: make_sequence_length_divisible_by (default: the minimum factor).")
    ] = None,
    slime_pad_multiplier: Annotated[int, typer.Option(help="slime: --data-pad-size-multiplier.")] = 128,
    pad_to: Annotated[
        int | None, typer.Option(help="nemo with PP: total every micro-batch is padded to (default: computed).")
    ] = None,
    seq_len: Annotated[int | None, typer.Option(help="bshd: the padded width S (default: computed).")] = None,
    cu_seqlens: Annotated[
        str | None, typer.Option(help="thd: the trainer's cu_seqlens_padded per micro-batch, '0,16,40|0,8'.")
    ] = None,
    micro_batch_cp: Annotated[
        str | None, typer.Option(help="Dynamic CP: each micro-batch's CP size, '2,4' (default: --cp).")
    ] = None,
    tp: Annotated[int, typer.Option(help="Tensor parallel size (sequence parallel when > 1).")] = 1,
    cp: Annotated[int, typer.Option(help="Context parallel size.")] = 1,
    cp_layout: Annotated[str, typer.Option(help="zigzag | contiguous")] = "zigzag",
    pp: Annotated[int, typer.Option(help="Pipeline parallel size.")] = 1,
    vpp: Annotated[int, typer.Option(help="Virtual pipeline stages per rank.")] = 1,
    first_stage_layers: Annotated[int | None, typer.Option(help="Layers in the first pipeline stage.")] = None,
    last_stage_layers: Annotated[int | None, typer.Option(help="Layers in the last pipeline stage.")] = None,
    account_for_embedding: Annotated[bool, typer.Option(help="account_for_embedding_in_pipeline_split")] = False,
    account_for_loss: Annotated[bool, typer.Option(help="account_for_loss_in_pipeline_split")] = False,
    stage_layers: Annotated[
        str | None,
        typer.Option(help="Explicit layers per (pp rank, virtual stage): '0,1;4,5|2,3;6,7' (ranks by |, stages by ;)."),
    ] = None,
    rank: Annotated[str, typer.Option(help="This rank: tp=I,cp=J,pp=K.")] = "tp=0,cp=0,pp=0",
    missing: Annotated[
        str, typer.Option(help="dummy | router: what rows without a route get when installed.")
    ] = "dummy",
    policy_version: Annotated[
        list[int] | None, typer.Option(help="Replay only tokens generated by this policy version (repeatable).")
    ] = None,
    model_spec: Annotated[Path | None, typer.Option(help="Override the store's model spec.")] = None,
    storage_options: StorageOptions = None,
) -> None:
    """Write exactly what one trainer rank receives (keys: mb{m}_positions, mb{m}_layer{n}_ids, mb{m}_layer{n}_mask;
    n is Megatron's 1-based layer_number). Every option of the Python API's plan is here."""
    from routelog.align import AlignmentPlan, MicroBatch, Packing, ParallelLayout, RankCoords, parse_micro_batches
    from routelog.ingest import NpzWriter
    from routelog.loader import ReplayLoader
    from routelog.store import open_store

    text = Path(micro_batches[1:]).read_text() if micro_batches.startswith("@") else micro_batches
    batches = parse_micro_batches(text)
    per_batch: dict[str, list[Any]] = {
        "cu_seqlens_padded": _per_micro_batch(cu_seqlens, len(batches), "--cu-seqlens", tuple_of_ints=True),
        "cp": _per_micro_batch(micro_batch_cp, len(batches), "--micro-batch-cp"),
    }
    batches = [
        MicroBatch(
            b.sample_ids,
            cu_seqlens_padded=per_batch["cu_seqlens_padded"][i],
            cp=per_batch["cp"][i],
            seq_len=seq_len,
            pad_to=pad_to,
        )
        for i, b in enumerate(batches)
    ]
    store = open_store(url, storage_options=_options(storage_options))
    layout = ParallelLayout(
        tp=tp,
        cp=cp,
        pp=pp,
        vpp=vpp,
        cp_layout=cp_layout,  # type: ignore[arg-type]
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        account_for_embedding=account_for_embedding,
        account_for_loss=account_for_loss,
        stage_layers=_stage_layers(stage_layers),
    )
    plan = AlignmentPlan(
        spec=_load_spec(model_spec) if model_spec else store.model_spec,
        layout=layout,
        packing=Packing(
            kind=packing,  # type: ignore[arg-type]
            fp8=fp8,
            fp8_block=fp8_block,
            hybrid_ep=hybrid_ep,
            divisible_by=divisible_by,
            slime_pad_multiplier=slime_pad_multiplier,
        ),
        rank=RankCoords.parse(rank),
        micro_batches=tuple(batches),
        missing=missing,  # type: ignore[arg-type]
        policy_versions=frozenset(policy_version) if policy_version else None,
    )
    writer = NpzWriter(out)
    try:
        with ReplayLoader(store, step, plan) as loader:
            for replay in loader:
                writer.add(f"mb{replay.index}_positions", replay.positions)
                for j, router in enumerate(replay.routers):
                    writer.add(f"mb{replay.index}_layer{router.layer_number}_ids", replay.ids[j])
                    writer.add(f"mb{replay.index}_layer{router.layer_number}_mask", replay.mask)
    finally:
        writer.close()
    routers = [r.layer_number for r in plan.routers]
    err_console.print(f"wrote {len(plan.micro_batches)} micro-batches x {len(routers)} routers {routers} to {out}")


def _per_micro_batch(text: str | None, count: int, option: str, *, tuple_of_ints: bool = False) -> list[Any]:
    """``a|b|c`` (one entry per micro-batch; ``,``-separated ints each for ``tuple_of_ints``), else Nones."""
    if text is None:
        return [None] * count
    entries = text.split("|") if tuple_of_ints else text.split(",")
    if len(entries) != count:
        raise typer.BadParameter(f"{option} has {len(entries)} entries for {count} micro-batches")
    try:
        return [tuple(int(v) for v in e.split(",")) if tuple_of_ints else int(e) for e in entries]
    except ValueError:
        raise typer.BadParameter(f"{option} must hold integers") from None


def _stage_layers(text: str | None) -> tuple[tuple[tuple[int, ...], ...], ...] | None:
    if text is None:
        return None
    try:
        return tuple(
            tuple(tuple(int(v) for v in stage.split(",") if v.strip()) for stage in rank.split(";"))
            for rank in text.split("|")
        )
    except ValueError:
        raise typer.BadParameter("--stage-layers must look like '0,1;4,5|2,3;6,7'") from None


# -- steps ------------------------------------------------------------------------------------------------------
@app.command()
def seal(
    url: Annotated[str, typer.Argument(help="Store URL.")],
    step: Annotated[int, typer.Option(help="Step to seal.")],
    storage_options: StorageOptions = None,
) -> None:
    """Seal a step: no more commits are accepted; readers then open it in a few requests whatever its parts."""
    from routelog.store import open_store

    record = open_store(url, storage_options=_options(storage_options)).seal(step)
    console.print(
        f"sealed step {step}: {len(record.commits)} commits, {record.n_records} records, {record.n_tokens:,} tokens"
    )


@app.command()
def gc(
    url: Annotated[str, typer.Argument(help="Store URL.")],
    older_than: Annotated[str, typer.Option(help="Grace period, e.g. 6h, 30m, 2d.")] = "24h",
    delete: Annotated[bool, typer.Option("--delete", help="Delete (default: dry run, only report).")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Accept a grace period under 1h: only when no writer is running.")
    ] = False,
    json_out: JsonFlag = False,
    storage_options: StorageOptions = None,
) -> None:
    """Find (and with --delete remove) objects of dead writers that no commit or seal references."""
    from routelog.gc import collect_garbage, parse_duration
    from routelog.store import open_store

    try:
        seconds = parse_duration(older_than)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    store = open_store(url, storage_options=_options(storage_options))
    report = collect_garbage(store, seconds, delete=delete, force=force)
    if json_out:
        _print_json(
            {
                "orphans": report.orphans,
                "bytes": report.bytes,
                "deleted": report.deleted,
                "kept_young": report.kept_young,
                "damaged": report.damaged,
            }
        )
        if report.damaged:
            raise typer.Exit(1)
        return
    for damage in report.damaged:
        err_console.print(f"[bold red]damaged:[/] {damage}", highlight=False, soft_wrap=True)
    for key, size in sorted(report.orphans.items()):
        console.print(f"{'deleted' if report.deleted else 'orphan'} {key} ({size:,} bytes)", highlight=False)
    verb = "deleted" if report.deleted else "would delete (dry run; add --delete)"
    console.print(
        f"{verb} {len(report.orphans)} objects, {report.bytes:,} bytes; {report.kept_young} younger "
        f"unreferenced objects kept"
    )
    if report.damaged:
        err_console.print(f"{len(report.damaged)} damaged document(s): gc will delete nothing until they are repaired")
        raise typer.Exit(1)


# -- verify -----------------------------------------------------------------------------------------------------
@app.command()
def verify(
    url: Annotated[str, typer.Argument(help="Store URL.")],
    json_out: JsonFlag = False,
    storage_options: StorageOptions = None,
) -> None:
    """Check schemas, checksums, indexes and every routing row; exit 1 if the store is unsound."""
    from routelog.store import open_store
    from routelog.verify import verify_store

    store = open_store(url, storage_options=_options(storage_options))
    report = verify_store(store)
    if json_out:
        _print_json(
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
            err_console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
        for problem in report.problems:
            err_console.print(f"[bold red]problem:[/] {problem}", highlight=False, soft_wrap=True)
        verdict = "[green]sound[/]" if report.ok else f"[red]{len(report.problems)} problem(s)[/]"
        console.print(
            f"{store.url}: {report.steps} steps, {report.commits} commits, {report.records} records, "
            f"{report.objects} objects checked: {verdict}"
        )
    if not report.ok:
        raise typer.Exit(1)


# -- audits ---------------------------------------------------------------------------------------------------------
StepsOption = Annotated[list[int] | None, typer.Option("--step", help="Step to include (repeatable; default: all).")]
PlotOption = Annotated[Path | None, typer.Option("--plot", help="Write a figure (PNG) here.")]
RayFlag = Annotated[
    bool, typer.Option("--ray", help="Spread the work over a Ray cluster (RAY_ADDRESS, or a local one).")
]


class _AuditProgress:
    """A progress bar over records on stderr (only when it is a terminal); an audit calls it with
    (records done, records planned)."""

    def __init__(self, label: str) -> None:
        self.bar = _progress()
        self.bar.disable = not err_console.is_terminal
        self.task = self.bar.add_task(label, total=None)

    def __enter__(self) -> _AuditProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def __call__(self, done: int, total: int) -> None:
        self.bar.update(self.task, completed=done, total=total)


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
    url: Annotated[str, typer.Argument(help="Store URL.")],
    step: StepsOption = None,
    json_out: JsonFlag = False,
    plot: PlotOption = None,
    use_ray: RayFlag = False,
    storage_options: StorageOptions = None,
) -> None:
    """Per MoE layer: expert load, imbalance (max/mean, CV) and routing entropy; totals."""
    from routelog import audit
    from routelog.audit.figures import stats_figure

    options = _options(storage_options)
    with _AuditProgress("stats") as progress:
        result = audit.stats(url, step, storage_options=options, use_ray=use_ray, progress=progress)
    table = Table("layer", "imbalance (max/mean)", "CV", "entropy / log2 E", "busiest expert")
    for layer in result.layers:
        table.add_row(
            str(layer.layer),
            f"{layer.imbalance:.3f}",
            f"{layer.cv:.3f}",
            f"{layer.entropy_normalized:.4f}",
            str(int(np.argmax(layer.load))),
        )
    summary = (
        f"{result.url}: steps {result.steps}, {result.records} records, {result.tokens} tokens "
        f"({result.rows} routed), {result.stored_bytes} B stored = {result.bytes_per_token_layer:.2f} B/token-layer"
    )
    _report(result, json_out, plot, stats_figure, [summary])
    if not json_out:
        console.print(table)


@app.command()
def diff(
    url_a: Annotated[str, typer.Argument(help="First store URL (e.g. the inference recording).")],
    url_b: Annotated[str, typer.Argument(help="Second store URL (e.g. a training-side recording); may be the same.")],
    step: Annotated[int, typer.Option(help="Step of the first store.")],
    step_b: Annotated[int | None, typer.Option(help="Step of the second store (default: --step).")] = None,
    json_out: JsonFlag = False,
    plot: PlotOption = None,
    use_ray: RayFlag = False,
    storage_options: StorageOptions = None,
) -> None:
    """Routing differences of the same records (router, token and sequence level; per layer): paper Fig. 3."""
    from routelog import audit
    from routelog.audit.figures import diff_figure

    options = _options(storage_options)
    with _AuditProgress("diff") as progress:
        result = audit.diff(
            url_a, url_b, step, step_b=step_b, storage_options=options, use_ray=use_ray, progress=progress
        )
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
    storage_options: StorageOptions = None,
) -> None:
    """Per step: training-inference KL (k3) and F(t) for t in 1.5, 2, 5 from stored log-probs: paper Fig. 5."""
    from routelog import audit
    from routelog.audit.figures import mismatch_figure

    options = _options(storage_options)
    with _AuditProgress("mismatch") as progress:
        result = audit.mismatch(url, step, storage_options=options, use_ray=use_ray, progress=progress)
    lines = [
        f"step {s.step}: {s.tokens} tokens, KL k3 {s.kl_k3:.3e}, "
        + ", ".join(f"F({t}) {v:.3e}" for t, v in s.extreme.items())
        for s in result.steps
    ] or [f"{url}: no record has both logprob_infer and logprob_train"]
    _report(result, json_out, plot, mismatch_figure, lines)


@app.command()
def drift(
    url: Annotated[str, typer.Argument(help="Store URL.")],
    other: Annotated[str | None, typer.Option(help="Another run's store: compare the same steps.")] = None,
    step: StepsOption = None,
    json_out: JsonFlag = False,
    plot: PlotOption = None,
    use_ray: RayFlag = False,
    storage_options: StorageOptions = None,
) -> None:
    """Expert-load shift: Jensen-Shannon divergence per layer between consecutive steps and between two runs."""
    from routelog import audit
    from routelog.audit.figures import drift_figure

    options = _options(storage_options)
    with _AuditProgress("drift") as progress:
        result = audit.drift(url, other, step, storage_options=options, use_ray=use_ray, progress=progress)
    lines = [f"{p.a} -> {p.b}: mean JS {p.mean_js:.3e}, max {p.max_js:.3e} bits" for p in result.consecutive]
    lines += [f"{p.a} vs {p.b}: mean JS {p.mean_js:.3e}, max {p.max_js:.3e} bits" for p in result.between_runs]
    _report(result, json_out, plot, drift_figure, lines or [f"{url}: a single step, nothing to compare"])


if __name__ == "__main__":
    main()
