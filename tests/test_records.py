"""Bad input: every rule of a record raises a typed error naming the sample, the field and the fix, and nothing
already appended or committed is lost."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import routelog
from routelog import DuplicateSampleError, InvalidRecordError, ModelSpec, Record, Segment


def _record(
    spec: ModelSpec, rng: np.random.Generator, make_routing: Callable[..., np.ndarray], **overrides: Any
) -> Record:
    tokens = overrides.pop("tokens", 12)
    fields: dict[str, Any] = {
        "sample_id": "req-7/0",
        "expert_ids": make_routing(rng, tokens, spec.num_moe_layers, spec.num_experts, spec.topk),
        "prompt_len": 4,
        "response_len": tokens - 4,
    }
    fields.update(overrides)
    return Record(**fields)


def _bad_cases(spec: ModelSpec, good: np.ndarray) -> list[tuple[str, dict[str, Any], str, str]]:
    """(case, overrides, field, words of the message)."""
    dup = good.copy()
    dup[3, 1, 1] = dup[3, 1, 0]
    high = good.astype(np.int64)
    high[5, 2, 0] = spec.num_experts
    neg = good.astype(np.int64)
    neg[2, 0, 3] = -1
    return [
        ("wrong rank", {"expert_ids": good[:, 0]}, "expert_ids", "3 axes"),
        (
            "full layer axis",
            {"expert_ids": np.zeros((12, spec.num_layers, spec.topk), np.int64)},
            "expert_ids",
            "to_moe_axis",
        ),
        ("topk differs", {"expert_ids": good[:, :, :2]}, "expert_ids", "top-k 2"),
        ("row count", {"expert_ids": good[:-1]}, "expert_ids", "valid=False"),
        ("id too large", {"expert_ids": high}, "expert_ids", "outside [0, num_experts"),
        ("negative id", {"expert_ids": neg}, "expert_ids", "outside"),
        ("duplicate id", {"expert_ids": dup}, "expert_ids", "repeats an expert"),
        ("float ids", {"expert_ids": good.astype(np.float32)}, "expert_ids", "integer dtype"),
        ("valid mask shape", {"valid": np.ones(11, bool)}, "valid", "shape (12,)"),
        ("token ids length", {"token_ids": np.arange(5)}, "token_ids", "12 integer ids"),
        (
            "token hash",
            {"token_ids": np.arange(12), "token_hash": routelog.token_hash(np.arange(1, 13))},
            "token_hash",
            "does not match",
        ),
        (
            "segments order",
            {"segments": [Segment(start=4, end=12), Segment(start=0, end=4)]},
            "segments[1]",
            "out of order",
        ),
        ("segment past end", {"segments": [Segment(start=0, end=13)]}, "segments[0]", "outside"),
        ("extra not json", {"extra": {"x": object()}}, "extra", "JSON"),
        ("negative length", {"prompt_len": -1, "response_len": 13}, "prompt_len", "non-negative"),
    ]


def test_every_bad_input_is_a_typed_error_naming_sample_field_and_fix(
    memory_url: str, dense_first_spec: ModelSpec, make_routing: Callable[..., np.ndarray]
) -> None:
    spec = dense_first_spec
    rng = np.random.default_rng(0)
    good = make_routing(rng, 12, spec.num_moe_layers, spec.num_experts, spec.topk)
    with routelog.open_writer(memory_url, step=0, model_spec=spec, writer_id="w") as writer:
        writer.append(_record(spec, rng, make_routing, sample_id="kept-before"))
        for case, overrides, field, words in _bad_cases(spec, good):
            record = _record(spec, rng, make_routing, **{"expert_ids": good, **overrides})
            with pytest.raises(InvalidRecordError) as info:
                writer.append(record)
            error = info.value
            assert error.field == field, case
            assert error.sample_id == "req-7/0", case
            assert words in str(error), (case, str(error))
            assert "Fix:" in str(error), case
        writer.append(_record(spec, rng, make_routing, sample_id="kept-after"))
    snapshot = routelog.open_store(memory_url).step(0)
    assert snapshot.sample_ids == ["kept-before", "kept-after"], "rejected records must not cost others"


def test_error_names_the_token_and_global_layer(
    memory_url: str, dense_first_spec: ModelSpec, make_routing: Callable[..., np.ndarray]
) -> None:
    spec = dense_first_spec  # MoE layers start at global layer 3
    rng = np.random.default_rng(1)
    ids = make_routing(rng, 12, spec.num_moe_layers, spec.num_experts, spec.topk)
    ids[7, 2, 1] = ids[7, 2, 0]
    valid = np.ones(12, bool)
    valid[0] = False  # the error must still name the input position, not the stored row
    with (
        routelog.open_writer(memory_url, step=0, model_spec=spec) as writer,
        pytest.raises(InvalidRecordError, match="token 7, layer 5"),
    ):
        writer.append(Record(sample_id="s", expert_ids=ids, prompt_len=2, response_len=10, valid=valid))


def test_dtype_too_narrow_for_the_experts(memory_url: str, make_routing: Callable[..., np.ndarray]) -> None:
    spec = ModelSpec(num_layers=2, moe_layers=(0, 1), num_experts=384, topk=8)
    ids = make_routing(np.random.default_rng(2), 5, 2, 256, 8).astype(np.uint8)
    with routelog.open_writer(memory_url, step=0, model_spec=spec) as writer:
        with pytest.raises(InvalidRecordError, match="cannot hold expert IDs up to 383"):
            writer.append(Record(sample_id="narrow", expert_ids=ids, prompt_len=1, response_len=4))
        writer.abort()


def test_repeated_sample_id_in_a_step(
    memory_url: str, small_spec: ModelSpec, make_routing: Callable[..., np.ndarray]
) -> None:
    rng = np.random.default_rng(3)
    with routelog.open_writer(memory_url, step=1, model_spec=small_spec, flush_bytes=1) as writer:
        writer.append(_record(small_spec, rng, make_routing, sample_id="a"))  # flushed: already committed
        with pytest.raises(DuplicateSampleError, match="already appended") as info:
            writer.append(_record(small_spec, rng, make_routing, sample_id="a"))
        assert info.value.field == "sample_id"
    assert routelog.open_store(memory_url).step(1).sample_ids == ["a"]


def test_empty_sample_id(memory_url: str, small_spec: ModelSpec, make_routing: Callable[..., np.ndarray]) -> None:
    rng = np.random.default_rng(4)
    with routelog.open_writer(memory_url, step=0, model_spec=small_spec) as writer:
        with pytest.raises(InvalidRecordError, match="non-empty string"):
            writer.append(_record(small_spec, rng, make_routing, sample_id=""))
        writer.abort()


def test_token_hash_is_blake2b_of_little_endian_int64() -> None:
    import hashlib

    ids = [5, 1, 2**20]
    expected = hashlib.blake2b(np.array(ids, dtype="<i8").tobytes(), digest_size=16).hexdigest()
    assert routelog.token_hash(ids) == "blake2b-128:" + expected
    assert routelog.token_hash(np.array(ids, dtype=np.int32)) == routelog.token_hash(ids)
