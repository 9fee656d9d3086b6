"""Codec benchmark: bytes per token-layer and MB/s of routelog against the layouts peers ship, in one run.

Baselines, all on the same routing: raw int16 .npy (veRL's batch tensor), vLLM's base64 .npy (uint8/uint16),
SGLang's base64 raw int32, zstd-3 on raw uint8, Parquet (FixedSizeBinary row per token, zstd-3), and the entropy
bound log2(C(E, K)) / 8. MB/s count the raw uint8 routing bytes (one byte per ID) per second on one core.

Goals (issue: routing store v1): routelog <= 1.05 x the bound on uniform routing; encode >= 0.5 x and decode
>= 0.7 x the speed of zstd-3 alone on the same raw bytes.

    python tools/bench_codec.py [--json] [--quick] [--tokens T --layers L --experts E --topk K --skew S]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from numcodecs import Zstd

from routelog.codec import encode_rows, layer_major, sort_and_check
from routelog.format import CommitRecord, ObjectInfo, RoutingArrayInfo, utc_now
from routelog.part import BlockRequest, PartOptions, fetch_blocks, shard_layout
from routelog.shard import encode_shard
from routelog.spec import entropy_bound_bytes
from routelog.storage import Storage
from routelog.synth import synth_routing, synthetic_spec


def best_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def routelog_codec(
    ids: np.ndarray, num_experts: int, chunk_rows: int, chunk_layers: int, topk_order: str = "sorted"
) -> dict[str, Any]:
    """routelog's on-disk path: sort + gaps (``topk_order="score"``: the engine's order, no transform), then the
    zarr shard (zstd-3 + crc32c per inner chunk); decoding goes through the reader's chunk fetcher on an
    in-memory filesystem, into ``[T, L, K]``."""
    t, layers, k = ids.shape
    sort = topk_order == "sorted"
    info = RoutingArrayInfo(
        dtype=ids.dtype.name,
        n_rows=t,
        num_moe_layers=layers,
        topk=k,
        num_experts=num_experts,
        transform="sorted_gaps" if sort else "none",
        topk_order="sorted" if sort else "score",
        chunk_rows=chunk_rows,
        chunk_layers=min(chunk_layers, layers),
    )
    layout = shard_layout(info)
    storage = Storage.open(f"memory://bench-codec-{uuid.uuid4().hex}")

    def encode() -> bytes:
        by_layer = layer_major(ids)
        rows, problem = sort_and_check(by_layer.reshape(-1, k), num_experts)
        if problem is not None:
            raise ValueError(problem)
        stored = encode_rows(rows, "sorted_gaps") if sort else by_layer.reshape(-1, k)
        return encode_shard(stored.reshape(layers, t, k), layout, 3)

    def commit_for(shard: bytes) -> CommitRecord:
        return CommitRecord(
            step=0,
            part="bench.00000000.0",
            writer_id="bench",
            seq=0,
            created_at=utc_now(),
            n_records=1,
            n_tokens=t,
            routing=info,
            objects=[
                ObjectInfo(key=f"routing/{layout.shard_key}", size=len(shard), sha256=hashlib.sha256(shard).hexdigest())
            ],
        )

    written: list[tuple[bytes, CommitRecord]] = []

    def decode(shard: bytes) -> np.ndarray:
        if not written or written[0][0] is not shard:  # upload once, outside the timed decodes that follow
            storage.write(f"part/routing/{layout.shard_key}", shard)
            written[:] = [(shard, commit_for(shard))]
        (block,) = fetch_blocks(storage, [BlockRequest.of("part", written[0][1], (0, layers), (0, t))])
        return block.transpose(1, 0, 2)  # the [T, L, K] view readers hand out

    return {"encode": encode, "decode": decode, "size": len}


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = synthetic_spec(args.layers, args.experts, args.topk)
    rng = np.random.default_rng(args.seed)
    popularity = (
        [rng.dirichlet(np.full(args.experts, 1.0 / args.skew)) for _ in range(args.layers)] if args.skew > 0 else None
    )
    ids = synth_routing(rng, args.tokens, spec, popularity, args.locality)
    raw = np.ascontiguousarray(ids)
    raw_bytes = raw.nbytes  # one byte per ID (uint8); two above 256 experts
    token_layers = args.tokens * args.layers
    zstd = Zstd(level=3)
    results: dict[str, dict[str, float]] = {}

    def measure(name: str, encode: Callable[[], Any], decode: Callable[[Any], Any], size: Callable[[Any], int]) -> None:
        t_enc, encoded = best_time(encode, args.repeats)
        t_dec, decoded = best_time(lambda: decode(encoded), args.repeats)
        # Every layout must give back the routing (as a set per row: routelog canonicalises the order).
        got = np.frombuffer(decoded, raw.dtype) if isinstance(decoded, bytes) else np.asarray(decoded)
        if not np.array_equal(np.sort(got.reshape(raw.shape), axis=-1), np.sort(raw, axis=-1)):
            raise AssertionError(f"{name}: decoded routing differs from the input")
        nbytes = size(encoded)
        results[name] = {
            "bytes_per_token_layer": nbytes / token_layers,
            "encode_MBps": raw_bytes / t_enc / 1e6,
            "decode_MBps": raw_bytes / t_dec / 1e6,
        }

    def npy(array: np.ndarray) -> bytes:
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        return buffer.getvalue()

    measure("zstd-3 raw uint8", lambda: zstd.encode(raw), zstd.decode, len)
    codec = routelog_codec(raw, args.experts, args.chunk_rows, args.chunk_layers)
    measure("routelog", codec["encode"], codec["decode"], codec["size"])
    scored = routelog_codec(raw, args.experts, args.chunk_rows, args.chunk_layers, topk_order="score")
    measure("routelog --topk-order score", scored["encode"], scored["decode"], scored["size"])
    measure(
        "raw int16 .npy (veRL)",
        lambda: npy(raw.astype(np.int16)),
        lambda b: np.load(io.BytesIO(b), allow_pickle=False),
        len,
    )
    measure(
        "vLLM base64 .npy",
        lambda: base64.b64encode(npy(raw)),
        lambda s: np.load(io.BytesIO(base64.b64decode(s)), allow_pickle=False),
        len,
    )
    measure(
        "SGLang base64 int32",
        lambda: base64.b64encode(raw.astype(np.int32).tobytes()),
        lambda s: np.frombuffer(base64.b64decode(s), dtype=np.int32).reshape(raw.shape),
        len,
    )

    def parquet_encode() -> bytes:
        row_bytes = args.layers * args.topk * raw.itemsize
        column = pa.FixedSizeBinaryArray.from_buffers(pa.binary(row_bytes), args.tokens, [None, pa.py_buffer(raw)])
        sink = io.BytesIO()
        pq.write_table(
            pa.table({"routing": column}), sink, compression="zstd", compression_level=3, use_dictionary=False
        )
        return sink.getvalue()

    def parquet_decode(data: bytes) -> np.ndarray:
        column = pq.read_table(io.BytesIO(data)).column("routing").combine_chunks()
        return np.frombuffer(column.buffers()[1], dtype=raw.dtype).reshape(raw.shape)

    measure("Parquet FSB zstd-3", parquet_encode, parquet_decode, len)

    bound = entropy_bound_bytes(args.experts, args.topk)
    base = results["zstd-3 raw uint8"]
    ours = results["routelog"]
    return {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "entropy_bound_bytes_per_token_layer": bound,
        "results": results,
        "ratios": {
            "routelog_size_vs_bound": ours["bytes_per_token_layer"] / bound,
            "routelog_encode_vs_zstd3": ours["encode_MBps"] / base["encode_MBps"],
            "routelog_decode_vs_zstd3": ours["decode_MBps"] / base["decode_MBps"],
            "score_order_size_vs_sorted": results["routelog --topk-order score"]["bytes_per_token_layer"]
            / ours["bytes_per_token_layer"],
        },
        "goals": {"size_vs_bound_max": 1.05, "encode_vs_zstd3_min": 0.5, "decode_vs_zstd3_min": 0.7},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (smoke test)")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--skew", type=float, default=0.0)
    parser.add_argument("--locality", type=float, default=0.0)
    parser.add_argument("--chunk-rows", type=int, default=PartOptions.chunk_rows)
    parser.add_argument("--chunk-layers", type=int, default=PartOptions.chunk_layers)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.layers, args.repeats = 2048, 8, 1
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(
        f"routing: {args.tokens} tokens x {args.layers} layers, top-{args.topk} of {args.experts}, "
        f"skew {args.skew}, locality {args.locality}"
    )
    print(f"{'layout':30s} {'B/token-layer':>14s} {'enc MB/s':>10s} {'dec MB/s':>10s}")
    print(f"{'entropy bound':30s} {report['entropy_bound_bytes_per_token_layer']:14.3f}")
    for name, r in report["results"].items():
        print(f"{name:30s} {r['bytes_per_token_layer']:14.3f} {r['encode_MBps']:10.0f} {r['decode_MBps']:10.0f}")
    ratios, goals = report["ratios"], report["goals"]
    for key, label, goal in (
        ("routelog_size_vs_bound", "routelog size / bound", f"<= {goals['size_vs_bound_max']}"),
        ("routelog_encode_vs_zstd3", "routelog encode / zstd-3", f">= {goals['encode_vs_zstd3_min']}"),
        ("routelog_decode_vs_zstd3", "routelog decode / zstd-3", f">= {goals['decode_vs_zstd3_min']}"),
    ):
        print(f"{label:28s} {ratios[key]:.3f}  (goal {goal})")
    print(
        f"{'score order / sorted size':28s} {ratios['score_order_size_vs_sorted']:.3f}  "
        "(the cost of keeping the engine's order)"
    )


if __name__ == "__main__":
    main()
