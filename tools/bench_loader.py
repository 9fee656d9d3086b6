"""Loader benchmark: one rank's replay tensors for one micro-batch, routelog vs. the whole step in memory.

Setup (defaults): a 48-layer, E=128, K=8 model; one step of 256 records x 4096 tokens; the rank is
(tp=1, cp=1, pp=2) of PP=4, CP=2, TP=2 with verl packing; a micro-batch is 4 records. The baseline is what RL
frameworks do today: load the step's routing as one raw int16 ``.npy`` (veRL's layout, every layer) and slice it;
both sides then run the same alignment, so the comparison is the data path. Each side runs in a fresh process:
time, bytes read from storage, and peak RSS.

    python tools/bench_loader.py [--json] [--quick] [--records N --tokens T --layers L]
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
from benchlib import count_reads, dense_routing, peak_rss_mb, process_age_seconds

import routelog
from routelog import PartOptions, Record
from routelog.align import AlignmentPlan, MicroBatch, Packing, ParallelLayout, RankCoords, gather
from routelog.synth import synth_routing, synthetic_spec

RANK = RankCoords(tp=1, cp=1, pp=2)
LAYOUT = ParallelLayout(tp=2, cp=2, pp=4)
MICRO_BATCH = 4


def prepare(root: Path, records: int, tokens: int, layers: int) -> dict[str, Any]:
    """Write the step both ways: a routelog store and the baseline's int16 .npy of the whole step."""
    spec = synthetic_spec(layers, 128, 8)
    rng = np.random.default_rng(0)
    npy = np.lib.format.open_memmap(root / "step.npy", mode="w+", dtype=np.int16, shape=(records, tokens, layers, 8))
    start = time.perf_counter()
    with routelog.open_writer(
        str(root / "store"), 0, model_spec=spec, writer_id="bench", options=PartOptions()
    ) as writer:
        for i in range(records):
            ids = synth_routing(rng, tokens, spec, None, 0.0)
            npy[i] = ids
            writer.append(
                Record(sample_id=f"r{i:05d}", expert_ids=ids, prompt_len=tokens // 4, response_len=tokens - tokens // 4)
            )
    npy.flush()
    del npy
    return {"write_seconds": time.perf_counter() - start, "store": str(root / "store"), "npy": str(root / "step.npy")}


def plan_for(spec: Any, records: int) -> AlignmentPlan:
    ids = tuple(f"r{i:05d}" for i in range(MICRO_BATCH))
    rest = tuple(
        MicroBatch(tuple(f"r{i:05d}" for i in range(s, s + MICRO_BATCH)))
        for s in range(MICRO_BATCH, min(records, 16 * MICRO_BATCH), MICRO_BATCH)
    )
    return AlignmentPlan(spec, LAYOUT, Packing("verl"), RANK, (MicroBatch(ids), *rest))


def run_routelog(store: str, records: int) -> dict[str, Any]:
    from routelog.loader import ReplayLoader

    start = time.perf_counter()
    opened = routelog.open_store(store)
    read = count_reads(opened.storage)
    plan = plan_for(opened.model_spec, records)
    loader = ReplayLoader(opened, 0, plan, prefetch=0)
    replay = loader.load(0)
    seconds = time.perf_counter() - start
    from_start = process_age_seconds()  # since the interpreter started: every import included
    reads = dict(read)
    # Steady state: the rank's next micro-batches from the same long-lived loader (its step already open).
    steady = time.perf_counter()
    later = [loader.load(m) for m in range(1, len(plan.micro_batches))]
    steady_seconds = time.perf_counter() - steady
    rows = sum(int(r.ids.shape[1]) * len(r.routers) for r in later)
    return {
        "seconds": seconds,
        "seconds_from_start": from_start,
        "steady_micro_batches": len(later),
        "steady_micro_batches_per_s": len(later) / steady_seconds if later else 0.0,
        "steady_router_rows_per_s": rows / steady_seconds if later else 0.0,
        "bytes_read": reads["routing"] + reads["metadata"],
        "requests": reads["requests"],
        "rows": int(replay.ids.shape[1]),
        "routers": len(replay.routers),
        "checksum": int(replay.ids.sum()),
        "peak_rss_mb": peak_rss_mb(),
    }


def run_baseline(npy: str, records: int, layers: int) -> dict[str, Any]:
    start = time.perf_counter()
    step = np.load(npy, allow_pickle=False)  # the whole step in host memory, as peers broadcast it
    spec = synthetic_spec(layers, 128, 8)
    plan = plan_for(spec, records)
    batch = plan.micro_batches[0]
    wanted = plan.moe_layers
    # The baseline's rows are all routed (the writer above marks none missing): its last row is routed too.
    routings = {sid: dense_routing(sid, step[int(sid[1:])], wanted, layers) for sid in batch.sample_ids}
    for routing in routings.values():
        routing.valid[-1] = True
    replay = gather(plan, 0, routings)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "seconds_from_start": process_age_seconds(),
        "bytes_read": Path(npy).stat().st_size,
        "requests": 1,
        "rows": int(replay.ids.shape[1]),
        "routers": len(replay.routers),
        "checksum": int(replay.ids.sum()),
        "peak_rss_mb": peak_rss_mb(),
    }


def _child(side: str, args: argparse.Namespace, paths: dict[str, Any]) -> dict[str, Any]:
    command = [
        sys.executable,
        __file__,
        "--child",
        side,
        "--records",
        str(args.records),
        "--tokens",
        str(args.tokens),
        "--layers",
        str(args.layers),
        "--path",
        paths["store" if side == "routelog" else "npy"],
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return dict(json.loads(result.stdout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small step (smoke test)")
    parser.add_argument("--records", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--child", choices=["routelog", "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.records, args.tokens, args.layers = 16, 512, 16
    if args.child == "routelog":
        print(json.dumps(run_routelog(args.path, args.records)))
        return
    if args.child == "baseline":
        print(json.dumps(run_baseline(args.path, args.records, args.layers)))
        return
    with tempfile.TemporaryDirectory(prefix="routelog-bench-") as tmp:
        paths = prepare(Path(tmp), args.records, args.tokens, args.layers)
        ours, base = _child("routelog", args, paths), _child("baseline", args, paths)
    if ours["checksum"] != base["checksum"]:
        raise SystemExit("routelog and the baseline produced different replay tensors")
    report = {
        "config": {
            "records": args.records,
            "tokens": args.tokens,
            "layers": args.layers,
            "experts": 128,
            "topk": 8,
            "layout": "PP=4 CP=2 TP=2 (verl packing)",
            "rank": "tp=1,cp=1,pp=2",
            "micro_batch_records": MICRO_BATCH,
        },
        "write_seconds": paths["write_seconds"],
        "routelog": ours,
        "baseline_whole_step_int16_npy": base,
        "ratios": {
            "time_baseline_over_routelog": base["seconds"] / ours["seconds"],
            "bytes_baseline_over_routelog": base["bytes_read"] / ours["bytes_read"],
            "peak_rss_baseline_over_routelog": base["peak_rss_mb"] / ours["peak_rss_mb"],
        },
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(
        f"step: {args.records} records x {args.tokens} tokens x {args.layers} layers, top-8 of 128; "
        f"rank tp=1,cp=1,pp=2 of PP=4 CP=2 TP=2; one micro-batch of {MICRO_BATCH} records"
    )
    print(f"{'':28s} {'seconds':>9s} {'MB read':>10s} {'requests':>9s} {'peak RSS MB':>12s}")
    for name, r in (("routelog loader", ours), ("whole-step int16 .npy", base)):
        print(
            f"{name:28s} {r['seconds']:9.3f} {r['bytes_read'] / 1e6:10.2f} {r['requests']:9d} {r['peak_rss_mb']:12.0f}"
        )
    print(f"rows per router: {ours['rows']}, routers on this rank: {ours['routers']}")
    print(
        f"from process start (imports included): routelog {ours['seconds_from_start']:.3f} s, "
        f"baseline {base['seconds_from_start']:.3f} s"
    )
    if ours["steady_micro_batches"]:
        print(
            f"long-lived loader, its next {ours['steady_micro_batches']} micro-batches: "
            f"{ours['steady_micro_batches_per_s']:.1f} micro-batches/s, "
            f"{ours['steady_router_rows_per_s'] / 1e6:.2f} M router rows/s"
        )
    for key, value in report["ratios"].items():
        print(f"{key}: {value:.1f}x")


if __name__ == "__main__":
    main()
