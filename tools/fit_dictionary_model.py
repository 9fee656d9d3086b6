"""Fit and check the codec's dictionary cost model against trial compressions of the corpus' chunk layers.

Whether a layer keeps a dictionary (``routelog/format/_ckernels.c``, ``dictionary_pays``) is decided by a model, not by
compressing both ways: the gain of a dictionary over zstd's matches is ``MATCH_BYTES * runs - INDEX_WEIGHT *
index_bytes - LONG_RUN_BYTES * long_runs``, where for the layer's unique rows (rows equal to the row before them
removed) ``runs`` counts runs of rows that repeat earlier ones, ``long_runs`` those longer than a row, and
``index_bytes`` is the order-0 entropy of the entry indices' byte planes (entries ranked by use) over the rows no
run covers. This tool encodes every chunk layer of the corpus (``--chunk-rows`` rows, one layer at a time) with and
without a dictionary, fits the three constants by least squares on the record-order routing, and reports how
close choosing by the fitted and by the shipped constants comes to the better of the two per layer, on record
order (the fit) and on the rows the corpus' format-2 store holds (held out).

    python tools/fit_dictionary_model.py [--json] [--quick] [--corpus STORE ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from bench_codec import corpus_routing, stored_routing, writer_sizes

from routelog.format import kernels, ranked
from routelog.format.codec import sort_by_layer

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "corpus"


def layer_features(words: np.ndarray) -> tuple[int, int, float]:
    """``runs``, ``long_runs`` and ``index_bytes`` of one layer's rows (one uint64 word per sorted row), as the
    codec's encoder counts them (without its hash table's collisions)."""
    unique = words[np.concatenate([[True], words[1:] != words[:-1]])]
    n = unique.size
    order = np.argsort(unique, kind="stable")  # equal rows together, in row order
    same_as_before = np.concatenate([[False], unique[order][1:] == unique[order][:-1]])
    latest = np.full(n, -1)  # the latest earlier row with the same set
    latest[order[same_as_before]] = order[np.flatnonzero(same_as_before) - 1]
    group_start = np.maximum.accumulate(np.where(same_as_before, 0, np.arange(n)))
    entry_row = np.empty(n, np.int64)
    entry_row[order] = order[group_start]  # each row's first occurrence names its entry
    repeated = latest >= 0
    # a repeat continues a run when the row before it repeated the row before its own earlier copy
    continues = repeated & np.concatenate([[False], repeated[:-1] & (latest[1:] == latest[:-1] + 1)])
    runs = int((repeated & ~continues).sum())
    long_runs = int((continues & ~np.concatenate([[False], continues[:-1]])).sum())
    first_rows, entries = np.unique(entry_row, return_inverse=True)  # entries numbered in order of first sight
    uses = np.bincount(entries[~continues], minlength=first_rows.size).astype(np.float64)
    ranks = np.empty(uses.size, np.int64)
    ranks[np.argsort(-uses, kind="stable")] = np.arange(uses.size)
    bits = _entropy_bits(np.bincount(ranks & 255, weights=uses, minlength=256))
    if uses.size > 256:
        bits += _entropy_bits(np.bincount(ranks >> 8, weights=uses))
    return runs, long_runs, bits / 8


def _entropy_bits(counts: np.ndarray) -> float:
    counts = counts[counts > 0]
    return float(-(counts * np.log2(counts / counts.sum())).sum())


def trial_compressions(ids: np.ndarray, num_experts: int, chunk_rows: int, limit: int | None) -> list[dict[str, Any]]:
    """Each chunk layer of ``ids`` ``[T, L, K]`` (rows of eight uint8 IDs): its size without and with a dictionary
    and the model's features."""
    tokens, layers, k = ids.shape
    if ids.dtype != np.uint8 or k != 8:
        raise SystemExit("the model's features are computed on rows of eight uint8 IDs")
    by_layer, problem = sort_by_layer(ids, num_experts)
    if problem is not None:
        raise SystemExit(f"the routing holds a row that is no set: {problem}")
    found = []
    for start in range(0, tokens, chunk_rows)[:limit]:
        for layer in range(layers):
            chunk = np.ascontiguousarray(by_layer[layer : layer + 1, start : start + chunk_rows])
            runs, long_runs, index_bytes = layer_features(chunk.reshape(-1, 8).view(np.uint64).ravel())
            found.append(
                {
                    "without": len(ranked.encode(chunk, num_experts, dictionaries="never")),
                    "with": len(ranked.encode(chunk, num_experts, dictionaries="always")),
                    "runs": runs,
                    "long_runs": long_runs,
                    "index_bytes": index_bytes,
                }
            )
    return found


def choices(layers: list[dict[str, Any]], constants: tuple[float, float, float]) -> dict[str, float]:
    """Total bytes when each layer takes what ``constants`` (match, index weight, long run) predict, against the
    better of the two per layer and against never using a dictionary."""
    match, weight, long_run = constants
    chosen = agree = 0
    for layer in layers:
        predicted = match * layer["runs"] - weight * layer["index_bytes"] - long_run * layer["long_runs"] > 0
        chosen += layer["with"] if predicted else layer["without"]
        agree += predicted == (layer["with"] < layer["without"])
    best = sum(min(layer["with"], layer["without"]) for layer in layers)
    return {
        "chosen_bytes": chosen,
        "best_bytes": best,
        "never_bytes": sum(layer["without"] for layer in layers),
        "chosen_vs_best": chosen / best,
        "agreement": agree / len(layers),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    record_order: list[dict[str, Any]] = []
    as_stored: list[dict[str, Any]] = []
    for url in args.corpus:
        ids, experts = corpus_routing(url)
        record_order += trial_compressions(ids, experts, args.chunk_rows, args.limit)
        _, written = writer_sizes(url)
        as_stored += trial_compressions(stored_routing(written), experts, args.chunk_rows, args.limit)
    features = np.array([[x["runs"], -x["index_bytes"], -x["long_runs"]] for x in record_order], np.float64)
    gains = np.array([x["without"] - x["with"] for x in record_order], np.float64)
    fitted = tuple(float(c) for c in np.linalg.lstsq(features, gains, rcond=None)[0])
    shipped = (kernels.MATCH_BYTES, kernels.INDEX_WEIGHT, kernels.LONG_RUN_BYTES)
    return {
        "config": {"corpus": args.corpus, "chunk_rows": args.chunk_rows, "limit": args.limit},
        "layers": {"record order": len(record_order), "as stored": len(as_stored)},
        "fitted": dict(zip(("match_bytes", "index_weight", "long_run_bytes"), fitted, strict=True)),
        "shipped": dict(zip(("match_bytes", "index_weight", "long_run_bytes"), shipped, strict=True)),
        "record order (fit)": {"fitted": choices(record_order, fitted), "shipped": choices(record_order, shipped)},
        "as stored (held out)": {"fitted": choices(as_stored, fitted), "shipped": choices(as_stored, shipped)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--quick", action="store_true", help="the first 4 row chunks of each routing (smoke test)")
    parser.add_argument("--corpus", nargs="*", default=[str(CORPUS / "qwen3moe"), str(CORPUS / "deepseekv3")])
    parser.add_argument("--chunk-rows", type=int, default=4096)
    args = parser.parse_args()
    args.limit = 4 if args.quick else None
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"chunk layers: {report['layers']}")
    for name in ("fitted", "shipped"):
        print(f"{name} constants: " + ", ".join(f"{k} {v:.2f}" for k, v in report[name].items()))
    for data in ("record order (fit)", "as stored (held out)"):
        for name, got in report[data].items():
            print(
                f"  {data}, {name}: {got['chosen_bytes']} B, {got['chosen_vs_best']:.4f} x the better per layer "
                f"(never: {got['never_bytes']}), {got['agreement']:.1%} of choices agree"
            )


if __name__ == "__main__":
    main()
