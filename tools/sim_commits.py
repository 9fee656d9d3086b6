"""A discrete-event model of committing to one step from many writers, to extrapolate ``tools/bench_commits.py`` to
the scale users run (1,000 writers) and to compare the commit paths that were candidates.

The model sends, request by request, what each commit path sends (the sequences are written from routelog's own
code, with its constants: the backoff, the deadlines, 1,000-key listing pages, 64 connections per process) to an
object store with:

- a latency per request, drawn from a log-normal around ``--latency`` (``--jitter`` its sigma);
- a server time per request (``--service``): 0 for S3; the moto server of the benchmark answers one request at a
  time on two busy cores, which ``--validate`` calibrates;
- S3's per-prefix request rates (3,500 PUT/COPY/POST/DELETE and 5,500 GET/HEAD/LIST per second, a prefix being an
  object's directory; ``--prefix step`` makes a whole step one prefix), answered ``503 SlowDown`` past them and
  retried as routelog's storage retries (full-jitter backoff from 50 ms, six attempts, a 60 s deadline);
- conditional creates applied atomically at the store (412 when the key exists).

Commit paths (``--paths``):

- ``before``: routelog before format 4 (every writer appends its own entry after listing the whole log and reading
  every new entry and every new commit's index; its backoff restarting at 5 ms on each append, a 120 s deadline);
- ``own``: format 4, each writer through its own committer (the log listed from the last position read, digests
  instead of indexes, the backoff carried across appends);
- ``shared``: format 4, one committer (a Ray actor) for all writers: writers ask it and send it their parts over
  RPC, it appends everything that waits as one entry;
- ``lanes``: the candidate in which each writer appends to a log of its own and a shared log orders only drops and
  seals; exact reports (a record is only "committed" if no earlier copy of its sample id exists) then make every
  writer read every other lane's new entries before it reports.

Printed per scenario: commits done and failed, requests per commit (the protocol's, and with the parts' data
objects), creates per entry, how long the burst took to drain, commits per second, append p50/p99, and the time
and requests of a reader opening the unsealed step and of the seal. ``--validate BENCH.json`` runs the benchmark's
scenarios (N <= 64) in the model, calibrated to that machine, and prints both side by side; ``--json`` prints JSON.

    python tools/sim_commits.py --writers 16,64,256,1000 --parts 4 --paths shared,own,before
    python tools/bench_commits.py --json > bench.json && python tools/sim_commits.py --validate bench.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections import Counter
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import simpy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from routelog.store.committer import DEFAULT_MAX_GROUP, SHARED_REFRESH_SECONDS
from routelog.store.steplog import APPEND_DEADLINE, Backoff
from routelog.store.storage import S3_CONNECTIONS, RetryPolicy

Event = Generator[Any, Any, Any]
PUT_KINDS = frozenset({"PUT", "CPUT", "DELETE"})
LIST_PAGE = 1000
DATA_OBJECTS = 3
"""Objects of a part: ``routing/zarr.json``, its shard and ``index.parquet``."""


@dataclass
class Settings:
    latency: float = 0.03
    jitter: float = 0.35
    service: float = 0.0
    limits: bool = True
    prefix: str = "dir"
    build: float = 0.02
    """Seconds of CPU to build one part."""
    client_cores: int | None = None
    """Cores the writers share (the benchmark's client: 2); None: each writer has its own host."""
    rpc: float = 0.001
    """One way of a call to the committer actor."""
    committer_cpu: float = 0.0005
    """The committer actor's CPU per call (a lookup, or one part's commit): Ray's own 0.28-0.33 ms a call plus
    decoding, deciding and answering (measured on the development machine: 0.61 ms a call with 64 writer threads
    on the same two cores, ``bench_commits.py --committer ray``)."""
    shards: int = 1
    """Committer actors sharing the writers (``routelog.ray.start_committer(shards=...)``)."""
    view_cpu: float = 0.0
    """``before``: CPU seconds per commit of the step to evaluate it again after each read (every record's index
    row, on the writers' shared cores)."""

    seed: int = 0


class SlowDownError(Exception):
    """A request answered 503 six times (or past the 60 s deadline)."""


class Store:
    """The object store: latency, a serial server time, per-prefix rates, atomic conditional creates."""

    def __init__(self, env: simpy.Environment, settings: Settings) -> None:
        self.env, self.settings = env, settings
        self.rng = random.Random(settings.seed)
        self.keys: set[str] = set()
        self.log_size = 0
        self.counts: Counter[str] = Counter()
        self.server = simpy.Resource(env, capacity=1) if settings.service else None
        self._window: dict[tuple[str, str], list[float]] = {}
        self.retry = RetryPolicy()

    def _latency(self) -> float:
        s = self.settings
        return s.latency * math.exp(self.rng.gauss(0, s.jitter)) if s.jitter else s.latency

    def _admitted(self, kind: str, key: str) -> bool:
        """Whether the prefix of ``key`` takes one more request of ``kind`` in the last second."""
        if not self.settings.limits:
            return True
        prefix = key.rsplit("/", 1)[0] if self.settings.prefix == "dir" else "/".join(key.split("/")[:2])
        cls = "PUT" if kind in PUT_KINDS else "GET"
        rate = 3500 if cls == "PUT" else 5500
        window = self._window.setdefault((prefix, cls), [])
        now = self.env.now
        while window and window[0] <= now - 1.0:
            window.pop(0)
        if len(window) >= rate:
            return False
        window.append(now)
        return True

    def request(self, pool: simpy.Resource, kind: str, key: str, area: str) -> Event:
        """One request with the storage's retries; returns whether a ``CPUT`` created its key (True otherwise)."""
        start = self.env.now
        for attempt in range(self.retry.attempts):
            with pool.request() as connection:
                yield connection
                self.counts[f"{kind} {area}"] += 1
                yield self.env.timeout(self._latency() / 2)
                if self.server is not None:
                    with self.server.request() as turn:
                        yield turn
                        yield self.env.timeout(self.settings.service)
                admitted = self._admitted(kind, key)
                created = True
                if admitted and kind == "CPUT":
                    created = key not in self.keys
                    if created:
                        self.keys.add(key)
                        self.log_size += area == "log"
                yield self.env.timeout(self._latency() / 2)
            if admitted:
                return created
            self.counts["503 SlowDown"] += 1
            if attempt == self.retry.attempts - 1 or self.env.now - start > self.retry.deadline:
                break
            yield self.env.timeout(self.retry.delay(attempt))
        raise SlowDownError(key)

    def many(self, pool: simpy.Resource, kind: str, keys: list[str], area: str) -> Event:
        """Requests sent together (a process's concurrent reads or uploads); fails when one of them failed."""

        def one(key: str) -> Event:
            try:
                yield from self.request(pool, kind, key, area)
            except SlowDownError as exc:
                return exc
            return None

        if keys:
            done = yield self.env.all_of([self.env.process(one(k)) for k in keys])
            failed = [e for e in done.values() if e is not None]
            if failed:
                raise failed[0]

    def list_log(self, pool: simpy.Resource, start: int) -> Event:
        """A listing of the log from ``start`` on, in pages of 1,000 keys (one page at least)."""
        pages = max(1, math.ceil(max(0, self.log_size - start) / LIST_PAGE))
        for _ in range(pages):
            yield from self.request(pool, "LIST", "log/", "log")


class _Committer:
    """A committer actor: its queue, its one core (Python), its connections, and the log as it read it."""

    def __init__(self, env: simpy.Environment) -> None:
        self.queue: simpy.Store = simpy.Store(env)
        self.cpu = simpy.Resource(env, capacity=1)
        self.pool = simpy.Resource(env, capacity=S3_CONNECTIONS)
        self.seen = 0
        self.read_at = -math.inf


@dataclass
class Outcome:
    commits: int = 0
    failed_parts: int = 0
    failed_writers: int = 0
    entries: int = 0
    latencies: list[float] = field(default_factory=list)
    finished: float = 0.0


class Scenario:
    """One run: ``writers`` writers, ``parts`` parts each, all starting at time 0."""

    def __init__(self, path: str, writers: int, parts: int, settings: Settings) -> None:
        self.path, self.writers, self.parts, self.settings = path, writers, parts, settings
        self.env = simpy.Environment()
        self.store = Store(self.env, settings)
        self.outcome = Outcome()
        cores = settings.client_cores
        self.cpu = simpy.Resource(self.env, capacity=cores) if cores else None
        self.client_pool = simpy.Resource(self.env, capacity=S3_CONNECTIONS) if cores else None
        self.rng = random.Random(settings.seed + 1)
        self.lanes: list[str] = []
        """The lanes candidate: every lane entry created so far (its key is in its writer's directory)."""
        self.data_requests = 0
        self.waiting = 0
        self.all_open = self.env.event()
        self.open_requests = 0
        self.started = 0.0

    # -- what every path shares ----------------------------------------------------------------------------------
    def pool(self) -> simpy.Resource:
        """A writer's connections: the benchmark's writers share one process's, real writers have their own."""
        return self.client_pool or simpy.Resource(self.env, capacity=S3_CONNECTIONS)

    def build(self) -> Event:
        yield from self.compute(self.settings.build)

    def upload(self, pool: simpy.Resource, writer: int, part: int) -> Event:
        keys = [f"parts/w{writer}.{part}/object{i}" for i in range(DATA_OBJECTS)]
        self.data_requests += len(keys)
        yield from self.store.many(pool, "PUT", keys, "parts")

    def read_new(self, pool: simpy.Resource, seen: int, indexes: bool = False) -> Event:
        """List the log from ``seen`` and read what is new; returns the log's length. ``indexes``: also read each new
        commit's index and evaluate the whole step again (routelog before format 4)."""
        size = self.store.log_size
        yield from self.store.list_log(pool, seen)
        new = [f"log/{p}" for p in range(seen, size)]
        yield from self.store.many(pool, "GET", new, "log")
        if indexes:
            yield from self.store.many(pool, "GET", [f"parts/{k}/index" for k in new], "parts")
            yield from self.compute(self.settings.view_cpu * size)
        return size

    def compute(self, seconds: float) -> Event:
        """CPU work of a writer: on its own core, or on the benchmark's shared ones."""
        if self.cpu is None:
            yield self.env.timeout(seconds)
            return
        with self.cpu.request() as core:
            yield core
            yield self.env.timeout(seconds)

    def run(self) -> dict[str, Any]:
        starts = {
            "before": self.writer_before,
            "own": self.writer_own,
            "lanes": self.writer_lanes,
            "shared": self.writer_shared,
        }
        if self.path == "shared":
            self.committers = [_Committer(self.env) for _ in range(self.settings.shards)]
            for committer in self.committers:
                self.env.process(self.run_committer(committer))
        done = [self.env.process(starts[self.path](i)) for i in range(self.writers)]
        self.env.run(until=self.env.all_of(done))
        counts = dict(self.store.counts)
        total = sum(n for k, n in counts.items() if k != "503 SlowDown")
        commits = max(1, self.outcome.commits)
        reader = self.reader()
        return {
            "path": self.path if self.path != "shared" else f"shared x{self.settings.shards}",
            "writers": self.writers,
            "parts": self.parts,
            "commits": self.outcome.commits,
            "expected_commits": self.writers * self.parts,
            "failed_parts": self.outcome.failed_parts,
            "failed_writers": self.outcome.failed_writers,
            "entries": self.outcome.entries,
            "requests_per_commit": round(total / commits, 2),
            "protocol_requests_per_commit": round((total - self.data_requests) / commits, 2),
            "creates_per_entry": round(counts.get("CPUT log", 0) / max(1, self.outcome.entries), 2),
            "requests_per_step_per_part": round(total / (self.writers * self.parts), 2),
            "slowdowns": counts.get("503 SlowDown", 0),
            "open_requests_per_writer": round(self.open_requests / self.writers, 2),
            "requests_per_commit_with_open": round((total + self.open_requests) / commits, 2),
            "drain_s": round(self.outcome.finished - self.started, 2),
            "commits_per_s": round(self.outcome.commits / max(self.outcome.finished - self.started, 1e-9), 1),
            "append_p50_s": round(statistics.median(self.outcome.latencies), 3) if self.outcome.latencies else None,
            "append_p99_s": round(_percentile(self.outcome.latencies, 99), 3) if self.outcome.latencies else None,
            **reader,
        }

    def opened(self) -> Event:
        """Wait until every writer is open: the burst starts together, and what opening cost is counted apart (as
        the benchmark's ``open`` phase)."""
        self.waiting += 1
        if self.waiting == self.writers:
            self.open_requests = sum(self.store.counts.values())
            self.store.counts.clear()
            self.started = self.env.now
            self.all_open.succeed()
        yield self.all_open

    def commit_done(self, began: float, parts: int = 1) -> None:
        self.outcome.commits += parts
        self.outcome.latencies += [self.env.now - began] * parts
        self.outcome.finished = max(self.outcome.finished, self.env.now)

    # -- routelog before format 4 ----------------------------------------------------------------------------------
    def writer_before(self, writer: int) -> Event:
        pool = self.pool()
        committed = 0
        try:
            seen = yield from self.read_new(pool, 0, indexes=True)  # the writer's first read of the step
            for _ in range(2):  # _SEALED.json and _SEALING.json: s3fs's exists is a HEAD, then a listing
                yield from self.store.request(pool, "HEAD", "seal/x", "seal")
                yield from self.store.request(pool, "LIST", "other/x", "other")
            yield from self.opened()
            for part in range(self.parts):
                yield from self.build()
                began = self.env.now
                for _ in range(2):
                    yield from self.store.request(pool, "HEAD", "seal/x", "seal")
                    yield from self.store.request(pool, "LIST", "other/x", "other")
                seen = yield from self.read_new(pool, seen, indexes=True)
                yield from self.upload(pool, writer, part)
                deadline = self.env.now + APPEND_DEADLINE
                attempt = 0
                while True:
                    position = seen  # the next position after what it read
                    created = yield from self.store.request(pool, "CPUT", f"log/{position}", "log")
                    if created:
                        seen = position + 1
                        self.outcome.entries += 1
                        break
                    yield from self.store.request(pool, "GET", f"log/{position}", "log")  # read back
                    seen = yield from self.read_new(pool, seen)  # the append reads entries, not indexes
                    if self.env.now > deadline:
                        raise SlowDownError("deadline")
                    yield self.env.timeout(self.rng.uniform(0, min(0.5, 0.005 * 2 ** min(attempt, 7))))
                    attempt += 1
                self.commit_done(began)
                committed += 1
                seen = yield from self.read_new(pool, seen, indexes=True)  # the writer's refresh after its commit
        except SlowDownError:
            self.outcome.failed_writers += 1
            self.outcome.failed_parts += self.parts - committed

    # -- format 4: a writer's own committer ------------------------------------------------------------------------
    def writer_own(self, writer: int) -> Event:
        pool = self.pool()
        backoff = Backoff()
        backoff_rng = random.Random(self.settings.seed * 7919 + writer)
        committed = 0
        try:
            seen = yield from self.read_new(pool, 0)  # the lookup that opens the writer
            yield from self.store.request(pool, "GET", "seal/_SEALING", "seal")
            yield from self.opened()
            for part in range(self.parts):
                yield from self.build()
                began = self.env.now
                seen = yield from self.read_new(pool, seen)  # the stage's lookup
                yield from self.store.request(pool, "GET", "seal/_SEALING", "seal")
                yield from self.upload(pool, writer, part)
                deadline = self.env.now + APPEND_DEADLINE
                while True:
                    yield self.env.timeout(_wait(backoff, backoff_rng))
                    position = seen
                    sent = self.env.now
                    created = yield from self.store.request(pool, "CPUT", f"log/{position}", "log")
                    backoff.observe(self.env.now - sent)
                    if created:
                        backoff.won()
                        seen = position + 1
                        self.outcome.entries += 1
                        break
                    backoff.lost()
                    seen = yield from self.read_new(pool, seen)
                    if self.env.now > deadline:
                        raise SlowDownError("deadline")
                self.commit_done(began)
                committed += 1
        except SlowDownError:
            self.outcome.failed_writers += 1
            self.outcome.failed_parts += self.parts - committed

    # -- the lanes candidate ---------------------------------------------------------------------------------------
    def writer_lanes(self, writer: int) -> Event:
        pool = self.pool()
        committed = 0
        seen = 0
        try:
            yield from self.opened()
            for part in range(self.parts):
                yield from self.build()
                began = self.env.now
                yield from self.upload(pool, writer, part)
                yield from self.store.request(pool, "CPUT", f"lanes/w{writer}/{part}", "log")
                self.lanes.append(f"lanes/w{writer}/{part}")
                self.outcome.entries += 1
                yield from self.store.request(pool, "GET", "seal/_SEALING", "seal")
                # exact reports: every lane's new entries are read (lanes are listed whole: no common start key)
                size = len(self.lanes)
                for _ in range(max(1, math.ceil(size / LIST_PAGE))):
                    yield from self.store.request(pool, "LIST", "lanes/", "log")
                yield from self.store.many(pool, "GET", self.lanes[seen:size], "log")
                seen = size
                self.commit_done(began)
                committed += 1
        except SlowDownError:
            self.outcome.failed_writers += 1
            self.outcome.failed_parts += self.parts - committed

    # -- format 4: one committer for every writer -------------------------------------------------------------------
    def writer_shared(self, writer: int) -> Event:
        pool = self.pool()
        committer = self.committers[writer % len(self.committers)]
        committed = 0
        try:
            yield from self.lookup(committer)
            yield from self.opened()
            for part in range(self.parts):
                yield from self.build()
                began = self.env.now
                yield from self.lookup(committer)
                yield from self.upload(pool, writer, part)
                reply = self.env.event()
                yield self.env.timeout(self.settings.rpc)
                yield committer.queue.put(reply)
                ok = yield reply
                yield self.env.timeout(self.settings.rpc)
                if not ok:
                    raise SlowDownError("committer")
                self.commit_done(began)
                committed += 1
        except SlowDownError:
            self.outcome.failed_writers += 1
            self.outcome.failed_parts += self.parts - committed

    def lookup(self, committer: _Committer) -> Event:
        """A writer's question to its committer: the log is read again at most every refresh interval."""
        yield self.env.timeout(self.settings.rpc)
        with committer.cpu.request() as turn:
            yield turn
            yield self.env.timeout(self.settings.committer_cpu)
        if self.env.now - committer.read_at >= SHARED_REFRESH_SECONDS:
            committer.read_at = self.env.now
            committer.seen = yield from self.read_new(committer.pool, committer.seen)
            yield from self.store.request(committer.pool, "GET", "seal/_SEALING", "seal")
        yield self.env.timeout(self.settings.rpc)

    def run_committer(self, committer: _Committer) -> Event:
        """Flat combining: while one entry is being created the parts that arrive queue up; the next takes them.
        Several committers append to the one log as any appenders do (a lost position is read, then the next)."""
        while True:
            first = yield committer.queue.get()
            batch = [first]
            while committer.queue.items and len(batch) < DEFAULT_MAX_GROUP:
                batch.append((yield committer.queue.get()))
            with committer.cpu.request() as turn:
                yield turn
                yield self.env.timeout(self.settings.committer_cpu * len(batch))
            try:
                while True:
                    key = f"log/{committer.seen}"
                    created = yield from self.store.request(committer.pool, "CPUT", key, "log")
                    if created:
                        committer.seen += 1
                        break
                    committer.seen = yield from self.read_new(committer.pool, committer.seen)
                self.outcome.entries += 1
                for reply in batch:
                    reply.succeed(True)
            except SlowDownError:
                for reply in batch:
                    reply.succeed(False)

    # -- readers and the seal --------------------------------------------------------------------------------------
    def reader(self) -> dict[str, Any]:
        """A reader opening the unsealed step, then a sealer, with one process's connections each."""
        before = sum(self.store.counts.values())
        start = self.env.now
        pool = simpy.Resource(self.env, capacity=S3_CONNECTIONS)
        entries = self.outcome.entries
        commits = self.outcome.commits

        def open_step() -> Event:
            yield from self.store.request(pool, "GET", "seal/_SEALED", "seal")
            yield from self.store.list_log(pool, 0)
            yield from self.store.many(pool, "GET", [f"log/{p}" for p in range(entries)], "log")
            yield from self.store.many(pool, "GET", [f"parts/{c}/index" for c in range(commits)], "parts")

        self.env.run(until=self.env.process(open_step()))
        opened = self.env.now - start
        reader_requests = sum(self.store.counts.values()) - before

        def seal() -> Event:
            yield from self.store.request(pool, "PUT", "seal/_SEALING", "seal")
            yield from open_step()  # the sealer reads the step
            yield from self.store.many(pool, "PUT", ["seal/_sealed/commits", "seal/_sealed/index"], "seal")
            yield from self.store.request(pool, "CPUT", f"log/{entries}", "log")
            yield from self.store.request(pool, "CPUT", "seal/_SEALED", "seal")

        before = sum(self.store.counts.values())
        self.env.run(until=self.env.process(seal()))
        return {
            "reader_open_s": round(opened, 3),
            "reader_open_requests": reader_requests,
            "seal_requests": sum(self.store.counts.values()) - before,
        }


def _wait(backoff: Backoff, rng: random.Random) -> float:
    """``Backoff.wait`` with the model's own random draws (reproducible)."""
    if not backoff.level:
        return 0.0
    return rng.uniform(0, min(Backoff.MAX_WAIT, backoff.slot * backoff.level))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


# -- validation against the benchmark ---------------------------------------------------------------------------------
BEFORE_MEASURED = {
    (4, 1): {"requests_per_commit": 19.5, "creates_per_entry": 2.5},
    (16, 1): {"requests_per_commit": 48.6, "creates_per_entry": 8.2},
    (16, 4): {"requests_per_commit": 53.3, "creates_per_entry": 7.7},
    (64, 1): {"requests_per_commit": 146.0, "creates_per_entry": 9.5},
}
"""routelog before format 4 on the benchmark's machine (issue #52's table: moto behind the proxy, 30 ms)."""


def validation_settings(bench: dict[str, Any], service: float) -> Settings:
    return Settings(
        latency=float(bench["latency_s"]), jitter=0.0, service=service, limits=False, client_cores=2, build=0.03
    )


def validate(bench: dict[str, Any], service: float, seeds: int) -> list[dict[str, Any]]:
    """Each benchmark scenario beside the model's (calibrated: the benchmark's two cores, its moto), and the
    measured figures of routelog before format 4 beside its model."""
    rows = []
    for measured in bench["scenarios"]:
        path = {"own": "own", "shared": "shared", "ray": "shared"}[measured["committer"]]
        modeled = _averaged(path, measured["writers"], measured["parts"], validation_settings(bench, service), seeds)
        rows.append(_side_by_side(f"{measured['committer']} (bench)", measured, modeled))
    for (writers, parts), measured in BEFORE_MEASURED.items():  # measured with each writer's opening counted
        modeled = _averaged("before", writers, parts, validation_settings(bench, service), seeds, with_open=True)
        rows.append(_side_by_side("before (issue #52)", {"writers": writers, "parts": parts, **measured}, modeled))
    return rows


def _averaged(
    path: str, writers: int, parts: int, settings: Settings, seeds: int, *, with_open: bool = False
) -> dict[str, Any]:
    runs = [Scenario(path, writers, parts, Settings(**{**settings.__dict__, "seed": s})).run() for s in range(seeds)]
    requests = "requests_per_commit_with_open" if with_open else "requests_per_commit"
    return {
        "requests_per_commit": statistics.mean(r[requests] for r in runs),
        "creates_per_entry": statistics.mean(r["creates_per_entry"] for r in runs),
    }


def _side_by_side(label: str, measured: dict[str, Any], modeled: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"what": label, "writers": measured["writers"], "parts": measured["parts"]}
    for key in ("requests_per_commit", "creates_per_entry"):
        row[f"{key}_measured"] = measured[key]
        row[f"{key}_model"] = round(modeled[key], 2)
        row[f"{key}_ratio"] = round(modeled[key] / measured[key], 2) if measured[key] else None
    return row


def _scenarios(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    settings = Settings(
        latency=args.latency,
        jitter=args.jitter,
        limits=not args.no_limits,
        prefix=args.prefix,
        seed=args.seed,
        shards=args.shards,
        committer_cpu=args.committer_cpu,
    )
    for path in args.paths.split(","):
        for writers in (int(n) for n in args.writers.split(",")):
            for parts in (int(p) for p in args.parts.split(",")):
                if path in ("before", "own", "lanes") and writers * parts > args.max_contended:
                    yield {"path": path, "writers": writers, "parts": parts, "skipped": "--max-contended"}
                    continue
                yield Scenario(path, writers, parts, settings).run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writers", default="16,64,256,1000")
    parser.add_argument("--parts", default="4")
    parser.add_argument("--paths", default="shared,own,lanes,before")
    parser.add_argument("--latency", type=float, default=0.03)
    parser.add_argument("--jitter", type=float, default=0.35)
    parser.add_argument("--prefix", choices=("dir", "step"), default="dir")
    parser.add_argument("--no-limits", action="store_true", help="no per-prefix request rates")
    parser.add_argument("--max-contended", type=int, default=4000, help="largest N x P modelled for contended paths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1, help="committer actors of the shared path")
    parser.add_argument("--committer-cpu", type=float, default=Settings.committer_cpu, help="seconds a call")
    parser.add_argument("--validate", type=Path, help="a bench_commits.py --json report")
    parser.add_argument("--service", type=float, default=0.004, help="--validate: moto's seconds per request")
    parser.add_argument("--seeds", type=int, default=3, help="--validate: model runs averaged per scenario")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.validate:
        rows = validate(json.loads(args.validate.read_text()), args.service, args.seeds)
    else:
        rows = list(_scenarios(args))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for row in rows:
        print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
