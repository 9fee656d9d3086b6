"""HF transformers as the CPU reference engine: recording during generate, and replay (real tiny models)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from routelog import ModelSpec, ModelSpecError
from routelog.engines.hf import RoutingRecorder, find_routers, replay, replay_weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "head_dim": 16,
    "initializer_range": 0.1,
    "max_position_embeddings": 256,
}
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "num_hidden_layers": 3,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "mlp_only_layers": [0],
            "intermediate_size": 64,
            "moe_intermediate_size": 32,
        },
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "n_group": 4,
            "topk_group": 2,
            "intermediate_size": 64,
            "moe_intermediate_size": 32,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "n_shared_experts": 1,
            "head_dim": 8,
            "num_key_value_heads": 4,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        {"num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32},
    ),
    "gpt_oss": (
        "GptOssConfig",
        {
            "num_hidden_layers": 2,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "layer_types": ["full_attention", "full_attention"],
        },
    ),
}


def tiny_model(name: str) -> tuple[Any, ModelSpec]:
    class_name, extra = MODELS[name]
    config = getattr(transformers, class_name)(**{**TINY, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if name == "deepseek_v3":  # random bias so group-limited selection is not trivially the plain top-k
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.uniform_(-0.05, 0.05)
    return model, ModelSpec.from_hf_config(config.to_dict())


def _routes_of_forward(model: Any, spec: ModelSpec, tokens: Any) -> np.ndarray:
    """[T, L, K] sorted expert IDs of one full forward (no cache, no padding)."""
    with RoutingRecorder(model, spec) as rec, torch.no_grad():
        model(tokens[None])
    return np.sort(np.stack([rec.calls[layer][0] for layer in spec.moe_layers], axis=1), axis=-1)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_recorder_aligns_rows_with_input_positions(name: str) -> None:
    model, spec = tiny_model(name)
    torch.manual_seed(1)
    lengths = [5, 9, 7]
    width = max(lengths)
    input_ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for b, n in enumerate(lengths):  # left padding, as batched generation uses
        input_ids[b, width - n :] = torch.randint(1, 128, (n,))
        mask[b, width - n :] = 1
    with RoutingRecorder(model, spec) as rec, torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=0, pad_token_id=0, eos_token_id=None
        )
    records = rec.records(input_ids, mask, out, sample_ids=["a", "b", "c"])
    agree, shifted = [], []
    for record, n in zip(records, lengths, strict=True):
        assert record.prompt_len == n and record.response_len == 6
        valid = np.asarray(record.valid)
        assert valid[:-1].all() and not valid[-1], "every fed token has a row; the last sampled one none"
        reference = _routes_of_forward(model, spec, torch.as_tensor(np.asarray(record.token_ids)))
        got = np.sort(np.asarray(record.expert_ids), axis=-1)
        agree.append((got[:-1] == reference[:-1]).all(-1).mean())
        shifted.append((got[1:-1] == reference[:-2]).all(-1).mean())
    # Generation with the KV cache and padding vs. one clean forward: same routes up to float noise near ties.
    assert min(agree) >= 0.98, agree
    assert max(shifted) < 0.5, "a one-token misalignment must not look aligned"


def test_recorder_stops_a_response_at_eos() -> None:
    model, spec = tiny_model("qwen3_moe")
    input_ids = torch.tensor([[3, 4, 5, 6]])
    with RoutingRecorder(model, spec) as rec, torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    eos = int(out[0, 6])  # pretend the third new token was the end of the response
    (record,) = rec.records(input_ids, torch.ones_like(input_ids), out, sample_ids=["x"], eos_token_id=eos)
    first_eos = int(np.flatnonzero(out[0, 4:].numpy() == eos)[0])
    assert record.response_len == first_eos + 1


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_recorded_weights_survive_the_store_with_their_experts(name: str, tmp_path: Any) -> None:
    """``record_weights``: the router's weights of its chosen experts, stored in float32 and read back paired with
    the same experts after the sets were sorted."""
    import routelog

    model, spec = tiny_model(name)
    input_ids = torch.tensor([[0, 3, 4, 5, 6], [7, 8, 9, 10, 11]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    with RoutingRecorder(model, spec, record_weights=True) as rec, torch.no_grad():
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    records = rec.records(input_ids, mask, out, sample_ids=["a", "b"])
    url = str(tmp_path / "store")
    options = routelog.PartOptions(weights_dtype="float32")
    with routelog.open_writer(url, step=0, model_spec=spec, options=options) as writer:
        for record in records:
            writer.append(record)
    for record, got in zip(records, routelog.open_store(url).step(0).read_many(["a", "b"], weights=True), strict=True):
        valid = np.asarray(record.valid)
        want_ids, want_w = np.asarray(record.expert_ids)[valid], np.asarray(record.weights)[valid]
        assert got.weights is not None
        got_ids, got_w = got.ids[valid], got.weights.transpose(1, 0, 2)[valid]
        order = np.argsort(want_ids, axis=-1)
        np.testing.assert_array_equal(got_ids, np.take_along_axis(want_ids, order, -1))
        np.testing.assert_array_equal(got_w, np.take_along_axis(want_w, order, -1).astype(np.float32))
        assert (want_w > 0).all()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_replay_weights_follow_each_router(name: str) -> None:
    model, spec = tiny_model(name)
    routers = find_routers(model, spec)
    hidden = torch.randn(10, TINY["hidden_size"])
    for router in routers.values():
        logits, weights, indices = router(hidden)
        torch.testing.assert_close(replay_weights(router, logits, indices, spec), weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_replay_forces_the_selection_and_keeps_gradients(name: str) -> None:
    model, spec = tiny_model(name)
    tokens = torch.randint(1, 128, (1, 12))
    rng = np.random.default_rng(0)
    forced = {
        layer: torch.as_tensor(np.argsort(rng.random((12, spec.num_experts)), axis=1)[:, : spec.topk])
        for layer in spec.moe_layers
    }
    with replay(model, spec, forced), RoutingRecorder(model, spec) as rec:
        loss = model(tokens).logits.float().logsumexp(-1).mean()
    for layer in spec.moe_layers:
        np.testing.assert_array_equal(rec.calls[layer][0], forced[layer].numpy())
    loss.backward()
    for router in find_routers(model, spec).values():
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_routers_must_match_the_spec() -> None:
    model, spec = tiny_model("qwen3_moe")
    wrong = spec.model_copy(update={"moe_layers": (0, 1, 2)})
    with pytest.raises(ModelSpecError, match="routers sit in layers"):
        RoutingRecorder(model, wrong)
