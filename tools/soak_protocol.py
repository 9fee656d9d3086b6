"""Soak the store protocol: the model-based test of ``tests/test_protocol.py`` for longer than CI affords.

Runs the state machine (writers in-process and in their own process, re-writes, drops, seals, annotations, gc with
a simulated clock, writer crashes, lost create responses) on local disk, and on a moto S3 server behind the
fault-injecting proxy, with as many examples (interleavings) and operations per example as asked, then prints how
many interleavings, operations of each kind, faults and checks ran, and whether any diverged from the model.

    python tools/soak_protocol.py [--backend local|s3|both] [--examples 200] [--steps 40] [--seed N] [--json]

A failure prints hypothesis' shortest reproduction (the operations in order) and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = {"local": "test_protocol_on_local_disk", "s3": "test_protocol_on_s3_behind_a_fault_proxy"}


def soak(backend: str, examples: int, steps: int, seed: int | None) -> dict[str, Any]:
    """One pytest run of the machine on ``backend``; its totals, read from the machine's statistics file."""
    with tempfile.TemporaryDirectory() as scratch:
        stats = Path(scratch) / "stats.jsonl"
        env = {
            **os.environ,
            "ROUTELOG_PROTOCOL_EXAMPLES": str(examples),
            "ROUTELOG_PROTOCOL_STEPS": str(steps),
            "ROUTELOG_PROTOCOL_STATS": str(stats),
            "HYPOTHESIS_PROFILE": "default",  # randomized, unlike CI's derandomized profile
        }
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
        command += [f"tests/test_protocol.py::{TESTS[backend]}"]
        if seed is not None:
            command.append(f"--hypothesis-seed={seed}")
        start = time.monotonic()
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        seconds = time.monotonic() - start
        runs = [json.loads(line) for line in stats.read_text().splitlines()] if stats.exists() else []
    operations: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    for run in runs:
        operations.update(run["counts"])
        faults.update(run["faults"])
    checks = operations.pop("check", 0) + operations.pop("as_of_check", 0)
    return {
        "backend": backend,
        "passed": result.returncode == 0,
        "interleavings": len(runs),
        "operations": sum(operations.values()),
        "by_operation": dict(sorted(operations.items())),
        "faults": dict(sorted(faults.items())),
        "view_checks": checks,
        "seconds": round(seconds, 1),
        "output": "" if result.returncode == 0 else result.stdout[-20_000:] + result.stderr[-5_000:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["local", "s3", "both"], default="both")
    parser.add_argument("--examples", type=int, default=200, help="interleavings per backend")
    parser.add_argument("--steps", type=int, default=40, help="operations per interleaving (at most)")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    backends = ["local", "s3"] if args.backend == "both" else [args.backend]
    results = [soak(b, args.examples, args.steps, args.seed) for b in backends]
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "output"} for r in results], indent=1))
    for result in results:
        if not args.json:
            verdict = "no divergence from the model" if result["passed"] else "DIVERGED from the model"
            print(
                f"{result['backend']}: {result['interleavings']} interleavings, {result['operations']} operations, "
                f"{result['view_checks']} view checks in {result['seconds']} s: {verdict}"
            )
            print(f"  operations: {result['by_operation']}")
            print(f"  faults: {result['faults']}")
        if not result["passed"]:
            print(result["output"], file=sys.stderr)
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
