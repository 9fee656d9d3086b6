"""Engine adapters, with payloads built from each engine's documented encoding (np.save + base64, raw int32 +
base64, nested JSON lists, veRL's padded batch, slime's per-sample tensor)."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import routelog
from routelog import IngestError, ModelSpec, PartOptions
from routelog.engines import Payload, TurnStitcher, payload_to_record, sglang, slime, to_full_axis, verl, vllm
from routelog.store.verify import verify_store

DSV3 = ModelSpec.from_hf_config(  # dense-first: layers 0-2 dense
    {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 8,
        "first_k_dense_replace": 3,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_group": 8,
        "topk_group": 4,
    }
)
INTERLEAVED = ModelSpec.from_hf_config(  # MoE on odd layers
    {
        "model_type": "qwen2_moe",
        "num_hidden_layers": 8,
        "decoder_sparse_step": 2,
        "num_experts": 32,
        "num_experts_per_tok": 4,
    }
)
WIDE = ModelSpec.from_hf_config(  # E > 256: uint16 on the wire
    {
        "model_type": "kimi_k2",
        "num_hidden_layers": 5,
        "first_k_dense_replace": 1,
        "n_routed_experts": 384,
        "num_experts_per_tok": 8,
    }
)
SPECS = {"dense-first": DSV3, "interleaved": INTERLEAVED, "wide": WIDE}


def truth(spec: ModelSpec, tokens: int, seed: int) -> np.ndarray:
    """``[tokens, n_moe_layers, K]`` routing in score order (distinct experts per row)."""
    rng = np.random.default_rng(seed)
    keys = rng.random((tokens, spec.num_moe_layers, spec.num_experts))
    return np.argsort(keys, axis=-1)[..., : spec.topk].astype(np.int64)


def npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def wire_dtype(spec: ModelSpec) -> type:
    return np.uint8 if spec.num_experts <= 256 else np.uint16


def vllm_022_choice(spec: ModelSpec, ids: np.ndarray, start: int = 0) -> str:
    """What vLLM 0.22+ returns: full layer axis (dense layers 0), rows [start, T - 1), uint8/uint16 .npy, base64."""
    return npy_b64(to_full_axis(ids[start:-1], spec, fill=0).astype(wire_dtype(spec)))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_vllm_http_022_two_choices(name: str) -> None:
    spec = SPECS[name]
    prompt = list(range(100, 107))
    outs = [truth(spec, 7 + n, seed=n) for n in (5, 9)]
    response = {
        "id": "cmpl-abc",
        "prompt_token_ids": prompt,
        "choices": [
            {
                "index": i,
                "token_ids": list(range(200, 200 + out.shape[0] - 7)),
                "routed_experts": vllm_022_choice(spec, out),
            }
            for i, out in enumerate(outs)
        ],
    }
    records = vllm.records_from_http(response, spec, policy_version=4)
    assert [r.sample_id for r in records] == ["cmpl-abc/0", "cmpl-abc/1"]
    for record, ids in zip(records, outs, strict=True):
        assert record.group_id == "cmpl-abc"
        assert record.prompt_len == 7
        valid = np.asarray(record.valid)
        assert not valid[-1] and valid[:-1].all(), "the final token is never forwarded"
        np.testing.assert_array_equal(np.asarray(record.expert_ids)[:-1], ids[:-1])
        # Round trip to the engine's own layout is exact (score order kept by the record).
        assert vllm.to_http_choice(record, spec) == vllm_022_choice(spec, ids)


def test_vllm_prompt_start_and_request_prompt() -> None:
    spec = DSV3
    ids = truth(spec, 12, seed=1)
    request = {"prompt": list(range(8)), "routed_experts_prompt_start": 5}
    response = {
        "id": "cmpl-s",
        "choices": [{"token_ids": [9, 9, 9, 9], "routed_experts": vllm_022_choice(spec, ids, 5)}],
    }
    (record,) = vllm.records_from_http(response, spec, request=request)
    valid = np.asarray(record.valid)
    assert valid.tolist() == [False] * 5 + [True] * 6 + [False]
    np.testing.assert_array_equal(np.asarray(record.expert_ids)[5:11], ids[5:11])


@pytest.mark.parametrize("trailing_zero_layers", [False, True])
def test_vllm_021_nested_lists_on_the_moe_axis(trailing_zero_layers: bool) -> None:
    spec = DSV3
    ids = truth(spec, 10, seed=2)
    rows = ids[:-1].astype(np.int16)
    if trailing_zero_layers:  # 0.21 counted all 8 layers as MoE for first_k_dense_replace models
        rows = np.concatenate([rows, np.zeros((9, 3, spec.topk), np.int16)], axis=1)
    response = {
        "id": "cmpl-21",
        "prompt_token_ids": list(range(4)),
        "prompt_routed_experts": rows[:4].tolist(),
        "choices": [{"index": 0, "token_ids": list(range(6)), "routed_experts": rows[4:].tolist()}],
    }
    (record,) = vllm.records_from_http(response, spec)
    np.testing.assert_array_equal(np.asarray(record.expert_ids)[:-1], ids[:-1])


def test_vllm_in_process_0_20_int32_full_axis() -> None:
    spec = INTERLEAVED
    ids = truth(spec, 9, seed=3)
    output = SimpleNamespace(
        request_id="req-9",
        prompt_token_ids=[1, 2, 3],
        outputs=[
            SimpleNamespace(token_ids=[4, 5, 6, 7, 8, 9], routed_experts=to_full_axis(ids[:-1], spec).astype(np.int32))
        ],
    )
    record = vllm.record_from_output(output, spec, engine_version="0.20.0")
    assert record.sample_id == "req-9"
    np.testing.assert_array_equal(np.asarray(record.expert_ids)[:-1], ids[:-1])
    assert record.engine == "vllm"


def sglang_meta(spec: ModelSpec, ids: np.ndarray, start: int = 0) -> str:
    """What SGLang returns: flat raw int32, full layer axis, rows [start, T - 1), base64, no header."""
    return base64.b64encode(to_full_axis(ids[start:-1], spec).astype("<i4").tobytes()).decode()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_sglang_generate_round_trip(name: str) -> None:
    spec = SPECS[name]
    ids = truth(spec, 15, seed=4)
    request = {"input_ids": list(range(6)), "return_routed_experts": True}
    response = {"output_ids": list(range(9)), "meta_info": {"id": "rid-1", "routed_experts": sglang_meta(spec, ids)}}
    (record,) = sglang.records_from_http(response, spec, request=request)
    assert record.sample_id == "rid-1"
    np.testing.assert_array_equal(np.asarray(record.expert_ids)[:-1], ids[:-1])
    assert sglang.to_meta_info(record, spec) == sglang_meta(spec, ids)


def test_sglang_turns_stitch_on_start_len_and_refuse_a_changed_prefix() -> None:
    spec = DSV3
    ids = truth(spec, 30, seed=5)
    tokens = np.arange(1000, 1030)
    stitcher = TurnStitcher(spec, "session-1")
    # Turn 1: prompt 5, response 6 -> tokens [0, 11); turn 2 re-sends those plus 4 tool tokens and 9 new; turn 3 ...
    for turn, (prompt_end, end, start) in enumerate([(5, 11, 0), (15, 24, 10), (26, 30, 23)]):
        meta = {"id": f"rid-{turn}", "routed_experts": sglang_meta(spec, ids[:end], start)}
        request = {"input_ids": tokens[:prompt_end].tolist(), "routed_experts_start_len": start}
        response = {"output_ids": tokens[prompt_end:end].tolist(), "meta_info": meta}
        rows = sglang.record_from_generate(response, spec, request=request)
        payload = Payload(f"rid-{turn}", np.asarray(rows.expert_ids)[start : end - 1], start)
        stitcher.add_turn(payload, tokens[:end], prompt_end, policy_version=turn)
    record = stitcher.record(group_id="g")
    valid = np.asarray(record.valid)
    assert valid[:-1].all() and not valid[-1]
    np.testing.assert_array_equal(np.asarray(record.expert_ids)[:-1], ids[:-1])
    assert [(s.start, s.end, s.policy_version) for s in record.segments] == [(0, 10, 0), (10, 23, 1), (23, 30, 2)]
    bad = tokens[:40].copy()
    bad[3] = 7  # a re-rendered template: the prefix is not what the earlier turns saw
    with pytest.raises(IngestError, match="first difference at position 3"):
        stitcher.add_turn(Payload("rid-x", to_full_axis(np.zeros((9, 5, 6), np.int64), spec), 30), bad[:40], 31)


def test_sglang_openai_choices() -> None:
    """SGLang 0.5.9+ puts the first choice's routing in the response-level ``sglext`` (the fixtures under
    tests/fixtures/engines cover every version's exact payload)."""
    spec = INTERLEAVED
    ids = truth(spec, 8, seed=6)
    response = {
        "id": "chatcmpl-1",
        "prompt_token_ids": [1, 2, 3],
        "choices": [{"index": 0, "token_ids": [4, 5, 6, 7, 8]}],
        "sglext": {"routed_experts": sglang_meta(spec, ids)},
    }
    (record,) = sglang.records_from_http(response, spec)
    np.testing.assert_array_equal(np.asarray(record.expert_ids)[:-1], ids[:-1])


def verl_batch(
    spec: ModelSpec, seqs: list[tuple[np.ndarray, int]], prompt_max: int, response_max: int, axis: str
) -> dict[str, Any]:
    """veRL's batch built by hand: left-padded prompts, right-padded responses, zeros elsewhere and on the final
    token, int16."""
    layers = spec.num_layers if axis == "full" else spec.num_moe_layers
    routes = np.zeros((len(seqs), prompt_max + response_max, layers, spec.topk), np.int16)
    mask = np.zeros((len(seqs), prompt_max + response_max), np.int64)
    tokens = np.zeros_like(mask)
    for b, (ids, prompt_len) in enumerate(seqs):
        n = ids.shape[0]
        begin = prompt_max - prompt_len
        rows = to_full_axis(ids[:-1], spec) if axis == "full" else ids[:-1]
        routes[b, begin : begin + n - 1] = rows
        mask[b, begin : begin + n] = 1
        tokens[b, begin : begin + n] = np.arange(n) + 10 * b
    return {
        "routed_experts": routes,
        "attention_mask": mask,
        "input_ids": tokens,
        "prompts": tokens[:, :prompt_max],
        "responses": tokens[:, prompt_max:],
    }


@pytest.mark.parametrize("axis", ["full", "moe"])
def test_verl_batch_round_trip(axis: str) -> None:
    spec = DSV3
    seqs = [(truth(spec, 9, seed=7), 3), (truth(spec, 14, seed=8), 6), (truth(spec, 5, seed=9), 5)]
    batch = verl_batch(spec, seqs, prompt_max=6, response_max=8, axis=axis)
    records = verl.records_from_arrays(batch, spec, "batch-3")
    assert [r.sample_id for r in records] == ["batch-3/0", "batch-3/1", "batch-3/2"]
    for record, (ids, prompt_len) in zip(records, seqs, strict=True):
        assert (record.prompt_len, record.n_tokens) == (prompt_len, ids.shape[0])
        np.testing.assert_array_equal(np.asarray(record.expert_ids)[:-1], ids[:-1])
        assert not np.asarray(record.valid)[-1]
    back = verl.to_batch(records, spec, prompt_length=6, response_length=8, layer_axis=axis)  # type: ignore[arg-type]
    for key in ("routed_experts", "attention_mask", "input_ids", "responses"):
        np.testing.assert_array_equal(back[key], batch[key])


def test_slime_sample_round_trip() -> None:
    spec = WIDE
    ids = truth(spec, 11, seed=10)
    tokens = np.arange(11) + 500
    sample = {
        "rollout_routed_experts": to_full_axis(ids[:-1], spec).astype(np.int32),
        "tokens": tokens,
        "response_length": np.asarray(7),
    }
    record = slime.record_from_sample(sample["rollout_routed_experts"], tokens, 7, spec, sample_id="s-1")
    assert record.prompt_len == 4
    back = slime.to_sample(record, spec)
    for key, value in sample.items():
        np.testing.assert_array_equal(back[key], value)


# -- bad payloads -----------------------------------------------------------------------------------------------
def _vllm_response(rows: Any) -> dict[str, Any]:
    return {
        "id": "cmpl-bad",
        "prompt_token_ids": [1, 2, 3],
        "choices": [{"token_ids": [4, 5, 6], "routed_experts": rows}],
    }


@pytest.mark.parametrize(
    ("rows", "words"),
    [
        (lambda s, ids: npy_b64(to_full_axis(ids[:-2], s).astype(np.uint8)), "4 routing rows, expected 5"),
        (lambda s, ids: npy_b64(to_full_axis(ids[:-1, :, :4], s).astype(np.uint8)), "top-k 4"),
        (lambda s, ids: npy_b64(np.full((5, s.num_layers, s.topk), 70, np.uint8)), "expert ID 70"),
        (lambda s, ids: npy_b64(to_full_axis(ids[:-1], s).astype(np.uint8))[:-9], "not valid base64"),
        (lambda s, ids: npy_b64(ids[:-1, :3].astype(np.uint8)), "matches|8 decoder layers"),
    ],
    ids=["row count", "wrong K", "id out of range", "truncated base64", "layer axis matches neither"],
)
def test_bad_vllm_payloads_name_the_request(rows: Any, words: str) -> None:
    ids = truth(DSV3, 6, seed=11)
    with pytest.raises(IngestError, match=words) as info:
        vllm.records_from_http(_vllm_response(rows(DSV3, ids)), DSV3)
    assert "cmpl-bad" in str(info.value)


def test_bad_sglang_payloads_name_the_request() -> None:
    ids = truth(DSV3, 6, seed=12)
    good = sglang_meta(DSV3, ids)
    request = {"input_ids": [1, 2, 3]}
    for text, words in [
        (good[:-6], "base64|whole number"),
        (sglang_meta(DSV3, ids[:-1]), "4 routing rows, expected 5"),
    ]:
        response = {"output_ids": [4, 5, 6], "meta_info": {"id": "rid-bad", "routed_experts": text}}
        with pytest.raises(IngestError, match=words) as info:
            sglang.records_from_http(response, DSV3, request=request)
        assert "rid-bad" in str(info.value)


def test_sglang_pipeline_parallel_zero_layers_are_refused() -> None:
    ids = truth(DSV3, 12, seed=13)
    full = to_full_axis(ids[:-1], DSV3)
    full[:, 5:] = 0  # only the first pipeline stage's layers were captured
    meta = {"id": "rid-pp", "routed_experts": base64.b64encode(full.astype("<i4").tobytes()).decode()}
    with pytest.raises(IngestError, match=r"MoE layers \[5, 6, 7\] are all zeros"):
        sglang.records_from_http(
            {"output_ids": list(range(6)), "meta_info": meta}, DSV3, request={"input_ids": list(range(6))}
        )


# -- the four R3 bugs from the field (vLLM + veRL, DeepSeek-V3-style models) -------------------------------------
def test_bug_capture_never_bound_all_zero_routes_are_refused() -> None:
    """vLLM 0.15: the capturer was bound before it existed; every route arrived as zeros."""
    zeros = np.zeros((9, DSV3.num_layers, DSV3.topk), np.int32)
    output = SimpleNamespace(
        request_id="req-0", prompt_token_ids=[1] * 4, outputs=[SimpleNamespace(token_ids=[2] * 6, routed_experts=zeros)]
    )
    with pytest.raises(IngestError, match="all zeros for every token"):
        vllm.record_from_output(output, DSV3)


def test_bug_physical_eplb_ids_are_mapped_to_logical() -> None:
    """EPLB replicas give physical IDs beyond the logical range; Megatron replays logical IDs."""
    spec = DSV3
    ids = truth(spec, 8, seed=14)
    physical_to_logical = np.concatenate([np.arange(64), np.arange(0, 64, 4)])  # 16 redundant replicas
    logical_to_physical = {e: 64 + e // 4 for e in range(0, 64, 4)}
    physical = np.vectorize(lambda e: logical_to_physical.get(int(e), int(e)))(ids)
    response = {
        "id": "cmpl-eplb",
        "prompt_token_ids": [1, 2, 3],
        "choices": [{"token_ids": [4, 5, 6, 7, 8], "routed_experts": vllm_022_choice(spec, physical)}],
    }
    with pytest.raises(IngestError, match="physical-to-logical"):
        vllm.records_from_http(response, spec)
    (record,) = vllm.records_from_http(response, spec, physical_to_logical=physical_to_logical)
    np.testing.assert_array_equal(np.asarray(record.expert_ids)[:-1], ids[:-1])


def test_bug_dense_prefix_does_not_shift_the_layers() -> None:
    """A full-axis payload indexed 'i + offset' over the routers shifts every MoE layer after the dense ones;
    layers must be addressed by their global index."""
    spec = DSV3  # dense 0-2, MoE 3-7
    full = np.zeros((4, spec.num_layers, spec.topk), np.int64)
    for layer in spec.moe_layers:  # a signature per layer: experts 6*layer .. 6*layer+5 (mod 64)
        full[:, layer] = (np.arange(spec.topk) + 6 * layer) % 64
    record = payload_to_record(Payload("sig", full), spec, sample_id="sig", prompt_len=2, response_len=3)
    for j, layer in enumerate(spec.moe_layers):
        assert sorted(np.asarray(record.expert_ids)[0, j]) == sorted((np.arange(6) + 6 * layer) % 64)


def test_bug_zero_filled_rows_never_become_duplicate_routes(memory_url: str) -> None:
    """veRL padded with zeros; replaying [0, 0, ...] rows collapses the routing map and crashes the alltoall
    dispatcher. Zero rows must become missing rows, and partially zero rows must be refused."""
    spec = DSV3
    seqs = [(truth(spec, 9, seed=15), 4), (truth(spec, 6, seed=16), 2)]
    records = verl.records_from_arrays(verl_batch(spec, seqs, 4, 6, "full"), spec, "b")
    with routelog.open_writer(memory_url, 0, model_spec=spec, options=PartOptions(topk_order="score")) as writer:
        for record in records:
            writer.append(record)
    store = routelog.open_store(memory_url)
    assert verify_store(store).ok, "every stored row must be K distinct experts"
    got = store.step(0).read("b/0")
    assert (got.expert_ids[-1] == -1).all() and (got.expert_ids[:-1] >= 0).all()
    broken = to_full_axis(seqs[0][0][:-1], spec)
    broken[2, 4, :3] = 0  # a half-zeroed row: three copies of expert 0, not a missing route
    record = payload_to_record(Payload("half", broken), spec, sample_id="half", prompt_len=4, response_len=5)
    with routelog.open_writer(memory_url, 1, model_spec=spec) as writer:
        with pytest.raises(routelog.InvalidRecordError, match="token 2, layer 4 repeats an expert"):
            writer.append(record)
        writer.abort()
