"""How well ``routelog check`` tells broken capture from healthy: recall on every injected fault class and the
false-positive rates on healthy routing (the two corpora, synthetic routing, the engine fixtures).

    python tools/check_rates.py           # full corpora (about a minute)
    python tools/check_rates.py --quick   # 48 records per corpus step
    python tools/check_rates.py --json

A false positive is any finding on healthy routing; rates are per judgement: per record for the record-level
detectors (routed_rows, stale_rows, constant_rows), per step and MoE layer for the layer-level ones. The faults
(``tests/check_faults.py``) are injected as each bug leaves them in a store; recall is the share of injected faults
a listed finding names (sample, layer and token range where the fault has them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from routelog.audit.check import DETECTORS, CheckResult, Thresholds, check
from tests.check_faults import (
    FAULTS,
    Case,
    corpus,
    engine_fixtures,
    healthy_synthetic,
    missed,
    stale_rows,
    token_routed,
)

RECORD_LEVEL = {"routed_rows", "stale_rows", "constant_rows"}
NEEDS_CONTINUITY = {"layer_offset", "layer_offset_dense_first"}
"""Faults seen across steps: only routing whose router persists from step to step shows them (not synth_records',
which draws a new router per step)."""
NEEDS_SETS = {"all_zero_rows", "eplb_replicas"}
"""Faults of top-k sets (K > 1): with top-1 a zero is expert 0 and an expert has no company to keep."""
LISTED = Thresholds(max_findings=10_000)


def _run(case: Case) -> tuple[CheckResult, float]:
    url = case.write()
    start = time.perf_counter()
    result = check(url, thresholds=LISTED)
    return result, time.perf_counter() - start


def healthy(case: Case) -> dict[str, Any]:
    result, seconds = _run(case)
    records = sum(s.records for s in result.steps)
    step_layers = len(result.steps) * case.spec.num_moe_layers
    by_detector: dict[str, dict[str, int]] = {}
    for f in result.findings:
        by_detector.setdefault(f.detector, {"error": 0, "warning": 0})[f.severity] += 1
    rates = {
        d: sum(by_detector.get(d, {}).values()) / (records if d in RECORD_LEVEL else step_layers) for d in DETECTORS
    }
    return {
        "case": case.name,
        "steps": len(result.steps),
        "records": records,
        "rows": sum(s.rows for s in result.steps),
        "errors": result.errors,
        "warnings": result.warnings,
        "findings": by_detector,
        "false_positive_rate": {d: r for d, r in rates.items() if r},
        "seconds": round(seconds, 3),
        "examples": [f"{f.severity} {f.detector} {f.sample_id} {f.tokens}: {f.message}" for f in result.findings[:3]],
    }


def recall(
    base: Case, fault: str, seed: int, fault_fn: Callable[[Case, np.random.Generator], Case] | None = None
) -> dict[str, Any]:
    case = (fault_fn or FAULTS[fault])(base, np.random.default_rng(seed))
    result, seconds = _run(case)
    lost = missed(result, case.expected)
    others = sorted({f.detector for f in result.findings} - {e.detector for e in case.expected})
    return {
        "fault": fault,
        "base": base.name,
        "injected": len(case.expected),
        "found": len(case.expected) - len(lost),
        "recall": (len(case.expected) - len(lost)) / len(case.expected) if case.expected else None,
        "missed": [str(e) for e in lost],
        "other_detectors": others,
        "seconds": round(seconds, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="48 records per corpus step")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    limit = 48 if args.quick else None
    corpora = [corpus("qwen3moe", limit=limit), corpus("deepseekv3", limit=limit)]
    synthetic = healthy_synthetic()
    report: dict[str, Any] = {
        "healthy": {
            "corpora": [healthy(c) for c in corpora],
            "synthetic": [healthy(c) for c in synthetic],
            "engine_fixtures": [healthy(c) for c in engine_fixtures()],
        },
        "recall": [],
    }
    bases = [*corpora, synthetic[1], token_routed("token-routed")]
    for fault in FAULTS:
        for base in bases:
            if fault in NEEDS_CONTINUITY and base.name.startswith("skew"):
                continue
            if fault in NEEDS_SETS and base.spec.topk < 2:
                continue
            report["recall"].append(recall(base, fault, seed=len(report["recall"])))
    for base in corpora:  # stale stretches wherever they fall, repeated tokens or not: not every one can be told
        anywhere = recall(base, "stale_rows", seed=99, fault_fn=partial(stale_rows, min_changes=0))
        report["recall"].append(anywhere | {"fault": "stale_rows (any stretch)"})
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for group, cases in report["healthy"].items():
        records = sum(c["records"] for c in cases)
        errors, warnings = sum(c["errors"] for c in cases), sum(c["warnings"] for c in cases)
        print(f"healthy {group}: {len(cases)} stores, {records:,} records: {errors} errors, {warnings} warnings")
        for c in cases:
            if c["errors"] or c["warnings"]:
                print(f"  {c['case']}: {c['findings']} rates {c['false_positive_rate']}")
                for example in c["examples"]:
                    print(f"    {example}")
    for r in report["recall"]:
        extra = f", also {r['other_detectors']}" if r["other_detectors"] else ""
        print(f"{r['fault']:>26} on {r['base']:<18} {r['found']}/{r['injected']} found{extra}")
        for lost in r["missed"]:
            print(f"    missed {lost}")


if __name__ == "__main__":
    main()
