"""Codec benchmark: bytes per token-layer and MB/s of routelog against the layouts peers ship, in one run.

Layouts, all on the same routing: routelog format 2 (``ranked_gaps``: the chunk codec that learns popularity and
repeats), format 1 (``sorted_gaps``), score order kept, raw int16 .npy (veRL's batch tensor), vLLM's base64 .npy,
SGLang's base64 raw int32, zstd-3 on raw uint8 and Parquet. MB/s count the raw uint8 routing bytes (one byte per
ID) per second on one core; routelog's decode goes through the reader's chunk fetcher.

References per routing: the bound log2(C(E, K)) / 8 (uniform sets), the floor of the gap transform under a
byte-wise Huffman code (:func:`gap_huffman_floor`: what formats 1 and 2 can reach on uniform sets), and an
empirical conditional-entropy estimate (see :func:`entropy_estimate`). With ``--corpus STORE...`` the routing is
the corpus' (every valid row of every record, in record order: the codec alone, without sharing prefixes), uniform
routing is measured in the same run at the corpus' shape and at the shape the goals were set at (``--layers``,
``--experts``, ``--topk``: 48 layers, top-8 of 128), and the corpus is also written again by routelog's writer as
format 1 and as format 2 (codec and shared prefixes: what a store of that corpus costs). Every layout is then
measured again on the rows that format-2 store holds ("as stored": each shared prefix once, the rows routelog's
codec really encodes), where record order repeats every GRPO prompt n times.

Goals (issue #14, :data:`GOALS`): on the corpus v2 >= 1.3 x smaller than v1 and <= 1.1 x the estimate; on uniform
routing no worse than v1 (<= 1.05 x the bound at the goals' shape); encode >= 0.5 x and decode >= 0.7 x the speed
of zstd-3 alone on the same raw bytes. The run ends with each goal's figure on each dataset and whether it is met
(:func:`verdict`, which says what is judged against what).

Two zstd-3 references for speed: on the same inner chunks routelog stores (one frame per chunk through a reused
context: what zstd alone costs in a chunked store, format 1's codec or a plain zarr array of the IDs with a zstd
codec), which the goals are judged against, and one frame over the whole array, given beside it. The whole-array
frame finds matches across chunks (the corpus' GRPO prompts repeat in record order, and sets recur thousands of
rows apart; a real store keeps the prompts once through shared prefixes) that per-chunk frames cannot, so on the
corpus it codes far fewer literals than any chunk codec; the compiled kernels (``routelog.format.kernels``) and, on
encode, the writer's sort and checks (``sort_by_layer``) come on top of zstd for routelog.
Every layout runs once untimed first (routelog's kernels load, or compile, on their first chunk). The speed ratios
are paired (:func:`paired_speed`): routelog and both references timed back to back in each of ``--rounds`` rounds,
the median round's ratio reported with the range; the MB/s columns come from the first, unpaired pass.

As an archive (issue #33, :func:`archive`): the corpora's records, token-dependent routing over Zipf vocabularies
of 150k and 260 token ids, and uniform routing without token ids, each written by routelog's writer with the
``ranked_context`` codec (judged) and with format 2's ``ranked_gaps`` (beside it; every byte of the store counted)
against the whole raw routing array in one zstd-19 frame plus the int32 token ids in another, with each store's
write and read speed (best of ``--repeats``, after an untimed pass of each codec) and each codec's alone on the rows
the parts hold (:func:`codec_alone`). Issue #55's speed goals (:data:`ARCHIVE_SPEED_GOALS`: on the corpora the archive
codec's store written at >= 40 and read at >= 150 raw MB/s) are judged there, format 2's figures beside them.

    python tools/bench_codec.py [--json] [--quick] [--corpus tests/fixtures/corpus/qwen3moe ...]
                                [--tokens T --layers L --experts E --topk K --skew S --locality P]
                                [--repeats N --rounds N]
"""

from __future__ import annotations

import argparse
import base64
import functools
import hashlib
import heapq
import io
import json
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from benchlib import corpus_steps, token_dependent_records, zstd19_baseline
from numcodecs import Zstd

import routelog
from routelog import Record
from routelog.format import keys, zstd_frames
from routelog.format.codec import Transform, encode_rows, layer_major, sort_by_layer
from routelog.format.documents import CommitRecord, ObjectInfo, RoutingArrayInfo, utc_now
from routelog.format.index_rows import part_row_tokens
from routelog.format.part import PartOptions, shard_layout
from routelog.format.shard import encode_shard, encode_shards
from routelog.format.spec import ModelSpec, entropy_bound_bytes
from routelog.store.blocks import BlockRequest, fetch_blocks
from routelog.store.storage import Storage
from routelog.store.store import Store
from routelog.synth import synth_routing, synthetic_spec


def best_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def routelog_codec(
    ids: np.ndarray, num_experts: int, chunk_rows: int, chunk_layers: int, transform: Transform = "ranked_gaps"
) -> dict[str, Any]:
    """routelog's on-disk path: sort, then the chunk codec of ``transform`` (format 2 ``ranked_gaps``, format 1
    ``sorted_gaps``; ``none`` keeps the engine's order) in the zarr shard (zstd-3 + crc32c per inner chunk);
    decoding goes through the reader's chunk fetcher on an in-memory filesystem, into ``[T, L, K]``."""
    t, layers, k = ids.shape
    sort = transform != "none"
    info = RoutingArrayInfo(
        dtype=ids.dtype.name,
        n_rows=t,
        num_moe_layers=layers,
        topk=k,
        num_experts=num_experts,
        transform=transform,
        topk_order="sorted" if sort else "score",
        chunk_rows=chunk_rows,
        chunk_layers=min(chunk_layers, layers),
    )
    layout = shard_layout(info)
    storage = Storage.open(f"memory://bench-codec-{uuid.uuid4().hex}")

    def encode() -> bytes:
        rows, problem = sort_by_layer(ids, num_experts)  # the writer's sort and checks, into layer order
        if problem is not None:
            raise ValueError(problem)
        stored = (
            layer_major(ids)
            if not sort
            else encode_rows(rows.reshape(-1, k), transform).reshape(layers, t, k)
            if transform == "sorted_gaps"
            else rows
        )
        return encode_shard(stored, layout, 3)

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
                ObjectInfo(
                    key=f"routing/{layout.shard_key()}", size=len(shard), sha256=hashlib.sha256(shard).hexdigest()
                )
            ],
        )

    written: list[tuple[bytes, CommitRecord]] = []

    def decode(shard: bytes) -> np.ndarray:
        if not written or written[0][0] is not shard:  # upload once, outside the timed decodes that follow
            storage.write(f"part/routing/{layout.shard_key()}", shard)
            written[:] = [(shard, commit_for(shard))]
        (block,) = fetch_blocks(storage, [BlockRequest.of("part", written[0][1], (0, layers), (0, t))])
        return block.transpose(1, 0, 2)  # the [T, L, K] view readers hand out

    return {"encode": encode, "decode": decode, "size": len}


def zstd_per_chunk(ids: np.ndarray, chunk_rows: int, chunk_layers: int) -> dict[str, Any]:
    """zstd-3 alone on the same inner chunks routelog stores (layer-major ``[layers, rows, K]`` blocks of the raw
    IDs, as a plain zarr array of them with a zstd codec would hold): what any chunked store pays, one frame per
    chunk through a reused context, decoded into ``[T, L, K]``."""
    t, layers, k = ids.shape
    chunk_layers = min(chunk_layers, layers)
    grid = [(l0, r0) for l0 in range(0, layers, chunk_layers) for r0 in range(0, t, chunk_rows)]

    def encode() -> list[bytes]:
        by_layer = layer_major(ids)
        return [
            zstd_frames.compress(np.ascontiguousarray(by_layer[l0 : l0 + chunk_layers, r0 : r0 + chunk_rows]), 3)
            for l0, r0 in grid
        ]

    def decode(frames: list[bytes]) -> np.ndarray:
        out = np.empty((layers, t, k), ids.dtype)
        for (l0, r0), frame in zip(grid, frames, strict=True):
            block = out[l0 : l0 + chunk_layers, r0 : r0 + chunk_rows]
            block[...] = zstd_frames.decompress(frame, block.nbytes, "chunk").view(ids.dtype).reshape(block.shape)
        return out.transpose(1, 0, 2)

    return {"encode": encode, "decode": decode, "size": lambda frames: sum(len(f) for f in frames)}


def entropy_estimate(ids: np.ndarray, num_experts: int) -> float:
    """Bytes per token-layer of an empirical conditional-entropy estimate of ``ids`` ``[T, L, K]``.

    The model, per MoE layer and conditioned on the previous token's set in that layer: with the layer's empirical
    rate ``r`` the token repeats that set (``h(r)`` bits for the event); otherwise its set is new and each expert is
    in it independently with its empirical frequency among new sets (``sum_e h(q_e)`` bits, which upper-bounds the
    entropy of the set under those marginals). Fitted on the data itself (plug-in), so it ignores what a coder pays
    to learn the statistics, and it sees no dependence on the token id or across layers.
    """
    t, layers, _ = ids.shape

    def h(p: np.ndarray) -> np.ndarray:
        p = np.clip(p, 1e-300, 1.0)
        q = np.clip(1.0 - p, 1e-300, 1.0)
        return np.where((p <= 0) | (p >= 1), 0.0, -(p * np.log2(p) + q * np.log2(q)))

    bits = 0.0
    for j in range(layers):
        rows = np.sort(ids[:, j], axis=-1)
        repeat = np.zeros(t, dtype=bool)
        repeat[1:] = (rows[1:] == rows[:-1]).all(axis=1)
        rate = float(repeat.mean())
        new = rows[~repeat]
        inclusion = np.bincount(new.ravel(), minlength=num_experts) / max(1, new.shape[0])
        bits += t * float(h(np.array(rate))) + new.shape[0] * float(h(inclusion).sum())
    return bits / 8 / (t * layers)


def gap_huffman_floor(num_experts: int, topk: int) -> float | None:
    """Bytes per token-layer of the best the gap transform can do on uniform sets with one byte-wise Huffman code
    (zstd's literal coder; formats 1 and 2 store uniform layers this way): K gaps, each coded by the optimal
    Huffman code of the gaps' exact distribution, with no table or frame overhead. Every gap of a uniform K-subset
    of E has the distribution of the smallest member, P(g = x) = C(E - 1 - x, K - 1) / C(E, K). None above 256
    experts (gaps of two bytes are coded as two byte planes)."""
    if num_experts > 256:
        return None
    total = math.comb(num_experts, topk)
    probabilities = [math.comb(num_experts - 1 - x, topk - 1) / total for x in range(num_experts - topk + 1)]
    return topk * huffman_mean_length(probabilities) / 8


def huffman_mean_length(probabilities: list[float]) -> float:
    """The expected code length, in bits, of an optimal (Huffman) prefix code for ``probabilities``: the sum of
    the merged weights, each merge adding a bit to every symbol beneath it."""
    heap = [p for p in probabilities if p > 0]
    heapq.heapify(heap)
    bits = 0.0
    while len(heap) > 1:
        merged = heapq.heappop(heap) + heapq.heappop(heap)
        bits += merged
        heapq.heappush(heap, merged)
    return bits


def measure_routing(ids: np.ndarray, num_experts: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every layout on ``ids`` ``[T, L, K]``: sizes, speeds and the ratios the goals name."""
    raw = np.ascontiguousarray(ids)
    raw_bytes = raw.nbytes  # one byte per ID (uint8); two above 256 experts
    tokens, layers, topk = raw.shape
    token_layers = tokens * layers
    zstd = Zstd(level=3)
    results: dict[str, dict[str, float]] = {}
    codecs: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {}

    def measure(name: str, encode: Callable[[], Any], decode: Callable[[Any], Any], size: Callable[[Any], int]) -> None:
        codecs[name] = (encode, decode)
        decode(encode())  # untimed first call: caches and allocations outside the clock
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
    chunked = zstd_per_chunk(raw, args.chunk_rows, args.chunk_layers)
    measure("zstd-3 per inner chunk", chunked["encode"], chunked["decode"], chunked["size"])
    for name, transform in (
        ("routelog", "ranked_gaps"),
        ("routelog v1 (sorted_gaps)", "sorted_gaps"),
        ("routelog --topk-order score", "none"),
    ):
        codec = routelog_codec(raw, num_experts, args.chunk_rows, args.chunk_layers, transform)
        measure(name, codec["encode"], codec["decode"], codec["size"])
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
        row_bytes = layers * topk * raw.itemsize
        column = pa.FixedSizeBinaryArray.from_buffers(pa.binary(row_bytes), tokens, [None, pa.py_buffer(raw)])
        sink = io.BytesIO()
        pq.write_table(
            pa.table({"routing": column}), sink, compression="zstd", compression_level=3, use_dictionary=False
        )
        return sink.getvalue()

    def parquet_decode(data: bytes) -> np.ndarray:
        column = pq.read_table(io.BytesIO(data)).column("routing").combine_chunks()
        return np.frombuffer(column.buffers()[1], dtype=raw.dtype).reshape(raw.shape)

    measure("Parquet FSB zstd-3", parquet_encode, parquet_decode, len)

    bound = entropy_bound_bytes(num_experts, topk)
    estimate = entropy_estimate(raw, num_experts)
    speed = paired_speed(codecs, ("routelog", "zstd-3 raw uint8", "zstd-3 per inner chunk"), args)
    ours = results["routelog"]
    return {
        "shape": {"tokens": tokens, "layers": layers, "experts": num_experts, "topk": topk},
        "entropy_bound_bytes_per_token_layer": bound,
        "gap_huffman_floor_bytes_per_token_layer": gap_huffman_floor(num_experts, topk),
        "entropy_estimate_bytes_per_token_layer": estimate,
        "results": results,
        "ratios": {
            "routelog_size_vs_bound": ours["bytes_per_token_layer"] / bound,
            "routelog_size_vs_estimate": ours["bytes_per_token_layer"] / estimate,
            "v1_size_vs_v2": results["routelog v1 (sorted_gaps)"]["bytes_per_token_layer"]
            / ours["bytes_per_token_layer"],
            **{name: rounds["median"] for name, rounds in speed.items()},
            "score_order_size_vs_sorted": results["routelog --topk-order score"]["bytes_per_token_layer"]
            / ours["bytes_per_token_layer"],
        },
        "paired_speed": speed,
    }


SPEED_RATIOS = {
    "routelog_encode_vs_zstd3": ("encode", "zstd-3 raw uint8"),
    "routelog_decode_vs_zstd3": ("decode", "zstd-3 raw uint8"),
    "routelog_encode_vs_zstd3_per_chunk": ("encode", "zstd-3 per inner chunk"),
    "routelog_decode_vs_zstd3_per_chunk": ("decode", "zstd-3 per inner chunk"),
}


def paired_speed(
    codecs: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]], names: tuple[str, ...], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """The speed ratios of routelog (``names[0]``) to each zstd-3 reference, paired: ``--rounds`` rounds, each
    timing every layout (best of ``--repeats``) back to back, in an order that reverses every round, and taking
    the ratios of that round. This host's speed drifts by 10 to 30 % between moments; timed seconds apart, in
    the same round, the layouts see the same host. Reports the median round and the range."""
    times: dict[str, list[float]] = {name: [] for name in SPEED_RATIOS}
    for round_ in range(args.rounds):
        seconds: dict[tuple[str, str], float] = {}
        for name in names if round_ % 2 == 0 else names[::-1]:
            encode, decode = codecs[name]
            seconds[name, "encode"], encoded = best_time(encode, args.repeats)
            seconds[name, "decode"], _ = best_time(functools.partial(decode, encoded), args.repeats)
        for ratio, (direction, reference) in SPEED_RATIOS.items():
            times[ratio].append(seconds[reference, direction] / seconds[names[0], direction])
    return {
        ratio: {"median": float(np.median(values)), "min": min(values), "max": max(values), "rounds": values}
        for ratio, values in times.items()
    }


def corpus_routing(url: str) -> tuple[np.ndarray, int]:
    """Every computed row of every record of every step of a store, in record order: ``[rows, L, K]``."""
    store = routelog.open_store(url)
    blocks = []
    for step in store.steps():
        snapshot = store.step(step)
        for got in snapshot.read_many(snapshot.sample_ids):
            blocks.append(got.expert_ids[got.valid])
    spec = store.model_spec
    return np.concatenate(blocks).astype(spec.id_dtype), spec.num_experts


def writer_sizes(url: str) -> tuple[dict[str, float], str]:
    """The corpus written again by routelog's writer, as format 1 (``sorted_gaps``, no sharing) and format 2 (the
    default: codec and shared prefixes): routing bytes per routed token-layer, the figure ``inspect`` prints; and
    the format-2 store's URL (in memory)."""
    store = routelog.open_store(url)
    sizes = {}
    target = ""
    for name, options in (
        ("format 1 writer", PartOptions(transform="sorted_gaps", dedup="off")),
        ("format 2 writer", PartOptions()),
    ):
        target = f"memory://bench-codec-writer/{uuid.uuid4().hex}"
        for step in store.steps():
            snapshot = store.step(step)
            with routelog.open_writer(target, step, model_spec=store.model_spec, options=options) as writer:
                for got in snapshot.read_many(snapshot.sample_ids):
                    writer.append(got.to_record())
        sizes[name] = routelog.open_store(target).summary()["bytes_per_token_layer"]
    sizes["v1_size_vs_v2"] = sizes["format 1 writer"] / sizes["format 2 writer"]
    return sizes, target


def stored_routing(url: str) -> np.ndarray:
    """The rows a store's parts hold, part after part: each shared prefix once, so what routelog's codec encodes
    for that store (read through zarr and the registered codec), as ``[rows, L, K]``."""
    store = routelog.open_store(url)
    blocks = [
        np.asarray(snapshot.open_zarr(commit.part)[:])
        for snapshot in map(store.step, store.steps())
        for commit in snapshot.commits
    ]
    return np.concatenate(blocks, axis=1).transpose(1, 0, 2)


ARCHIVE_TRANSFORMS: tuple[Transform, ...] = ("ranked_context", "ranked_gaps")
"""The codecs the archive comparison writes the records with: issue #33's (judged) and format 2 (the default)."""


def archive(steps: list[list[Record]], spec: ModelSpec, repeats: int = 1) -> dict[str, Any]:
    """Issue #33's comparison: the records written by routelog's writer (a step per list) with each of
    :data:`ARCHIVE_TRANSFORMS`, every byte the store holds on disk, against the simplest archive a user would make of
    them: the whole raw routing array (every routed row in record order, uint8 or uint16 as the engine gave it) in
    one zstd-19 frame (and one zstd-3 frame), plus the int32 token ids in one zstd-19 frame. Bytes per routed
    token-layer throughout; beside them, each store's write and read speed (raw uint8 routing MB/s: the writer from
    the first append to its close, every record read back in a fresh process-like snapshot), the best of
    ``repeats`` fresh stores each, after one untimed write and read of each codec (the first pass of a process
    loads the writer's and reader's modules: timed, it went to whichever codec ran first)."""
    baseline = zstd19_baseline([r for records in steps for r in records], spec)
    token_layers = int(baseline["token_layers"] or 0)
    token_ids = baseline["zstd19_token_ids_bytes"]
    result: dict[str, Any] = {
        "token_layers": token_layers,
        "zstd19_whole_routing": (baseline["zstd19_routing_bytes"] or 0) / token_layers,
        "zstd3_whole_routing": (baseline["zstd3_routing_bytes"] or 0) / token_layers,
        "zstd19_token_ids": None if token_ids is None else token_ids / token_layers,
    }
    simple = result["zstd19_whole_routing"] + (result["zstd19_token_ids"] or 0.0)
    raw_mb = token_layers * spec.topk / 1e6
    for transform in ARCHIVE_TRANSFORMS:  # untimed: each codec's first write and read load their modules
        _archive_read(_archive_write(steps, spec, transform)[1])
    for transform in ARCHIVE_TRANSFORMS:
        written, url = min(_archive_write(steps, spec, transform) for _ in range(max(1, repeats)))
        read = min(_archive_read(url) for _ in range(max(1, repeats)))
        store = routelog.open_store(url)
        storage = store.storage
        codec_mb, encoded, decoded = codec_alone(store, repeats)
        sizes = {path: int(info["size"]) for path, info in storage.fs.find(storage.root, detail=True).items()}
        every_byte = sum(sizes.values()) / token_layers
        routing = sum(v for k, v in sizes.items() if f"/{keys.ROUTING}/" in k) / token_layers
        result[transform] = {
            "store": url,
            "store_every_byte": every_byte,
            "store_routing": routing,
            "store_routing_vs_zstd19_whole": routing / result["zstd19_whole_routing"],
            "store_every_byte_vs_zstd19_routing_and_tokens": every_byte / simple,
            "write_MBps": raw_mb / written,
            "read_MBps": raw_mb / read,
            "codec_alone_MB": codec_mb,
            "codec_alone_encode_MBps": codec_mb / encoded,
            "codec_alone_decode_MBps": codec_mb / decoded,
        }
    return result


def codec_alone(store: Store, repeats: int) -> tuple[float, float, float]:
    """The codec alone on the rows a store's parts hold (each shared prefix once): raw uint8 MB, and the best of
    ``repeats`` seconds to decode them through the reader's chunk fetcher (a fresh cache each time: shard indexes,
    models, chunks) and to encode them again (:func:`~routelog.format.shard.encode_shards`, with the rows' token ids
    where the part is context-coded; checked to be the bytes the writer stored). What the store's write and read
    spend in the codec; the rest is the writer's and the reader's own work (records' checks, shared prefixes,
    indexes)."""
    parts = []
    for step in store.steps():
        for commit in store.step(step).commits:
            part_key = keys.part_dir(step, commit.part)
            table = pq.read_table(io.BytesIO(store.storage.read(f"{part_key}/{keys.INDEX}")))
            parts.append((part_key, commit, part_row_tokens(table, commit.routing.n_rows)))
    level = PartOptions().zstd_level

    def decode() -> list[np.ndarray]:
        blocks = []
        for part_key, commit, tokens in parts:
            request = BlockRequest.of(part_key, commit, (0, commit.routing.num_moe_layers), (0, commit.routing.n_rows))
            blocks += fetch_blocks(store.storage, [request], row_tokens=lambda _, t=tokens: t)
        return blocks

    rows = decode()  # untimed: the first pass loads what it needs

    def encode() -> list[dict[str, Any]]:
        encoded = []
        for (_, commit, tokens), block in zip(parts, rows, strict=True):
            layout = shard_layout(commit.routing)
            context_tokens = tokens.window(0, block.shape[1]) if layout.context else None
            encoded.append(encode_shards(block, layout, level, tokens=context_tokens))
        return encoded

    for (part_key, commit, _), shards in zip(parts, encode(), strict=True):
        for key, shard in shards.items():
            if bytes(shard) != store.storage.read(f"{part_key}/{commit.routing.path}/{key}"):
                raise RuntimeError(f"{part_key}: the codec encodes other bytes than the writer stored ({key})")
    return (
        sum(block.nbytes for block in rows) / 1e6,
        best_time(encode, repeats)[0],
        best_time(decode, repeats)[0],
    )


def _archive_write(steps: list[list[Record]], spec: ModelSpec, transform: Transform) -> tuple[float, str]:
    """Seconds to write the records into a fresh in-memory store with ``transform`` (a step per list), and its URL."""
    url = f"memory://bench-codec-archive/{uuid.uuid4().hex}"
    start = time.perf_counter()
    for step, records in enumerate(steps):
        with routelog.open_writer(url, step, model_spec=spec, options=PartOptions(transform=transform)) as writer:
            for record in records:
                writer.append(record)
    return time.perf_counter() - start, url


def _archive_read(url: str) -> float:
    """Seconds to read every record of every step of the store at ``url`` (opened afresh, untimed)."""
    store = routelog.open_store(url)
    start = time.perf_counter()
    for step in store.steps():
        snapshot = store.step(step)
        snapshot.read_many(snapshot.sample_ids)
    return time.perf_counter() - start


def uniform_records(rng: np.random.Generator, tokens: int, spec: ModelSpec, record_tokens: int = 1024) -> list[Record]:
    """Records of uniform routing without token ids (what the store costs a writer that has none)."""
    records = []
    for i, start in enumerate(range(0, tokens - 1, record_tokens)):
        n = min(record_tokens, tokens - start)
        routing = synth_routing(rng, n, spec, None, 0.0)
        records.append(Record(sample_id=f"uniform-{i:05d}", expert_ids=routing, prompt_len=1, response_len=n - 1))
    return records


def run(args: argparse.Namespace) -> dict[str, Any]:
    datasets: dict[str, Any] = {}
    rng = np.random.default_rng(args.seed)
    shapes = []
    for url in args.corpus:
        ids, experts = corpus_routing(url)
        datasets[f"corpus {url}"] = measure_routing(ids, experts, args)
        datasets[f"corpus {url}"]["writers"], written = writer_sizes(url)
        # The same layouts on the rows that store holds: the codec's real input, without the copies of shared
        # prefixes that record order repeats (zstd's matches find those, and its speed there is a match copy's).
        datasets[f"corpus {url} as stored"] = measure_routing(stored_routing(written), experts, args)
        shapes.append((ids.shape, experts))
    if not args.corpus:
        spec = synthetic_spec(args.layers, args.experts, args.topk)
        popularity = (
            [rng.dirichlet(np.full(args.experts, 1.0 / args.skew)) for _ in range(args.layers)]
            if args.skew > 0
            else None
        )
        ids = synth_routing(rng, args.tokens, spec, popularity, args.locality)
        datasets[f"synthetic skew {args.skew} locality {args.locality}"] = measure_routing(ids, args.experts, args)
        shapes.append((ids.shape, args.experts))
    if args.corpus or args.skew > 0 or args.locality > 0:  # uniform routing of the same shape, in the same run
        (tokens, layers, topk), experts = shapes[0]
        uniform = synth_routing(rng, tokens, synthetic_spec(layers, experts, topk), None, 0.0)
        datasets["uniform"] = measure_routing(uniform, experts, args)
    if args.corpus:  # and of the shape the goals were set at (--tokens/--layers/--experts/--topk)
        spec = synthetic_spec(args.layers, args.experts, args.topk)
        uniform = synth_routing(rng, args.tokens, spec, None, 0.0)
        name = f"uniform {args.layers} layers, top-{args.topk} of {args.experts}"
        datasets[name] = measure_routing(uniform, args.experts, args)
    archives = {}
    for url in args.corpus:
        archives[f"corpus {url}"] = archive(*corpus_steps(url), repeats=args.repeats)
    spec = synthetic_spec(args.layers, args.experts, args.topk)
    for vocab in (150_000, 260):
        name = (
            f"token-dependent, {vocab:,}-token Zipf vocabulary, {args.layers} layers, top-{args.topk} of {args.experts}"
        )
        archives[name] = archive([token_dependent_records(rng, args.tokens, spec, vocab)], spec, args.repeats)
    archives[f"uniform {args.layers} layers, top-{args.topk} of {args.experts}, no token ids"] = archive(
        [uniform_records(rng, args.tokens, spec)], spec, args.repeats
    )
    return {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "datasets": datasets,
        "archive": archives,
        "goals": {**GOALS, "archive": ARCHIVE_GOALS, "archive_speed": ARCHIVE_SPEED_GOALS},
        "verdict": verdict(datasets) + archive_verdict(archives),
    }


GOALS = {
    "corpus_v1_size_vs_v2_min": 1.3,
    "corpus_size_vs_estimate_max": 1.1,
    "uniform_size_vs_bound_max": 1.05,
    "encode_vs_zstd3_min": 0.5,
    "decode_vs_zstd3_min": 0.7,
}
"""Issue #14's targets. Uniform routing: no worse than format 1, which stores it within 1.05 x the bound at the shape
the goal was set at (E = 128, K = 8: the defaults of --experts and --topk)."""

ARCHIVE_GOALS = {
    "store_routing_vs_zstd19_whole_max": 1.0,
    "store_every_byte_vs_zstd19_routing_and_tokens_max": 1.0,
    "token_dependent_every_byte_max": 3.0,
}
"""Issue #33's targets (format 2 meets none of them): on the corpora, the store's routing no larger than zstd-19 of
the whole raw routing array in one frame; every byte of the store no larger than that plus zstd-19 of the int32
token ids (on the corpora and the token-dependent sets); the token-dependent sets at most 3.0 bytes per token-layer,
every byte counted."""

ARCHIVE_SPEED_GOALS = {"write_MBps_min": 40.0, "read_MBps_min": 150.0}
"""Issue #55's targets (part 3) for the archive codec on the corpora: raw uint8 routing MB/s through the writer
(encode) and the reader (decode), as :func:`archive` measures them; beside them format 2's of the same run, and both
codecs alone (:func:`codec_alone`)."""


def archive_verdict(archives: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue #33's goals on each archive comparison they apply to (:func:`archive`), in :func:`verdict`'s rows."""
    rows = []
    for name, data in archives.items():
        judged, beside = data[ARCHIVE_TRANSFORMS[0]], data[ARCHIVE_TRANSFORMS[1]]
        checks = []
        if name.startswith("corpus"):
            checks.append(("size / zstd-19 whole, routing", "store_routing_vs_zstd19_whole"))
        if data["zstd19_token_ids"] is not None:
            checks.append(("size / zstd-19 whole, every byte", "store_every_byte_vs_zstd19_routing_and_tokens"))
        if name.startswith("token-dependent"):
            checks.append(("size (B / token-layer), every byte", "store_every_byte"))
        for goal, key in checks:
            limit = ARCHIVE_GOALS[f"{key}_max" if key != "store_every_byte" else "token_dependent_every_byte_max"]
            rows.append(goal_row(goal, name, judged[key], "<=", limit, True, {"ranked_gaps": beside[key]}))
        if name.startswith("corpus"):
            for direction, key in (("encode", "write_MBps"), ("decode", "read_MBps")):
                alone = f"codec_alone_{direction}_MBps"
                figures = {
                    "ranked_gaps": beside[key],
                    "codec_alone": judged[alone],
                    "codec_alone_ranked_gaps": beside[alone],
                }
                goal = f"{direction} MB/s (store {key.split('_')[0]})"
                rows.append(goal_row(goal, name, judged[key], ">=", ARCHIVE_SPEED_GOALS[f"{key}_min"], True, figures))
    return rows


def goal_row(
    goal: str, dataset: str, value: float, relation: str, limit: float, judged: bool, beside: dict[str, Any]
) -> dict[str, Any]:
    """One row of the verdict: a goal's figure on a dataset, its limit, whether it is met (and figures beside)."""
    met = value <= limit if relation == "<=" else value >= limit
    row = {"goal": goal, "dataset": dataset, "value": value, "relation": relation, "limit": limit}
    return {**row, "judged": judged, "met": met, **beside}


def verdict(datasets: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal on each dataset it applies to: the figure, the limit and whether it is met (``judged`` false: a
    figure given for information).

    Speed is judged against zstd-3 on the same inner chunks: zstd alone in a store a loader can read a micro-batch
    from (format 1's codec, or a plain zarr array of the IDs with a zstd codec) compresses each chunk as one frame.
    One frame over the whole array is given beside it (``whole_array``), not judged: no reader can take a
    micro-batch from it without decoding everything, and its lead on the corpus comes from matches across chunks
    (GRPO prompts in record order, sets recurring thousands of rows apart), which grow with the context a frame
    sees, not from a cheaper coder (with ``--chunk-rows 16384`` routelog gains on it too).

    The uniform size bound is judged at the shape the goal was set at; at another shape (the corpus') it is given
    with format 1's figure and the floor of the gap transform under a byte-wise Huffman code
    (:func:`gap_huffman_floor`), which both formats store uniform layers with."""
    rows: list[dict[str, Any]] = []

    def check(goal: str, dataset: str, value: float, limit: float, judged: bool = True, **beside: Any) -> None:
        rows.append(goal_row(goal, dataset, value, "<=" if goal.startswith("size /") else ">=", limit, judged, beside))

    goal_shape = [name for name in datasets if name.startswith("uniform ")]
    for name, data in datasets.items():
        ratios = data["ratios"]
        if "writers" in data:
            value = data["writers"]["v1_size_vs_v2"]
            check("format 1 size / format 2 size, written", name, value, GOALS["corpus_v1_size_vs_v2_min"])
        if name.startswith("corpus"):
            value = ratios["routelog_size_vs_estimate"]
            check("size / entropy estimate", name, value, GOALS["corpus_size_vs_estimate_max"])
        if name.startswith("uniform"):
            bound = data["entropy_bound_bytes_per_token_layer"]
            floor = data["gap_huffman_floor_bytes_per_token_layer"]
            check(
                "size / bound",
                name,
                ratios["routelog_size_vs_bound"],
                GOALS["uniform_size_vs_bound_max"],
                judged=name in goal_shape or not goal_shape,
                format_1=data["results"]["routelog v1 (sorted_gaps)"]["bytes_per_token_layer"] / bound,
                gap_huffman_floor=None if floor is None else floor / bound,
            )
        for direction in ("encode", "decode"):
            check(
                f"{direction} speed / zstd-3 per inner chunk",
                name,
                ratios[f"routelog_{direction}_vs_zstd3_per_chunk"],
                GOALS[f"{direction}_vs_zstd3_min"],
                whole_array=ratios[f"routelog_{direction}_vs_zstd3"],
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (smoke test)")
    parser.add_argument("--corpus", nargs="*", default=[], help="routelog store(s) whose routing to measure")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--skew", type=float, default=0.0)
    parser.add_argument("--locality", type=float, default=0.0)
    parser.add_argument("--chunk-rows", type=int, default=PartOptions.chunk_rows)
    parser.add_argument("--chunk-layers", type=int, default=PartOptions.chunk_layers)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=7, help="paired rounds for the speed ratios")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.layers, args.repeats, args.rounds = 2048, 8, 1, 1
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for name, data in report["datasets"].items():
        shape = data["shape"]
        print(
            f"\n{name}: {shape['tokens']} tokens x {shape['layers']} layers, top-{shape['topk']} of {shape['experts']}"
        )
        print(f"{'layout':30s} {'B/token-layer':>14s} {'enc MB/s':>10s} {'dec MB/s':>10s}")
        print(f"{'entropy bound log2 C(E,K)':30s} {data['entropy_bound_bytes_per_token_layer']:14.3f}")
        if data["gap_huffman_floor_bytes_per_token_layer"] is not None:
            print(f"{'gaps, Huffman floor (uniform)':30s} {data['gap_huffman_floor_bytes_per_token_layer']:14.3f}")
        print(f"{'entropy estimate (see --help)':30s} {data['entropy_estimate_bytes_per_token_layer']:14.3f}")
        for layout, r in data["results"].items():
            print(f"{layout:30s} {r['bytes_per_token_layer']:14.3f} {r['encode_MBps']:10.0f} {r['decode_MBps']:10.0f}")
        for key, value in data["ratios"].items():
            rounds = data["paired_speed"].get(key)
            spread = f"  (paired rounds {rounds['min']:.3f} to {rounds['max']:.3f})" if rounds else ""
            print(f"  {key:32s} {value:.3f}{spread}")
        if "writers" in data:
            w = data["writers"]
            print(
                f"  written by routelog (bytes per routed token-layer): format 1 {w['format 1 writer']:.3f}, "
                f"format 2 (codec + shared prefixes) {w['format 2 writer']:.3f}: {w['v1_size_vs_v2']:.2f}x smaller"
            )
    print(
        "\nas an archive (bytes per routed token-layer of the store as written; raw uint8 MB/s to write and read the"
        " store, and of the codec alone on the rows its parts hold):"
    )
    print(
        f"{'':44s} {'codec':>15s} {'every byte':>10s} {'routing':>8s} {'/ zstd-19':>9s} {'write':>6s} {'read':>6s}"
        f" {'zstd-19':>8s} {'zstd-3':>7s} {'tok zstd-19':>11s} {'codec enc':>9s} {'codec dec':>9s}"
    )
    for name, a in report["archive"].items():
        tokens = "-" if a["zstd19_token_ids"] is None else f"{a['zstd19_token_ids']:.3f}"
        for transform in ARCHIVE_TRANSFORMS:
            t = a[transform]
            print(
                f"{name[:44]:44s} {transform:>15s} {t['store_every_byte']:10.3f} {t['store_routing']:8.3f}"
                f" {t['store_every_byte_vs_zstd19_routing_and_tokens']:9.2f} {t['write_MBps']:6.0f}"
                f" {t['read_MBps']:6.0f} {a['zstd19_whole_routing']:8.3f} {a['zstd3_whole_routing']:7.3f} {tokens:>11s}"
                f" {t['codec_alone_encode_MBps']:9.0f} {t['codec_alone_decode_MBps']:9.0f}"
            )
    print("\ngoals (speed against zstd-3 on the same inner chunks; one whole-array frame beside, not judged):")
    for row in report["verdict"]:
        state = ("met" if row["met"] else "NOT MET") if row["judged"] else "(info)"
        beside = ""
        if "whole_array" in row:
            beside = f"  (whole array {row['whole_array']:.3f})"
        elif "format_1" in row:
            floor = row["gap_huffman_floor"]
            beside = f"  (format 1 {row['format_1']:.3f}" + (
                "" if floor is None else f", gap Huffman floor {floor:.4f}"
            )
            beside += ")"
        if "ranked_gaps" in row:
            beside = f"  (ranked_gaps {row['ranked_gaps']:.3f})"
        if "codec_alone" in row:
            beside += f"  (codec alone {row['codec_alone']:.1f}, ranked_gaps' {row['codec_alone_ranked_gaps']:.1f})"
        print(
            f"  {state:8s} {row['goal']:40s} {row['value']:6.3f} {row['relation']} {row['limit']:<4} "
            f"{row['dataset']}{beside}"
        )


if __name__ == "__main__":
    main()
