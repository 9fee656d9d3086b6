"""Audit benchmark: ``stats`` and ``diff`` throughput on a large synthetic store, single process vs Ray.

Setup (defaults): a 48-layer, E=128, K=8 model; step 0 holds 2560 records x 4096 tokens (10.5M token-rows), step 1
the same records with 10 % of router decisions changed. Each measurement runs in a fresh process: tokens/s over
the wall time of the audit (Ray's start-up excluded, its scheduling included) and the process's peak RSS (for
Ray, the driver's; each worker holds one unit's batch). The baseline measured in the same run is a plain read of
every record's routing with no computation: the audit's cost above the data path.

Goals (issue #32, :data:`GOALS`): the plain read >= 1 M tokens/s on one core; ``stats`` >= 0.8 x and ``diff``
>= 0.5 x of the plain read's tokens/s (``diff`` reads two steps, so 0.5 x is what reading them costs alone).

    python tools/bench_audit.py [--json] [--quick] [--archived] [--records N --tokens T --layers L]

``--archived`` also writes the same records with the archive codec (``ranked_context``) and measures the plain read,
``stats`` and ``diff`` on them beside format 2's (issue 55's goals: the archived plain read >= 1 M tokens/s,
``stats`` >= 0.8 x and ``diff`` >= 0.5 x of it).
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
from benchlib import peak_rss_mb

import routelog
from routelog import Record
from routelog.synth import synth_routing, synthetic_spec

POOL = 16
"""Distinct routing arrays cycled through the records (generation would otherwise dominate the set-up)."""


GOALS = {"read_only_M_tokens_per_s": 1.0, "stats_vs_read_only": 0.8, "diff_vs_read_only": 0.5}


def prepare(url: str, records: int, tokens: int, layers: int, transform: str = "ranked_gaps") -> None:
    spec = synthetic_spec(layers, 128, 8)
    rng = np.random.default_rng(0)
    pool = [synth_routing(rng, tokens, spec, None, 0.0) for _ in range(POOL)]
    changed = []
    for ids in pool:  # step 1: ~10 % of (token, layer) decisions get one different expert
        other = ids.copy()
        flip = rng.random(ids.shape[:2]) < 0.1
        candidate = (other[..., 0] + 1 + rng.integers(0, 127, other.shape[:2])) % 128
        clash = (candidate[..., None] == other).any(-1)
        other[..., 0] = np.where(flip & ~clash, candidate, other[..., 0])
        changed.append(other)
    store = routelog.create_store(url, spec)
    for step, arrays in ((0, pool), (1, changed)):
        with store.writer(step, "bench", options=routelog.PartOptions(transform=transform)) as writer:  # type: ignore[arg-type]
            for i in range(records):
                writer.append(
                    Record(
                        sample_id=f"r{i:06d}",
                        expert_ids=arrays[i % POOL],
                        prompt_len=tokens // 4,
                        response_len=tokens - tokens // 4,
                        token_ids=np.arange(i, i + tokens),
                    )
                )


def child(args: argparse.Namespace) -> dict[str, Any]:
    from routelog import audit

    if args.ray:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    store = routelog.open_store(args.url)
    start = time.perf_counter()
    if args.child == "read":
        snapshot = store.step(0)
        ids = snapshot.sample_ids
        for i in range(0, len(ids), 32):
            snapshot.read_many(ids[i : i + 32])
    elif args.child == "stats":
        audit.stats(args.url, [0], use_ray=args.ray)
    else:
        result = audit.diff(args.url, args.url, 0, step_b=1, use_ray=args.ray)
        assert 0.05 < result.router_diff_rate < 0.15, result.router_diff_rate
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": store.step(0).n_tokens, "peak_rss_mb": peak_rss_mb()}


def measure(url: str, kind: str, use_ray: bool) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", kind, "--url", url] + (["--ray"] if use_ray else [])
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result["tokens_per_s"] = result["tokens"] / result["seconds"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--records", type=int)
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray measurements")
    parser.add_argument(
        "--archived",
        action="store_true",
        help="also the same store written with the archive codec (ranked_context), measured beside format 2's",
    )
    parser.add_argument("--child", choices=["read", "stats", "diff"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--ray", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    records = args.records or (64 if args.quick else 2560)
    tokens = args.tokens or (1024 if args.quick else 4096)
    with tempfile.TemporaryDirectory(prefix="routelog-bench-audit-") as root:
        url = str(Path(root) / "store")
        start = time.perf_counter()
        prepare(url, records, tokens, args.layers)
        setup = time.perf_counter() - start
        results: dict[str, Any] = {
            "config": {
                "records": records,
                "tokens": tokens,
                "layers": args.layers,
                "experts": 128,
                "topk": 8,
                "token_rows": records * tokens,
                "setup_seconds": setup,
            },
            "read_only": measure(url, "read", False),
            "stats": measure(url, "stats", False),
            "diff": measure(url, "diff", False),
        }
        if not args.no_ray:
            results["stats_ray2"] = measure(url, "stats", True)
            results["diff_ray2"] = measure(url, "diff", True)
        if args.archived:  # the same records in the archive codec, measured in the same run
            archived_url = str(Path(root) / "archived")
            prepare(archived_url, records, tokens, args.layers, "ranked_context")
            archived = {kind: measure(archived_url, kind, False) for kind in ("read", "stats", "diff")}
            plain = archived["read"]["tokens_per_s"]
            results["archived"] = archived | {
                "ratios": {
                    "read_vs_format2_read": plain / results["read_only"]["tokens_per_s"],
                    "stats_vs_read_only": archived["stats"]["tokens_per_s"] / plain,
                    "diff_vs_read_only": archived["diff"]["tokens_per_s"] / plain,
                }
            }
    read = results["read_only"]["tokens_per_s"]
    ratios = {
        "stats_vs_read_only": results["stats"]["tokens_per_s"] / read,
        "diff_vs_read_only": results["diff"]["tokens_per_s"] / read,
    }
    if not args.no_ray:
        ratios["stats_ray2_vs_single"] = results["stats_ray2"]["tokens_per_s"] / results["stats"]["tokens_per_s"]
        ratios["diff_ray2_vs_single"] = results["diff_ray2"]["tokens_per_s"] / results["diff"]["tokens_per_s"]
    results["ratios"] = ratios
    figures = {"read_only_M_tokens_per_s": read / 1e6, **ratios}
    results["goals"] = {
        name: {"goal": goal, "measured": figures[name], "met": figures[name] >= goal} for name, goal in GOALS.items()
    }
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"{records} records x {tokens} tokens x {args.layers} layers (set-up {setup:.0f} s)")
    for name in ("read_only", "stats", "diff", "stats_ray2", "diff_ray2"):
        if name in results:
            r = results[name]
            print(
                f"{name:>10}: {r['tokens_per_s'] / 1e6:7.2f} M tokens/s  {r['seconds']:7.1f} s  "
                f"peak RSS {r['peak_rss_mb']:.0f} MB"
            )
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    if "archived" in results:
        archived = results["archived"]
        for name in ("read", "stats", "diff"):
            r = archived[name]
            print(f"{'archived ' + name:>14}: {r['tokens_per_s'] / 1e6:7.2f} M tokens/s  {r['seconds']:7.1f} s")
        for name, value in archived["ratios"].items():
            print(f"archived {name}: {value:.2f}x")
    for name, goal in results["goals"].items():
        print(f"goal {name}: {goal['measured']:.2f} (>= {goal['goal']}) {'met' if goal['met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
