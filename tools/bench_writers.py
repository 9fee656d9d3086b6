"""Writer benchmark: ingest throughput of 1, 2 and 4 concurrent writers to local disk and to S3 (a local moto
server), peak RSS per writer and objects per flush, next to the simplest tools on the same arrays in the same run:
``np.save`` (no compression) and zstd-3 of each record's raw IDs, one file per record, one core (issue #32's goal:
one writer at least as fast, and its peak RSS at most 2 x the flush buffer above what the process holds before
its first append: its imports, a warm-up commit to another step, and the records it will append). 128 records a
writer by default, six flush buffers: a writer's memory is measured over many parts, not one or two.

Each writer is its own process (as rollout workers are); routing is generated before the clock starts. MB/s count
raw-equivalent routing bytes (one byte per expert ID) over the wall time from the first append to the last commit.
The routing is uniform unless ``--routing`` asks for skewed or token-dependent sets (:data:`ROUTING_KINDS`); the
baselines store the same arrays.

``--scheduler`` measures instead what a writer costs the inference engine it runs in: the engine's scheduler is
GIL-bound Python, so a loop of small pure-Python steps stands in for it, appending a record at a realistic rate
(default 4 records/s of 4096 tokens x 48 layers, top-8 of 128: 6 MB/s of routing per engine). Each trial is a fresh
process running the loop for a fixed time without a writer, with the writer in the engine's process, and with the
writer's validation and encoding in a separate process (:class:`routelog.ProcessWriter`: the engine copies each
record into shared memory); the three alternate, and the medians of steps per second give the overhead. Fresh
processes differ by more than the goal on a shared machine, so each writer run also alternates half-second windows
with and without appends in the same process, in the order with, without, without, with (the paired overhead: steps
per second without over with, median over trials; the same windows without a writer give the measurement's own
noise, an A/A test), and reports where the writer process's CPU fell: in the windows with appends, in the settles
after them, or in the others (which would hide its cost). Next to it, what the
writer costs the engine's process in CPU time, which other load barely blurs: the share of the loop's time spent
inside ``append`` (on the engine's own thread) plus the CPU of the process's other threads during appending windows
over that in the others (the in-process writer's encoding; the writer process's reply reader). The paired CPU
overhead divides steps by the loop thread's own CPU time instead of wall time: it leaves out every moment the loop
was not running (preempted, or waiting for the GIL) and keeps only slower instructions (caches and memory shared
with the writer). ``--pin`` puts the loop on the first CPU and the writer process on the others
(``ProcessWriter(cpus=...)``), as on a host that keeps cores free beside the engine's. Goal (issue #15): <= 1.01 x.

Durability (issue #29): on local disk a writer fsyncs each object, its log entry and their directories before it
reports a commit. ``--durability`` measures what that costs, in the same run: one writer to local disk with fsync,
and the same with fsync made a no-op, alternating (``--rounds`` each); with ``--baseline-ref REF`` also the routelog
of a git revision (checked out into a temporary worktree and run the same way), so the ratio covers everything the
revision changed (the step log's listing and reads, the flush-time checks, fsync). Goal (issue #29, nothing in the
protocol costs the writer more than 5 %): fsync / the revision before it >= 0.95 x. Fsync / no fsync is what
durability itself costs on this disk: the writer compresses part k + 1 while part k is fsynced, so what remains is
the last part's write to the disk (fsyncs of one flush run concurrently, so per-call latency is hidden; synthetic
uniform routing, the least compressible, stores 5 bytes per token-layer).

``--ceiling`` bounds what any cheaper stage could give issue #32's goal: one writer to local disk as it is, then with
zstd's compression of its chunks made free (:data:`FREE_STAGES`: a copy as large as uniform routing's gaps
compress to), then fsync too, then the SHA-256 of its objects too, alternating rounds, each beside its own zstd-3
per record run. Such stores cannot be read: the variants measure time only. Each also reports the ratio per CPU
second (zstd-3's CPU time over the writer process's, every thread's): what one writer would reach on one core, and
a figure the host's drift between runs blurs less than wall time.

    python tools/bench_writers.py [--json] [--quick] [--records N --tokens T --layers L] [--routing KIND]
    python tools/bench_writers.py --ceiling [--rounds N] [--json] [--quick]
    python tools/bench_writers.py --scheduler [--pin] [--json] [--rate R --trials N --seconds S]
    python tools/bench_writers.py --durability [--baseline-ref REF] [--rounds N] [--json] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import zstandard
from benchlib import current_rss_mb, peak_rss_mb, reset_peak_rss, token_dependent_records

import routelog
from routelog import Record
from routelog.store.writer import cpus_available
from routelog.synth import synth_routing, synthetic_spec
from routelog.testing import local_s3_server

ROUTING_KINDS = ("uniform", "skewed", "token-dependent")
"""``--routing``: uniform sets (the least compressible, the default); each layer's experts drawn from a skewed
popularity (Dirichlet(1/3), as trained routers' load); or sets that depend on the token (a 150k vocabulary of
Zipf-distributed ids, 60 % of token-layers taking their id's preferred set: ``routelog.synth``)."""


def _routing(args: argparse.Namespace, seed: int) -> list[np.ndarray]:
    spec = synthetic_spec(args.layers, 128, 8)
    rng = np.random.default_rng(seed)
    if args.routing == "token-dependent":
        records = token_dependent_records(rng, args.records * args.tokens, spec, 150_000, record_tokens=args.tokens)
        return [np.ascontiguousarray(record.expert_ids) for record in records]
    popularity = None
    if args.routing == "skewed":
        shared = np.random.default_rng(1000)  # every writer's layers share one popularity, as one model's do
        popularity = [shared.dirichlet(np.full(128, 1 / 3)) for _ in range(args.layers)]
    return [synth_routing(rng, args.tokens, spec, popularity, 0.0) for _ in range(args.records)]


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One writer: generate its routing, then append everything and close, timed."""
    _make_free(args.free)  # the durability benchmark's baseline: fsync free, the same writes never forced to disk
    arrays = _routing(args, seed=args.writer)
    spec = synthetic_spec(args.layers, 128, 8)
    store = routelog.create_store(args.url, spec)
    objects = []
    # Warm up outside the clock: the first part and the first commit pay one-time lazy imports (zarr, pyarrow's
    # Parquet writer, the storage's write path; ~0.2 s and a few MB), which a writer living for a whole RL run pays
    # once, not per flush. One 16-token record goes to step 1, which nothing reads.
    with store.writer(1, f"warmup-{args.writer}") as warmup:
        warmup.append(
            Record(sample_id=f"warmup-{args.writer}", expert_ids=arrays[0][:16], prompt_len=4, response_len=12)
        )
    before = current_rss_mb()  # imports, the routing to append, the warm-up commit
    reset_peak_rss()  # generating the routing took temporaries (token-dependent sets: several times the records)
    start, cpu = time.perf_counter(), time.process_time()
    with store.writer(
        0,
        f"bench-{args.writer}",
        flush_bytes=args.flush_mb << 20,
        encode_threads=int(args.encode_threads),
        on_commit=lambda commit, ids: objects.append(len(commit.objects) + 1),
    ) as writer:
        for i, ids in enumerate(arrays):
            writer.append(
                Record(
                    sample_id=f"w{args.writer}-{i}",
                    expert_ids=ids,
                    prompt_len=args.tokens // 4,
                    response_len=args.tokens - args.tokens // 4,
                )
            )
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "raw_bytes": sum(a.nbytes for a in arrays),
        "peak_rss_mb": peak_rss_mb(),
        "rss_before_mb": before,
        "parts": len(objects),
        "objects_per_flush": float(np.mean(objects)) if objects else 0.0,
    }


FREE_STAGES = ("entropy", "fsync", "sha256")
"""What ``--ceiling`` (and ``--durability``'s baseline: fsync) makes cost nothing in a writer process (the store it
writes is then unreadable: measurement only): zstd's compression of every chunk frame (each frame becomes a copy of
the first two thirds of its input, as large as uniform routing's gaps compress to), forcing objects to disk, and
hashing them for their commit."""

CEILING_VARIANTS: dict[str, tuple[str, ...]] = {
    "writer": (),
    "entropy free": ("entropy",),
    "entropy and fsync free": ("entropy", "fsync"),
    "entropy, fsync and sha256 free": FREE_STAGES,
}


def _make_free(stages: str) -> None:
    """Replace the stages named (comma-separated, :data:`FREE_STAGES`) in this process by ones that cost nothing."""
    for stage in filter(None, stages.split(",")):
        if stage == "entropy":
            from routelog.format import zstd_frames

            def copy(data: Any, level: int, *, min_match: int | None = None) -> bytes:
                view = memoryview(zstd_frames._buffer(data)).cast("B")
                return bytes(view[: len(view) * 2 // 3])

            zstd_frames.compress = copy
        elif stage == "fsync":
            os.fsync = lambda fd: None
        elif stage == "sha256":  # a local upload reads each object back for its digest: hash nothing instead
            import hashlib

            hashlib.file_digest = lambda file, digest: hashlib.sha256(b"")  # type: ignore[assignment]
        else:
            raise SystemExit(f"--free: unknown stage {stage!r} (one of {', '.join(FREE_STAGES)})")


SCHEDULER_MODES = ("no writer", "writer in the engine process", "writer process")


WINDOW_SECONDS = 0.5
SETTLE_SECONDS = 0.25
ORDER = (True, False, False, True)
"""Windows with appends (True) and without, repeating in this order (mirrored for every other mode): a drift
over time and any cost of coming first after a pause fall on both sides alike."""


def _writer_cpu(writer: Any) -> float:
    """CPU seconds the writer process has used so far (Linux ``/proc``; 0 for another writer, whose CPU shows
    in its engine's process)."""
    child = getattr(writer, "_child", None)
    if child is None:
        return 0.0
    try:
        with open(f"/proc/{child.pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:  # not Linux
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def scheduler_child(args: argparse.Namespace) -> dict[str, Any]:
    """The stand-in scheduler for ``args.seconds``: steps of pure-Python work, a record appended at ``args.rate``.

    With a writer the run alternates windows of :data:`WINDOW_SECONDS` with and without appends in the order of
    :data:`ORDER` (mirrored when ``args.mode`` is odd), each followed by an untimed :data:`SETTLE_SECONDS` in which
    the writer finishes the records already given (without a writer every window runs the same way): the paired
    windows of one process share its core, its placement and the machine's load at that moment, which separate
    fresh processes do not. The writer process's CPU is counted per window and settle: its work must fall in the
    windows with appends, or the paired ratio would not see it."""
    spec = synthetic_spec(args.layers, 128, 8)
    arrays = _routing(args, seed=1)[:8]
    mode = SCHEDULER_MODES[args.mode]
    writer: Any = None
    writer_cpus = None
    if args.pin:  # the engine's loop on the first CPU, the writer process on the others
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("--pin needs two CPUs: one for the loop, one for the writer process")
        os.sched_setaffinity(0, cpus[:1])
        writer_cpus = cpus[1:]
    if mode == "writer in the engine process":
        writer = routelog.open_writer(args.url, 0, model_spec=spec, writer_id="engine", flush_bytes=16 << 20)
    elif mode == "writer process":
        writer = routelog.ProcessWriter(
            args.url, 0, model_spec=spec, writer_id="engine", flush_bytes=16 << 20, cpus=writer_cpus
        )
    if writer is not None:  # warm up outside the clock (imports, the first part)
        writer.append(Record(sample_id="warmup", expert_ids=arrays[0], prompt_len=16, response_len=args.tokens - 16))
        writer.flush()
    appended = 0
    in_append = 0.0
    timed = {"with": [0, 0.0, 0.0], "without": [0, 0.0, 0.0]}  # steps, seconds, the loop thread's CPU seconds

    def run(window: float, appending: bool, paired: bool) -> None:
        nonlocal appended, in_append
        steps = 0
        start, cpu = time.perf_counter(), time.thread_time()
        end = start + window
        due = start
        while True:
            now = time.perf_counter()
            if now >= end:
                break
            if appending and now >= due:
                ids = arrays[appended % len(arrays)]
                called = time.perf_counter()
                writer.append(
                    Record(sample_id=f"r{appended}", expert_ids=ids, prompt_len=16, response_len=args.tokens - 16)
                )
                in_append += time.perf_counter() - called
                appended += 1
                due += 1.0 / args.rate
            total = 0
            for k in range(400):  # one scheduler step: ~20 us of bytecode holding the GIL
                total += k * k
            steps += 1
        tally = timed["with" if paired else "without"]
        tally[0] += steps
        tally[1] += time.perf_counter() - start
        tally[2] += time.thread_time() - cpu

    # CPU the engine process spends outside its loop's thread (a writer's threads, the writer process's reply
    # reader), per window and the settle after it: unlike throughput, CPU time is barely blurred by other load.
    other_cpu = {"with": [0.0, 0.0], "without": [0.0, 0.0]}  # CPU seconds, wall seconds
    writer_cpu = {"with windows": 0.0, "settles after them": 0.0, "without windows and their settles": 0.0}
    for window in range(max(4, round(args.seconds / WINDOW_SECONDS))):  # every mode runs the same windows
        # Without a writer: an A/A test, the measurement's own noise.
        paired = ORDER[window % len(ORDER)] != (args.mode % 2 == 1)
        wall, process, loop = time.perf_counter(), time.process_time(), time.thread_time()
        child = _writer_cpu(writer)
        run(WINDOW_SECONDS, writer is not None and paired, paired)
        settle = _writer_cpu(writer)
        time.sleep(SETTLE_SECONDS)
        done = _writer_cpu(writer)
        if paired:
            writer_cpu["with windows"] += settle - child
            writer_cpu["settles after them"] += done - settle
        else:
            writer_cpu["without windows and their settles"] += done - child
        used = other_cpu["with" if paired else "without"]
        used[0] += (time.process_time() - process) - (time.thread_time() - loop)
        used[1] += time.perf_counter() - wall
    if writer is not None:
        writer.close()
    rate = {name: steps / seconds for name, (steps, seconds, _) in timed.items()}
    per_cpu = {name: steps / cpu for name, (steps, _, cpu) in timed.items()}
    return {
        "mode": mode,
        "steps_per_second": rate["with"] if writer is not None else sum(rate.values()) / 2,
        "paired_overhead": rate["without"] / rate["with"],
        "paired_cpu_overhead": per_cpu["without"] / per_cpu["with"],
        "records": appended,
        "append_share": in_append / timed["with"][1] if timed["with"][1] else 0.0,
        "other_threads_cpu_share": other_cpu["with"][0] / other_cpu["with"][1]
        - other_cpu["without"][0] / other_cpu["without"][1],
        "writer_process_cpu_seconds": writer_cpu,
    }


def scheduler_overhead(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    runs: dict[str, list[float]] = {mode: [] for mode in SCHEDULER_MODES}
    paired: dict[str, list[float]] = {mode: [] for mode in SCHEDULER_MODES}
    paired_cpu: dict[str, list[float]] = {mode: [] for mode in SCHEDULER_MODES}
    append_share: dict[str, list[float]] = {mode: [] for mode in SCHEDULER_MODES}
    other_cpu: dict[str, list[float]] = {mode: [] for mode in SCHEDULER_MODES}
    child_cpu: dict[str, float] = {}
    for trial in range(args.trials):
        for mode in range(len(SCHEDULER_MODES)):
            command = [sys.executable, __file__, "--scheduler-child", "--mode", str(mode), "--url"]
            command += [str(root / f"store-{trial}-{mode}"), "--seconds", str(args.seconds), "--rate", str(args.rate)]
            command += ["--tokens", str(args.tokens), "--layers", str(args.layers), "--records", "8"]
            command += ["--pin"] if args.pin else []
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            name = SCHEDULER_MODES[mode]
            runs[name].append(result["steps_per_second"])
            append_share[name].append(result["append_share"])
            other_cpu[name].append(result["other_threads_cpu_share"])
            paired[name].append(result["paired_overhead"])
            paired_cpu[name].append(result["paired_cpu_overhead"])
            if name == "writer process":
                for where, seconds in result["writer_process_cpu_seconds"].items():
                    child_cpu[where] = child_cpu.get(where, 0.0) + seconds
    medians = {mode: float(np.median(values)) for mode, values in runs.items()}
    base = medians["no writer"]
    return {
        "config": {
            "rate_records_per_s": args.rate,
            "tokens": args.tokens,
            "layers": args.layers,
            "trials": args.trials,
            "window_seconds": WINDOW_SECONDS,
        },
        "steps_per_second": runs,
        "median_steps_per_second": medians,
        "overhead": {mode: base / medians[mode] for mode in SCHEDULER_MODES[1:]},
        "pinned": args.pin,
        "paired_overhead": _writer_medians(paired),
        "paired_overhead_trials": paired,
        "paired_null_test": _null_test(paired["no writer"]),
        "paired_cpu_overhead": _writer_medians(paired_cpu),
        "paired_cpu_overhead_trials": paired_cpu,
        "paired_cpu_null_test": _null_test(paired_cpu["no writer"]),
        "writer_process_cpu_share": {
            where: seconds / (sum(child_cpu.values()) or 1.0) for where, seconds in child_cpu.items()
        },
        "append_share": {mode: float(np.median(append_share[mode])) for mode in SCHEDULER_MODES[1:]},
        "engine_cpu_share": {
            mode: float(np.median(append_share[mode]) + np.median(other_cpu[mode])) for mode in SCHEDULER_MODES
        },
        "goal": "<= 1.01 x",
    }


def _writer_medians(trials: dict[str, list[float]]) -> dict[str, float]:
    return {mode: float(np.median(values)) for mode, values in trials.items() if mode != "no writer"}


def _null_test(trials: list[float]) -> dict[str, Any]:
    """The paired ratio of windows without a writer on either side: what the measurement reads when nothing
    differs."""
    return {"median": float(np.median(trials)), "spread": [float(min(trials)), float(max(trials))]}


def baseline(args: argparse.Namespace, root: Path, kind: str = "np.save") -> dict[str, Any]:
    """The same arrays to local disk, one file per record: ``np.save`` (no compression), or ``zstd-3`` of each
    record's raw IDs (python-zstandard, one reused context)."""
    arrays = _routing(args, seed=0)
    compressor = zstandard.ZstdCompressor(level=3)
    start, cpu = time.perf_counter(), time.thread_time()
    for i, ids in enumerate(arrays):
        with (root / f"{i}.{kind}").open("wb") as handle:
            if kind == "np.save":
                np.save(handle, ids, allow_pickle=False)
            else:
                handle.write(compressor.compress(np.ascontiguousarray(ids).tobytes()))
    seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
    raw = sum(a.nbytes for a in arrays)
    return {"seconds": seconds, "cpu_seconds": cpu, "raw_bytes": raw, "MBps": raw / seconds / 1e6}


def run_writers(
    args: argparse.Namespace, url: str, writers: int, env: dict[str, str], extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                "--url",
                url,
                "--writer",
                str(w),
                "--records",
                str(args.records),
                "--tokens",
                str(args.tokens),
                "--layers",
                str(args.layers),
                "--flush-mb",
                str(args.flush_mb),
                "--routing",
                args.routing,
                *extra,
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for w in range(writers)
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=1800)
        if proc.returncode:
            raise SystemExit(f"a writer failed with exit code {proc.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    wall = max(r["seconds"] for r in results)
    raw = sum(r["raw_bytes"] for r in results)
    committed = len(routelog.open_store(url).step(0))
    if committed != writers * args.records:
        raise SystemExit(f"{committed} records committed, expected {writers * args.records}")
    return {
        "writers": writers,
        "MBps": raw / wall / 1e6,
        "seconds": wall,
        "cpu_seconds": sum(r["cpu_seconds"] for r in results),
        "peak_rss_mb_per_writer": max(r["peak_rss_mb"] for r in results),
        "rss_above_before_over_flush": max((r["peak_rss_mb"] - r["rss_before_mb"]) / args.flush_mb for r in results),
        "objects_per_flush": float(np.mean([r["objects_per_flush"] for r in results])),
        "parts": sum(r["parts"] for r in results),
    }


def encode_threads(args: argparse.Namespace, root: Path, env: dict[str, str]) -> dict[str, Any]:
    """One writer to local disk compressing on each of ``--encode-threads`` threads, in alternating rounds, each
    run beside zstd-3 per record measured just before it (the machine's load drifts between runs): medians of MB/s
    and of the ratio to zstd-3."""
    counts = sorted({int(t) for t in args.encode_threads.split(",")})
    rates: dict[int, list[float]] = {t: [] for t in counts}
    ratios: dict[int, list[float]] = {t: [] for t in counts}
    for round_ in range(args.rounds):
        for threads in counts:
            (root / f"zstd-{round_}-{threads}").mkdir()
            zstd = baseline(args, root / f"zstd-{round_}-{threads}", "zstd-3")["MBps"]
            url = str(root / f"threads-{threads}-{round_}")
            got = run_writers(args, url, 1, env, ("--encode-threads", str(threads)))["MBps"]
            rates[threads].append(got)
            ratios[threads].append(got / zstd)
    return {
        str(t): {
            "MBps": float(np.median(rates[t])),
            "over_zstd3_per_record": float(np.median(ratios[t])),
            "rounds_over_zstd3": ratios[t],
        }
        for t in counts
    }


def ceiling(args: argparse.Namespace, root: Path, env: dict[str, str]) -> dict[str, Any]:
    """One writer to local disk as it is and with its stages made free one after another (:data:`CEILING_VARIANTS`),
    in alternating rounds, each round beside its own zstd-3 per record run: the most any cheaper entropy coder (or
    cheaper durability and integrity) could give the writer, against issue #32's goal."""
    rates: dict[str, list[float]] = {name: [] for name in CEILING_VARIANTS}
    ratios: dict[str, list[float]] = {name: [] for name in CEILING_VARIANTS}
    cpu_ratios: dict[str, list[float]] = {name: [] for name in CEILING_VARIANTS}
    baselines: list[float] = []
    (root / "zstd-warm-up").mkdir()  # this process's first run of the baseline measured 0.55-0.6 x its later ones
    baseline(args, root / "zstd-warm-up", "zstd-3")
    for round_ in range(args.rounds):
        (root / f"zstd-{round_}").mkdir()
        zstd = baseline(args, root / f"zstd-{round_}", "zstd-3")
        baselines.append(zstd["MBps"])
        for name, stages in CEILING_VARIANTS.items():
            url = str(root / f"{name.replace(' ', '-').replace(',', '')}-{round_}")
            got = run_writers(args, url, 1, env, ("--free", ",".join(stages)) if stages else ())
            rates[name].append(got["MBps"])
            ratios[name].append(got["MBps"] / zstd["MBps"])
            cpu_ratios[name].append(zstd["cpu_seconds"] / got["cpu_seconds"])
    return {
        "variants": {
            name: {
                "free": list(CEILING_VARIANTS[name]),
                "MBps": float(np.median(rates[name])),
                "over_zstd3_per_record": float(np.median(ratios[name])),
                "rounds_over_zstd3": ratios[name],
                "over_zstd3_per_cpu_second": float(np.median(cpu_ratios[name])),
            }
            for name in CEILING_VARIANTS
        },
        "zstd3_per_record_MBps_rounds": baselines,
        "goal": "one writer >= 1 x zstd-3 per record",
    }


def durability(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One writer to local disk: with fsync, without, and (``--baseline-ref``) the revision's routelog; alternating
    rounds, medians of MB/s, ratios against each baseline."""
    sides: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
        "fsync": (dict(os.environ), ()),
        "no fsync": (dict(os.environ), ("--free", "fsync")),
    }
    if args.baseline_ref:
        tree = root / "baseline"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), args.baseline_ref],
            check=True,
            capture_output=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        if (tree / "setup.py").exists():  # its compiled kernels, as an install builds them (else numpy's run)
            subprocess.run(
                [sys.executable, "setup.py", "build_ext", "--inplace"], check=True, capture_output=True, cwd=tree
            )
        sides[f"routelog at {args.baseline_ref}"] = ({**os.environ, "PYTHONPATH": str(tree)}, ())
    rates: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for round_ in range(args.rounds):
            for name, (env, extra) in sides.items():
                url = str(root / f"{name.replace(' ', '-')}-{round_}")
                rates[name].append(run_writers(args, url, 1, env, extra)["MBps"])
    finally:
        if args.baseline_ref:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(root / "baseline")],
                check=False,
                capture_output=True,
                cwd=Path(__file__).resolve().parents[1],
            )
    medians = {name: float(np.median(values)) for name, values in rates.items()}
    ratios = {f"fsync / {name}": medians["fsync"] / value for name, value in medians.items() if name != "fsync"}
    goal = {name: ">= 0.95 x" for name in ratios if "routelog at" in name}
    return {"MBps": medians, "rounds": rates, "ratios": ratios, "goal": goal or "run with --baseline-ref"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--records", type=int, default=None, help="records per writer (128; --durability: 256)")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--flush-mb", type=int, default=None, help="(16; --durability: 64, the writer's default)")
    parser.add_argument("--writers", default="1,2,4")
    parser.add_argument("--routing", choices=ROUTING_KINDS, default="uniform", help="what the records route like")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--writer", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--scheduler", action="store_true", help="measure the overhead a writer adds to an engine")
    parser.add_argument("--rate", type=float, default=4.0, help="--scheduler: records per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="--scheduler: seconds per trial")
    parser.add_argument("--trials", type=int, default=5, help="--scheduler: trials per mode")
    parser.add_argument(
        "--pin", action="store_true", help="--scheduler: the engine on one CPU, the writer process on the rest"
    )
    parser.add_argument("--durability", action="store_true", help="measure the cost of fsync (and of a revision)")
    parser.add_argument("--baseline-ref", help="--durability: also run the routelog of this git revision")
    parser.add_argument(
        "--rounds", type=int, default=None, help="alternating rounds per side (--durability: 5; encode threads: 3)"
    )
    parser.add_argument(
        "--encode-threads",
        default=None,
        help="one writer's encode_threads to compare, comma-separated (default: 1 and this process's CPUs)",
    )
    parser.add_argument(
        "--ceiling", action="store_true", help="measure one writer with its entropy stage, fsync and hashing made free"
    )
    parser.add_argument("--free", default="", help=argparse.SUPPRESS)
    parser.add_argument("--scheduler-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    # Durability is measured over several flushes of the writer's default size: a few small flushes measure the
    # latency of one fsync, not what it costs a writer's throughput.
    args.records = args.records or (256 if args.durability else 128)
    args.flush_mb = args.flush_mb or (64 if args.durability else 16)
    args.rounds = args.rounds or (5 if args.durability else 3)
    if args.encode_threads is None:
        args.encode_threads = "1" if args.child else f"1,{cpus_available()}"
    if args.quick:
        args.records, args.tokens, args.layers, args.flush_mb, args.writers = 4, 256, 8, 1, "1,2"
        args.seconds, args.trials, args.rounds = 1.0, 1, 1
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.scheduler_child:
        print(json.dumps(scheduler_child(args)))
        return
    if args.ceiling:
        with tempfile.TemporaryDirectory(prefix="routelog-bench-ceiling-") as tmp:
            report = ceiling(args, Path(tmp), dict(os.environ))
        report["config"] = {"records": args.records, "tokens": args.tokens, "layers": args.layers}
        report["config"] |= {"flush_mb": args.flush_mb, "routing": args.routing, "rounds": args.rounds}
        if args.json:
            print(json.dumps(report, indent=1))
            return
        print(f"one writer, local disk, {args.records} records x {args.tokens} tokens x {args.layers} layers:")
        for name, r in report["variants"].items():
            rounds = ", ".join(f"{v:.2f}" for v in r["rounds_over_zstd3"])
            print(
                f"  {name:32s} {r['MBps']:7.0f} MB/s {r['over_zstd3_per_record']:6.2f} x zstd-3 (rounds: {rounds}); "
                f"per CPU second {r['over_zstd3_per_cpu_second']:.2f} x"
            )
        rounds = ", ".join(f"{v:.0f}" for v in report["zstd3_per_record_MBps_rounds"])
        print(f"  zstd-3 per record, local: {rounds} MB/s; goal: {report['goal']}")
        return
    if args.durability:
        if args.quick:
            args.rounds = 1
        with tempfile.TemporaryDirectory(prefix="routelog-bench-durability-") as tmp:
            report = durability(args, Path(tmp))
        if args.json:
            print(json.dumps(report, indent=1))
            return
        print(f"one writer, local disk, {args.records} records x {args.tokens} tokens x {args.layers} layers:")
        for name, value in report["MBps"].items():
            print(f"  {name:28s} {value:8.1f} MB/s (rounds: {', '.join(f'{v:.0f}' for v in report['rounds'][name])})")
        for name, ratio in report["ratios"].items():
            print(f"  {name:28s} {ratio:8.3f} x")
        goal = report["goal"]
        print("goal: " + (", ".join(f"{k} {v}" for k, v in goal.items()) if isinstance(goal, dict) else goal))
        return
    if args.scheduler:
        if not args.quick:
            args.tokens = 4096
        with tempfile.TemporaryDirectory(prefix="routelog-bench-scheduler-") as tmp:
            report = scheduler_overhead(args, Path(tmp))
        if args.json:
            print(json.dumps(report, indent=1))
            return
        shape = f"{args.tokens} tokens x {args.layers} layers"
        print(f"a GIL-bound scheduler loop appending {args.rate:g} records/s of {shape}:")
        for mode, value in report["median_steps_per_second"].items():
            line = f"{mode:30s} {value:12.0f} steps/s"
            if mode in report["overhead"]:
                share = 100 * report["append_share"][mode]
                line += f"  overhead {report['overhead'][mode]:.4f} x (paired windows "
                line += f"{report['paired_overhead'][mode]:.4f} x, per CPU second of the loop "
                line += f"{report['paired_cpu_overhead'][mode]:.4f} x); append() holds the loop {share:.2f} %, the "
                line += f"engine process's CPU for the writer {100 * report['engine_cpu_share'][mode]:.2f} %"
            print(line)
        for name, key in (("", "paired_null_test"), (", per CPU second", "paired_cpu_null_test")):
            null = report[key]
            low, high = null["spread"]
            print(
                f"paired windows without a writer (A/A: the noise){name}: {null['median']:.4f} x, "
                f"trials {low:.4f}-{high:.4f} x"
            )
        where = ", ".join(f"{100 * share:.0f} % {name}" for name, share in report["writer_process_cpu_share"].items())
        print(f"the writer process's CPU fell in: {where}")
        if report["pinned"]:
            print("the loop on CPU 0, the writer process on the others (--pin)")
        print(f"goal: {report['goal']}")
        return

    servers = contextlib.ExitStack()
    endpoint = servers.enter_context(local_s3_server())
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
    import boto3

    boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench", region_name="us-east-1"
    ).create_bucket(Bucket="bench")
    os.environ.update(
        {k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")}
    )
    counts = [int(n) for n in args.writers.split(",")]
    report: dict[str, Any] = {
        "config": {
            "records_per_writer": args.records,
            "tokens": args.tokens,
            "layers": args.layers,
            "experts": 128,
            "topk": 8,
            "flush_mb": args.flush_mb,
            "routing": args.routing,
        }
    }
    with tempfile.TemporaryDirectory(prefix="routelog-bench-writers-") as tmp:
        root = Path(tmp)
        (root / "npy").mkdir()
        (root / "zstd").mkdir()
        report["np_save_local"] = baseline(args, root / "npy")
        report["zstd3_per_record_local"] = baseline(args, root / "zstd", "zstd-3")
        report["local"] = [run_writers(args, str(root / f"local-{n}"), n, env) for n in counts]
        report["s3_moto"] = [run_writers(args, f"s3://bench/{uuid.uuid4().hex}-{n}", n, env) for n in counts]
        report["encode_threads"] = encode_threads(args, root, env)
    servers.close()
    base = report["np_save_local"]["MBps"]
    zstd = report["zstd3_per_record_local"]["MBps"]
    report["ratios_vs_np_save"] = {
        f"{target}_{r['writers']}_writers": r["MBps"] / base for target in ("local", "s3_moto") for r in report[target]
    }
    one = next(r for r in report["local"] if r["writers"] == 1) if 1 in counts else None
    zstd_cpu = report["zstd3_per_record_local"]["cpu_seconds"]
    report["goals"] = {
        "one_writer_over_zstd3_per_record": None if one is None else one["MBps"] / zstd,
        "one_writer_over_zstd3_per_record_per_cpu_second": None if one is None else zstd_cpu / one["cpu_seconds"],
        "peak_rss_above_before_over_flush_buffer": None if one is None else one["rss_above_before_over_flush"],
        "one_writer_over_zstd3_per_record_by_encode_threads": {
            threads: r["over_zstd3_per_record"] for threads, r in report["encode_threads"].items()
        },
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    cfg = report["config"]
    print(
        f"{cfg['records_per_writer']} records x {cfg['tokens']} tokens x {cfg['layers']} layers (top-8 of 128, "
        f"{cfg['routing']} routing) per writer, parts of {cfg['flush_mb']} MiB"
    )
    print(f"np.save, local, no compression: {base:8.0f} MB/s; zstd-3 per record, local: {zstd:8.0f} MB/s")
    print(
        f"{'target':10s} {'writers':>8s} {'MB/s':>8s} {'x np.save':>10s} {'x zstd-3':>9s} {'peak RSS/writer MB':>19s} "
        f"{'above start / flush':>20s} {'objects/flush':>14s}"
    )
    for target in ("local", "s3_moto"):
        for r in report[target]:
            print(
                f"{target:10s} {r['writers']:8d} {r['MBps']:8.0f} {r['MBps'] / base:10.2f} {r['MBps'] / zstd:9.2f} "
                f"{r['peak_rss_mb_per_writer']:19.0f} {r['rss_above_before_over_flush']:20.2f} "
                f"{r['objects_per_flush']:14.1f}"
            )
    goals = report["goals"]
    if goals["one_writer_over_zstd3_per_record"] is not None:
        print(
            f"goals: one writer / zstd-3 per record {goals['one_writer_over_zstd3_per_record']:.2f} x (>= 1; per CPU "
            f"second {goals['one_writer_over_zstd3_per_record_per_cpu_second']:.2f} x); "
            f"peak RSS above its start {goals['peak_rss_above_before_over_flush_buffer']:.2f} x the flush buffer "
            "(<= 2)"
        )
    for threads, r in report["encode_threads"].items():
        print(
            f"one writer, local, encode_threads={threads}: {r['MBps']:6.0f} MB/s, "
            f"{r['over_zstd3_per_record']:.2f} x zstd-3 per record (median of {len(r['rounds_over_zstd3'])} rounds, "
            "each beside its own zstd-3 run)"
        )


if __name__ == "__main__":
    main()
