"""Commit benchmark: N writers committing P parts each to one step at once, on a real S3 server (moto) behind the
fault proxy with a set latency, every request counted at the proxy by kind and phase.

Each scenario runs its writers as threads of one client process (so that 64 writers fit on two cores); the moto
server and the proxy run in this process, which counts what reaches the proxy. The client stops between phases, so
each phase's requests are its own:

- ``open``: the writers open (each asks its committer whether the step takes records);
- ``write``: every writer appends the records of one part and flushes, P times, all writers starting together
  (a part's *append latency* is its flush: build, upload and commit);
- ``reader``: a reader opens the unsealed step (``Store.step``);
- ``seal``: the step is sealed;
- ``sealed reader``: a reader opens the sealed step.

Committers (``--committer``): ``own`` (each writer commits through its own, contending for the step's log),
``shared`` (one :class:`routelog.Committer` shared by the client's writers), ``ray`` (a committer actor of a local
Ray cluster, ``routelog.ray.start_committer``: the writers reach it over Ray as they would from rollout workers).

Printed per scenario: commits done and failed, requests per commit (all, and the commit protocol's alone, without
the parts' data objects), creates per log entry (attempts), commits per second, append p50/p99, the requests of a
reader opening the step before and after the seal, and of the seal. ``--json`` prints the report as JSON.
``tools/sim_commits.py`` models the same request sequences and prints its figures beside these.

    python tools/bench_commits.py --writers 4,16,64 --parts 1,4 --latency 0.03 --committer own,shared
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from routelog.fault_proxy import FaultProxy
from routelog.testing import local_s3_server

PHASES = ("open", "write", "reader", "seal", "sealed reader")
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
TIMEOUT = 1800.0
"""Seconds one scenario may take in all (every wait is bounded)."""


def request_kind(method: str, target: str, headers: frozenset[str]) -> str:
    """LIST, GET, HEAD, conditional PUT (``If-None-Match``), PUT, DELETE or POST."""
    if method == "GET" and ("list-type=" in target or re.search(r"[?&]prefix=", target)):
        return "LIST"
    if method == "PUT" and "if-none-match" in headers:
        return "PUT-if-none-match"
    return method


def request_area(target: str) -> str:
    """What a request touches: the step's log, a part's data, the seal's objects, or anything else."""
    path = target.split("?", 1)[0]
    if "/log/" in path or ("prefix=" in target and "log" in target):
        return "log"
    if "/parts/" in path:
        return "parts"
    if "_SEAL" in path or "/_sealed/" in path:
        return "seal"
    return "other"


class Counts:
    """Requests seen by the proxy since the last :meth:`take`, by kind and area."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()

    def __call__(self, method: str, target: str, headers: frozenset[str]) -> None:
        with self._lock:
            self._counts[(request_kind(method, target, headers), request_area(target))] += 1

    def take(self) -> dict[str, int]:
        with self._lock:
            counts, self._counts = self._counts, Counter()
        return {f"{kind} {area}": n for (kind, area), n in sorted(counts.items())}


# -- the client: N writers as threads ---------------------------------------------------------------------------------
def client(options: dict[str, Any]) -> None:
    """Run one scenario's phases, pausing after each until the parent has taken its counts."""
    import numpy as np

    import routelog
    from routelog.synth import synthetic_spec
    from tests.records import sample_records

    writers, parts, records = options["writers"], options["parts"], options["records"]
    storage_options = {"endpoint_url": options["endpoint"], "skip_instance_cache": True}
    url = options["url"]
    spec = synthetic_spec(layers=8, experts=64, topk=4)
    routelog.create_store(url, spec, storage_options=storage_options)
    committer: Any = None
    if options["committer"] == "shared":
        committer = routelog.Committer(routelog.open_store(url, storage_options=storage_options))
    elif options["committer"] == "ray":
        import ray

        from routelog.ray import start_committer

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        committer = start_committer(url, storage_options=storage_options)

    def phase(name: str) -> None:
        print(f"PHASE {name}", flush=True)
        if sys.stdin.readline().strip() != "OK":
            raise SystemExit("the parent went away")

    opened: list[Any] = [None] * writers
    errors: dict[int, str] = {}
    latencies: list[float] = []
    lock = threading.Lock()

    def open_writer(i: int) -> None:
        store = routelog.open_store(url, storage_options=storage_options)
        try:
            opened[i] = store.writer(0, f"w{i:04d}", flush_bytes=1 << 40, flush_seconds=None, committer=committer)
        except Exception as exc:
            errors[i] = repr(exc)

    _run_all([threading.Thread(target=open_writer, args=(i,)) for i in range(writers)])
    phase("open")
    usage_before = _committer_usage(options)
    start = threading.Barrier(writers, timeout=TIMEOUT)

    def write(i: int) -> None:
        writer = opened[i]
        if writer is None:
            return
        try:
            start.wait()
            for p in range(parts):
                for record in sample_records(spec, records, seed=i * 1000 + p, prefix=f"w{i}-p{p}-", tokens=(32, 96)):
                    writer.append(record)
                began = time.monotonic()
                writer.flush()
                with lock:
                    latencies.append(time.monotonic() - began)
            writer.close()
        except Exception as exc:
            errors[i] = repr(exc)
            writer.abort()

    began = time.monotonic()
    _run_all([threading.Thread(target=write, args=(i,)) for i in range(writers)])
    wall = time.monotonic() - began
    commits = sum(len(w.commits) for w in opened if w is not None)
    usage = _committer_usage(options)
    phase("write")
    reader = routelog.open_store(url, storage_options=storage_options)
    snapshot = reader.step(0)
    phase("reader")
    reader.seal(0)
    phase("seal")
    sealed = routelog.open_store(url, storage_options=storage_options).step(0)
    phase("sealed reader")
    entries = reader.storage.list(f"steps/{0:010d}/log")
    per_call = None
    if usage is not None and usage_before is not None:
        calls = usage["lookup"] + usage["commit"] - usage_before["lookup"] - usage_before["commit"]
        per_call = round((usage["cpu_s"] - usage_before["cpu_s"]) / max(1, calls), 5)
    result = {
        "commits": commits,
        "expected_commits": writers * parts,
        "failed_writers": len(errors),
        "errors": sorted(set(errors.values()))[:3],
        "entries": len(entries) - 1,  # the seal's aside
        "records_read": len(snapshot),
        "records_sealed": len(sealed),
        "wall_s": round(wall, 3),
        "append_p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "append_p99_s": round(float(np.percentile(latencies, 99)), 3) if latencies else None,
        "committer_cpu_s_per_call": per_call,
    }
    print("RESULT " + json.dumps(result), flush=True)
    if options["committer"] == "ray":
        import ray

        ray.shutdown()


def _committer_usage(options: dict[str, Any]) -> dict[str, float] | None:
    """The committer actor's calls and CPU seconds so far (``ray`` scenarios)."""
    if options["committer"] != "ray":
        return None
    import ray

    from routelog.ray import _STARTED

    (first, *_) = next(iter(_STARTED.values()))
    return dict(json.loads(ray.get(first.usage.remote())))


def _run_all(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)


# -- the parent: moto, the proxy and the counts ----------------------------------------------------------------------
def scenario(
    proxy: FaultProxy, counts: Counts, writers: int, parts: int, committer: str, records: int
) -> dict[str, Any]:
    """Run one scenario in a client process; its figures and the requests of each phase."""
    options = {
        "writers": writers,
        "parts": parts,
        "records": records,
        "committer": committer,
        "endpoint": proxy.endpoint,
        "url": f"s3://bench/{uuid.uuid4().hex[:12]}",
    }
    env = {**os.environ, **S3_ENV, "AWS_ENDPOINT_URL": proxy.endpoint, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--client", json.dumps(options)]
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=Path(__file__).parent.parent
    )
    assert process.stdin is not None and process.stdout is not None
    counts.take()
    phases: dict[str, dict[str, int]] = {}
    result: dict[str, Any] = {}
    deadline = time.monotonic() + TIMEOUT
    for line in process.stdout:
        if line.startswith("PHASE "):
            phases[line.split(" ", 1)[1].strip()] = counts.take()
            process.stdin.write("OK\n")
            process.stdin.flush()
        elif line.startswith("RESULT "):
            result = json.loads(line.split(" ", 1)[1])
        if time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"scenario {options} ran past {TIMEOUT:.0f} s")
    process.wait(timeout=60)
    if not result:
        raise SystemExit(f"scenario {options} failed (exit {process.returncode})")
    return {"writers": writers, "parts": parts, "committer": committer, **result, **_figures(result, phases)}


def _figures(result: dict[str, Any], phases: dict[str, dict[str, int]]) -> dict[str, Any]:
    write = phases["write"]
    commits = max(1, result["commits"])
    total = sum(write.values())
    data = sum(n for k, n in write.items() if k.startswith("PUT ") and k.endswith(" parts"))
    creates = sum(n for k, n in write.items() if k.startswith("PUT-if-none-match") and k.endswith(" log"))
    return {
        "requests_per_commit": round(total / commits, 2),
        "protocol_requests_per_commit": round((total - data) / commits, 2),
        "data_puts_per_commit": round(data / commits, 2),
        "creates_per_entry": round(creates / max(1, result["entries"]), 2),
        "commits_per_s": round(result["commits"] / max(result["wall_s"], 1e-9), 1),
        "open_requests_per_writer": round(sum(phases["open"].values()) / max(1, result["expected_commits"]), 2),
        "reader_open_requests": sum(phases["reader"].values()),
        "seal_requests": sum(phases["seal"].values()),
        "sealed_reader_open_requests": sum(phases["sealed reader"].values()),
        "phases": phases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writers", default="4,16,64", help="writer counts, comma-separated")
    parser.add_argument("--parts", default="1,4", help="parts per writer, comma-separated")
    parser.add_argument("--committer", default="own,shared", help="own, shared and/or ray, comma-separated")
    parser.add_argument("--latency", type=float, default=0.03, help="seconds the proxy adds to every request")
    parser.add_argument("--records", type=int, default=4, help="records per part")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client(json.loads(args.client))
        return
    for key, value in S3_ENV.items():
        os.environ.setdefault(key, value)
    counts = Counts()
    report: dict[str, Any] = {"latency_s": args.latency, "scenarios": []}
    with local_s3_server() as endpoint, FaultProxy(endpoint, latency=args.latency, observer=counts) as proxy:
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        for committer in args.committer.split(","):
            for writers in (int(n) for n in args.writers.split(",")):
                for parts in (int(p) for p in args.parts.split(",")):
                    row = scenario(proxy, counts, writers, parts, committer, args.records)
                    report["scenarios"].append(row)
                    if not args.json:
                        _print_row(row)
    if args.json:
        print(json.dumps(report, indent=2))


def _print_row(row: dict[str, Any]) -> None:
    print(
        f"{row['committer']:>6} N={row['writers']:<4} P={row['parts']} commits {row['commits']}/"
        f"{row['expected_commits']} failed writers {row['failed_writers']} | requests/commit "
        f"{row['requests_per_commit']} (protocol {row['protocol_requests_per_commit']}, data "
        f"{row['data_puts_per_commit']}) | entries {row['entries']}, creates/entry {row['creates_per_entry']} | "
        f"{row['commits_per_s']} commits/s, append p50 {row['append_p50_s']} s p99 {row['append_p99_s']} s | "
        f"reader open {row['reader_open_requests']}, seal {row['seal_requests']}, sealed reader "
        f"{row['sealed_reader_open_requests']}",
        flush=True,
    )
    if row["errors"]:
        print(f"       errors: {row['errors']}", flush=True)


if __name__ == "__main__":
    main()
