"""Model specs: the layer map must match the models themselves (real HF transformers and megatron-core code)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from routelog import ModelSpec, ModelSpecError

TINY = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "head_dim": 8}

# model_type -> (config class name, extra config, expected MoE layers)
HF_CASES: dict[str, tuple[str, dict[str, Any], list[int]]] = {
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_hidden_layers": 6,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
        },
        [1, 5],
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "num_hidden_layers": 5,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "mlp_only_layers": [0],
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
        },
        [1, 2, 3, 4],
    ),
    "mixtral": (
        "MixtralConfig",
        {"num_hidden_layers": 3, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
        [0, 1, 2],
    ),
    "olmoe": (
        "OlmoeConfig",
        {"num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32},
        [0, 1, 2],
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        {
            "num_hidden_layers": 4,
            "first_k_dense_replace": 1,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "n_shared_experts": 1,
        },
        [1, 2, 3],
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "num_hidden_layers": 6,
            "first_k_dense_replace": 3,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "n_group": 4,
            "topk_group": 2,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "n_shared_experts": 1,
        },
        [3, 4, 5],
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        {
            "num_hidden_layers": 4,
            "first_k_dense_replace": 1,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "n_shared_experts": 1,
        },
        [1, 2, 3],
    ),
    "gpt_oss": (
        "GptOssConfig",
        {
            "num_hidden_layers": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        [0, 1],
    ),
}


def _router_layers(model: Any) -> list[int]:
    """Global indices of decoder layers that own a router module (what the engines capture)."""
    found = set()
    for name, _ in model.named_modules():
        parts = name.split(".")
        if parts[-1] in ("gate", "router") and "layers" in parts and parts[-2] in ("mlp", "feed_forward"):
            found.add(int(parts[parts.index("layers") + 1]))
    return sorted(found)


@pytest.mark.parametrize("model_type", sorted(HF_CASES))
def test_hf_spec_matches_the_real_model(model_type: str) -> None:
    transformers = pytest.importorskip("transformers")
    class_name, extra, expected = HF_CASES[model_type]
    config = getattr(transformers, class_name)(**{**TINY, **extra})
    spec = ModelSpec.from_hf_config(config.to_dict())
    assert list(spec.moe_layers) == expected
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert _router_layers(model) == expected, "the spec's MoE layers must be where the model's routers are"
    assert spec.num_layers == config.num_hidden_layers
    assert spec.topk == extra["num_experts_per_tok"]
    assert spec.architecture == model_type


def test_deepseek_v3_router_kind() -> None:
    spec = ModelSpec.from_hf_config(
        {
            "model_type": "deepseek_v3",
            "num_hidden_layers": 61,
            "first_k_dense_replace": 3,
            "n_routed_experts": 256,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "routed_scaling_factor": 2.5,
            "num_nextn_predict_layers": 1,
        }
    )
    assert spec.num_moe_layers == 58
    assert spec.moe_layers[0] == 3
    assert spec.router.score_function == "sigmoid"
    assert spec.router.expert_bias
    assert (spec.router.n_group, spec.router.topk_group) == (8, 4)
    assert spec.mtp_layers == 1
    assert spec.id_dtype == np.uint8


def test_kimi_k2_needs_uint16_ids() -> None:
    spec = ModelSpec.from_hf_config(
        {
            "model_type": "kimi_k2",
            "num_hidden_layers": 61,
            "first_k_dense_replace": 1,
            "n_routed_experts": 384,
            "num_experts_per_tok": 8,
        }
    )
    assert spec.id_dtype == np.uint16
    assert spec.num_moe_layers == 60


def test_multimodal_config_uses_its_text_config() -> None:
    spec = ModelSpec.from_hf_config(
        {
            "model_type": "qwen3_vl_moe",
            "text_config": {
                "model_type": "qwen3_moe",
                "num_hidden_layers": 4,
                "num_experts": 16,
                "num_experts_per_tok": 4,
            },
        }
    )
    assert spec.moe_layers == (0, 1, 2, 3)


@pytest.mark.parametrize(
    ("freq", "expected"),
    [
        (1, [0, 1, 2, 3, 4, 5]),
        (2, [0, 2, 4]),
        ([0, 0, 1, 1, 1, 1], [2, 3, 4, 5]),
        ("([0]*3+[1]*3)", [3, 4, 5]),
        ("[1,0]*3", [0, 2, 4]),
    ],
)
def test_megatron_moe_layer_freq_matches_megatron_core(freq: int | list[int] | str, expected: list[int]) -> None:
    spec = ModelSpec.from_megatron(num_layers=6, num_moe_experts=8, moe_router_topk=2, moe_layer_freq=freq)
    assert list(spec.moe_layers) == expected
    gpt_layer_specs = pytest.importorskip("megatron.core.models.gpt.gpt_layer_specs")
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_layer import MoELayer

    config = TransformerConfig(
        num_layers=6,
        hidden_size=32,
        num_attention_heads=4,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_layer_freq=spec.megatron_moe_layer_freq() if isinstance(freq, str) else freq,
    )
    layer_specs = gpt_layer_specs.get_gpt_decoder_layer_specs(config, use_transformer_engine=False)
    built = [i for i, s in enumerate(layer_specs) if s.submodules.mlp.module is MoELayer]
    assert built == expected


def test_spec_round_trips_through_json() -> None:
    spec = ModelSpec.from_megatron(
        num_layers=4,
        num_moe_experts=64,
        moe_router_topk=8,
        moe_layer_freq=[0, 1, 1, 1],
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
    )
    assert ModelSpec.model_validate_json(spec.model_dump_json()) == spec
    assert spec.moe_index(3) == 2
    assert not spec.is_moe(0)
    with pytest.raises(ModelSpecError, match="not a MoE layer"):
        spec.moe_index(0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 4, "moe_layers": (), "num_experts": 8, "topk": 2}, "empty"),
        ({"num_layers": 4, "moe_layers": (2, 1), "num_experts": 8, "topk": 2}, "ascending"),
        ({"num_layers": 4, "moe_layers": (4,), "num_experts": 8, "topk": 2}, "outside"),
        ({"num_layers": 4, "moe_layers": (1,), "num_experts": 8, "topk": 9}, "exceeds"),
    ],
)
def test_inconsistent_specs_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelSpecError, match=message):
        ModelSpec(**kwargs)


def test_unknown_family_and_missing_fields_are_typed_errors() -> None:
    with pytest.raises(ModelSpecError, match="not a MoE family"):
        ModelSpec.from_hf_config({"model_type": "llama", "num_hidden_layers": 2, "num_experts": 2, "top_k": 1})
    with pytest.raises(ModelSpecError, match="num_experts_per_tok"):
        ModelSpec.from_hf_config({"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 8})
    with pytest.raises(ModelSpecError, match="moe_layer_freq"):
        ModelSpec.from_megatron(num_layers=3, num_moe_experts=8, moe_router_topk=2, moe_layer_freq=[1, 0])
    with pytest.raises(ModelSpecError, match="only ints"):
        ModelSpec.from_megatron(num_layers=3, num_moe_experts=8, moe_router_topk=2, moe_layer_freq="__import__('os')")
