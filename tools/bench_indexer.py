"""Benchmark the indexer positions codec (routelog/format/positions.py) against its entropy bound and zstd.

Synthetic rows, as a DeepSeek Sparse Attention indexer's top-k selections behave: in each layer, the query at
position p selects k of the key positions 0..p; rows with p + 1 <= k select every position (determined); after
that each row is the row before with d positions removed (uniformly among its k) and d added (uniformly among the
p + 1 - k positions of [0, p] it lacks), d ~ Binomial(k, 1 - overlap) capped at p + 1 - k, so adjacent rows share
``overlap`` (95 %) of their positions. The rows are exactly that draw's outcomes, so the bound is the sum over rows
of log2 C(k, d) + log2 C(p + 1 - k, d) + the entropy of the capped binomial: no coder can do better on average.

Prints, per run: the bound, the block's size and its ratio to the bound (goal <= 1.1) and to the raw int32 rows
(goal <= 2.5 %), zstd-19 of the raw rows (one frame) and of two row transforms (each row XOR the row before; each
row's gaps, position minus the one before) as baselines, and the speeds of the compiled coder and its Python twin
in M positions a second (positions: the rows' selected positions, determined rows included; one core, best of
``--repeats``), encode goal >= 50 and decode goal >= 200 for the compiled coder.

    python tools/bench_indexer.py [--quick] [--json] [--layers 1] [--tokens 32768] [--k 2048]

``--quick``: k = 256 over 4096 tokens. :func:`report_traces` reports the same figures on real rows (a list of
``int32 [n, k]`` arrays, one per layer and sequence), the bound there being the swap model's given each row's d.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from routelog.format import positions, positions_python

GOALS = {"size / bound": 1.1, "size / raw": 0.025, "encode M positions/s": 50.0, "decode M positions/s": 200.0}


def _log2_binomial(n: int, m: int) -> float:
    return (math.lgamma(n + 1) - math.lgamma(m + 1) - math.lgamma(n - m + 1)) / math.log(2)


def synthetic_layer(
    tokens: int, k: int, *, overlap: float = 0.95, seed: int = 0
) -> tuple[npt.NDArray[np.int32], float]:
    """One layer's canonical rows ``[tokens, k]`` (first position 0) drawn as the module docstring says, and the
    draw's entropy in bytes."""
    rng = np.random.default_rng(seed)
    q = 1.0 - overlap
    rows = np.full((tokens, k), -1, np.int32)
    determined = min(tokens, k)
    for p in range(determined):
        rows[p, : p + 1] = np.arange(p + 1)
    # the entropy of d ~ min(Binomial(k, q), c): the sum over d < c of -P log2 P, plus the tail's mass at c
    pmf = np.array(
        [
            math.exp(_log2_binomial(k, d) * math.log(2) + d * math.log(q) + (k - d) * math.log(1 - q))
            if 0 < q < 1
            else float(d == round(k * q))
            for d in range(k + 1)
        ]
    )
    terms = np.where(pmf > 0, -pmf * np.log2(np.where(pmf > 0, pmf, 1)), 0.0)
    head = np.concatenate(([0.0], np.cumsum(terms)))
    tail = np.concatenate((np.cumsum(pmf[::-1])[::-1], [0.0]))
    bits = 0.0
    prev = np.arange(k, dtype=np.int64)
    shift_base = np.arange(k, dtype=np.int64)
    for p in range(determined, tokens):
        candidates = p + 1 - k
        d = min(int(rng.binomial(k, q)), candidates)
        cap = min(candidates, k + 1)
        mass = float(tail[cap]) if cap <= k else 0.0
        bits += float(head[cap]) + (-mass * math.log2(mass) if mass > 0 else 0.0)
        bits += _log2_binomial(k, d) + _log2_binomial(candidates, d)
        removed = rng.choice(k, d, replace=False)
        ranks = np.sort(rng.choice(candidates, d, replace=False))
        added = ranks + np.searchsorted(prev - shift_base, ranks, side="right")
        kept = np.delete(prev, removed)
        prev = np.insert(kept, np.searchsorted(kept, added), added)
        rows[p] = prev
    return rows, bits / 8


def model_bound_bytes(layers: Sequence[npt.NDArray[Any]], first_positions: Sequence[int]) -> float:
    """The swap model's cost of real rows: per row with a known row before, log2 C(k, d) + log2 C(p + 1 - k, d)
    for its d; log2 C(p + 1, k) for the rows coded alone; plus the empirical entropy of the d's. Not a bound on
    real data (which may be more predictable), the figure the codec's model aims at."""
    bits = 0.0
    ds: list[int] = []
    for rows, first in zip(layers, first_positions, strict=True):
        n, k = rows.shape
        prev_known = False
        for i in range(n):
            p = first + i
            row = rows[i]
            if row[0] == -1 and (row == -1).all():
                prev_known = False
                continue
            if p + 1 <= k:
                prev_known = True
                continue
            if not prev_known:
                bits += _log2_binomial(p + 1, k)
            else:
                d = int(k - np.intersect1d(rows[i - 1], row, assume_unique=True).size)
                ds.append(d)
                bits += _log2_binomial(k, d) + _log2_binomial(p + 1 - k, d)
            prev_known = True
    if ds:
        counts = np.bincount(ds).astype(float)
        share = counts[counts > 0] / len(ds)
        bits += float(-(share * np.log2(share)).sum()) * len(ds)
    return bits / 8


def _zstd(data: bytes, level: int) -> int:
    import zstandard

    return len(zstandard.ZstdCompressor(level=level).compress(data))


def _baselines(layers: Sequence[npt.NDArray[np.int32]], level: int) -> dict[str, int]:
    raw = b"".join(np.ascontiguousarray(rows).tobytes() for rows in layers)
    xor = b"".join(
        np.bitwise_xor(rows, np.concatenate([np.zeros((1, rows.shape[1]), np.int32), rows[:-1]])).tobytes()
        for rows in layers
    )
    gaps = b"".join(np.diff(rows, axis=1, prepend=0).astype(np.int32).tobytes() for rows in layers)
    return {
        f"zstd-{level} raw int32": _zstd(raw, level),
        f"zstd-{level} row XOR row before": _zstd(xor, level),
        f"zstd-{level} row gaps": _zstd(gaps, level),
    }


def _best(run: Any, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def _speeds(
    layers: Sequence[npt.NDArray[np.int32]], firsts: Sequence[int], blocks: Sequence[bytes], count: int, repeats: int
) -> dict[str, dict[str, float]]:
    """M positions a second, encode and decode, of the compiled coder (where built) and the Python twin."""
    speeds: dict[str, dict[str, float]] = {}
    implementations = ["compiled", "python"] if positions.IMPLEMENTATION == "compiled" else ["python"]
    for name in implementations:
        if name == "compiled":

            def encode() -> None:
                for rows, first in zip(layers, firsts, strict=True):
                    positions.encode_positions(rows, first)

            def decode() -> None:
                for block in blocks:
                    positions.decode_positions(block)

            times = _best(encode, repeats), _best(decode, repeats)
        else:

            def encode() -> None:
                for rows, first in zip(layers, firsts, strict=True):
                    positions_python.encode(rows, first, 256)

            def decode() -> None:
                for block in blocks:
                    header = positions_python.parse_header(block)
                    out = np.empty((header.n, header.k), np.int32)
                    positions_python.decode(np.frombuffer(block, np.uint8), header, 0, header.n, out)

            times = _best(encode, 1), _best(decode, 1)
        speeds[name] = {"encode_mpos_s": count / times[0] / 1e6, "decode_mpos_s": count / times[1] / 1e6}
    return speeds


def _random_access_us(blocks: Sequence[bytes], rng: np.random.Generator, tries: int = 200) -> float:
    """Mean microseconds to decode one row at random (from its keyframe group's start)."""
    started = time.perf_counter()
    for _ in range(tries):
        block = blocks[int(rng.integers(len(blocks)))]
        n = positions.positions_header(block)[0]
        if n:
            row = int(rng.integers(n))
            positions.decode_positions(block, start=row, stop=row + 1)
    return (time.perf_counter() - started) / tries * 1e6


def _report(
    layers: Sequence[npt.NDArray[np.int32]],
    firsts: Sequence[int],
    bound: float,
    bound_kind: str,
    *,
    level: int,
    repeats: int,
) -> dict[str, Any]:
    blocks = [positions.encode_positions(rows, first) for rows, first in zip(layers, firsts, strict=True)]
    for rows, block in zip(layers, blocks, strict=True):
        if not np.array_equal(positions.decode_positions(block), rows):
            raise SystemExit("the codec does not decode its own rows")
    size = sum(len(b) for b in blocks)
    raw = sum(rows.size * 4 for rows in layers)
    count = sum(int((rows >= 0).sum()) for rows in layers)
    baselines = _baselines(layers, level)
    speeds = _speeds(layers, firsts, blocks, count, repeats)
    compiled = speeds.get("compiled")
    ratios = {"size / bound": size / bound if bound else math.inf, "size / raw": size / raw}
    verdict = [
        {"goal": name, "value": value, "limit": GOALS[name], "met": value <= GOALS[name]}
        for name, value in ratios.items()
    ]
    if compiled:
        verdict += [
            {
                "goal": f"{direction} M positions/s",
                "value": compiled[f"{direction}_mpos_s"],
                "limit": limit,
                "met": compiled[f"{direction}_mpos_s"] >= limit,
            }
            for direction, limit in (
                ("encode", GOALS["encode M positions/s"]),
                ("decode", GOALS["decode M positions/s"]),
            )
        ]
    return {
        "implementation": positions.IMPLEMENTATION,
        "layers": len(layers),
        "rows": sum(len(rows) for rows in layers),
        "k": sorted({rows.shape[1] for rows in layers}),
        "positions": count,
        "bound_kind": bound_kind,
        "bound_bytes": bound,
        "encoded_bytes": size,
        "raw_bytes": raw,
        "ratios": ratios,
        "baselines": {
            name: {"bytes": b, "vs_bound": b / bound if bound else math.inf, "vs_raw": b / raw, "vs_codec": b / size}
            for name, b in baselines.items()
        },
        "speeds_mpos_s": speeds,
        "random_row_us": _random_access_us(blocks, np.random.default_rng(0)),
        "verdict": verdict,
    }


def report_traces(
    traces: Sequence[npt.NDArray[Any]],
    first_positions: Sequence[int] | None = None,
    *,
    zstd_level: int = 19,
    repeats: int = 3,
) -> dict[str, Any]:
    """The benchmark's figures on real rows: ``traces``, one canonical ``[n, k]`` array per layer and sequence
    (first position 0 unless ``first_positions`` says otherwise); the bound is :func:`model_bound_bytes`."""
    layers = [np.ascontiguousarray(rows, dtype=np.int32) for rows in traces]
    firsts = list(first_positions) if first_positions is not None else [0] * len(layers)
    for rows, first in zip(layers, firsts, strict=True):
        positions.check_position_rows(rows, first)
    return _report(
        layers,
        firsts,
        model_bound_bytes(layers, firsts),
        "swap model given each row's d",
        level=zstd_level,
        repeats=repeats,
    )


def synthetic_report(
    tokens: int, k: int, *, layers: int = 1, overlap: float = 0.95, zstd_level: int = 19, repeats: int = 3
) -> dict[str, Any]:
    drawn = [synthetic_layer(tokens, k, overlap=overlap, seed=seed) for seed in range(layers)]
    report = _report(
        [rows for rows, _ in drawn],
        [0] * layers,
        sum(bits for _, bits in drawn),
        "entropy of the generator",
        level=zstd_level,
        repeats=repeats,
    )
    report["generator"] = {"tokens": tokens, "k": k, "layers": layers, "overlap": overlap}
    return report


TRACE_MODEL = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 16,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 4,
    "kv_lora_rank": 32,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "qk_nope_head_dim": 16,
    "index_head_dim": 32,
    "index_n_heads": 4,
    "first_k_dense_replace": 1,
    "initializer_range": 0.1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
"""The tiny DeepSeek-V3.2-style model the traces come from (random weights, as the demo's; no weights can be
downloaded here)."""


def model_traces(lengths: Sequence[int], keys_per_query: int, seed: int = 0) -> list[npt.NDArray[np.int32]]:
    """Indexer rows recorded from a tiny random DeepSeek-V3.2-style HF model in bf16: one prefill of random tokens
    per length (every query's selection, as an engine's prefill computes it), ``index_topk = keys_per_query`` so
    that it binds; one ``[n, k]`` array per layer and sequence."""
    import torch
    import transformers

    from routelog.engines.hf import RoutingRecorder
    from routelog.engines.hf_indexer import IndexerRecorder
    from routelog.format.spec import ModelSpec

    torch.manual_seed(seed)
    config = {**TRACE_MODEL, "index_topk": keys_per_query, "max_position_embeddings": max(lengths)}
    model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**config)).eval().to(torch.bfloat16)
    spec = ModelSpec.from_hf_config({"model_type": "deepseek_v32", **config})
    traces = []
    for length in lengths:
        tokens = torch.randint(3, config["vocab_size"], (1, length))
        mask = torch.ones_like(tokens)
        with RoutingRecorder(model, spec) as routing, IndexerRecorder(model, spec) as indexers, torch.no_grad():
            model(tokens, attention_mask=mask)
        (record,) = indexers.attach(routing.records(tokens, mask, tokens, sample_ids=[f"len-{length}"]), mask)
        rows = np.asarray(record.indexer)
        traces += [np.ascontiguousarray(rows[:, j, :]) for j in range(rows.shape[1])]
    return traces


def _print(report: dict[str, Any]) -> None:
    mb = 1 / 1e6
    print(
        f"{report['layers']} layer(s), {report['rows']} rows, k={report['k']}, {report['positions'] * mb:.1f} M"
        f" positions; implementation: {report['implementation']}"
    )
    print(f"  bound ({report['bound_kind']}): {report['bound_bytes']:,.0f} B")
    ratios = report["ratios"]
    print(
        f"  routelog positions: {report['encoded_bytes']:,} B = {ratios['size / bound']:.4f} x bound,"
        f" {100 * ratios['size / raw']:.3f} % of raw int32 ({report['raw_bytes']:,} B)"
    )
    for name, base in report["baselines"].items():
        print(
            f"  {name}: {base['bytes']:,} B = {base['vs_bound']:.3f} x bound, {100 * base['vs_raw']:.3f} % of raw,"
            f" {base['vs_codec']:.2f} x routelog"
        )
    for name, speed in report["speeds_mpos_s"].items():
        print(f"  {name}: encode {speed['encode_mpos_s']:.1f} M positions/s, decode {speed['decode_mpos_s']:.1f}")
    print(f"  one row at random: {report['random_row_us']:.0f} us")
    for row in report["verdict"]:
        print(
            f"  goal {row['goal']}: {row['value']:.4g} against {row['limit']:g}: {'met' if row['met'] else 'NOT met'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="k = 256 over 4096 tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--k", type=int, default=None)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--overlap", type=float, default=0.95)
    parser.add_argument("--zstd-level", type=int, default=19)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--traces",
        action="store_true",
        help="also rows recorded from a tiny random DeepSeek-V3.2-style HF model (prefills of 1k, 2k, 4k tokens, "
        "index_topk 128; --quick: 512 and 1k tokens, index_topk 64)",
    )
    args = parser.parse_args()
    tokens = args.tokens or (4096 if args.quick else 32768)
    k = args.k or (256 if args.quick else 2048)
    report = synthetic_report(
        tokens, k, layers=args.layers, overlap=args.overlap, zstd_level=args.zstd_level, repeats=args.repeats
    )
    if args.traces:
        lengths, keys_per_query = ((512, 1024), 64) if args.quick else ((1024, 2048, 4096), 128)
        traced = report_traces(model_traces(lengths, keys_per_query), zstd_level=args.zstd_level, repeats=args.repeats)
        traced["model"] = {"lengths": list(lengths), "index_topk": keys_per_query, **TRACE_MODEL}
        report["traces"] = traced
    report["cpu_count"] = os.cpu_count()
    if args.json:
        print(json.dumps(report))
    else:
        _print(report)
        if "traces" in report:
            print("rows recorded from the tiny DeepSeek-V3.2-style model:")
            _print(report["traces"])


if __name__ == "__main__":
    main()
