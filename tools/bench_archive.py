"""Archive benchmark (issue #55): a run written in format 2, sealed, then archived in place (``routelog archive``).

Two measurements, baselines in the same run:

- **Size**, on each corpus (``--corpus``): every step's records written in format 2 by each of ``--writers``
  writers per step (a part each, shared prompts across them), sealed, archived, and gc'd past its grace (the
  original parts go: what stays of the format-2 history is its log, a commit entry per part). Every
  byte the store then holds (log, seal, consolidated copies, archive parts) against the simplest archive a user would
  make of the same records: the whole raw routing array in one zstd-19 frame plus the int32 token ids in another
  (:func:`benchlib.zstd19_baseline`). Goal: <= 1.0 x. ``verify`` must call the archived store sound. Beside it, the
  format-2 store before archiving and the records written fresh with the archive codec.
- **Time**, on ``--raw-mb`` of token-dependent routing (1 GiB by default; 48 layers, top-8 of 128): archiving the
  format-2 step against writing the same records fresh with the archive codec (``PartOptions(transform=
  "ranked_context")``), each timed from the first record to the last byte. Goal: <= 1.5 x.

    python tools/bench_archive.py [--json] [--quick] [--corpus tests/fixtures/corpus/qwen3moe ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import corpus_steps, token_dependent_records, zstd19_baseline

import routelog
from routelog import PartOptions, Record
from routelog.format.spec import ModelSpec
from routelog.store.verify import verify_store
from routelog.synth import synthetic_spec

GOALS = {"every_byte_vs_zstd19_max": 1.0, "archive_vs_fresh_time_max": 1.5}
CORPORA = [
    str(Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "corpus" / name)
    for name in ("qwen3moe", "deepseekv3")
]


def store_bytes(root: Path) -> int:
    """Every byte of every file under a local store."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def write_steps(url: str, spec: ModelSpec, steps: list[list[Record]], writers: int, options: PartOptions) -> float:
    """Write each step's records round-robin through ``writers`` writers (a part each); seconds taken."""
    store = routelog.create_store(url, spec)
    started = time.perf_counter()
    for step, records in enumerate(steps):
        for w in range(writers):
            with store.writer(step, f"w{w}", options=options) as writer:
                for record in records[w::writers]:
                    writer.append(record)
    return time.perf_counter() - started


def archive_all(url: str) -> tuple[float, int]:
    """Seal and archive every step (the seal untimed); seconds the archives took, raw routing bytes re-coded."""
    store = routelog.open_store(url)
    for step in store.steps():
        store.seal(step)
    started = time.perf_counter()
    raw = sum(store.archive(step).raw_bytes for step in store.steps())
    return time.perf_counter() - started, raw


def size_on(corpus: str, writers: int, scratch: Path) -> dict[str, Any]:
    steps, spec = corpus_steps(corpus)
    every = [r for records in steps for r in records]
    baseline = zstd19_baseline(every, spec)
    format2, fresh = scratch / "format2", scratch / "fresh"
    write_steps(f"file://{format2}", spec, steps, writers, PartOptions())
    write_steps(f"file://{fresh}", spec, steps, writers, PartOptions(transform="ranked_context"))
    before = store_bytes(format2)
    archive_all(f"file://{format2}")
    store = routelog.open_store(f"file://{format2}")
    report = store.gc(3600, delete=True, now=time.time() + 7200)  # past the grace: the original parts go
    after = store_bytes(format2)
    simple = (baseline["zstd19_routing_bytes"] or 0) + (baseline["zstd19_token_ids_bytes"] or 0)
    verified = verify_store(store)
    return {
        "records": len(every),
        "token_layers": baseline["token_layers"],
        "zstd19_routing_and_tokens_bytes": simple,
        "format2_bytes": before,
        "fresh_archive_codec_bytes": store_bytes(fresh),
        "archived_bytes": after,
        "reclaimed_bytes": report.bytes,
        "format2_vs_zstd19": before / simple,
        "fresh_archive_codec_vs_zstd19": store_bytes(fresh) / simple,
        "every_byte_vs_zstd19": after / simple,
        "verify_ok": verified.ok,
        "verify_problems": verified.problems[:4],
    }


def time_on(raw_mb: float, writers: int, scratch: Path) -> dict[str, Any]:
    spec = synthetic_spec(layers=48, experts=128, topk=8)
    tokens = int(raw_mb * 1e6 / (spec.num_moe_layers * spec.topk))
    records = token_dependent_records(np.random.default_rng(55), tokens, spec, vocab_size=150_000)
    fresh_url, format2_url = f"file://{scratch}/time-fresh", f"file://{scratch}/time-format2"
    fresh = write_steps(fresh_url, spec, [records], writers, PartOptions(transform="ranked_context"))
    format2 = write_steps(format2_url, spec, [records], writers, PartOptions())
    archived, raw = archive_all(format2_url)
    return {
        "raw_mb": raw / 1e6,
        "fresh_archive_codec_write_s": fresh,
        "format2_write_s": format2,
        "archive_s": archived,
        "archive_MBps": raw / 1e6 / archived,
        "archive_vs_fresh_time": archived / fresh,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"sizes": {}, "goals": GOALS}
    with tempfile.TemporaryDirectory() as tmp:
        for i, corpus in enumerate(args.corpus):
            for writers in args.writers:
                scratch = Path(tmp) / f"corpus{i}-{writers}"
                scratch.mkdir()
                out["sizes"][f"{Path(corpus).name}, {writers} writer{'s' if writers > 1 else ''} a step"] = size_on(
                    corpus, writers, scratch
                )
        out["time"] = time_on(32.0 if args.quick else args.raw_mb, 1, Path(tmp))
    out["verdict"] = [
        {
            "goal": "archived store, every byte / zstd-19 of routing + token ids",
            "dataset": corpus,
            "value": data["every_byte_vs_zstd19"],
            "limit": GOALS["every_byte_vs_zstd19_max"],
            "met": data["every_byte_vs_zstd19"] <= GOALS["every_byte_vs_zstd19_max"] and data["verify_ok"],
            "format2_before": data["format2_vs_zstd19"],
            "fresh_archive_codec": data["fresh_archive_codec_vs_zstd19"],
        }
        for corpus, data in out["sizes"].items()
    ]
    ratio = out["time"]["archive_vs_fresh_time"]
    out["verdict"].append(
        {
            "goal": "archive time / fresh archive-codec write time",
            "dataset": f"token-dependent, {out['time']['raw_mb']:.0f} MB raw",
            "value": ratio,
            "limit": GOALS["archive_vs_fresh_time_max"],
            "met": ratio <= GOALS["archive_vs_fresh_time_max"],
        }
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--quick", action="store_true", help="32 MB for the time measurement (smoke test)")
    parser.add_argument("--corpus", nargs="*", default=CORPORA, help="routelog store(s) whose records to archive")
    parser.add_argument(
        "--writers", type=int, nargs="+", default=[1, 4], help="writers (parts) per step in format 2, each measured"
    )
    parser.add_argument("--raw-mb", type=float, default=1073.741824, help="raw routing MB for the time measurement")
    result = run(parser.parse_args())
    if parser.parse_args().json:
        print(json.dumps(result, indent=1))
        return
    for corpus, data in result["sizes"].items():
        print(
            f"{corpus}: {data['records']} records; zstd-19 routing + tokens "
            f"{data['zstd19_routing_and_tokens_bytes']:,} B; format 2 {data['format2_vs_zstd19']:.2f} x, "
            "fresh archive codec "
            f"{data['fresh_archive_codec_vs_zstd19']:.2f} x, archived {data['every_byte_vs_zstd19']:.2f} x "
            f"(verify {'sound' if data['verify_ok'] else data['verify_problems']})"
        )
    t = result["time"]
    print(
        f"{t['raw_mb']:.0f} MB raw: fresh archive-codec write {t['fresh_archive_codec_write_s']:.1f} s, format 2 write "
        f"{t['format2_write_s']:.1f} s, archive {t['archive_s']:.1f} s ({t['archive_MBps']:.1f} MB/s) = "
        f"{t['archive_vs_fresh_time']:.2f} x the fresh write"
    )
    for row in result["verdict"]:
        verdict = "MET " if row["met"] else "MISS"
        print(f"  {verdict} {row['goal']} on {row['dataset']}: {row['value']:.3f} <= {row['limit']}")


if __name__ == "__main__":
    main()
