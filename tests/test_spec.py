"""Model specs: the layer map must match the models themselves (real HF transformers and megatron-core code)."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import numpy as np
import pytest

import routelog
import routelog.format.spec
from routelog import ModelSpec, ModelSpecError
from routelog.format import documents as format_
from routelog.synth import synthetic_spec

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


# -- limits: absurd configs are one-line ModelSpecErrors, and nothing is allocated for them ---------------------
QWEN = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2}
DEEPSEEK = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 8,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
}
LLAMA4 = {"model_type": "llama4_text", "num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 1}
ERNIE = {"model_type": "ernie4_5_moe", "num_hidden_layers": 4, "moe_num_experts": 8, "moe_k": 2}


@pytest.mark.parametrize(
    ("base", "update", "field"),
    [
        (QWEN, {"num_hidden_layers": 2**31 - 1}, "num_hidden_layers"),
        (QWEN, {"num_hidden_layers": 2**200}, "num_hidden_layers"),
        (QWEN, {"num_hidden_layers": -3}, "num_hidden_layers"),
        (QWEN, {"num_hidden_layers": 0}, "num_hidden_layers"),
        (QWEN, {"num_hidden_layers": 4.5}, "num_hidden_layers"),
        (QWEN, {"num_hidden_layers": "4"}, "num_hidden_layers"),
        (QWEN, {"num_hidden_layers": True}, "num_hidden_layers"),
        (QWEN, {"num_experts": 70000}, "num_experts"),
        (QWEN, {"num_experts": 0}, "num_experts"),
        (QWEN, {"num_experts_per_tok": 0}, "num_experts_per_tok"),
        (QWEN, {"num_experts": 4096, "num_experts_per_tok": 1025}, "num_experts_per_tok"),
        (QWEN, {"num_experts_per_tok": [2]}, "num_experts_per_tok"),
        (QWEN, {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        (QWEN, {"decoder_sparse_step": -1}, "decoder_sparse_step"),
        (QWEN, {"mlp_only_layers": "0,1"}, "mlp_only_layers"),
        (QWEN, {"mlp_only_layers": [-1]}, "mlp_only_layers"),
        (QWEN, {"mlp_only_layers": [0.5]}, "mlp_only_layers"),
        (QWEN, {"norm_topk_prob": "false"}, "norm_topk_prob"),
        (QWEN, {"num_hidden_layers": 5000}, "5000 MoE layers"),
        (DEEPSEEK, {"first_k_dense_replace": -1}, "first_k_dense_replace"),
        (DEEPSEEK, {"first_k_dense_replace": 9}, "first_k_dense_replace"),
        (DEEPSEEK, {"moe_layer_freq": 0}, "moe_layer_freq"),
        (DEEPSEEK, {"n_group": 0}, "n_group"),
        (DEEPSEEK, {"n_group": "4"}, "n_group"),
        (DEEPSEEK, {"n_group": 32}, "n_group"),
        (DEEPSEEK, {"topk_group": 5}, "topk_group"),
        (DEEPSEEK, {"routed_scaling_factor": "2.5"}, "routed_scaling_factor"),
        (DEEPSEEK, {"routed_scaling_factor": float("nan")}, "routed_scaling_factor"),
        (DEEPSEEK, {"routed_scaling_factor": -1.0}, "routed_scaling_factor"),
        (DEEPSEEK, {"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
        (DEEPSEEK, {"num_nextn_predict_layers": 5000}, "num_nextn_predict_layers"),
        (LLAMA4, {"interleave_moe_layer_step": 0}, "interleave_moe_layer_step"),
        (LLAMA4, {"moe_layers": [1, 99]}, "moe_layers"),
        (LLAMA4, {"moe_layers": "all"}, "moe_layers"),
        (ERNIE, {"moe_layer_interval": 0}, "moe_layer_interval"),
        (ERNIE, {"moe_layer_start_index": -1}, "moe_layer_start_index"),
        (ERNIE, {"moe_layer_end_index": -2}, "moe_layer_end_index"),
        ({"text_config": "qwen3_moe"}, {}, "text_config"),
    ],
)
def test_absurd_hf_config_values_are_one_line_errors(base: dict[str, Any], update: dict[str, Any], field: str) -> None:
    with pytest.raises(ModelSpecError) as raised:
        ModelSpec.from_hf_config({**base, **update})
    message = str(raised.value)
    assert field in message
    assert "\n" not in message and len(message) < 300, message
    assert "pydantic" not in message


def test_in_range_hf_configs_still_parse() -> None:
    assert ModelSpec.from_hf_config(DEEPSEEK).router.n_group == 4
    assert ModelSpec.from_hf_config(LLAMA4).moe_layers == (0, 1, 2, 3)
    assert ModelSpec.from_hf_config({**ERNIE, "moe_layer_start_index": 1}).moe_layers == (1, 2, 3)
    # -1 means "to the last layer" (HF's Ernie4_5_MoeConfig); 0 is layer 0 itself, not "the last layer"
    assert ModelSpec.from_hf_config({**ERNIE, "moe_layer_end_index": 0}).moe_layers == (0,)
    # HF ignores mlp_only_layers entries past the last layer
    assert ModelSpec.from_hf_config({**QWEN, "mlp_only_layers": [0, 40]}).moe_layers == (1, 2, 3)
    widest = ModelSpec.from_hf_config({**QWEN, "num_hidden_layers": 4096, "num_experts": 65536, "top_k": 1})
    assert widest.num_moe_layers == routelog.format.spec.MAX_MOE_LAYERS
    assert ModelSpec.from_hf_config({**QWEN, "num_experts": 2048, "num_experts_per_tok": 1024}).topk == 1024


@pytest.mark.parametrize(
    "build",
    [
        lambda: ModelSpec.from_hf_config({**QWEN, "num_hidden_layers": 2**31 - 1}),
        lambda: ModelSpec.from_hf_config({**DEEPSEEK, "num_hidden_layers": 2**31 - 1}),
        lambda: ModelSpec.from_megatron(num_layers=2**31 - 1, num_moe_experts=8, moe_router_topk=2),
        lambda: ModelSpec(num_layers=2**31 - 1, moe_layers=(0,), num_experts=8, topk=2),
        lambda: ModelSpec(num_layers=2**31 - 1, moe_layers=range(2**31 - 1), num_experts=8, topk=2),
        lambda: synthetic_spec(2**31 - 1, 8, 2),  # routelog synth --layers
    ],
)
def test_huge_layer_counts_are_refused_before_allocating(build: Any) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(ModelSpecError, match="layers"):
            build()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse the spec"


SPEC = {"num_layers": 4, "moe_layers": (1,), "num_experts": 8, "topk": 2}


def _stream(**fields: int) -> dict[str, Any]:
    return {**SPEC, "streams": [{"name": "indexer", "num_layers": 1, "universe": 64, "topk": 2, **fields}]}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({**SPEC, "num_experts": 2048, "topk": 1025}, "topk"),
        ({**SPEC, "num_experts": 65537}, "num_experts"),
        ({**SPEC, "topk": 0}, "topk"),
        ({**SPEC, "topk": "2"}, "topk"),
        ({**SPEC, "topk": None}, "topk"),
        ({**SPEC, "num_layers": 65537}, "num_layers"),
        ({**SPEC, "num_layers": 5000, "moe_layers": tuple(range(4097))}, "4097 entries"),
        ({**SPEC, "mtp_layers": 4097}, "mtp_layers"),
        ({**SPEC, "mtp_layers": -1}, "mtp_layers"),
        ({**SPEC, "router": {"n_group": 0}}, "n_group"),
        ({**SPEC, "router": {"n_group": 2, "topk_group": 3}}, "topk_group"),
        ({**SPEC, "router": {"scaling_factor": 0}}, "scaling_factor"),
        (_stream(universe=4096, topk=1025), "topk"),
        (_stream(num_layers=4097), "num_layers"),
        (_stream(universe=70000), "universe"),
    ],
)
def test_specs_the_format_cannot_store_are_refused_when_built(kwargs: dict[str, Any], field: str) -> None:
    for build in (lambda: ModelSpec(**kwargs), lambda: ModelSpec.model_validate_json(json.dumps(kwargs))):
        with pytest.raises(ModelSpecError) as raised:
            build()
        message = str(raised.value)
        assert field in message and "\n" not in message, message


def test_the_format_takes_its_limits_from_the_spec(memory_url: str) -> None:
    assert (format_.MAX_TOPK, format_.MAX_MOE_LAYERS, format_.MAX_EXPERTS) == (1024, 4096, 65536)
    assert format_.MAX_TOPK is routelog.format.spec.MAX_TOPK
    assert format_.MAX_MOE_LAYERS is routelog.format.spec.MAX_MOE_LAYERS
    # the largest spec the limits allow is a store the format accepts, written and read back
    spec = ModelSpec(
        num_layers=routelog.format.spec.MAX_LAYERS,
        moe_layers=tuple(range(0, 2 * format_.MAX_MOE_LAYERS, 2)),
        num_experts=format_.MAX_EXPERTS,
        topk=format_.MAX_TOPK,
        mtp_layers=format_.MAX_MOE_LAYERS,
    ).with_mtp_stream()
    routelog.create_store(memory_url, spec)
    assert routelog.open_store(memory_url).model_spec == spec
