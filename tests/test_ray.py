"""Ray: writer actors on a real local cluster, and Ray Data reads of several stores matching direct reads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import routelog
from routelog import ModelSpec, Record
from tests.records import sample_records

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.usefixtures("ray_cluster")

SPEC = ModelSpec(name="ray", num_layers=4, moe_layers=(1, 2, 3), num_experts=32, topk=4)


def make_records(prefix: str, n: int, seed: int) -> list[Record]:
    return sample_records(SPEC, n, seed, prefix, tokens=(5, 40), policy_version=1)


def test_writer_actors_commit_to_s3(s3_bucket: str) -> None:
    from routelog.format.transport import record_payload
    from routelog.ray import remote_writer

    url = f"s3://{s3_bucket}/ray-writers"
    actors = [  # the second compresses on two threads
        remote_writer(url, 3, f"actor-{i}", model_spec=SPEC, flush_bytes=500, encode_threads=1 + i) for i in range(2)
    ]
    records = {i: make_records(f"a{i}-", 12, seed=i) for i in range(2)}
    ray.get([actor.append_many.remote([record_payload(r) for r in records[i]]) for i, actor in enumerate(actors)])
    parts = ray.get([actor.close.remote() for actor in actors])
    assert all(len(p) >= 2 for p in parts)
    snapshot = routelog.open_store(url).step(3)
    assert sorted(snapshot.sample_ids) == sorted(r.sample_id for rs in records.values() for r in rs)
    got = snapshot.read("a1-s5")
    want = records[1][5]
    np.testing.assert_array_equal(got.expert_ids[:-1], np.sort(want.expert_ids, -1)[:-1])
    assert got.info.group_id == "g2"


def test_writer_inside_a_rollout_worker(tmp_path: object) -> None:
    from routelog.ray import ray_writer_id

    url = f"{tmp_path}/store"
    routelog.create_store(url, SPEC)

    @ray.remote(num_cpus=0.5)
    class RolloutWorker:
        def generate_and_log(self, n: int) -> str:
            writer_id = ray_writer_id("rollout")
            with routelog.open_writer(url, 0, writer_id=writer_id) as writer:
                for record in make_records(f"{writer_id}/", n, seed=1):
                    writer.append(record)
            return writer_id

    worker = RolloutWorker.remote()  # type: ignore[attr-defined]
    writer_id = ray.get(worker.generate_and_log.remote(5))
    assert writer_id.startswith("rollout-")
    assert ray.get(worker.generate_and_log.remote(0)) == writer_id, "stable per actor"
    assert len(routelog.open_store(url).step(0)) == 5


def test_ray_data_reads_many_stores(tmp_path: object) -> None:
    from routelog.ray import read_index, read_routing

    urls = []
    for s in range(2):
        url = f"{tmp_path}/run-{s}"
        for step in (0, 1):
            with routelog.open_writer(url, step, model_spec=SPEC, flush_bytes=2000) as writer:
                for i, record in enumerate(make_records(f"s{s}-{step}-", 6, seed=10 * s + step)):
                    if i % 2:  # absent metadata must stay absent (None), not become NaN
                        record.policy_version, record.group_id = None, None
                    writer.append(record)
        urls.append(url)
    dataset = read_index(urls)
    schema = dataset.schema(fetch_if_missing=True)
    for name, kind in zip(schema.names, schema.types, strict=True):  # plain columns: nothing for Ray to pickle
        assert not pa.types.is_struct(kind) and not (pa.types.is_list(kind) and pa.types.is_struct(kind.value_type)), (
            name
        )
    index = dataset.take_all()
    assert len(index) == 24
    assert {row["step"] for row in index} == {0, 1}
    for row in index:
        info = routelog.open_store(row["url"]).step(row["step"]).info(row["sample_id"])
        assert (row["policy_version"], row["group_id"]) == (info.policy_version, info.group_id)
        assert row["policy_version"] is None or isinstance(row["policy_version"], int)
        assert list(row["spans_token_start"]) == [span.token_start for span in info.spans]
        assert list(row["spans_n_rows"]) == [span.n_rows for span in info.spans]
    routing = read_routing(urls, steps=[1], moe_layers=[0, 2], batch_size=5).materialize()
    for name, kind in zip(*_schema(routing), strict=True):  # Arrow types and Ray's tensor extension, never pickle
        assert "PythonObject" not in type(kind).__name__, (name, kind)
    rows = routing.take_all()
    assert len(rows) == 12
    for row in rows:
        direct = routelog.open_store(row["url"]).step(1).read(row["sample_id"], moe_layers=[0, 2])
        np.testing.assert_array_equal(np.asarray(row["expert_ids"]), direct.expert_ids)
        np.testing.assert_array_equal(np.asarray(row["valid"]), direct.valid)


def _schema(dataset: Any) -> tuple[list[str], list[Any]]:
    schema = dataset.schema()
    return list(schema.names), list(schema.types)


RAY_USER = """
import sys, numpy as np, routelog
from routelog.format.transport import record_payload
from routelog.ray import read_index, read_routing, remote_writer
from tests.records import sample_records
spec = routelog.ModelSpec(name="ray", num_layers=4, moe_layers=(1, 2, 3), num_experts=32, topk=4)
actor = remote_writer(sys.argv[1], step=4, writer_id="rollout-1", model_spec=spec)
records = sample_records(spec, 4, 0, "s", tokens=(5, 40), policy_version=1)
import ray
ray.get(actor.append_many.remote([record_payload(r) for r in records]))
ray.get(actor.close.remote())
print(read_index([sys.argv[1]]).count(), read_routing([sys.argv[1]], steps=[4]).take(1)[0]["expert_ids"].shape)
"""


def test_a_users_first_ray_session_is_quiet_and_pickles_nothing(tmp_path: Path) -> None:
    """As the README's Ray snippet runs in a fresh process: Ray started by routelog, no INFO lines from Ray or Ray
    Data, and no column falls back to pickled Python objects (a warning a worker forwards to the driver)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, "-c", RAY_USER, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("4 ("), result.stdout
    output = result.stdout + result.stderr
    assert "pickle" not in output, output
    assert not [line for line in output.splitlines() if " INFO " in line], output


def test_concurrent_tasks_get_their_own_writer_ids(tmp_path: Path) -> None:
    """Ray task ids end with the job's part: ids cut from their tail were one id for every task, and concurrent
    tasks' commits collided (one task's records refused). Each task here holds its writer open until every task
    has opened one, so their commits are concurrent."""
    from routelog.ray import ray_writer_id

    url = f"{tmp_path}/store"
    routelog.create_store(url, SPEC)
    gate = tmp_path / "gate"
    gate.mkdir()
    tasks = 3

    @ray.remote(num_cpus=0)  # they wait for each other: CPUs other tests' actors still hold must not keep one out
    def generate_and_log(task: int) -> tuple[str, str]:
        writer_id = ray_writer_id("rollout")
        with routelog.open_writer(url, 0, writer_id=writer_id) as writer:
            (gate / str(task)).touch()
            deadline = time.monotonic() + 120
            while len(list(gate.iterdir())) < tasks:  # every task's writer is open (bounded: Ray starts workers)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {sorted(p.name for p in gate.iterdir())} of {tasks} tasks started")
                time.sleep(0.05)
            for record in make_records(f"t{task}-", 4, seed=task):
                writer.append(record)
        return writer_id, ray_writer_id("rollout")

    ids = ray.get([generate_and_log.remote(task) for task in range(tasks)], timeout=300)
    assert all(first == again for first, again in ids), "stable within a task"
    writer_ids = [first for first, _ in ids]
    assert len(set(writer_ids)) == tasks, writer_ids
    assert all(re.fullmatch(r"rollout-[0-9a-f]{16}", w) for w in writer_ids), writer_ids
    snapshot = routelog.open_store(url).step(0)
    assert sorted(snapshot.sample_ids) == sorted(f"t{t}-s{i}" for t in range(tasks) for i in range(4))
    for task in range(tasks):
        want = make_records(f"t{task}-", 4, seed=task)[2]
        np.testing.assert_array_equal(snapshot.read(want.sample_id).expert_ids[:-1], np.sort(want.expert_ids, -1)[:-1])


def test_writer_actors_commit_through_a_committer_actor(s3_bucket: str) -> None:
    """Rollout workers' writers commit through one committer actor (their parts in few log entries, requests and
    replies as JSON); when it dies for good, they commit through their own committers, and nothing is lost."""
    from routelog.format.documents import CommitGroup, parse_log_document
    from routelog.format.transport import record_payload
    from routelog.ray import committer_name, remote_writer, start_committer, stop_committer

    url = f"s3://{s3_bucket}/ray-committer"
    routelog.create_store(url, SPEC)
    start_committer(url, max_restarts=0)
    name = committer_name(url)
    actors = [remote_writer(url, 0, f"actor-{i}", num_cpus=0.25, flush_bytes=1 << 30, committer=name) for i in range(4)]
    records = {i: make_records(f"a{i}-", 6, seed=i) for i in range(4)}
    ray.get([a.append_many.remote([record_payload(r) for r in records[i][:3]]) for i, a in enumerate(actors)])
    assert sum(ray.get([a.flush.remote() for a in actors])) == 4
    store = routelog.open_store(url)
    directory = "steps/0000000000/log"
    log = [parse_log_document(store.storage.read(f"{directory}/{n}"), n) for n in store.storage.list(directory)]
    assert all(isinstance(e, CommitGroup) and e.committer.startswith("committer-") for e in log)
    stop_committer(url)
    ray.get([a.append_many.remote([record_payload(r) for r in records[i][3:]]) for i, a in enumerate(actors)])
    parts = ray.get([a.close.remote() for a in actors])
    assert all(len(p) == 2 for p in parts)
    snapshot = routelog.open_store(url).step(0)
    assert sorted(snapshot.sample_ids) == sorted(r.sample_id for rs in records.values() for r in rs)
