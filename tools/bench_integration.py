"""Integration benchmark: what one training rank receives and holds for a whole step, routelog vs veRL's own path.

A simulated veRL step (defaults: 256 samples x 4096 tokens, 48 MoE layers, E = 128, K = 8; DP = 4, PP = 4, CP = 2,
TP = 2 with veRL's THD packing; 4 samples per micro-batch). One representative rank (dp 0, tp 1, cp 1, pp 2)
replays every micro-batch of its DP share, in a fresh process per side:

* **veRL's path**: the rollout's dense ``routed_experts`` int16 ``[bsz, seq, L, K]`` travels in the batch; the rank
  receives its DP chunk whole (every token, every layer: veRL dispatches the same chunk to every TP/CP/PP rank of
  the DP group), then packs and slices each micro-batch;
* **routelog**: the batch carries sample ids; the rank's loader reads only the chunks holding its own tokens
  (its CP/SP share of each sequence) and its pipeline stage's layers, micro-batch by micro-batch.

Reported per side: routing bytes received (routelog also reads the step's index and commit documents once,
reported apart as ``metadata_bytes``), peak RSS, and, as the goal's yardstick, the rank's **own share**: the stored
bytes of exactly the rows and layers it installs (the step's routing bytes times its share of routed
token-layers; raw uint8 for veRL's tensor). Goal (issue #15): routelog's bytes <= 1.1 x the own share, and peak
memory independent of the step's size (the step runs at 1/2 and full size in the same run).

What a rank reads beyond its share: the inner chunks at the edges of each of its token ranges (a CP rank's share of
a sequence is a few ranges; on average one chunk per range more, so ``chunk_rows`` small next to the ranges), and
the chunk indexes of the shards it touches, read whole (16 bytes per inner chunk of every layer a shard holds: with
one shard per part array a stage reads every stage's entries; ``PartOptions(shard_layers=...)`` gives each stage
its own). Stores compared (``--variants``): 4096-row chunks (the default), 256, and 128 with one shard per stage;
``:context`` writes a variant with the ``ranked_context`` codec, whose rank also reads the models of its layers
(counted with the routing bytes). The routing is uniform, or with ``--routing token-dependent`` sets that depend on
the token (a 150k Zipf vocabulary, one :class:`routelog.synth.TokenRouter` for the step, so an id prefers the same
sets in every record): where ``ranked_context`` has something to learn, and its models to read.

    python tools/bench_integration.py [--json] [--quick] [--variants ROWS[:stage][:context] ...]
                                      [--records N --tokens T --layers L] [--routing uniform|token-dependent]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import count_reads, dense_routing, peak_rss_mb

import routelog
from routelog import PartOptions, Record
from routelog.align import AlignmentPlan, MicroBatch, Packing, ParallelLayout, RankCoords, gather
from routelog.synth import TokenRouter, synth_routing, synthetic_spec, zipf_token_ids

DP = 4
LAYOUT = ParallelLayout(tp=2, cp=2, pp=4)
RANK = RankCoords(tp=1, cp=1, pp=2)
MICRO_BATCH = 4


def prepare(
    root: Path, records: int, tokens: int, layers: int, variants: list[str], routing: str = "uniform"
) -> dict[str, Any]:
    """The step as stores (one per variant) and as veRL's dense int16 tensor (a memory map). ``routing``: uniform
    sets, or sets that depend on the token (a 150k Zipf vocabulary, the records carrying their token ids)."""
    spec = synthetic_spec(layers, 128, 8)
    rng = np.random.default_rng(0)
    npy = np.lib.format.open_memmap(root / "step.npy", mode="w+", dtype=np.int16, shape=(records, tokens, layers, 8))
    writers = [
        routelog.open_writer(
            str(root / f"store-{name}"), 0, model_spec=spec, writer_id="rollout", options=options_of(name, layers)
        )
        for name in variants
    ]
    router = None
    if routing == "token-dependent":  # one router for the step: a token id prefers the same sets in every record
        step_tokens = zipf_token_ids(rng, records * tokens, 150_000).reshape(records, tokens)
        router = TokenRouter.draw(rng, step_tokens, spec)
    for i in range(records):
        token_ids = None
        if router is not None:
            token_ids = step_tokens[i]
            ids = router.route(rng, token_ids)
        else:
            ids = synth_routing(rng, tokens, spec, None, 0.0)
        npy[i] = ids
        valid = np.ones(tokens, bool)
        valid[-1] = False
        record = Record(
            sample_id=f"r{i:05d}",
            expert_ids=ids,
            prompt_len=tokens // 4,
            response_len=tokens - tokens // 4,
            valid=valid,
            token_ids=token_ids,
        )
        for writer in writers:
            writer.append(record)
    for writer in writers:
        writer.close()
    npy.flush()
    del npy
    return {"stores": {name: str(root / f"store-{name}") for name in variants}, "npy": str(root / "step.npy")}


def options_of(variant: str, layers: int) -> PartOptions:
    """``ROWS`` (one shard per part array), with ``:stage`` (one shard per pipeline stage's layers) and/or
    ``:context`` (the ``ranked_context`` codec)."""
    rows, *flags = variant.split(":")
    return PartOptions(
        chunk_rows=int(rows),
        shard_layers=layers // LAYOUT.pp if "stage" in flags else None,
        transform="ranked_context" if "context" in flags else "ranked_gaps",
    )


def describe(variant: str, layers: int) -> str:
    options = options_of(variant, layers)
    shards = f", shard_layers={options.shard_layers}" if options.shard_layers else ""
    codec = ", ranked_context" if options.transform == "ranked_context" else ""
    return f"routelog chunk_rows={options.chunk_rows}{shards}{codec}"


def plan_for(spec: Any, records: int) -> AlignmentPlan:
    """DP rank 0's micro-batches: its contiguous quarter of the step, 4 samples each (veRL's fixed split)."""
    share = [f"r{i:05d}" for i in range(records // DP)]
    batches = tuple(MicroBatch(tuple(share[s : s + MICRO_BATCH])) for s in range(0, len(share), MICRO_BATCH))
    return AlignmentPlan(spec, LAYOUT, Packing("verl"), RANK, batches)


def run_routelog(store: str, records: int) -> dict[str, Any]:
    from routelog.loader import ReplayLoader

    start = time.perf_counter()
    opened = routelog.open_store(store)
    read = count_reads(opened.storage)
    plan = plan_for(opened.model_spec, records)
    rows = checksum = 0
    with ReplayLoader(opened, 0, plan) as loader:
        for mb in loader:
            rows += int(mb.mask.sum())
            checksum += int(mb.ids[:, mb.mask].sum())
    summary = opened.summary()
    return {
        "seconds": time.perf_counter() - start,
        "bytes_received": read["routing"],
        "metadata_bytes": read["metadata"],
        "requests": read["requests"],
        "installed_rows": rows,
        "stage_layers": len(plan.moe_layers),
        "checksum": checksum,
        "step_routing_bytes": summary["routing_bytes"],
        "step_routed_token_layers": summary["routed_rows"] * opened.model_spec.num_moe_layers,
        "peak_rss_mb": peak_rss_mb(),
    }


def run_verl_path(npy: str, records: int, layers: int) -> dict[str, Any]:
    """The DP chunk of the dense tensor as the rank receives it, then per micro-batch veRL's packing and slicing."""
    start = time.perf_counter()
    spec = synthetic_spec(layers, 128, 8)
    plan = plan_for(spec, records)
    step = np.load(npy, mmap_mode="r")
    chunk = np.array(step[: records // DP])  # received through the batch: the whole DP share, every layer
    received = chunk.nbytes
    rows = checksum = 0
    for m, batch in enumerate(plan.micro_batches):
        routings = {sid: dense_routing(sid, chunk[int(sid[1:])], plan.moe_layers, layers) for sid in batch.sample_ids}
        mb = gather(plan, m, routings)
        rows += int(mb.mask.sum())
        checksum += int(mb.ids[:, mb.mask].sum())
    return {
        "seconds": time.perf_counter() - start,
        "bytes_received": received,
        "installed_rows": rows,
        "checksum": checksum,
        "peak_rss_mb": peak_rss_mb(),
    }


def _child(side: str, path: str, args: argparse.Namespace, records: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", side, "--path", path, "--records", str(records)]
    command += ["--tokens", str(args.tokens), "--layers", str(args.layers)]
    return dict(json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout))


def measure(args: argparse.Namespace, records: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="routelog-bench-integration-") as tmp:
        paths = prepare(Path(tmp), records, args.tokens, args.layers, args.variants, args.routing)
        verl = _child("verl", paths["npy"], args, records)
        sides: dict[str, Any] = {}
        for variant, store in paths["stores"].items():
            ours = _child("routelog", store, args, records)
            if (ours["installed_rows"], ours["checksum"]) != (verl["installed_rows"], verl["checksum"]):
                raise SystemExit("routelog and veRL's path installed different rows")
            share = ours["installed_rows"] * ours["stage_layers"]  # the rank's routed token-layers
            own_stored = ours["step_routing_bytes"] * share / ours["step_routed_token_layers"]
            ours["own_share_bytes"] = own_stored
            ours["bytes_vs_own_share"] = ours["bytes_received"] / own_stored
            sides[describe(variant, args.layers)] = ours
    own_raw = verl["installed_rows"] * sides[next(iter(sides))]["stage_layers"] * 8
    verl["own_share_bytes"] = own_raw
    verl["bytes_vs_own_share"] = verl["bytes_received"] / own_raw
    return {"records": records, "veRL dense tensor": verl, **sides}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a small step (smoke test)")
    parser.add_argument("--records", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["4096", "256", "128:stage"],
        help="stores to compare: ROWS per inner chunk, ':stage' for one shard per pipeline stage's layers, "
        "':context' for the ranked_context codec",
    )
    parser.add_argument(
        "--routing",
        choices=["uniform", "token-dependent"],
        default="uniform",
        help="uniform sets, or sets that depend on the token (150k Zipf vocabulary)",
    )
    parser.add_argument("--child", choices=["routelog", "verl"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.records, args.tokens, args.layers = 32, 512, 16
    if args.child == "routelog":
        print(json.dumps(run_routelog(args.path, args.records)))
        return
    if args.child == "verl":
        print(json.dumps(run_verl_path(args.path, args.records, args.layers)))
        return
    runs = [measure(args, args.records // 2), measure(args, args.records)]
    report = {
        "config": {
            "records": args.records,
            "tokens": args.tokens,
            "layers": args.layers,
            "experts": 128,
            "topk": 8,
            "layout": f"DP={DP} PP=4 CP=2 TP=2 (veRL THD packing)",
            "rank": "dp=0,tp=1,cp=1,pp=2",
            "micro_batch_samples": MICRO_BATCH,
            "routing": args.routing,
        },
        "half_step": runs[0],
        "full_step": runs[1],
        "ratios": {
            name: {
                "bytes_vs_own_share": runs[1][name]["bytes_vs_own_share"],
                "peak_rss_full_over_half_step": runs[1][name]["peak_rss_mb"] / runs[0][name]["peak_rss_mb"],
                "verl_bytes_over_these": runs[1]["veRL dense tensor"]["bytes_received"]
                / runs[1][name]["bytes_received"],
            }
            for name in runs[1]
            if name != "records"
        },
        "goal": "bytes <= 1.1 x the rank's own share; peak memory independent of the step's size",
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for name, ratio in report["ratios"].items():
        full, half = runs[1][name], runs[0][name]
        print(
            f"{name:26s} received {full['bytes_received'] / 1e6:9.2f} MB = {ratio['bytes_vs_own_share']:6.2f} x own "
            f"share; peak RSS {half['peak_rss_mb']:.0f} MB (half step) -> {full['peak_rss_mb']:.0f} MB (full step); "
            f"veRL / this: {ratio['verl_bytes_over_these']:.1f} x bytes"
        )
    print(f"goal: {report['goal']}")


if __name__ == "__main__":
    main()
