"""What a model shared by a part's chunks could save (issue #33): candidate models measured on the rows stores hold.

Format 2 codes each 4096-row chunk alone and never looks at the token ids stored beside the routing. Issue #33 asks
for a model shared by a part's chunks and read once with it. Before such a model enters the format, this tool
measures candidates on the rows a format-2 store holds (each shared prefix once), every byte of the model counted,
in bytes per routed token-layer of the records (the unit of ``tools/bench_codec.py``'s archive comparison):

* ``format 2``: the chunk codec alone, layer-major chunks of 4096 rows x 4 layers (what the store holds today);
* ``token table``: per layer, each token id seen at least twice with the same set gets that set as its entry; a row
  equal to its token's entry costs a hit bit (the layer's bitmap in one zstd-19 frame), the other rows go through
  the format-2 codec, and the table (token ids as deltas, sets through the codec) is counted;
* ``token pair table``: the same, keyed by the token and the one before it in its record;
* ``zstd-19 per part``: each part's rows token-major (a token's sets in every layer together) in one zstd-19 frame,
  what long matches find when a frame sees the whole part (no micro-batch can be read without decoding it all);
* ``zstd-19 per chunk, trained dictionary``: token-major chunks of 4096 rows, each a zstd-19 frame with a 32 KiB
  dictionary trained on the part (the dictionary counted): a chunk decodes alone given the part's dictionary;
* ``context model``: an ideal arithmetic coder's cost (the sum of -log2 P, nothing stored) of an adaptive model of
  each layer's set given the token id, or the token id and the set of the layer below (PPM's method C: a context's
  own counts, escaping to the layer's set counts, escaping to a fresh set, whose experts cost what the layer's
  adaptive expert counts give them, less log2 K! for their order), over each part in row order (no chunk then
  decodes alone) or restarting every 4096 rows (each chunk alone, no part model), or restarting so from a prior
  the part stores (its token table, or its counts of sets per layer and per token; counted: each chunk alone given
  the part's model, what issue #33 asks for);
* ``recent sets per token``: a design that decodes at zstd's speed, where the context model needs an arithmetic
  decoder: each row is its set's place in its token's list of recent sets (or in its layer's), in bytes through
  zstd-3 per chunk (:func:`recency_ranks_bytes`), without and with the part's counts as prior;
* ``ranked_context``: what became of these, the codec routelog stores (:mod:`routelog.format.context`), in its real
  bytes: chunks and model, as a writer encodes them (:func:`context_codec_bytes`).

Beside them, issue #33's goal: zstd-19 of the whole raw routing array of every record in one frame.

    python tools/explore_part_models.py [--json] [--quick] [--corpus STORE ...]
"""

from __future__ import annotations

import argparse
import json
import math
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import zstandard
from benchlib import corpus_steps, routed_rows, token_dependent_records

import routelog
from routelog import Record
from routelog.format import context, ranked
from routelog.format.spec import ModelSpec
from routelog.synth import synthetic_spec

CHUNK_ROWS = 4096
CHUNK_LAYERS = 4
DICTIONARY_BYTES = 32 << 10
PRIOR_MODEL = "context model (token), per 4096-row chunk, the part's token table as prior"
COUNT_PRIOR_MODEL = "context model (token), per 4096-row chunk, the part's counts as prior"
RECENCY = "recent sets per token, zstd-3 per 4096-row chunk"
RECENCY_PRIOR = "recent sets per token, zstd-3 per 4096-row chunk, the part's counts as prior"
CODEC = "ranked_context: the codec routelog stores, its model included"
CANDIDATES = (
    "format 2",
    "token table",
    "token pair table",
    "zstd-19 per part",
    "zstd-19 per chunk, trained dictionary",
    "context model (token), per part",
    "context model (token), per 4096-row chunk",
    "context model (token, layer below), per part",
    "context model (token, layer below), per 4096-row chunk",
    PRIOR_MODEL,
    COUNT_PRIOR_MODEL,
    RECENCY,
    RECENCY_PRIOR,
    CODEC,
)
"""Every model the tool measures, by the name its report gives it."""


def set_items(rows: np.ndarray) -> np.ndarray:
    """Token-major rows ``[n, layers, K]`` as ``[n, layers]`` items, one per set (compared and hashed whole)."""
    n, layers, k = rows.shape
    return np.ascontiguousarray(rows).view(np.dtype((np.void, k * rows.dtype.itemsize))).reshape(n, layers)


def codec_bytes(rows: np.ndarray, num_experts: int) -> int:
    """The format-2 chunk codec's bytes for sorted rows ``[layers, n, K]`` in chunks of 4096 rows x 4 layers."""
    layers, n, _ = rows.shape
    return sum(
        len(ranked.encode(np.ascontiguousarray(rows[l0 : l0 + CHUNK_LAYERS, r0 : r0 + CHUNK_ROWS]), num_experts))
        for l0 in range(0, layers, CHUNK_LAYERS)
        for r0 in range(0, n, CHUNK_ROWS)
    )


def zstd19(data: bytes) -> int:
    return len(zstandard.ZstdCompressor(level=19).compress(data))


def token_table(keys: np.ndarray, rows: np.ndarray, layer: int, num_experts: int) -> tuple[np.ndarray, np.ndarray, int]:
    """One layer's table for token-major sorted rows ``[n, layers, K]``: each key seen at least twice with one set
    gets its most used set. Returns the keys (ascending), a row holding each entry's set, and the table's bytes
    (the keys as deltas in a zstd-19 frame, the sets through the format-2 codec)."""
    items = set_items(rows)[:, layer]
    _, first_row, set_index = np.unique(items, return_index=True, return_inverse=True)
    pairs, uses = np.unique(np.stack([keys, set_index.reshape(-1)], axis=1), axis=0, return_counts=True)
    order = np.lexsort((-uses, pairs[:, 0]))  # per key, its most used set first
    pairs, uses = pairs[order], uses[order]
    entries = np.r_[True, pairs[1:, 0] != pairs[:-1, 0]] & (uses >= 2)
    entry_keys, entry_rows = pairs[entries, 0], first_row[pairs[entries, 1]]
    if not entry_keys.size:
        return entry_keys, entry_rows, 0
    size = zstd19(np.diff(entry_keys, prepend=0).astype("<u8").tobytes())
    return entry_keys, entry_rows, size + codec_bytes(rows[entry_rows, layer][None], num_experts)


def table_model(keys: np.ndarray, rows: np.ndarray, num_experts: int) -> dict[str, float]:
    """Bytes of the keyed table model for token-major sorted rows ``[n, layers, K]`` (see the module): the table,
    the hit bitmaps, the other rows; and how many rows the table predicts."""
    n, layers, _ = rows.shape
    table = flags = misses = hits = 0
    for layer in range(layers):
        entry_keys, entry_rows, size = token_table(keys, rows, layer, num_experts)
        table += size
        hit = np.zeros(n, bool)
        if entry_keys.size:
            at = np.minimum(np.searchsorted(entry_keys, keys), entry_keys.size - 1)
            hit = (entry_keys[at] == keys) & (rows[entry_rows[at], layer] == rows[:, layer]).all(axis=1)
        hits += int(hit.sum())
        flags += zstd19(np.packbits(hit).tobytes())
        if (~hit).any():
            misses += codec_bytes(np.ascontiguousarray(rows[~hit, layer])[None], num_experts)
    return {"bytes": table + flags + misses, "table": table, "flags": flags, "misses": misses, "hits": hits}


def trained_chunks(rows: np.ndarray) -> int:
    """Token-major chunks of 4096 rows, each a zstd-19 frame with a dictionary trained on the part, plus the
    dictionary itself in a zstd-19 frame."""
    data = np.ascontiguousarray(rows)
    chunks = [data[r0 : r0 + CHUNK_ROWS].tobytes() for r0 in range(0, len(data), CHUNK_ROWS)]
    samples = [data[r0 : r0 + 256].tobytes() for r0 in range(0, len(data), 256)]
    try:
        dictionary = zstandard.train_dictionary(DICTIONARY_BYTES, samples, level=19)
    except zstandard.ZstdError:  # too few samples to train on: chunks without a dictionary
        return sum(zstd19(chunk) for chunk in chunks)
    compressor = zstandard.ZstdCompressor(level=19, dict_data=dictionary)
    return sum(len(compressor.compress(chunk)) for chunk in chunks) + zstd19(dictionary.as_bytes())


def context_model_bits(
    rows: np.ndarray,
    tokens: np.ndarray,
    num_experts: int,
    restart: int | None,
    layer_below: bool,
    prior: list[dict[Any, dict[bytes, int]]] | None = None,
) -> float:
    """The context model's cost in bits for token-major sorted rows ``[n, layers, K]`` (see the module), its
    counts restarting every ``restart`` rows (``None``: never); the context is the token id, and the set of the
    layer below where ``layer_below``. ``prior`` (per layer: token id -> set -> uses, and under ``None`` the
    layer's set -> uses) seeds the counts at each restart."""
    n, layers, k = rows.shape
    order_bits = math.log2(math.factorial(k))
    keys = [[bytes(item) for item in row] for row in set_items(rows)]
    bits = 0.0
    for layer in range(layers):
        counts: dict[Any, dict[bytes, int]] = {}  # context -> set -> uses; the layer's own counts under None
        totals: dict[Any, int] = {}
        experts = np.zeros(num_experts)
        for i in range(n):
            if i == 0 or (restart and i % restart == 0):
                counts, totals, experts = {}, {}, np.zeros(num_experts)
                for key, seeded in (prior[layer] if prior else {}).items():
                    level = None if key is None else (key, b"")
                    counts[level], totals[level] = dict(seeded), sum(seeded.values())
            item = keys[i][layer]
            context = (int(tokens[i]), keys[i][layer - 1] if layer_below and layer else b"")
            for level in (context, None):  # the context, then the layer's counts; then a fresh set
                seen = counts.setdefault(level, {})
                total, kinds = totals.get(level, 0), len(seen)
                found = seen.get(item, 0)
                seen[item] = found + 1
                totals[level] = total + 1
                if found:
                    bits -= math.log2(found / (total + kinds))
                    break
                if total:
                    bits -= math.log2(kinds / (total + kinds))
            else:
                chosen = rows[i, layer].astype(np.int64)
                p = (experts[chosen] + 0.5) / (experts.sum() + 0.5 * num_experts)
                bits += float(-np.log2(p).sum()) - order_bits
                experts[chosen] += 1
    return bits


def table_prior(
    tokens: np.ndarray, rows: np.ndarray, num_experts: int
) -> tuple[list[dict[Any, dict[bytes, int]]], int]:
    """A prior from the part's token tables (:func:`token_table`): one use of each token's set; and its bytes."""
    prior, size = [], 0
    for layer in range(rows.shape[1]):
        entry_keys, entry_rows, table_bytes = token_table(tokens, rows, layer, num_experts)
        prior.append(
            {int(key): {rows[row, layer].tobytes(): 1} for key, row in zip(entry_keys, entry_rows, strict=True)}
        )
        size += table_bytes
    return prior, size


def count_prior(
    tokens: np.ndarray, rows: np.ndarray, num_experts: int, cap: int = 15
) -> tuple[list[dict[Any, dict[bytes, int]]], int]:
    """A prior from the part's counts: per layer, every set used at least twice (with its uses, at most ``cap``)
    and, per token id, every such set it took at least twice; and its bytes: the layer's sets once through the
    format-2 codec, their counts, and each token's entries (token deltas, set numbers, counts) in zstd-19 frames."""
    prior, size = [], 0
    items = set_items(rows)
    for layer in range(rows.shape[1]):
        _, first_row, set_index = np.unique(items[:, layer], return_index=True, return_inverse=True)
        set_index = set_index.reshape(-1)
        uses = np.bincount(set_index)
        kept = np.flatnonzero(uses >= 2)
        number = np.full(uses.size, -1)
        number[kept] = np.arange(kept.size)
        seeded: dict[Any, dict[bytes, int]] = {
            None: {rows[first_row[s], layer].tobytes(): int(min(uses[s], cap)) for s in kept}
        }
        pairs, pair_uses = np.unique(np.stack([tokens, set_index], axis=1), axis=0, return_counts=True)
        pairs, pair_uses = (
            pairs[(pair_uses >= 2) & (number[pairs[:, 1]] >= 0)],
            pair_uses[(pair_uses >= 2) & (number[pairs[:, 1]] >= 0)],
        )
        for (token, s), count in zip(pairs, pair_uses, strict=True):
            seeded.setdefault(int(token), {})[rows[first_row[s], layer].tobytes()] = int(min(count, cap))
        prior.append(seeded)
        if kept.size:
            size += codec_bytes(rows[first_row[kept], layer][None], num_experts)
            size += zstd19(np.minimum(uses[kept], cap).astype(np.uint8).tobytes())
        if pairs.size:
            size += zstd19(np.diff(pairs[:, 0], prepend=0).astype("<u8").tobytes())
            size += zstd19(number[pairs[:, 1]].astype("<u2").tobytes())
            size += zstd19(np.minimum(pair_uses, cap).astype(np.uint8).tobytes())
    return prior, size


def recency_ranks_bytes(
    rows: np.ndarray, tokens: np.ndarray, num_experts: int, prior: list[dict[Any, dict[bytes, int]]] | None
) -> int:
    """A design that decodes at zstd's speed: per 4096-row chunk and layer, each token id keeps its sets most recent
    first (at most 15; seeded from ``prior`` most used first), and a row is stored as its set's place in its
    token's list, or an escape and its place in the layer's list (at most 1024), or an escape and the set itself;
    the places are bytes in zstd-3 frames, new sets go through the format-2 codec."""
    n, layers, _ = rows.shape
    size = 0
    for r0 in range(0, n, CHUNK_ROWS):
        for layer in range(layers):
            seeded = prior[layer] if prior else {}
            ranked_sets = {key: sorted(sets, key=lambda s, sets=sets: -sets[s]) for key, sets in seeded.items()}
            recent = {key: sets[:15] for key, sets in ranked_sets.items() if key is not None}
            layer_recent = ranked_sets.get(None, [])[:1024]
            places, layer_places, new = bytearray(), bytearray(), []
            for i in range(r0, min(n, r0 + CHUNK_ROWS)):
                item, mine = rows[i, layer].tobytes(), recent.setdefault(int(tokens[i]), [])
                if item in mine:
                    places.append(mine.index(item))
                    mine.remove(item)
                else:
                    places.append(255)
                    if item in layer_recent:
                        layer_places.append(min(layer_recent.index(item), 254))
                        layer_recent.remove(item)
                    else:
                        layer_places.append(255)
                        new.append(rows[i, layer])
                    layer_recent.insert(0, item)
                    del layer_recent[1024:]
                mine.insert(0, item)
                del mine[15:]
            compressor = zstandard.ZstdCompressor(level=3)
            size += len(compressor.compress(bytes(places))) + len(compressor.compress(bytes(layer_places)))
            if new:
                size += codec_bytes(np.stack(new)[None], num_experts)
    return size


def context_codec_bytes(rows: np.ndarray, tokens: np.ndarray, num_experts: int) -> int:
    """What ``ranked_context`` (:mod:`routelog.format.context`) stores for token-major rows ``[n, layers, K]``:
    its chunks of 4096 rows x 4 layers and the part's model, as a writer encodes them."""
    by_layer = np.ascontiguousarray(rows.transpose(1, 0, 2))
    layers, n, _ = by_layer.shape
    size, models = 0, []
    for l0 in range(0, layers, CHUNK_LAYERS):
        plan = context.plan_layers(by_layer[l0 : l0 + CHUNK_LAYERS], tokens, CHUNK_ROWS)
        models += plan.models
        for c, r0 in enumerate(range(0, n, CHUNK_ROWS)):
            block = by_layer[l0 : l0 + CHUNK_LAYERS, r0 : r0 + CHUNK_ROWS]
            size += sum(map(len, context.chunk_pieces(plan, c, block, num_experts)))
    return size + len(context.encode_model(models, num_experts))


def stored_parts(url: str) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each part of a store: its rows token-major ``[n, layers, K]``, each row's token id, and the token id before
    it in its record (-1 at a record's start), from the records' spans in the part."""
    store = routelog.open_store(url)
    for snapshot in map(store.step, store.steps()):
        records = snapshot.index.select(["token_ids", "spans"]).to_pylist()
        for commit in snapshot.commits:
            rows = np.asarray(snapshot.open_zarr(commit.part)[:]).transpose(1, 0, 2)
            tokens = np.full(len(rows), -1, np.int64)
            before = np.full(len(rows), -1, np.int64)
            for record in records:
                ids = np.asarray(record["token_ids"], np.int64)
                for span in record["spans"]:
                    if span["part"] not in (None, commit.part):
                        continue
                    start, count, row = span["token_start"], span["n_rows"], span["row"]
                    tokens[row : row + count] = ids[start : start + count]
                    before[row : row + count] = np.r_[-1, ids][start : start + count]
            yield np.ascontiguousarray(rows), tokens, before


def measure(steps: list[list[Record]], spec: ModelSpec) -> dict[str, Any]:
    """Every candidate on the records written by routelog's writer (default options, a step per list)."""
    url = f"memory://explore-part-models/{uuid.uuid4().hex}"
    for step, records in enumerate(steps):
        with routelog.open_writer(url, step, model_spec=spec) as writer:
            for record in records:
                writer.append(record)
    every = [r for records in steps for r in records]
    routed = routed_rows(every)
    token_layers = routed.shape[0] * routed.shape[1]
    totals = dict.fromkeys(CANDIDATES, 0.0)
    predicted = {"token table": 0, "token pair table": 0}
    stored_token_layers = 0
    for rows, tokens, before in stored_parts(url):
        stored_token_layers += rows.shape[0] * rows.shape[1]
        totals["format 2"] += codec_bytes(np.ascontiguousarray(rows.transpose(1, 0, 2)), spec.num_experts)
        for name, keys in (("token table", tokens), ("token pair table", tokens * (1 << 32) + before + 1)):
            model = table_model(keys, rows, spec.num_experts)
            totals[name] += model["bytes"]
            predicted[name] += model["hits"]
        totals["zstd-19 per part"] += zstd19(rows.tobytes())
        totals["zstd-19 per chunk, trained dictionary"] += trained_chunks(rows)
        for below, conditioned in ((False, "token"), (True, "token, layer below")):
            for restart, scope in ((None, "per part"), (CHUNK_ROWS, "per 4096-row chunk")):
                bits = context_model_bits(rows, tokens, spec.num_experts, restart, below)
                totals[f"context model ({conditioned}), {scope}"] += bits / 8
        for name, build in ((PRIOR_MODEL, table_prior), (COUNT_PRIOR_MODEL, count_prior)):
            prior, prior_bytes = build(tokens, rows, spec.num_experts)
            bits = context_model_bits(rows, tokens, spec.num_experts, CHUNK_ROWS, False, prior)
            totals[name] += bits / 8 + prior_bytes
        counts, counts_bytes = count_prior(tokens, rows, spec.num_experts)
        totals[RECENCY] += recency_ranks_bytes(rows, tokens, spec.num_experts, None)
        totals[RECENCY_PRIOR] += recency_ranks_bytes(rows, tokens, spec.num_experts, counts) + counts_bytes
        totals[CODEC] += context_codec_bytes(rows, tokens, spec.num_experts)
    goal = zstd19(np.ascontiguousarray(routed, dtype=spec.id_dtype).tobytes())
    return {
        "token_layers": token_layers,
        "stored_token_layers": stored_token_layers,
        "goal_zstd19_whole_array": goal / token_layers,
        "bytes_per_token_layer": {name: total / token_layers for name, total in totals.items()},
        "predicted_share": {name: hits / stored_token_layers for name, hits in predicted.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small synthetic sets only (smoke test)")
    parser.add_argument("--corpus", nargs="*", default=None, help="stores (default: the two corpus fixtures)")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--preferred-share", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    corpora = args.corpus
    if corpora is None:
        corpora = [] if args.quick else ["tests/fixtures/corpus/qwen3moe", "tests/fixtures/corpus/deepseekv3"]
    if args.quick:
        args.tokens, args.layers = 3000, 4
    report: dict[str, Any] = {}
    for url in corpora:
        report[f"corpus {url}"] = measure(*corpus_steps(url))
    spec = synthetic_spec(args.layers, 128, 8)
    for vocab in (150_000, 260):
        rng = np.random.default_rng(args.seed)
        records = token_dependent_records(rng, args.tokens, spec, vocab, args.preferred_share)
        report[f"token-dependent, {vocab:,}-token Zipf vocabulary"] = measure([records], spec)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print("bytes per routed token-layer, every byte of each model counted (issue #33's goal: <= zstd-19 whole array)")
    for name, data in report.items():
        print(f"\n{name}: zstd-19 of the whole array {data['goal_zstd19_whole_array']:.3f}")
        for model, value in data["bytes_per_token_layer"].items():
            share = data["predicted_share"].get(model)
            beside = "" if share is None else f"  ({share:.0%} of the stored token-layers predicted)"
            print(f"  {model:40s} {value:.3f}{beside}")


if __name__ == "__main__":
    main()
