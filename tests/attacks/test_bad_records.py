"""One bad record never sinks the others: everything a part stores is validated at ``append``, and a writer that
still hits an error while flushing keeps its good records and stays usable."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import routelog
from routelog import InvalidRecordError, Record, Segment
from routelog.store.writer import WriterError
from tests.attacks.kit import SPEC, make_records


def _good(i: int = 0) -> Record:
    return make_records(SPEC, 3, seed=5)[i]


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def _with(**changes: Any) -> Record:
    record = _good(2)
    for name, value in changes.items():
        setattr(record, name, value)
    return record


BAD: dict[str, tuple[Record, str]] = {
    "token id beyond int32": (_with(token_ids=np.full(_good(2).n_tokens, 2**31, np.int64)), "token_ids"),
    "negative token id": (_with(token_ids=np.full(_good(2).n_tokens, -1, np.int64)), "token_ids"),
    "token ids beyond int64": (_with(token_ids=[10**20] * _good(2).n_tokens), "token_ids"),
    "ragged token ids": (_with(token_ids=[[1, 2], [3]]), "token_ids"),
    "lone surrogate in the sample id": (_with(sample_id="s\udc80"), "sample_id"),
    "a sample id of 5000 characters": (_with(sample_id="x" * 5000), "sample_id"),
    "token hash not hex": (_with(token_ids=None, token_hash="blake2b-128:" + "z" * 32), "token_hash"),
    "token hash not a string": (_with(token_ids=None, token_hash=12), "token_hash"),
    "values of strings": (_with(token_values={"logprob_infer": ["-0.5"] * _good(2).n_tokens}), "logprob_infer"),
    "values of complex numbers": (_with(token_values={"logprob_infer": np.ones(_good(2).n_tokens) * 1j}), "logprob"),
    "group id a number": (_with(group_id=7), "group_id"),
    "engine a list": (_with(engine=["vllm"]), "engine"),
    "policy version a bool": (_with(policy_version=True), "policy_version"),
    "policy version a float": (_with(policy_version=1.5), "policy_version"),
    "segments not a list": (_with(segments="prompt"), "segments"),
    "a segment that is not one": (_with(segments=[{"start": "a"}]), "segments[0]"),
    "extra not a mapping": (_with(extra=["a"]), "extra"),
    "extra nested too deep": (_with(extra={"a": _nested(70)}), "extra"),
    "floats as expert ids": (_with(expert_ids=np.asarray(_good(2).expert_ids, np.float64)), "expert_ids"),
    "a record longer than the format allows": (_with(prompt_len=1 << 22, response_len=1), "prompt_len"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_records_are_refused_at_append_and_the_part_commits(memory_url: str, case: str) -> None:
    record, field = BAD[case]
    store = routelog.create_store(memory_url, SPEC)
    with store.writer(0, "w") as writer:
        writer.append(_good(0))
        with pytest.raises(InvalidRecordError) as info:
            writer.append(record)
        writer.append(_good(1))
    assert field in str(info.value)
    assert sorted(store.step(0).sample_ids) == sorted([_good(0).sample_id, _good(1).sample_id])


def test_segments_may_be_dicts(memory_url: str) -> None:
    record = _good(0)
    n = record.n_tokens
    given: list[Any] = [{"start": 0, "end": 2, "source": "prompt"}, Segment(start=2, end=n, source="response")]
    record.segments = given
    store = routelog.create_store(memory_url, SPEC)
    with store.writer(0, "w") as writer:
        writer.append(record)
    assert [s.source for s in store.step(0).info(record.sample_id).segments] == ["prompt", "response"]


def test_a_record_that_fails_at_flush_costs_only_itself(memory_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Should building a part still fail for one record, the part is retried without it: the good records are
    committed, the bad one is reported by sample id, and the writer stays usable."""
    import routelog.store.writer as writer_module

    real_build = writer_module.build_part

    def build(records: list[Any], *args: Any, **kwargs: Any) -> Any:
        if any(r.row.sample_id == "s1" for r in records):
            raise OverflowError("simulated: a value that passed validation does not fit its column")
        return real_build(records, *args, **kwargs)

    monkeypatch.setattr(writer_module, "build_part", build)
    store = routelog.create_store(memory_url, SPEC)
    writer = store.writer(0, "w")
    for i in range(3):
        writer.append(_good(i))
    with pytest.raises(WriterError) as info:
        writer.flush()
    assert info.value.sample_ids == ["s1"]
    assert "s1" in str(info.value) and "OverflowError" in str(info.value)
    assert sorted(store.step(0).sample_ids) == ["s0", "s2"]
    writer.append(make_records(SPEC, 1, seed=9, prefix="later/")[0])  # still usable
    writer.close()
    assert sorted(store.step(0).sample_ids) == ["later/s0", "s0", "s2"]


def test_a_failed_upload_is_reported_once_and_its_records_may_be_sent_again(memory_url: str) -> None:
    store = routelog.create_store(memory_url, SPEC)
    writer = store.writer(0, "w", background=False)
    original = store.storage.write_many
    failures = [PermissionError("simulated: access denied once")]

    def write_many(objects: dict[str, bytes]) -> None:
        if failures:
            raise failures.pop()
        original(objects)

    store.storage.write_many = write_many  # type: ignore[method-assign]
    first = _good(0)
    writer.append(first)
    with pytest.raises(WriterError) as info:
        writer.flush()
    assert info.value.sample_ids == [first.sample_id]
    assert store.steps() == [], "nothing of the failed part is visible"
    writer.append(first)  # not committed, so it may be appended again
    writer.append(_good(1))
    assert len(writer.flush()) == 1
    writer.close()
    assert sorted(store.step(0).sample_ids) == ["s0", "s1"]
