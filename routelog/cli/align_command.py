"""``routelog align``: what one trainer rank receives, written to ``.npz`` (the loader's arrays, for checking a
trainer's alignment by hand or from another language)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from routelog.cli.app import JsonFlag, StorageOptions, UrlArgument, app, load_spec, open_url, print_json, say
from routelog.format.limits import MAX_LAYERS, MAX_RECORD_TOKENS, MAX_STEP


@app.command()
def align(
    url: UrlArgument,
    step: Annotated[int, typer.Option(help="Step to align.", min=0, max=MAX_STEP)],
    micro_batches: Annotated[
        str, typer.Option(help="Sample ids per micro-batch: 'id1,id2|id3', or @FILE holding that text.")
    ],
    out: Annotated[Path, typer.Option(help="Output .npz file.")],
    packing: Annotated[str, typer.Option(help="verl | slime | slime-allgather | nemo | bshd | thd")] = "verl",
    fp8: Annotated[bool, typer.Option(help="FP8 padding (verl, nemo).")] = False,
    fp8_block: Annotated[
        int, typer.Option(help="nemo: FP8 block, 16 tensorwise, 32 MXFP8, 128 blockwise.", min=1, max=1 << 20)
    ] = 128,
    hybrid_ep: Annotated[
        bool, typer.Option(help="nemo: the flex dispatcher's HybridEP backend (total to 128x).")
    ] = False,
    divisible_by: Annotated[
        int | None,
        typer.Option(help="nemo: make_sequence_length_divisible_by (default: the minimum factor).", min=1, max=1 << 20),
    ] = None,
    slime_pad_multiplier: Annotated[
        int, typer.Option(help="slime: --data-pad-size-multiplier.", min=1, max=1 << 20)
    ] = 128,
    pad_to: Annotated[
        int | None,
        typer.Option(
            help="nemo with PP: total every micro-batch is padded to (default: computed).", min=1, max=1 << 40
        ),
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option(help="bshd: the padded width S (default: computed).", min=1, max=MAX_RECORD_TOKENS)
    ] = None,
    cu_seqlens: Annotated[
        str | None, typer.Option(help="thd: the trainer's cu_seqlens_padded per micro-batch, '0,16,40|0,8'.")
    ] = None,
    micro_batch_cp: Annotated[
        str | None, typer.Option(help="Dynamic CP: each micro-batch's CP size, '2,4' (default: --cp).")
    ] = None,
    tp: Annotated[int, typer.Option(help="Tensor parallel size (sequence parallel when > 1).", min=1, max=1 << 16)] = 1,
    cp: Annotated[int, typer.Option(help="Context parallel size.", min=1, max=1 << 16)] = 1,
    cp_layout: Annotated[str, typer.Option(help="zigzag | contiguous")] = "zigzag",
    pp: Annotated[int, typer.Option(help="Pipeline parallel size.", min=1, max=1 << 16)] = 1,
    vpp: Annotated[int, typer.Option(help="Virtual pipeline stages per rank.", min=1, max=1 << 16)] = 1,
    first_stage_layers: Annotated[
        int | None, typer.Option(help="Layers in the first pipeline stage.", min=0, max=MAX_LAYERS)
    ] = None,
    last_stage_layers: Annotated[
        int | None, typer.Option(help="Layers in the last pipeline stage.", min=0, max=MAX_LAYERS)
    ] = None,
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
        list[int] | None,
        typer.Option(
            help="Replay only routing of this policy version (repeatable); other versions: --other-versions.",
            min=0,
            max=2**63 - 1,
        ),
    ] = None,
    other_versions: Annotated[
        str, typer.Option(help="refuse | missing: tokens of another policy version fail, or get the missing rule.")
    ] = "refuse",
    model_spec: Annotated[Path | None, typer.Option(help="Override the store's model spec.")] = None,
    json_out: JsonFlag = False,
    storage_options_: StorageOptions = None,
) -> None:
    """Write exactly what one trainer rank receives, as .npz.

    Keys: mb{m}_positions, mb{m}_layer{n}_ids, mb{m}_layer{n}_mask, n being Megatron's 1-based layer_number. Every
    option of the Python API's plan is here.
    """
    from routelog.align import AlignmentPlan, MicroBatch, Packing, ParallelLayout, RankCoords, parse_micro_batches
    from routelog.ingest import NpzWriter
    from routelog.loader import ReplayLoader
    from routelog.outputs import written_whole

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
    store = open_url(url, storage_options_)
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
        spec=load_spec(model_spec) if model_spec else store.model_spec,
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
        other_versions=other_versions,  # type: ignore[arg-type]
    )
    with written_whole(out) as partial:
        writer = NpzWriter(partial)
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
    if json_out:
        print_json({"out": str(out), "micro_batches": len(plan.micro_batches), "routers": routers})
    say(f"wrote {len(plan.micro_batches)} micro-batches x {len(routers)} routers {routers} to {out}")


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
