"""Dedup benchmark: bytes per routed token-layer of GRPO groups and multi-turn sessions, format 1 vs format 2.

The routing is real model routing from the corpus (``tests/fixtures/corpus``, made by ``tools/make_corpus.py``):
its records are cut into the shapes RL produces, then written four ways in the same run:

* format 1: ``sorted_gaps`` chunks, no sharing (zstd still finds repeats that land in one chunk);
* format 2 codec only: ``ranked_gaps`` chunks, no sharing;
* format 2, sharing within a part only (``dedup="part"``);
* format 2: ``ranked_gaps`` and shared prefixes stored once per step, across parts and writers (the default).

Each is written in two layouts: one writer committing one part, and the way a rollout fleet writes: records dealt
round-robin to 4 writers (one per inference worker, so a group's samples land on different workers), each
committing a part every 8 records.

Scenarios: GRPO groups of n = 8 and 16 samples whose prompt is a fraction 0.25, 0.5 or 0.75 of the sequence
(each sample's response is another corpus record's tail, so responses differ), and multi-turn sessions of 4 and 8
turns where every turn re-sends the whole history. Sizes count the routing arrays' bytes over the routed token
rows of the records times the MoE layers (``routelog inspect``'s bytes per token-layer).

What sharing costs the writer: each configuration's writes are timed (to a memory store, the configurations
alternating, median of ``--rounds``), and format 2's time is given over format 2 codec only's (median of the
paired ratios).

    python tools/bench_dedup.py [--json] [--quick] [--rounds 5] [--corpus tests/fixtures/corpus/qwen3moe]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np

import routelog
from routelog import ModelSpec, PartOptions, Record

DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "corpus" / "qwen3moe"
CONFIGS = {
    "format 1 (sorted_gaps)": PartOptions(transform="sorted_gaps", dedup="off"),
    "format 2 codec only": PartOptions(dedup="off"),
    "format 2 dedup in part": PartOptions(dedup="part"),
    "format 2 (codec + dedup)": PartOptions(),
}
LAYOUTS = {"1 writer": (1, 0), "4 writers": (4, 8)}
"""Writers the records are dealt to round-robin, and records per part (0: one part per writer)."""


def corpus_sequences(url: str) -> tuple[ModelSpec, list[tuple[np.ndarray, np.ndarray]]]:
    """(token ids, routing ``[n, L, K]``) of every record's routed tokens, in record order."""
    store = routelog.open_store(url)
    rng = np.random.default_rng(0)  # token ids for stores that hold none (synthetic routing)
    sequences = []
    for step in store.steps():
        snapshot = store.step(step)
        for got in snapshot.read_many(snapshot.sample_ids):
            given = got.info.token_ids
            tokens = rng.integers(0, 1 << 20, got.info.n_tokens) if given is None else np.asarray(given, np.int64)
            sequences.append((tokens[got.valid], got.expert_ids[got.valid].astype(np.int64)))
    return store.model_spec, sequences


def _record(sample_id: str, tokens: np.ndarray, routing: np.ndarray, prompt_len: int, group: str) -> Record:
    valid = np.ones(tokens.size, bool)
    valid[-1] = False  # the last sampled token is never fed
    return Record(
        sample_id=sample_id,
        expert_ids=routing,
        prompt_len=prompt_len,
        response_len=tokens.size - prompt_len,
        valid=valid,
        token_ids=tokens,
        group_id=group,
    )


def grpo(sequences: list[tuple[np.ndarray, np.ndarray]], n: int, fraction: float, groups: int) -> Iterator[Record]:
    """``groups`` groups of ``n`` samples: one sequence's first ``fraction`` is the prompt, the responses are the
    tails of the sequences that follow it."""
    count = len(sequences)
    for g in range(groups):
        tokens, routing = sequences[(g * (n + 1)) % count]
        prompt = max(1, int(fraction * tokens.size))
        for i in range(n):
            other_tokens, other_routing = sequences[(g * (n + 1) + 1 + i) % count]
            length = max(2, min(other_tokens.size, tokens.size - prompt))
            yield _record(
                f"g{g}/{i}",
                np.concatenate([tokens[:prompt], other_tokens[-length:]]),
                np.concatenate([routing[:prompt], other_routing[-length:]]),
                prompt,
                f"g{g}",
            )


def multi_turn(sequences: list[tuple[np.ndarray, np.ndarray]], turns: int, sessions: int) -> Iterator[Record]:
    """``sessions`` sessions of ``turns`` turns; turn ``t`` re-sends turns ``0..t-1`` (one corpus sequence each)."""
    count = len(sequences)
    for s in range(sessions):
        parts = [sequences[(s * turns + t) % count] for t in range(turns)]
        for t in range(turns):
            tokens = np.concatenate([p[0] for p in parts[: t + 1]])
            routing = np.concatenate([p[1] for p in parts[: t + 1]])
            yield _record(f"s{s}/t{t}", tokens, routing, tokens.size - parts[t][0].size // 2, f"s{s}")


def write(url: str, spec: ModelSpec, records: list[Record], options: PartOptions, layout: tuple[int, int]) -> None:
    """Deal ``records`` round-robin to ``layout[0]`` writers, each committing every ``layout[1]`` records."""
    n_writers, per_part = layout
    writers = [
        routelog.open_writer(url, step=0, model_spec=spec, options=options, writer_id=f"w{i}", background=False)
        for i in range(n_writers)
    ]
    for i, record in enumerate(records):
        writer = writers[i % n_writers]
        writer.append(record)
        if per_part and writer.appended % per_part == 0:
            writer.flush()
    for writer in writers:
        writer.close()


def measure(spec: ModelSpec, records: list[Record], layout: tuple[int, int], rounds: int) -> dict[str, Any]:
    """Sizes of each configuration, and its write time (median over ``rounds``, the configurations alternating)."""
    out: dict[str, Any] = {}
    seconds: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(rounds):
        for name, options in CONFIGS.items():
            url = f"memory://bench-dedup/{uuid.uuid4().hex}"
            start = time.perf_counter()
            write(url, spec, records, options, layout)
            seconds[name].append(time.perf_counter() - start)
            summary = routelog.open_store(url).summary()
            out[name] = {
                "bytes_per_token_layer": summary["bytes_per_token_layer"],
                "routed_rows": summary["routed_rows"],
                "stored_rows": summary["stored_rows"],
                "routing_bytes": summary["routing_bytes"],
            }
            # The memory filesystem is one dict for the process, scanned by some lookups: keep it small.
            fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)
    for name, times in seconds.items():
        out[name]["write_seconds"] = statistics.median(times)
    v1 = out["format 1 (sorted_gaps)"]["bytes_per_token_layer"]
    v2 = out["format 2 (codec + dedup)"]["bytes_per_token_layer"]
    out["v1_size_vs_v2"] = v1 / v2
    paired = zip(seconds["format 2 (codec + dedup)"], seconds["format 2 codec only"], strict=True)
    out["dedup_write_time_vs_codec_only"] = statistics.median(a / b for a, b in paired)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec, sequences = corpus_sequences(args.corpus)
    groups, sessions = (2, 2) if args.quick else (args.groups, args.sessions)
    scenarios: dict[str, Any] = {}
    cases: dict[str, list[Record]] = {}
    for n in (8, 16):
        for fraction in (0.25, 0.5, 0.75):
            cases[f"GRPO n={n} prompt {fraction:.2f}"] = list(grpo(sequences, n, fraction, groups))
    for turns in (4, 8):
        cases[f"multi-turn {turns} turns"] = list(multi_turn(sequences, turns, sessions))
    for layout_name, layout in LAYOUTS.items():
        for case, records in cases.items():
            scenarios[f"{case}, {layout_name}"] = measure(spec, records, layout, 1 if args.quick else args.rounds)
    return {
        "corpus": args.corpus,
        "model": spec.name,
        "num_moe_layers": spec.num_moe_layers,
        "num_experts": spec.num_experts,
        "topk": spec.topk,
        "scenarios": scenarios,
        "goal": "<= 3 bytes per routed token-layer at rest",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--quick", action="store_true", help="two groups / sessions per scenario (smoke test)")
    parser.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="routelog store whose routing to use")
    parser.add_argument("--groups", type=int, default=12, help="GRPO groups per scenario")
    parser.add_argument("--sessions", type=int, default=8, help="multi-turn sessions per scenario")
    parser.add_argument("--rounds", type=int, default=5, help="writes of each configuration timed (median)")
    args = parser.parse_args()
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(
        f"corpus {report['corpus']}: {report['model']}, {report['num_moe_layers']} MoE layers, "
        f"top-{report['topk']} of {report['num_experts']}; bytes per routed token-layer"
    )
    names = list(CONFIGS)
    print(f"{'scenario':39s}" + "".join(f"{n:>25s}" for n in names) + f"{'dedup':>8s}{'v1/v2':>8s}{'time':>8s}")
    for scenario, result in report["scenarios"].items():
        dedup = result[names[-1]]["routed_rows"] / result[names[-1]]["stored_rows"]
        cells = "".join(f"{result[n]['bytes_per_token_layer']:25.3f}" for n in names)
        time_ratio = result["dedup_write_time_vs_codec_only"]
        print(f"{scenario:39s}{cells}{dedup:7.2f}x{result['v1_size_vs_v2']:7.2f}x{time_ratio:7.2f}x")
    print(f"goal: {report['goal']}")
    print("time: format 2's write time over format 2 codec only's (what finding shared prefixes costs the writer)")


if __name__ == "__main__":
    main()
