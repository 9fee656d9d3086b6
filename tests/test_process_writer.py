"""The writer process: records cross into it through shared memory and JSON (no pickle) and read back exactly;
a record it refuses is reported at the caller's next call, naming the sample; no shared memory is left behind."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import routelog
from routelog import ProcessWriter, Record, Segment
from routelog.synth import synthetic_spec
from routelog.writer import WriterError
from tests.records import random_routing

SPEC = synthetic_spec(layers=4, experts=32, topk=4)


def _record(rng: np.random.Generator, sid: str, n: int) -> Record:
    valid = np.ones(n, bool)
    valid[-1] = False
    return Record(
        sample_id=sid,
        expert_ids=random_routing(rng, n, SPEC.num_moe_layers, SPEC.num_experts, SPEC.topk),
        prompt_len=3,
        response_len=n - 3,
        valid=valid,
        token_ids=rng.integers(0, 1000, n),
        group_id="g",
        policy_version=2,
        segments=[Segment(start=0, end=3, source="prompt"), Segment(start=3, end=n, source="response")],
        extra={"reward": 0.5},
        token_values={"logprob_infer": rng.normal(size=n).astype(np.float32)},
        weights=rng.random((n, SPEC.num_moe_layers, SPEC.topk)).astype(np.float32),
    )


def _segments() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_records_written_through_the_process_read_back_exactly(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    records = [_record(rng, f"r{i}", int(rng.integers(5, 300))) for i in range(12)]
    before = _segments()
    url = str(tmp_path / "store")
    with ProcessWriter(url, 0, model_spec=SPEC, writer_id="engine", segments=2) as writer:
        for record in records:
            writer.append(record)
    assert _segments() == before, "the shared memory is freed"
    snapshot = routelog.open_store(url).step(0)
    got = {r.sample_id: r for r in snapshot.read_many([r.sample_id for r in records], weights=True)}
    values = snapshot.token_values([r.sample_id for r in records], ["logprob_infer"])
    for record in records:
        back = got[record.sample_id]
        valid = np.asarray(record.valid)
        np.testing.assert_array_equal(back.expert_ids[valid], np.sort(np.asarray(record.expert_ids), -1)[valid])
        assert back.info.segments == list(record.segments) and back.info.extra == '{"reward": 0.5}'
        assert back.info.token_hash == routelog.token_hash(np.asarray(record.token_ids))
        np.testing.assert_array_equal(
            values[record.sample_id]["logprob_infer"], np.asarray(record.token_values["logprob_infer"])
        )  # type: ignore[index]
        assert back.weights is not None and not np.isnan(back.weights[:, valid]).any()


def test_a_refused_record_is_reported_at_the_next_call_naming_it(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    good, bad = _record(rng, "good", 20), _record(rng, "bad", 20)
    ids = np.asarray(bad.expert_ids).copy()
    ids[4, 1] = [0, 0, 1, 2]  # a repeated expert
    bad = Record(**{**bad.__dict__, "expert_ids": ids})
    url = str(tmp_path / "store")
    writer = ProcessWriter(url, 0, model_spec=SPEC, writer_id="engine")
    writer.append(bad)
    writer.append(good)
    with pytest.raises(WriterError, match=r"'bad'.*repeats an expert") as caught:
        writer.flush()
    assert caught.value.sample_ids == ["bad"]
    writer.close()
    assert routelog.open_store(url).step(0).sample_ids == ["good"], "the good record is committed"


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="POSIX process priorities")
def test_the_writer_process_runs_at_a_lower_priority_than_the_engine(tmp_path: Path) -> None:
    spec = synthetic_spec(2, 16, 2)
    with ProcessWriter(str(tmp_path / "store"), 0, model_spec=spec, niceness=7) as writer:
        engine = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, writer._child.pid) == min(19, engine + 7)
    with ProcessWriter(str(tmp_path / "store2"), 0, model_spec=spec, niceness=0) as writer:
        assert os.getpriority(os.PRIO_PROCESS, writer._child.pid) == os.getpriority(os.PRIO_PROCESS, 0)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity (Linux)")
def test_the_writer_process_keeps_to_the_cpus_it_is_given(tmp_path: Path) -> None:
    spec = synthetic_spec(2, 16, 2)
    engine = os.sched_getaffinity(0)
    writer_cpus = {max(engine)}
    with ProcessWriter(str(tmp_path / "store"), 0, model_spec=spec, cpus=writer_cpus) as writer:
        assert os.sched_getaffinity(writer._child.pid) == writer_cpus
        writer.append(
            Record(sample_id="a", expert_ids=np.array([[[0, 1], [2, 3]]], np.uint8), prompt_len=0, response_len=1)
        )
    assert os.sched_getaffinity(0) == engine  # the engine's own mask is untouched
    assert routelog.open_store(str(tmp_path / "store")).step(0).read("a").expert_ids.tolist() == [[[0, 1], [2, 3]]]
    with ProcessWriter(str(tmp_path / "store2"), 0, model_spec=spec) as writer:
        assert os.sched_getaffinity(writer._child.pid) == engine  # by default the child inherits the engine's
    for wrong in (set(), {os.cpu_count() or 1}, {-1}):
        with pytest.raises(ValueError, match="cpus="):
            ProcessWriter(str(tmp_path / "store3"), 0, model_spec=spec, cpus=wrong)


def test_the_writer_process_warms_its_routings_kernels_before_it_is_ready(tmp_path: Path) -> None:
    from routelog.ranked import kernel_path

    spec = synthetic_spec(2, 300, 3)  # uint16 IDs
    with ProcessWriter(str(tmp_path / "store"), 0, model_spec=spec) as writer:
        assert set(writer.warm_up_seconds) == {kernel_path(300, 3)} == {"uint16 IDs"}
        assert all(seconds > 0 for seconds in writer.warm_up_seconds.values())
    with ProcessWriter(str(tmp_path / "store2"), 0, model_spec=spec, warm_up=False) as writer:
        assert writer.warm_up_seconds == {}
