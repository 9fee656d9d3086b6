"""Ray: writer actors on a real local cluster, and Ray Data reads of several stores matching direct reads."""

from __future__ import annotations

import numpy as np
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
    from routelog.ray import remote_writer
    from routelog.transport import record_payload

    url = f"s3://{s3_bucket}/ray-writers"
    actors = [remote_writer(url, 3, f"actor-{i}", model_spec=SPEC, flush_bytes=500) for i in range(2)]
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
    index = read_index(urls).take_all()
    assert len(index) == 24
    assert {row["step"] for row in index} == {0, 1}
    for row in index:
        info = routelog.open_store(row["url"]).step(row["step"]).info(row["sample_id"])
        assert (row["policy_version"], row["group_id"]) == (info.policy_version, info.group_id)
        assert row["policy_version"] is None or isinstance(row["policy_version"], int)
    rows = read_routing(urls, steps=[1], moe_layers=[0, 2], batch_size=5).take_all()
    assert len(rows) == 12
    for row in rows:
        direct = routelog.open_store(row["url"]).step(1).read(row["sample_id"], moe_layers=[0, 2])
        np.testing.assert_array_equal(np.asarray(row["expert_ids"]), direct.expert_ids)
        np.testing.assert_array_equal(np.asarray(row["valid"]), direct.valid)
