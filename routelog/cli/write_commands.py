"""Commands that write: ``synth``, ``ingest``, ``drop``, ``seal``, ``archive`` and ``gc``.

Writing is idempotent: records a step already holds are skipped, and the default writer id is derived from the
input, so running a command again (after fixing a bad line, or after Ctrl-C) completes what the first run began.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, cast

import typer

from routelog import interrupts
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
    progress_bar,
    say,
    storage_options,
    try_open,
)
from routelog.format.limits import MAX_EXPERTS, MAX_MOE_LAYERS, MAX_RECORD_TOKENS, MAX_STEP, MAX_TOPK

FlushBytes = Annotated[
    int | None,
    typer.Option(
        help="Raw routing bytes buffered before a part is written (default 64 MiB; smaller: more parts).",
        min=1,
        max=1 << 40,
    ),
]
OnDuplicate = Annotated[
    str,
    typer.Option(
        "--on-duplicate",
        help="A sample id the step already holds: 'skip' it (a re-run completes what is missing) or 'error'.",
    ),
]
CodecOption = Annotated[
    str,
    typer.Option(
        help="Chunk codec of sorted sets: 'ranked_gaps' (format 2: fast to write and read) or 'ranked_context' (each "
        "part stores a model of its tokens' usual sets: 20-45 % smaller on routing that recurs, 1.5-4 x slower; "
        "for the history you keep).",
    ),
]
EncodeThreads = Annotated[
    int | None,
    typer.Option(
        min=1,
        max=1024,
        help="Threads compressing each part (default: the CPUs this process may run on; 1 leaves cores free).",
    ),
]
TopkOrderOption = Annotated[
    str,
    typer.Option(
        help="'sorted' (canonical sets: the smallest) or 'score' (keep the engine's order: needed to export the "
        "payload back byte for byte; about 1.3x the bytes)."
    ),
]


def _choice(value: str, option: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise typer.BadParameter(f"{option} must be one of {', '.join(allowed)}, got {value!r}")
    return value


# -- synth ------------------------------------------------------------------------------------------------------
@app.command()
def synth(
    url: UrlArgument,
    step: Annotated[int, typer.Option(help="RL step to write.", min=0, max=MAX_STEP)] = 0,
    records: Annotated[int, typer.Option(help="Records to write.", min=1, max=1 << 40)] = 16,
    tokens: Annotated[
        int, typer.Option(help="Tokens per record (the mean with --ragged).", min=2, max=MAX_RECORD_TOKENS // 2)
    ] = 512,
    layers: Annotated[
        int | None,
        typer.Option(
            help="MoE layers, all layers MoE (default 8, or the existing store's spec).", min=1, max=MAX_MOE_LAYERS
        ),
    ] = None,
    experts: Annotated[
        int | None, typer.Option(help="Routed experts per layer (default 64).", min=1, max=MAX_EXPERTS)
    ] = None,
    topk: Annotated[
        int | None, typer.Option(help="Experts per token per layer (default 8).", min=1, max=MAX_TOPK)
    ] = None,
    model_spec: Annotated[
        Path | None, typer.Option(help="Model spec JSON (or a HF config.json) instead of --layers/--experts/--topk.")
    ] = None,
    seed: Annotated[
        int,
        typer.Option(help="Random seed (mixed with --step: each step draws its own routing).", min=0, max=2**32 - 1),
    ] = 0,
    skew: Annotated[float, typer.Option(help="Expert popularity skew (0 = uniform).", min=0.0, max=1e6)] = 0.0,
    locality: Annotated[
        float,
        typer.Option(help="Probability a token reuses the previous token's experts (below 1).", min=0.0, max=0.999999),
    ] = 0.0,
    ragged: Annotated[bool, typer.Option(help="Ragged lengths around --tokens.")] = False,
    sample_prefix: Annotated[str, typer.Option(help="Prefix of sample ids (lets processes share a step).")] = "",
    writer_id: Annotated[
        str | None, typer.Option(help="Writer id (default: derived from the options, so a re-run resumes).")
    ] = None,
    with_token_ids: Annotated[bool, typer.Option(help="Store token ids, not only their hash.")] = False,
    topk_order: TopkOrderOption = "sorted",
    logprob_noise: Annotated[
        float | None,
        typer.Option(
            help="Attach logprob_infer, then annotate logprob_train with this log-scale noise.", min=0.0, max=100.0
        ),
    ] = None,
    on_duplicate: OnDuplicate = "skip",
    flush_bytes: FlushBytes = None,
    encode_threads: EncodeThreads = None,
    json_out: JsonFlag = False,
    storage_options_: StorageOptions = None,
) -> None:
    """Write synthetic routing to a store (creating it if needed).

    The records follow from the options and the seed, so running the same command again adds nothing ("0 new, N
    already present").
    """
    from routelog.format import keys
    from routelog.format.part import PartOptions
    from routelog.store.store import create_store
    from routelog.store.writer import batch_encode_threads
    from routelog.synth import SynthConfig, synth_records, synthetic_spec

    order = _choice(topk_order, "--topk-order", ("sorted", "score"))
    duplicate = _choice(on_duplicate, "--on-duplicate", ("skip", "error"))
    options = storage_options(storage_options_)
    if model_spec is not None:
        spec = load_spec(model_spec)
    elif layers is None and experts is None and topk is None and (existing := try_open(url, options)):
        spec = existing.model_spec
    else:
        spec = synthetic_spec(
            8 if layers is None else layers, 64 if experts is None else experts, 8 if topk is None else topk
        )
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
    keys.check_step(step)
    fingerprint = hashlib.blake2b(
        json.dumps([spec.model_dump(mode="json"), asdict(config), order], sort_keys=True).encode(), digest_size=8
    ).hexdigest()
    writer_id = keys.check_writer_id(writer_id or f"synth-{fingerprint}")
    store = create_store(url, spec, storage_options=options)
    writer = store.writer(
        step,
        writer_id,
        options=PartOptions(topk_order=cast(Any, order)),
        on_duplicate=cast(Any, duplicate),
        flush_bytes=flush_bytes,
        encode_threads=batch_encode_threads(encode_threads),
    )
    try:
        with interrupts.deferred() as interrupt, progress_bar() as progress, writer:
            task = progress.add_task(f"synth step {step}", total=records)
            for record in synth_records(store.model_spec, config):
                interrupt.check()  # Ctrl-C lands here, between records, never inside the writer's locks
                writer.append(record)
                progress.advance(task)
    except KeyboardInterrupt:
        _interrupted(writer)
    annotated = _annotate_training_logprobs(store, step, writer_id, config) if logprob_noise is not None else 0
    report = {
        "url": store.url,
        "step": step,
        "writer_id": writer_id,
        "new": writer.appended,
        "already_present": len(writer.already_present),
        "parts": len(writer.commits),
        "annotated": annotated,
    }
    if json_out:
        print_json(report)
    say(
        f"synth: {writer.appended} new, {len(writer.already_present)} already present in step {step} of "
        f"{store.url} ({plural(len(writer.commits), 'part')}, writer {writer_id})"
    )


def _annotate_training_logprobs(store: Any, step: int, writer_id: str, config: Any) -> int:
    """What a trainer would report later: ``logprob_train`` for the synthetic records that lack it."""
    import numpy as np

    from routelog.format.values import LOGPROB_INFER, LOGPROB_TRAIN
    from routelog.synth import synth_records, synth_training_logprobs

    snapshot = store.step(step)
    wanted = {}
    for i, record in enumerate(synth_records(store.model_spec, config)):
        if record.token_values:
            infer = np.asarray(record.token_values[LOGPROB_INFER], np.float32)
            wanted[record.sample_id] = synth_training_logprobs(infer, config.logprob_noise, config.seed + i)
    present = snapshot.token_values(list(wanted), [LOGPROB_TRAIN])
    missing = [sid for sid in wanted if LOGPROB_TRAIN not in present.get(sid, {})]
    if missing:
        with store.annotate(step, f"{writer_id[:58]}-train") as annotator:
            for sid in missing:
                annotator.add(sid, {LOGPROB_TRAIN: wanted[sid]})
    return len(missing)


def _interrupted(writer: Any) -> None:
    from routelog.errors import WriteInterruptedError

    committed = sum(c.n_records for c in writer.commits)
    raise WriteInterruptedError(
        f"interrupted: {committed} records committed to step {writer.step} of {writer.store.url} in "
        f"{plural(len(writer.commits), 'part')}; run the same command again to resume (it skips what is committed)"
    ) from None


# -- ingest -----------------------------------------------------------------------------------------------------
@app.command()
def ingest(
    inputs: Annotated[
        list[Path],
        typer.Argument(
            help="JSONL of HTTP responses (vllm, sglang, nemo-rl, ms-swift, megatron); .npz/.safetensors (verl, slime)."
        ),
    ],
    engine: Annotated[str, typer.Option(help="vllm | sglang | nemo-rl | ms-swift | megatron | verl | slime")],
    to: Annotated[str, typer.Option("--to", help="Store URL.")],
    step: Annotated[int, typer.Option(help="RL step the records belong to.", min=0, max=MAX_STEP)],
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
    policy_version: Annotated[
        int | None, typer.Option(help="Policy (weights) version that generated them.", min=0, max=2**63 - 1)
    ] = None,
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
            help="Physical-to-logical expert table (.npy or JSON): shape (num_physical,), or vLLM's per-layer "
            "(num_moe_layers, num_physical)."
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
    partial: Annotated[
        bool,
        typer.Option(
            "--partial",
            help="Write the valid records and report the invalid ones, exiting 1 if there were any (default: write "
            "nothing if any is invalid).",
        ),
    ] = False,
    writer_id: Annotated[
        str | None, typer.Option(help="Writer id (default: derived from the inputs, so a re-run resumes).")
    ] = None,
    topk_order: TopkOrderOption = "sorted",
    codec: CodecOption = "ranked_gaps",
    on_duplicate: OnDuplicate = "skip",
    flush_bytes: FlushBytes = None,
    encode_threads: EncodeThreads = None,
    check_health: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Then check the step's capture health (routelog check) and exit 1 on an error-level finding.",
        ),
    ] = False,
    json_out: JsonFlag = False,
    storage_options_: StorageOptions = None,
) -> None:
    """Ingest routing as an engine or trainer logged it into a store.

    The whole input is validated before the first write (nothing is written, and no store is created, if a line is
    invalid; --partial writes the valid ones). Records the step already holds are skipped, so running the same
    command again after fixing a line or after Ctrl-C completes the ingest.
    """
    from routelog.ingest import IngestSource, read_table
    from routelog.ingest import ingest as run_ingest

    kind = _choice(engine, "--engine", ("vllm", "sglang", "nemo-rl", "ms-swift", "megatron", "verl", "slime"))
    order = _choice(topk_order, "--topk-order", ("sorted", "score"))
    chunk_codec = _choice(codec, "--codec", ("ranked_gaps", "ranked_context"))
    duplicate = _choice(on_duplicate, "--on-duplicate", ("skip", "error"))
    source = IngestSource(
        cast(Any, kind),
        tuple(inputs),
        sample_id_field=sample_id_field,
        policy_version=policy_version,
        engine_version=engine_version,
        physical_to_logical=None if eplb_map is None else read_table(eplb_map),
        eplb=eplb,
        stream_request=None if stream_request is None else json.loads(stream_request.read_text()),
    )
    with progress_bar() as progress:
        task = progress.add_task(f"ingest {engine}", total=None)
        report = run_ingest(
            source,
            to,
            step,
            spec=None if model_spec is None else load_spec(model_spec),
            storage_options=storage_options(storage_options_),
            topk_order=cast(Any, order),
            codec=cast(Any, chunk_codec),
            writer_id=writer_id,
            partial=partial,
            skip_absent=skip_absent,
            on_duplicate=cast(Any, duplicate),
            flush_bytes=flush_bytes,
            progress=lambda done: progress.update(task, completed=done),
            encode_threads=encode_threads,
        )
    health = None
    if check_health and report.new + report.already_present:  # no record written: no step to check
        from routelog.audit.check import check as run_check

        health = run_check(to, [step], storage_options=storage_options(storage_options_))
    if json_out:
        print_json(asdict(report) | ({} if health is None else {"check": health.model_dump(mode="json")}))
    for problem in report.invalid[:20]:
        labeled("invalid", "yellow", problem)
    if len(report.invalid) > 20:
        say(f"... and {len(report.invalid) - 20} more invalid (all of them in --json)")
    absent = f"; skipped {sum(report.absent.values())} without routing {report.absent}" if report.absent else ""
    invalid = f"; {len(report.invalid)} invalid not written" if report.invalid else ""
    say(
        f"ingest: {report.new} new, {report.already_present} already present in step {step} of {report.url} "
        f"({plural(report.parts, 'part')}, writer {report.writer_id}){absent}{invalid}"
    )
    if health is not None and not json_out:
        from routelog.cli.audit_commands import report_check

        report_check(health, json_out=False)
    if report.invalid:  # --partial wrote the valid records: exit 1 says some input was not (exit codes: main.py)
        raise typer.Exit(1)
    if health is not None and not health.ok:
        raise typer.Exit(1)


# -- drop, seal, gc ---------------------------------------------------------------------------------------------
@app.command()
def drop(
    url: UrlArgument,
    step: Annotated[int, typer.Option(help="Step to drop records from.", min=0, max=MAX_STEP)],
    sample: Annotated[list[str] | None, typer.Option("--sample", help="Sample id to drop (repeatable).")] = None,
    part: Annotated[list[str] | None, typer.Option("--part", help="Part to drop whole (repeatable).")] = None,
    writer: Annotated[
        list[str] | None, typer.Option("--writer", help="Writer whose parts to drop (repeatable).")
    ] = None,
    reason: Annotated[str | None, typer.Option(help="Why (kept in the drop document).")] = None,
    json_out: JsonFlag = False,
    storage_options_: StorageOptions = None,
) -> None:
    """Remove records from a step (by sample, part or writer) without rewriting data.

    A drop document is written: ls --as-of still shows the step before the drop, and gc reclaims the bytes of
    dropped parts.
    """
    if not (sample or part or writer):
        raise typer.BadParameter("name what to drop: --sample, --part or --writer")
    store = open_url(url, storage_options_)
    outcome = store.drop(step, sample_ids=sample or (), parts=part or (), writers=writer or (), reason=reason)
    record = outcome.drop
    if json_out:
        print_json(
            {
                "drop": None if record is None else record.model_dump(mode="json"),
                "already_dropped": outcome.already_dropped,
            }
        )
    if outcome.already_dropped:
        say(f"already dropped from step {step}: {', '.join(outcome.already_dropped[:8])} (nothing to do for them)")
    if record is not None:
        say(
            f"dropped from step {step} of {store.url}: {plural(len(record.sample_ids), 'sample')}, "
            f"{plural(len(record.parts), 'part')}, {plural(len(record.writers), 'writer')} (log entry {record.name}); "
            "`routelog gc` reclaims the bytes of dropped parts"
        )


@app.command()
def seal(
    url: UrlArgument,
    step: Annotated[int, typer.Option(help="Step to seal.", min=0, max=MAX_STEP)],
    allow_empty: Annotated[
        bool, typer.Option("--allow-empty", help="Seal a step that holds no records (it then stays empty).")
    ] = False,
    json_out: JsonFlag = False,
    storage_options_: StorageOptions = None,
) -> None:
    """Seal a step: no more commits are accepted; readers then open it in a few requests whatever its parts."""
    store = open_url(url, storage_options_)
    from routelog.store.steplog import read_seal_marker

    already = read_seal_marker(store, step)
    record = already or store.seal(step, allow_empty=allow_empty)
    snapshot = store.step(step)  # what readers of the sealed step read: live records (drops, races resolved)
    tokens = int(snapshot.index.column("n_tokens").to_numpy().sum()) if len(snapshot) else 0
    if json_out:
        print_json(
            {
                "step": step,
                "commits": len(record.commits),
                "records": len(snapshot),
                "tokens": tokens,
                "sealed_at": record.sealed_at,
                "already_sealed": already is not None,
            }
        )
        return
    when = "was already sealed" if already is not None else "sealed"
    console.print(
        f"step {step} {when} ({record.sealed_at.isoformat(timespec='seconds')}): "
        f"{plural(len(record.commits), 'commit')}, {plural(len(snapshot), 'record')}, {plural(tokens, 'token')}",
        highlight=False,
    )


@app.command()
def archive(
    url: UrlArgument,
    steps: Annotated[
        list[int] | None,
        typer.Option(
            "--step", help="Sealed step to archive (repeatable; default: every sealed step).", min=0, max=MAX_STEP
        ),
    ] = None,
    json_out: JsonFlag = False,
    storage_options_: StorageOptions = None,
) -> None:
    """Re-code sealed steps with the archive codec (smaller, slower to read) in one log entry per step.

    Readers see the step's old parts or its new ones, never a mix; ls --as-of an earlier time reads the old parts
    until gc's grace period has passed since the archive. Ctrl-C leaves a step as it was; running the command
    again archives what is left, and says so of steps archived already.
    """
    from routelog.store.archive import ArchiveOutcome
    from routelog.store.steplog import read_seal_marker

    store = open_url(url, storage_options_)
    chosen = sorted(set(steps)) if steps else [s for s in store.steps() if read_seal_marker(store, s) is not None]
    if not chosen:
        say(f"{store.url} holds no sealed step: seal a step first (routelog seal {store.url} --step N)")
        raise typer.Exit(1)
    outcomes: list[ArchiveOutcome] = []
    try:
        with interrupts.deferred() as interrupt, progress_bar() as progress:
            for step in chosen:
                task = progress.add_task(f"archive step {step}", total=None)

                def advanced(records: int, ids: int, total: int, task: Any = task, step: int = step) -> None:
                    described = f"archive step {step} ({ids / 1e6:,.1f} MB of routing)"
                    progress.update(task, completed=records, total=total, description=described)

                outcome = store.archive(step, progress=advanced, check=interrupt.check)
                outcomes.append(outcome)
                if not json_out:
                    _say_archived(store.url, outcome)
    except KeyboardInterrupt:
        say(
            f"interrupted: {plural(len(outcomes), 'step')} archived; the step in hand is as it was (run the same "
            "command again to go on)"
        )
        raise typer.Exit(130) from None
    if json_out:
        print_json(
            [
                {
                    "step": o.step,
                    "archived_already": o.archived_already,
                    "records": o.records,
                    "raw_bytes": o.raw_bytes,
                    "bytes_before": o.bytes_before,
                    "bytes_after": o.bytes_after,
                    "entry": None if o.entry is None else o.entry.name,
                }
                for o in outcomes
            ]
        )


def _say_archived(url: str, outcome: Any) -> None:
    if outcome.archived_already:
        say(f"step {outcome.step} is archived already ({outcome.bytes_after:,} bytes): nothing to do")
        return
    if outcome.entry is None:
        say(f"step {outcome.step} holds no record (every part dropped whole): nothing to archive")
        return
    ratio = outcome.bytes_after / outcome.bytes_before if outcome.bytes_before else 0.0
    console.print(
        f"archived step {outcome.step} of {url}: {plural(outcome.records, 'record')}, "
        f"{outcome.bytes_before:,} -> {outcome.bytes_after:,} bytes ({ratio:.2f} x; log entry {outcome.entry.name}); "
        "`routelog gc` reclaims the old parts once its grace period has passed",
        highlight=False,
    )


@app.command()
def gc(
    url: UrlArgument,
    older_than: Annotated[str, typer.Option(help="Grace period, e.g. 6h, 30m, 2d.")] = "24h",
    delete: Annotated[bool, typer.Option("--delete", help="Delete (default: dry run, only report).")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Accept a grace period under 1h: only when no writer is running.")
    ] = False,
    json_out: JsonFlag = False,
    storage_options_: StorageOptions = None,
) -> None:
    """Find (and with --delete remove) what no reader needs.

    That is objects of dead writers that no commit references, and the parts of dropped or shadowed records once
    they are older than the grace period.
    """
    from routelog.store.gc import parse_duration

    try:
        seconds = parse_duration(older_than)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    report = open_url(url, storage_options_).gc(seconds, delete=delete, force=force)
    if json_out:
        print_json(
            {
                "orphans": report.orphans,
                "dead_parts": report.dead_parts,
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
        labeled("damaged", "bold red", damage)
    for key, size in sorted(report.orphans.items()):
        console.print(f"{'deleted' if report.deleted else 'orphan'} {key} ({size:,} bytes)", highlight=False)
    for name in report.dead_parts:
        console.print(f"{'reclaimed' if report.deleted else 'dead part'} {name}", highlight=False)
    verb = "deleted" if report.deleted else "would delete (dry run; add --delete)"
    console.print(
        f"{verb} {plural(len(report.orphans), 'object')}, {report.bytes:,} bytes; {report.kept_young} younger "
        "unreferenced objects kept",
        highlight=False,
    )
    if report.damaged:
        say(f"{len(report.damaged)} damaged document(s): gc will delete nothing until they are repaired")
        raise typer.Exit(1)
