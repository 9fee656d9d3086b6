"""The model spec: which decoder layers route, over how many experts, and how.

Layer numbers in routelog are **global, 0-based decoder-layer indices** (HF's ``model.layers.{i}``); Megatron's
``TopKRouter.layer_number`` is ``i + 1``. Stored routing lives on the MoE-only axis: position ``j`` of that axis
is global layer ``moe_layers[j]``.
"""

from __future__ import annotations

import ast
import math
import reprlib
from collections.abc import Mapping, Sequence, Sized
from functools import cached_property
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from routelog.errors import ModelSpecError
from routelog.format.limits import MAX_EXPERTS, MAX_INDEX_TOPK, MAX_LAYERS, MAX_MOE_LAYERS, MAX_TOPK

# -- limits (FORMAT.md section 9, in routelog.format.limits): a spec the format cannot store is refused when built
_LIMITS_FIX = "see the limits in FORMAT.md section 9"
_HF_FIX = "correct it in the config.json"


def _show(value: object) -> str:
    """A short one-line rendering of a (possibly huge or hostile) value for an error message."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    return reprlib.repr(value)


def _count(value: object, field: str, lo: int, hi: int, fix: str) -> int:
    """``value`` as an ``int`` in ``[lo, hi]`` (bools, floats and strings refused), else a one-line
    :class:`ModelSpecError` naming ``field``, the allowed range and ``fix``."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        number = int(value)
        if lo <= number <= hi:
            return number
    raise ModelSpecError(f"{field} is {_show(value)}; it must be an integer in [{lo}, {hi}]: {fix}")


def _check_counts(data: Any, where: str, bounds: Mapping[str, tuple[int, int, bool]]) -> Any:
    """The raw input of a model with its integer fields checked (``field: (lo, hi, required)``) before pydantic
    sees them, so an out-of-range value is a :class:`ModelSpecError`, never a pydantic dump."""
    if not isinstance(data, Mapping):
        return data
    checked = dict(data)
    for field, (lo, hi, required) in bounds.items():
        value = checked.get(field)
        if value is not None or (required and field in checked):
            checked[field] = _count(value, f"{where}{field}", lo, hi, _LIMITS_FIX)
        elif required:
            raise ModelSpecError(f"{where}{field} is missing; it must be an integer in [{lo}, {hi}]")
    return checked


class RouterSpec(BaseModel):
    """How the router turns logits into a top-k selection and weights (informational for replay)."""

    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)

    score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Scores the selection is made on."""
    topk_before_softmax: bool = False
    """True when top-k is taken on raw logits and the softmax runs over the k chosen (GPT-OSS, Mixtral-style
    ``pre_softmax=False`` in Megatron terms)."""
    norm_topk_prob: bool = False
    """Whether the chosen experts' weights are renormalised to sum to one."""
    expert_bias: bool = False
    """A selection-only bias is added to the scores (DeepSeek-V3 ``e_score_correction_bias``)."""
    n_group: int | None = None
    """Expert groups for group-limited top-k (DeepSeek-V2/V3, GLM4-MoE)."""
    topk_group: int | None = None
    """Groups kept per token for group-limited top-k."""
    scaling_factor: float | None = None
    """``routed_scaling_factor`` applied to the weights."""

    @model_validator(mode="before")
    @classmethod
    def _bounds(cls, data: Any) -> Any:
        data = _check_counts(
            data, "router: ", {"n_group": (1, MAX_EXPERTS, False), "topk_group": (1, MAX_EXPERTS, False)}
        )
        scale = data.get("scaling_factor") if isinstance(data, Mapping) else None
        if scale is not None and (
            isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf
        ):
            raise ModelSpecError(f"router: scaling_factor is {_show(scale)}; it must be a finite number above 0")
        return data

    @model_validator(mode="after")
    def _check(self) -> RouterSpec:
        if self.n_group is not None and self.topk_group is not None and self.topk_group > self.n_group:
            raise ModelSpecError(
                f"router: topk_group {self.topk_group} exceeds n_group {self.n_group}; it keeps at most every group"
            )
        return self


class StreamSpec(BaseModel):
    """An extra per-token top-k decision stored beside the decoder routing (format 1.2): a stream of ``topk``
    distinct values out of ``universe`` per token and layer. ``mtp`` holds the routing of multi-token-prediction
    layers (their layer numbers collide with decoder layers in some trainers, so they are kept apart and never
    installed into a decoder router); other names hold e.g. a sparse-attention indexer's top-k."""

    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,31}$")
    num_layers: int = Field(ge=1)  # at most MAX_MOE_LAYERS (checked in _bounds, the schema stays unchanged)
    """Layers of the stream (its own axis, 0-based)."""
    universe: int = Field(ge=1, le=MAX_EXPERTS)
    """Values are in ``[0, universe)`` (experts for ``mtp``)."""
    topk: int = Field(ge=1)  # at most MAX_TOPK

    @model_validator(mode="before")
    @classmethod
    def _bounds(cls, data: Any) -> Any:
        name = _show(data.get("name")) if isinstance(data, Mapping) else ""
        bounds = {
            "num_layers": (1, MAX_MOE_LAYERS, True),
            "universe": (1, MAX_EXPERTS, True),
            "topk": (1, MAX_TOPK, True),
        }
        return _check_counts(data, f"stream {name}: ", bounds)

    @model_validator(mode="after")
    def _check(self) -> StreamSpec:
        if self.topk > self.universe:
            raise ModelSpecError(f"stream {self.name!r}: topk {self.topk} exceeds universe {self.universe}")
        return self


MTP_STREAM = "mtp"


class IndexerSpec(BaseModel):
    """A sparse-attention indexer (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5): in each layer that has one,
    every query token at position ``p`` attends only to the ``index_topk`` key positions among ``0..p`` its
    indexer scores highest. The second discrete per-token decision of these models besides the router; its rows
    are stored per record and indexer layer (:mod:`routelog.format.positions`)."""

    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)

    index_topk: int = Field(ge=1)  # at most MAX_INDEX_TOPK (checked in _bounds)
    """Key positions selected per query token (``min(index_topk, p + 1)`` at position ``p``)."""
    layers: tuple[int, ...]
    """Global 0-based decoder layers that compute their own selection, ascending: the stored layer axis."""
    shared: tuple[int, ...] = ()
    """Decoder layers that reuse the selection of the nearest layer of :attr:`layers` before them (GLM-5's
    ``index_topk_freq``): never stored, replayed from that layer's rows."""

    @model_validator(mode="before")
    @classmethod
    def _bounds(cls, data: Any) -> Any:
        data = _check_counts(data, "indexer: ", {"index_topk": (1, MAX_INDEX_TOPK, True)})
        for field in ("layers", "shared"):
            value = data.get(field) if isinstance(data, Mapping) else None
            if isinstance(value, Sized) and len(value) > MAX_LAYERS:
                raise ModelSpecError(f"indexer: {field} has {len(value)} entries; at most {MAX_LAYERS}: {_LIMITS_FIX}")
        return data

    @model_validator(mode="after")
    def _check(self) -> IndexerSpec:
        for field, layers in (("layers", self.layers), ("shared", self.shared)):
            if list(layers) != sorted(set(layers)) or (layers and layers[0] < 0):
                raise ModelSpecError(f"indexer: {field} must be ascending, unique and >= 0, got {list(layers)}")
        if not self.layers:
            raise ModelSpecError("indexer: layers is empty; at least one layer computes its own selection")
        both = sorted(set(self.layers) & set(self.shared))
        if both:
            raise ModelSpecError(f"indexer: layers {both} are listed both as computing and as shared")
        if self.shared and self.shared[0] < self.layers[0]:
            raise ModelSpecError(
                f"indexer: shared layer {self.shared[0]} comes before the first computing layer {self.layers[0]}; "
                "a shared layer reuses the selection of a computing layer before it"
            )
        return self

    @property
    def num_layers(self) -> int:
        """Length of the stored (computing) layer axis."""
        return len(self.layers)

    def source_of(self, layer: int) -> int:
        """Position on the stored axis of the selection decoder layer ``layer`` uses (its own, or for a shared
        layer the nearest computing layer's before it)."""
        if layer in self.layers:
            return self.layers.index(layer)
        if layer in self.shared:
            return max(i for i, computing in enumerate(self.layers) if computing < layer)
        raise ModelSpecError(
            f"indexer: decoder layer {layer} has no indexer (computing {list(self.layers)}, shared {list(self.shared)})"
        )


def hf_indexer_layers(config: Mapping[str, Any], model_type: str, num_layers: int) -> tuple[list[int], list[int]]:
    """The computing and the shared indexer layers of a HF DSA config (``deepseek_v32``: every layer computes;
    ``glm_moe_dsa``: ``indexer_types``, else ``index_topk_pattern`` ("F"/"S" per layer), else layer ``i`` computes
    iff ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0``, as transformers 5.23 and SGLang derive
    it)."""
    if model_type != "glm_moe_dsa":
        return list(range(num_layers)), []
    kinds = config.get("indexer_types")
    pattern = config.get("index_topk_pattern")
    if isinstance(kinds, Sequence) and not isinstance(kinds, str):
        full = [str(kind) == "full" for kind in kinds]
    elif isinstance(pattern, str):
        full = [c.upper() == "F" for c in pattern]
    else:
        freq = _hf_int(config, "index_topk_freq", 1, MAX_LAYERS, 1)
        offset = _hf_int(config, "index_skip_topk_offset", 0, MAX_LAYERS, 2)
        full = [max(i - offset + 1, 0) % freq == 0 for i in range(num_layers)]
    if len(full) != num_layers:
        raise ModelSpecError(
            f"HF config of model_type {model_type!r} gives {len(full)} indexer kinds for {num_layers} layers: {_HF_FIX}"
        )
    return [i for i, f in enumerate(full) if f], [i for i, f in enumerate(full) if not f]


class ModelSpec(BaseModel):
    """The layer map and routing shape of the model that produced the routing."""

    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)

    name: str = "unnamed"
    """Model name, e.g. the HF repo id."""
    revision: str | None = None
    """Model revision or checkpoint tag."""
    architecture: str | None = None
    """HF ``model_type`` (or ``megatron``) the spec was derived from."""
    # Upper bounds (MAX_LAYERS, MAX_MOE_LAYERS, MAX_TOPK, MAX_MOE_LAYERS for mtp_layers) are checked in _bounds.
    num_layers: int = Field(ge=1)
    """Decoder layers, dense and MoE (MTP layers excluded)."""
    moe_layers: tuple[int, ...]
    """Global 0-based indices of the MoE (routing) layers, ascending."""
    num_experts: int = Field(ge=1, le=MAX_EXPERTS)
    """Routed experts per MoE layer (shared experts excluded)."""
    topk: int = Field(ge=1)
    """Experts chosen per token per MoE layer."""
    router: RouterSpec = RouterSpec()
    """Router kind."""
    logical_ids: Literal[True] = True
    """Stored IDs are always logical (pre-EPLB) expert IDs; adapters convert physical IDs on ingest."""
    mtp_layers: int = Field(default=0, ge=0)
    """Multi-token-prediction layers after the decoder; never part of the decoder routing (their routing, when
    recorded, is the ``mtp`` stream)."""
    streams: tuple[StreamSpec, ...] = ()
    """Extra routing streams records may carry (format 1.2), e.g. ``mtp``."""
    indexer: IndexerSpec | None = None
    """The sparse-attention indexer of a DSA model, whose per-token key positions records may carry."""

    @model_validator(mode="before")
    @classmethod
    def _bounds(cls, data: Any) -> Any:
        """Every size is bounded before pydantic converts anything: a spec the format cannot store (FORMAT.md
        section 9) is refused when it is built, with a :class:`ModelSpecError`, never at the first commit."""
        if not isinstance(data, Mapping):
            return data
        where = f"model {_show(data.get('name', 'unnamed'))}: "
        bounds = {
            "num_layers": (1, MAX_LAYERS, True),
            "num_experts": (1, MAX_EXPERTS, True),
            "topk": (1, MAX_TOPK, True),
            "mtp_layers": (0, MAX_MOE_LAYERS, False),
        }
        data = _check_counts(data, where, bounds)
        layers = data.get("moe_layers")
        if isinstance(layers, Sized) and len(layers) > MAX_MOE_LAYERS:
            raise ModelSpecError(
                f"{where}moe_layers has {len(layers)} entries; the format stores at most {MAX_MOE_LAYERS} MoE "
                f"layers: {_LIMITS_FIX}"
            )
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        layers = self.moe_layers
        if not layers:
            raise ModelSpecError(f"model {self.name!r}: moe_layers is empty; a spec needs at least one MoE layer")
        if list(layers) != sorted(set(layers)):
            raise ModelSpecError(f"model {self.name!r}: moe_layers must be ascending and unique, got {list(layers)}")
        if layers[0] < 0 or layers[-1] >= self.num_layers:
            raise ModelSpecError(
                f"model {self.name!r}: moe_layers {list(layers)} fall outside [0, num_layers={self.num_layers})"
            )
        if self.topk > self.num_experts:
            raise ModelSpecError(f"model {self.name!r}: topk {self.topk} exceeds num_experts {self.num_experts}")
        names = [stream.name for stream in self.streams]
        if len(names) != len(set(names)):
            raise ModelSpecError(f"model {self.name!r}: stream names must be unique, got {names}")
        mtp = self.stream(MTP_STREAM)
        if mtp is not None and mtp.num_layers != self.mtp_layers:
            raise ModelSpecError(
                f"model {self.name!r}: the mtp stream has {mtp.num_layers} layers, mtp_layers is {self.mtp_layers}"
            )
        indexer = self.indexer
        if indexer is not None and max(indexer.layers[-1], *indexer.shared, 0) >= self.num_layers:
            raise ModelSpecError(
                f"model {self.name!r}: indexer layers {list(indexer.layers)} / shared {list(indexer.shared)} fall "
                f"outside [0, num_layers={self.num_layers})"
            )
        groups = self.router.n_group
        if groups is not None and groups > 1 and self.num_experts % groups:
            raise ModelSpecError(
                f"model {self.name!r}: num_experts {self.num_experts} is not divisible by n_group {groups}"
            )
        return self

    # -- derived -------------------------------------------------------------------------------------------
    @property
    def num_moe_layers(self) -> int:
        """Length of the MoE-only layer axis."""
        return len(self.moe_layers)

    @property
    def id_dtype(self) -> np.dtype[Any]:
        """Narrowest unsigned dtype that holds every expert ID (uint8 up to 256 experts, else uint16)."""
        return np.dtype(np.uint8) if self.num_experts <= 256 else np.dtype(np.uint16)

    def stream(self, name: str) -> StreamSpec | None:
        """The declared stream ``name``, or None."""
        return next((s for s in self.streams if s.name == name), None)

    def with_mtp_stream(self) -> ModelSpec:
        """This spec declaring the ``mtp`` stream (one layer per MTP layer, the decoder's experts and top-k)."""
        if self.mtp_layers < 1 or self.stream(MTP_STREAM) is not None:
            return self
        stream = StreamSpec(name=MTP_STREAM, num_layers=self.mtp_layers, universe=self.num_experts, topk=self.topk)
        return self.model_copy(update={"streams": (*self.streams, stream)})

    def is_moe(self, layer: int) -> bool:
        """Whether global layer ``layer`` routes."""
        return layer in self._moe_positions

    def moe_index(self, layer: int) -> int:
        """Position of global layer ``layer`` on the MoE-only axis."""
        try:
            return self._moe_positions[layer]
        except KeyError:
            raise ModelSpecError(
                f"model {self.name!r}: layer {layer} is not a MoE layer (MoE layers: {list(self.moe_layers)})"
            ) from None

    @cached_property
    def _moe_positions(self) -> dict[int, int]:
        return {layer: j for j, layer in enumerate(self.moe_layers)}

    def compatible_with(self, other: ModelSpec) -> bool:
        """True when routing written under ``other`` has the same meaning under this spec."""
        return (
            self.num_layers == other.num_layers
            and self.moe_layers == other.moe_layers
            and self.num_experts == other.num_experts
            and self.topk == other.topk
        )

    # -- constructors --------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, name: str | None = None) -> ModelSpec:
        """Derive the spec from a HF ``config.json`` dict (multimodal configs: their ``text_config``).

        Supported ``model_type``: qwen2_moe, qwen3_moe, qwen3_next, qwen3_5_moe, mixtral, olmoe, deepseek_v2,
        deepseek_v3, deepseek_v32 and glm_moe_dsa (with their sparse-attention indexer), kimi_k2, glm4_moe, gpt_oss,
        minimax_m2, llama4_text, ernie4_5_moe.
        """
        return _from_hf(config, name)

    @classmethod
    def from_megatron(
        cls,
        *,
        num_layers: int,
        num_moe_experts: int,
        moe_router_topk: int,
        moe_layer_freq: int | Sequence[int] | str = 1,
        moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax",
        moe_router_pre_softmax: bool = False,
        moe_router_num_groups: int | None = None,
        moe_router_group_topk: int | None = None,
        moe_router_enable_expert_bias: bool = False,
        moe_router_topk_scaling_factor: float | None = None,
        mtp_num_layers: int | None = None,
        name: str = "megatron",
    ) -> ModelSpec:
        """Derive the spec from megatron-core ``TransformerConfig`` fields.

        ``moe_layer_freq`` follows Megatron: an int ``f`` makes layer ``i`` MoE iff ``i % f == 0``; a list (or
        its string form such as ``"([0]*3+[1]*58)"``) gives 1 for MoE and 0 for dense per layer.
        """
        fix = "correct the Megatron config"
        num_layers = _count(num_layers, "num_layers", 1, MAX_LAYERS, fix)  # before the per-layer pattern is built
        num_moe_experts = _count(num_moe_experts, "num_moe_experts", 1, MAX_EXPERTS, fix)
        moe_router_topk = _count(moe_router_topk, "moe_router_topk", 1, MAX_TOPK, fix)
        if mtp_num_layers is not None:
            mtp_num_layers = _count(mtp_num_layers, "mtp_num_layers", 0, MAX_MOE_LAYERS, fix)
        pattern = _megatron_layer_pattern(moe_layer_freq, num_layers)
        return cls(
            name=name,
            architecture="megatron",
            num_layers=num_layers,
            moe_layers=tuple(i for i, flag in enumerate(pattern) if flag),
            num_experts=num_moe_experts,
            topk=moe_router_topk,
            router=RouterSpec(
                score_function=moe_router_score_function,
                # Megatron's default (pre_softmax=False) takes top-k on logits, then softmaxes over the k.
                topk_before_softmax=moe_router_score_function == "softmax" and not moe_router_pre_softmax,
                norm_topk_prob=moe_router_score_function == "sigmoid" and moe_router_topk > 1,
                expert_bias=moe_router_enable_expert_bias,
                n_group=moe_router_num_groups,
                topk_group=moe_router_group_topk,
                scaling_factor=moe_router_topk_scaling_factor,
            ),
            mtp_layers=mtp_num_layers or 0,
        ).with_mtp_stream()

    def megatron_moe_layer_freq(self) -> list[int]:
        """This spec's layer pattern as Megatron's ``moe_layer_freq`` list."""
        return [int(self.is_moe(i)) for i in range(self.num_layers)]


# -- HF configs --------------------------------------------------------------------------------------------
def _require(config: Mapping[str, Any], model_type: str, keys: Sequence[str], lo: int, hi: int) -> int:
    """The first of ``keys`` the config sets, checked to be an integer in ``[lo, hi]``."""
    for key in keys:
        value = config.get(key)
        if value is not None:
            return _count(value, f"HF config field {key!r}", lo, hi, _HF_FIX)
    raise ModelSpecError(
        f"HF config of model_type {model_type!r} has none of {list(keys)}; pass a complete config.json"
    )


def _hf_int(config: Mapping[str, Any], key: str, lo: int, hi: int, default: int) -> int:
    """Optional integer field ``key`` (``default`` when absent or null), checked to be in ``[lo, hi]``."""
    value = config.get(key)
    return default if value is None else _count(value, f"HF config field {key!r}", lo, hi, _HF_FIX)


def _hf_layers(config: Mapping[str, Any], key: str, num_layers: int) -> list[int] | None:
    """Optional list field ``key`` of global layer indices, each checked to be in ``[0, num_layers)``, the list
    to hold at most :data:`MAX_LAYERS` entries."""
    value = config.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) > MAX_LAYERS:
        raise ModelSpecError(
            f"HF config field {key!r} is {_show(value)}; it must be a list of at most {MAX_LAYERS} layer "
            f"indices: {_HF_FIX}"
        )
    return [_count(v, f"HF config field {key!r} entry", 0, num_layers - 1, _HF_FIX) for v in value]


def _hf_bool(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelSpecError(f"HF config field {key!r} is {_show(value)}; it must be true or false: {_HF_FIX}")
    return value


def _hf_scale(config: Mapping[str, Any], key: str) -> float | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ModelSpecError(
            f"HF config field {key!r} is {_show(value)}; it must be a finite number above 0: {_HF_FIX}"
        )
    return float(value)


def _from_hf(raw: Mapping[str, Any], name: str | None) -> ModelSpec:
    """Every field read is checked for type and range before use, and ``num_hidden_layers`` is bounded by
    :data:`MAX_LAYERS` before any per-layer list is built: an absurd config is a one-line ModelSpecError."""
    text_config = raw.get("text_config")
    if text_config is not None and not isinstance(text_config, Mapping):
        raise ModelSpecError(f"HF config field 'text_config' is {_show(text_config)}; it must be an object: {_HF_FIX}")
    config: Mapping[str, Any] = text_config or raw
    model_type = str(config.get("model_type") or raw.get("model_type") or "")
    num_layers = _require(config, model_type, ("num_hidden_layers",), 1, MAX_LAYERS)
    num_experts = _require(
        config, model_type, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 1, MAX_EXPERTS
    )
    topk = _require(config, model_type, ("num_experts_per_tok", "experts_per_token", "moe_k", "top_k"), 1, MAX_TOPK)
    router = RouterSpec(norm_topk_prob=_hf_bool(config, "norm_topk_prob", False))
    family = model_type.removesuffix("_text")
    moe: list[int]

    if family in ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe"):
        step = _hf_int(config, "decoder_sparse_step", 1, MAX_LAYERS, 1)
        # HF ignores mlp_only_layers entries past the last layer (a config cut down to fewer layers keeps them).
        dense = set(_hf_layers(config, "mlp_only_layers", MAX_LAYERS) or ())
        moe = [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
        if family == "qwen3_5_moe":
            router = RouterSpec(norm_topk_prob=True)
    elif family in ("mixtral", "minimax_m2", "gpt_oss", "olmoe"):
        moe = list(range(num_layers))
        if family == "mixtral":
            router = RouterSpec(norm_topk_prob=True)
        elif family == "gpt_oss":
            router = RouterSpec(topk_before_softmax=True, norm_topk_prob=True)
        elif family == "minimax_m2":
            router = RouterSpec(score_function="sigmoid", norm_topk_prob=True, expert_bias=True)
    elif family in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "kimi_k2", "glm4_moe"):
        # The original DeepSeek code (SGLang, vLLM, remote code) also honours moe_layer_freq; HF v5 ignores it.
        first_dense = _hf_int(config, "first_k_dense_replace", 0, num_layers, 0)
        freq = _hf_int(config, "moe_layer_freq", 1, MAX_LAYERS, 1)
        moe = [i for i in range(num_layers) if i >= first_dense and i % freq == 0]
        v2 = family == "deepseek_v2"
        scoring = str(config.get("scoring_func") or ("softmax" if v2 else "sigmoid"))
        grouped = (config.get("topk_method") or ("greedy" if v2 else "noaux_tc")) != "greedy"
        n_group = _hf_int(config, "n_group", 1, num_experts, 0) if grouped else 0
        topk_group = _hf_int(config, "topk_group", 1, n_group or num_experts, 0) if grouped else 0
        router = RouterSpec(
            score_function="sigmoid" if scoring == "sigmoid" else "softmax",
            norm_topk_prob=_hf_bool(config, "norm_topk_prob", not v2),
            expert_bias=not v2,
            n_group=n_group or None,
            topk_group=topk_group or None,
            scaling_factor=_hf_scale(config, "routed_scaling_factor"),
        )
    elif family == "llama4":
        step = _hf_int(config, "interleave_moe_layer_step", 1, MAX_LAYERS, 1)
        listed = _hf_layers(config, "moe_layers", num_layers)
        moe = listed if listed is not None else list(range(step - 1, num_layers, step))
        router = RouterSpec(score_function="sigmoid", topk_before_softmax=True)
    elif family == "ernie4_5_moe":
        start = _hf_int(config, "moe_layer_start_index", 0, MAX_LAYERS, 0)
        end = _hf_int(config, "moe_layer_end_index", -1, MAX_LAYERS, -1)
        end = num_layers - 1 if end == -1 else end  # -1 means the last layer (HF's Ernie4_5_MoeConfig)
        interval = _hf_int(config, "moe_layer_interval", 1, MAX_LAYERS, 1)
        moe = [i for i in range(num_layers) if start <= i <= end and (i + 1) % interval == 0]
        router = RouterSpec(norm_topk_prob=True)
    else:
        raise ModelSpecError(
            f"model_type {model_type!r} is not a MoE family routelog knows; build the spec with "
            "ModelSpec(num_layers=..., moe_layers=..., num_experts=..., topk=...) or ModelSpec.from_megatron(...)"
        )
    if not moe:
        raise ModelSpecError(f"HF config of model_type {model_type!r} describes no MoE layer")
    if len(moe) > MAX_MOE_LAYERS:
        raise ModelSpecError(
            f"HF config of model_type {model_type!r} describes {len(moe)} MoE layers; the format stores at most "
            f"{MAX_MOE_LAYERS}: {_LIMITS_FIX}"
        )
    indexer = None
    if family in ("deepseek_v32", "glm_moe_dsa"):
        computing, shared = hf_indexer_layers(config, family, num_layers)
        index_topk = _require(config, model_type, ("index_topk",), 1, MAX_INDEX_TOPK)
        indexer = IndexerSpec(index_topk=index_topk, layers=tuple(computing), shared=tuple(shared))
    return ModelSpec(
        name=name or str(raw.get("_name_or_path") or config.get("_name_or_path") or model_type),
        architecture=model_type,
        num_layers=num_layers,
        moe_layers=tuple(moe),
        num_experts=num_experts,
        topk=topk,
        router=router,
        mtp_layers=_hf_int(config, "num_nextn_predict_layers", 0, MAX_MOE_LAYERS, 0),
        indexer=indexer,
    ).with_mtp_stream()


# -- Megatron moe_layer_freq -------------------------------------------------------------------------------
def _megatron_layer_pattern(freq: int | Sequence[int] | str, num_layers: int) -> list[int]:
    if isinstance(freq, str):
        freq = _eval_layer_list(freq)
    if isinstance(freq, int):
        if freq < 1:
            raise ModelSpecError(f"moe_layer_freq must be >= 1, got {freq}")
        return [int(i % freq == 0) for i in range(num_layers)]
    pattern = [int(v) for v in freq]
    if len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise ModelSpecError(
            f"moe_layer_freq list must hold num_layers={num_layers} entries of 0 or 1, got {len(pattern)}: "
            f"{pattern[:16]}"
        )
    return pattern


_MAX_LAYER_LIST = 100_000
"""Entries of a ``moe_layer_freq`` list expression; far above any model's depth, far below a memory bomb."""


def _eval_layer_list(text: str) -> int | list[int]:
    """Evaluate Megatron's ``--moe-layer-freq`` string (an int or list arithmetic like ``[0]*3+[1]*58``).

    Sizes are checked before any list is built: ``[0]*4000000000`` is refused, not allocated.
    """
    if len(text) > _MAX_LAYER_LIST:
        raise ModelSpecError(f"moe_layer_freq is {len(text)} characters long; expected a short expression")

    def bounded(n: int) -> int:
        if not 0 <= n <= _MAX_LAYER_LIST:
            raise ModelSpecError(f"moe_layer_freq {text[:64]!r}: a list of {n} entries is not a layer pattern")
        return n

    def ev(node: ast.AST) -> int | list[int]:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.List):
            bounded(len(node.elts))
            return [_as_int(ev(e)) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
                bounded(len(left) + len(right))
                return left + right
            if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int):
                bounded(len(left) * right)
                return left * right
            if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, list):
                bounded(len(right) * left)
                return right * left
            if isinstance(left, int) and isinstance(right, int):
                value = left + right if isinstance(node.op, ast.Add) else left * right
                return bounded(value) if abs(value) > _MAX_LAYER_LIST else value
        raise ModelSpecError(f"moe_layer_freq {text[:64]!r}: only ints, lists, + and * are understood")

    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ModelSpecError(f"moe_layer_freq {text[:64]!r} is not an int or a list expression") from exc
    try:
        return ev(tree.body)
    except RecursionError:
        raise ModelSpecError(f"moe_layer_freq {text[:64]!r} is nested too deeply") from None


def _as_int(value: int | list[int]) -> int:
    if isinstance(value, list):
        raise ModelSpecError("moe_layer_freq lists must be flat")
    return value


def entropy_bound_bytes(num_experts: int, topk: int) -> float:
    """Bytes per token-layer an ideal coder needs for uniformly random top-k sets: log2(C(E, K)) / 8."""
    return math.log2(math.comb(num_experts, topk)) / 8
