"""Capture NeMo-RL's own router-replay data path as fixtures: ``tests/fixtures/nemo_rl/``.

NeMo-RL cannot be installed here (it requires Python 3.13 and pins torch 2.11; the ``nemo_rl`` wheel on PyPI is a
placeholder), so this script runs **NeMo-RL's real source at commit 7ea279ab** on CPU against megatron-core 0.16.1,
taken from a git directory (the one ``fetch github:NVIDIA-NeMo/RL`` gives, or a clone)::

    python tools/make_nemo_rl_fixtures.py --nemo-rl-git /work/.mirror/NVIDIA-NeMo+RL/repo

With ``--check-routelog`` it also patches routelog's integration into NeMo-RL's real ``data`` module and compares
what routelog's replacement installs with what NeMo-RL's own ``set_router_replay_forward`` installs, on a real
megatron-core model (:func:`check_routelog`).

What runs, unmodified (file and function of NeMo-RL):

* rollout: ``models/generation/vllm/utils.py`` ``pad_and_align_routed_expert_indices`` (vLLM rows -> ``[T, L, K]``
  with -1 missing rows and ``arange(K)`` final/pad rows), ``utils/routed_experts_codec.py``
  ``encode_routed_experts`` (the ``nrlre1:`` envelope), ``experience/rollouts.py``
  ``_attach_routed_experts_to_message_log_prefix``, ``_dummy_routed_experts_for_tokens`` and
  ``backfill_missing_routed_experts``, ``data/llm_message_utils.py`` ``batched_message_log_to_flat_message``
  (message logs -> ``train_data``);
* policy worker: ``distributed/batched_data_dict.py`` ``BatchedDataDict.shard_by_batch_size`` (DP shards and
  sequence-packing bins, or plain micro-batches), ``models/megatron/data.py`` ``get_microbatch_iterator`` ->
  ``_get_pack_sequence_parameters_for_megatron`` -> ``make_processed_microbatch_iterator`` ->
  ``process_microbatch`` -> ``_pack_sequences_for_megatron`` + ``_shard_routed_experts_for_cp`` (packed) or
  ``_fill_routed_experts_padding`` (unpacked), and ``models/megatron/router_replay.py``
  ``build_router_replay_assignments`` (``_normalize_routed_experts_for_mcore``, ``_split_for_sequence_parallel``,
  ``_global_moe_layer_numbers``, ``_payload_indices_for_moe_layers``) on a model whose modules carry
  ``router_replay`` and ``layer_number`` exactly as megatron-core's ``TopKRouter`` does;
* NeMo-RL's debug token identity (``_make_r3_trace_token_identity``) rides the same CP and SP transforms, so every
  replay row is labelled with the (sample, token position) it belongs to.

What is stubbed, and why (nothing on the path of tokens or routes):

* package ``__init__`` files that import what this machine lacks are skipped (``nemo_rl.models.generation``,
  ``.vllm``, ``nemo_rl.algorithms.loss``: vLLM, TRT-LLM, zmq); their submodules load from the real files;
* ``nemo_rl.models.policy`` (its ``__init__`` asserts transformers < 5.12) becomes a module whose capitalised names
  (``PolicyConfig``, ...: TypedDicts) are ``dict``;
* ``experience/rollouts.py`` imports the metric loggers (mlflow, wandb): its four route functions are executed from
  their unmodified source text, extracted by name;
* ``megatron.bridge`` (absent; ``get_packed_seq_cp_partition_indices`` serves models that slice CP themselves, not
  exercised), megatron-core 0.19's ``moe_logging`` and ``wandb`` are empty modules;
* in ``data``'s namespace, ``PackedSeqParams`` (NeMo-RL passes ``total_tokens``, which megatron-core 0.16.1 lacks)
  is a plain namespace and ``get_ltor_masks_and_position_ids`` (from the absent ``megatron.training``) returns
  nothing: both describe attention, not where tokens go;
* no GPU and no model-parallel groups: ``BatchedDataDict.to("cuda")`` is a no-op, and the context- and
  tensor-parallel ranks NeMo-RL asks megatron-core for are set per simulated rank in ``data``'s and
  ``router_replay``'s namespaces;
* vLLM cannot run: its per-request output objects are built with the shape and dtype vLLM 0.25 returns
  (``[prompt + generation - 1, num_hidden_layers, K]`` uint8), and the generation worker's stacking
  (``vllm_worker.py`` L945-1074) is repeated in a few lines.

Every sample id rides through NeMo-RL's sharding and micro-batching as a plain list column
(``routelog_sample_id``): the fixtures record what each micro-batch's data dict holds, which is how routelog's
NeMo-RL integration carries ids instead of routes.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import io
import json
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path
from typing import Any

import numpy as np

COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "nemo_rl"
SAMPLE_ID_KEY = "routelog_sample_id"  # routelog.integrations.nemo_rl.SAMPLE_ID_KEY

NUM_LAYERS = 8
MOE_LAYER_FREQ = [0, 1, 1, 1, 0, 1, 1, 1]
NUM_EXPERTS = 8
TOPK = 2
PAD_TOKEN = 0

# (prompt tokens, generated tokens, how vLLM returns the rows, extra message after the assistant's)
SAMPLES: list[tuple[int, int, str, str | None]] = [
    (5, 7, "complete", None),
    (9, 4, "surplus", None),  # one row more than expected: vLLM's final-token row, dropped by NeMo-RL
    (3, 10, "short", None),  # 3 rows fewer: the -1 missing-route sentinel
    (6, 2, "complete", "environment"),  # a trailing environment message: dummy arange(K) routes
    (4, 8, "complete", "unrouted"),  # a trailing message without routes: backfilled with -1
    (7, 5, "complete", None),
]

CONFIGS: dict[str, dict[str, Any]] = {
    "tp2_sp_cp2": {"tp": 2, "sp": True, "cp": 2, "pp": 1, "dp": 1, "divisible_by": 8, "mb_tokens": 48},
    "cp2_div16_dp2": {"tp": 1, "sp": False, "cp": 2, "pp": 1, "dp": 2, "divisible_by": 16, "mb_tokens": 64},
    "tp2_sp_fp8_blockwise": {
        "tp": 2, "sp": True, "cp": 1, "pp": 1, "dp": 1, "divisible_by": 2, "mb_tokens": 40, "fp8": "blockwise",
    },
    "cp2_mxfp8": {"tp": 1, "sp": False, "cp": 2, "pp": 1, "dp": 1, "divisible_by": 8, "mb_tokens": 40, "fp8": "mxfp8"},
    "hybridep_div1": {"tp": 1, "sp": False, "cp": 1, "pp": 1, "dp": 1, "divisible_by": 1, "mb_tokens": 40,
                      "hybridep": True},
    "pp2_cp2": {"tp": 1, "sp": False, "cp": 2, "pp": 2, "dp": 1, "divisible_by": 4, "mb_tokens": 40},
    "pp2_tp2_sp_fp8_dp2": {
        "tp": 2, "sp": True, "cp": 1, "pp": 2, "dp": 2, "divisible_by": 4, "mb_tokens": 48, "fp8": "tensorwise",
    },
    "unpacked_tp2_sp": {"tp": 2, "sp": True, "cp": 1, "pp": 1, "dp": 1, "divisible_by": 4, "packing": False,
                        "mbs": 2},
}  # fmt: skip


# -- loading NeMo-RL's source -------------------------------------------------------------------------------------
def extract(git_dir: Path, dest: Path) -> Path:
    """``nemo_rl/`` of commit ``COMMIT`` from a git directory, into ``dest``."""
    archive = subprocess.run(
        ["git", f"--git-dir={git_dir}", "archive", COMMIT, "nemo_rl"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def load_nemo_rl(src: Path) -> dict[str, types.ModuleType]:
    """Import the NeMo-RL modules used here from ``src`` with the stubs the module docstring lists."""
    sys.path.insert(0, str(src))

    def shell(name: str) -> None:  # a package whose __init__ is skipped; submodules load from the real files
        module = types.ModuleType(name)
        module.__path__ = [str(src / name.replace(".", "/"))]
        sys.modules[name] = module

    def stub(name: str, **attrs: Any) -> None:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__dict__.update(attrs)
        sys.modules[name] = module

    for name in ("nemo_rl.models.generation", "nemo_rl.models.generation.vllm", "nemo_rl.algorithms.loss"):
        shell(name)

    def typed_dict(name: str) -> type:  # PolicyConfig, TokenizerConfig, ...: TypedDicts, read as plain dicts
        if not name[:1].isupper():
            raise AttributeError(name)
        return dict

    stub("nemo_rl.models.policy", __getattr__=typed_dict)
    stub("megatron.core.transformer.moe.moe_logging", get_moe_metrics_tracker=None)
    for name in ("megatron.bridge", "megatron.bridge.training", "megatron.bridge.training.utils"):
        stub(name)
    stub("megatron.bridge.training.utils.packed_seq_utils", get_packed_seq_cp_partition_indices=None)
    stub("wandb", Table=object)
    names = {
        "bdd": "nemo_rl.distributed.batched_data_dict",
        "data": "nemo_rl.models.megatron.data",
        "router_replay": "nemo_rl.models.megatron.router_replay",
        "vllm_utils": "nemo_rl.models.generation.vllm.utils",
        "interfaces": "nemo_rl.models.generation.interfaces",
        "codec": "nemo_rl.utils.routed_experts_codec",
        "messages": "nemo_rl.data.llm_message_utils",
    }
    modules = {key: importlib.import_module(name) for key, name in names.items()}
    for module in modules.values():
        if not str(module.__file__).startswith(str(src)):
            raise RuntimeError(f"{module.__name__} was imported from {module.__file__}, not from {src}")
    modules["rollouts"] = functions_of(
        src / "nemo_rl/experience/rollouts.py",
        ("_attach_routed_experts_to_message_log_prefix", "_find_routed_experts_template",
         "_dummy_routed_experts_for_tokens", "backfill_missing_routed_experts"),
        ROUTED_EXPERTS_MISSING_ROUTE_SENTINEL=modules["interfaces"].ROUTED_EXPERTS_MISSING_ROUTE_SENTINEL,
    )  # fmt: skip
    # NeMo-RL pins a megatron-core whose PackedSeqParams takes ``total_tokens`` (0.16.1's does not); the attention
    # parameters play no part in where tokens and routes go.
    modules["data"].PackedSeqParams = types.SimpleNamespace
    # Unpacked micro-batches ask megatron.training (absent) for the attention mask and position ids; likewise.
    modules["data"].get_ltor_masks_and_position_ids = lambda **kwargs: (None, None, None)
    bdd_class = modules["bdd"].BatchedDataDict
    to_device = bdd_class.to
    bdd_class.to = lambda self, device: self if str(device).startswith("cuda") else to_device(self, device)
    return modules


def functions_of(path: Path, names: tuple[str, ...], **constants: Any) -> types.ModuleType:
    """Functions of a module whose imports cannot be satisfied here, executed from their unmodified source text
    (``experience/rollouts.py`` imports the metric loggers: mlflow, wandb, tensorboard)."""
    import ast
    from collections.abc import Sequence
    from typing import Optional

    import torch

    tree = ast.parse(path.read_text())
    module = types.ModuleType(f"nemo_rl_functions_of_{path.stem}")
    module.__dict__.update(torch=torch, Optional=Optional, Sequence=Sequence, Any=Any, **constants)
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    if sorted(node.name for node in found) != sorted(names):
        raise RuntimeError(f"{path}: expected functions {names}, found {[node.name for node in found]}")
    code = compile(ast.Module(body=found, type_ignores=[]), str(path), "exec")
    exec(code, module.__dict__)
    return module


# -- the rollout side -------------------------------------------------------------------------------------------
def vllm_rows(rng: np.random.Generator, n_rows: int) -> np.ndarray:
    """What vLLM 0.25 returns per request: ``[rows, num_hidden_layers, K]`` uint8, score-ordered top-k of the
    MoE layers, zeros in the dense ones."""
    rows = np.zeros((n_rows, NUM_LAYERS, TOPK), np.uint8)
    for layer, moe in enumerate(MOE_LAYER_FREQ):
        if moe:
            rows[:, layer] = np.argsort(rng.random((n_rows, NUM_EXPERTS)), axis=-1)[:, :TOPK]
    return rows


def rollout(nrl: dict[str, types.ModuleType], rng: np.random.Generator) -> dict[str, Any]:
    import torch

    carry = nrl["interfaces"].resolve_routed_experts_dtype(NUM_EXPERTS)
    prompts = [torch.from_numpy(rng.integers(1, 60, p)) for p, _, _, _ in SAMPLES]
    generations = [torch.from_numpy(rng.integers(1, 60, g)) for _, g, _, _ in SAMPLES]
    raw = []
    for (p, g, kind, _), _prompt in zip(SAMPLES, prompts, strict=True):
        expected = p + g - 1
        raw.append(vllm_rows(rng, {"complete": expected, "surplus": expected + 1, "short": expected - 3}[kind]))
    # vllm_worker.generate: prompts right-padded to the longest, generation after each prompt, stacked.
    padded_input = max(p for p, _, _, _ in SAMPLES)
    total = padded_input + max(g for _, g, _, _ in SAMPLES)
    output_ids = torch.full((len(SAMPLES), total), PAD_TOKEN, dtype=torch.int64)
    routed, stats = [], []
    for i, ((p, g, _, _), prompt, gen) in enumerate(zip(SAMPLES, prompts, generations, strict=True)):
        output_ids[i, :p] = prompt
        output_ids[i, p : p + g] = gen
        request = types.SimpleNamespace(prompt_routed_experts=None)
        completion = types.SimpleNamespace(routed_experts=raw[i], token_ids=gen.tolist())
        full, stat = nrl["vllm_utils"].pad_and_align_routed_expert_indices(
            request,
            completion,
            valid_length=p + g,
            padded_length=total,
            device=torch.device("cpu"),
            require_complete_routed_experts=True,
            return_stats=True,
            routed_experts_dtype=carry,
        )
        routed.append(full)
        stats.append(stat)
    generation = {
        "output_ids": output_ids,
        "generation_lengths": torch.tensor([g for _, g, _, _ in SAMPLES]),
        "unpadded_sequence_lengths": torch.tensor([p + g for p, g, _, _ in SAMPLES]),
        "routed_experts": torch.stack(routed),
        "r3_routed_experts_missing_routes": torch.tensor([s["missing_routes"] for s in stats]),
        "r3_routed_experts_expected_routes": torch.tensor([s["expected_routes"] for s in stats]),
        "r3_routed_experts_actual_routes": torch.tensor([s["actual_routes"] for s in stats]),
    }
    # rollouts.generate_responses: routes attached to the prompt messages and the assistant's.
    rollouts = nrl["rollouts"]
    logs = []
    for i, ((p, g, _, extra), prompt) in enumerate(zip(SAMPLES, prompts, strict=True)):
        log: list[dict[str, Any]] = [{"role": "user", "content": f"prompt {i}", "token_ids": prompt}]
        routes = generation["routed_experts"][i]
        if rollouts._attach_routed_experts_to_message_log_prefix(log, routes) != p:
            raise RuntimeError("prefix length differs from the prompt length")
        log.append(
            {
                "role": "assistant",
                "content": f"answer {i}",
                "token_ids": output_ids[i, p : p + g],
                "routed_experts": routes[p : p + g],
            }
        )
        if extra == "environment":  # rollout_manager: environment observations get dummy routes
            tokens = torch.from_numpy(rng.integers(1, 60, 3))
            dummy = rollouts._dummy_routed_experts_for_tokens(tokens, routes)
            log.append({"role": "environment", "content": "obs", "token_ids": tokens, "routed_experts": dummy})
        elif extra == "unrouted":
            log.append({"role": "user", "content": "more", "token_ids": torch.from_numpy(rng.integers(1, 60, 2))})
        logs.append(log)
    rollouts.backfill_missing_routed_experts(logs)
    envelopes = [[nrl["codec"].encode_routed_experts(m["routed_experts"]) for m in log] for log in logs]
    return {"generation": generation, "logs": logs, "envelopes": envelopes, "vllm_rows": raw}


def train_data(nrl: dict[str, types.ModuleType], logs: list[Any], divisible_by: int, sample_ids: list[str]) -> Any:
    """grpo_train: flatten the message logs, build ``train_data`` and carry the routes (and here, the ids)."""
    import torch

    flat, input_lengths = nrl["messages"].batched_message_log_to_flat_message(
        logs, pad_value_dict={"token_ids": PAD_TOKEN}, make_sequence_length_divisible_by=divisible_by
    )
    data = nrl["bdd"].BatchedDataDict(
        {
            "input_ids": flat["token_ids"],
            "input_lengths": input_lengths,
            "sample_mask": torch.ones(len(logs)),
            "routed_experts": flat["routed_experts"],  # grpo._preserve_router_replay_routed_experts
            SAMPLE_ID_KEY: list(sample_ids),
        }
    )
    return data


# -- the policy worker side ---------------------------------------------------------------------------------------
class Router:
    """What NeMo-RL looks for on a megatron-core ``TopKRouter``: ``router_replay`` and ``layer_number``."""

    def __init__(self, layer_number: int) -> None:
        self.layer_number = layer_number
        self.router_replay = types.SimpleNamespace(layer_number=layer_number)


def stage_model(pp: int, pp_rank: int, sequence_parallel: bool) -> Any:
    """One pipeline stage's model: its MoE routers (uniform split) and the megatron-core config NeMo-RL reads."""
    import torch

    per_stage = NUM_LAYERS // pp
    layers = range(pp_rank * per_stage + 1, (pp_rank + 1) * per_stage + 1)
    model = torch.nn.Module()
    for n in layers:
        if MOE_LAYER_FREQ[n - 1]:
            child = torch.nn.Module()
            child.layer_number = n
            child.router_replay = Router(n).router_replay
            model.add_module(f"router{n}", child)
    model.config = types.SimpleNamespace(
        num_layers=NUM_LAYERS,
        moe_layer_freq=MOE_LAYER_FREQ,
        sequence_parallel=sequence_parallel,
        num_moe_experts=NUM_EXPERTS,
    )
    return model


def policy_config(config: dict[str, Any]) -> dict[str, Any]:
    fp8 = config.get("fp8")
    return {
        "make_sequence_length_divisible_by": config["divisible_by"],
        "sequence_packing": {"enabled": config.get("packing", True), "algorithm": "modified_first_fit_decreasing"},
        "dynamic_batching": {"enabled": False},
        "megatron_cfg": {
            "tensor_model_parallel_size": config["tp"],
            "sequence_parallel": config["sp"],
            "context_parallel_size": config["cp"],
            "pipeline_model_parallel_size": config["pp"],
            "fp8_cfg": {"enabled": fp8 is not None, "fp8_recipe": fp8 or "tensorwise"},
            "moe_token_dispatcher_type": "flex" if config.get("hybridep") else "alltoall",
            "moe_flex_dispatcher_backend": "hybridep" if config.get("hybridep") else None,
        },
    }


def identity_rows(nrl: dict[str, types.ModuleType], processed: Any, seq_lengths: Any, cp_rank: int, cp: int) -> Any:
    """NeMo-RL's debug token identity ``[T_cp, 3]`` (sample index in the micro-batch, position, valid), through the
    same CP transform as the routes."""
    data = nrl["data"]
    raw = processed.data_dict
    identity = data._make_r3_trace_token_identity(raw["input_ids"], seq_lengths)
    if processed.cu_seqlens_padded is None and processed.packed_seq_params is None:  # unpacked: [B, S, 3]
        return identity
    cu = torch_cumsum(seq_lengths)
    _, _, _, local = data._shard_routed_experts_for_cp(
        None, identity, seq_lengths, cu, processed.cu_seqlens_padded, cp_rank, cp
    )
    return local


def torch_cumsum(lengths: Any) -> Any:
    import torch

    return torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lengths.to(torch.int32), 0)])


def capture_config(
    nrl: dict[str, types.ModuleType], name: str, config: dict[str, Any], logs: list[Any], sample_ids: list[str]
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    import torch

    data_module, replay_module = nrl["data"], nrl["router_replay"]
    cfg = policy_config(config)
    batch = train_data(nrl, logs, config["divisible_by"], sample_ids)
    arrays: dict[str, np.ndarray] = {
        "input_ids": batch["input_ids"].numpy(),
        "input_lengths": batch["input_lengths"].numpy(),
        "routed_experts": batch["routed_experts"].numpy(),
    }
    dp = config["dp"]
    if cfg["sequence_packing"]["enabled"]:
        packing_args = {
            "algorithm": cfg["sequence_packing"]["algorithm"],
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "sequence_length_pad_multiple": config["divisible_by"],
            "max_tokens_per_microbatch": config["mb_tokens"],
        }
        shards, _ = batch.shard_by_batch_size(dp, batch_size=batch.size, sequence_packing_args=packing_args)
        mbs = 1
    else:
        shards = batch.shard_by_batch_size(dp, batch_size=batch.size)
        mbs = config["mbs"]
    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    original_iterator = data_module.make_processed_microbatch_iterator

    def recording_iterator(raw_iterator: Any, **kwargs: Any) -> Any:
        captured.append(((), {k: v for k, v in kwargs.items() if k not in ("raw_iterator", "cfg", "straggler_timer")}))
        return original_iterator(raw_iterator, **kwargs)

    data_module.make_processed_microbatch_iterator = recording_iterator
    ranks = []
    try:
        for d, shard in enumerate(shards):
            for pp_rank in range(config["pp"]):
                model = stage_model(config["pp"], pp_rank, config["sp"])
                for cp_rank in range(config["cp"]):
                    for tp_rank in range(config["tp"]):
                        data_module.get_context_parallel_rank = lambda r=cp_rank: r
                        data_module.get_context_parallel_world_size = lambda c=config["cp"]: c
                        replay_module._get_tensor_model_parallel_rank = lambda r=tp_rank: r
                        replay_module._get_tensor_model_parallel_world_size = lambda t=config["tp"]: t
                        captured.clear()
                        iterator, n_mb, _, _, _ = data_module.get_microbatch_iterator(
                            shard, cfg, mbs, straggler_timer=None
                        )
                        (_, iterator_args) = captured[0]
                        rank_key = f"dp{d}_pp{pp_rank}_cp{cp_rank}_tp{tp_rank}"
                        micro_batches = []
                        for m, processed in enumerate(iterator):
                            raw = processed.data_dict
                            lengths = raw["input_lengths"]
                            assignments = replay_module.build_router_replay_assignments(
                                model, processed.routed_experts_cp_sharded
                            )
                            for replay, tensor in assignments:
                                arrays[f"{rank_key}_mb{m}_layer{replay.layer_number}"] = tensor.numpy().astype(np.int8)
                            identity = identity_rows(nrl, processed, lengths, cp_rank, config["cp"])
                            identity = identity.reshape(identity.shape[0], identity.shape[1], 1, 3)
                            identity = replay_module._split_for_sequence_parallel(
                                model.config, replay_module._normalize_routed_experts_for_mcore(identity)
                            )[:, 0]
                            arrays[f"{rank_key}_mb{m}_identity"] = identity.numpy().astype(np.int32)
                            rows = {int(t.shape[0]) for _, t in assignments}
                            if rows != {identity.shape[0]}:
                                raise RuntimeError(f"{name} {rank_key} mb{m}: rows {rows} vs {identity.shape[0]}")
                            micro_batches.append(
                                {
                                    SAMPLE_ID_KEY: list(raw[SAMPLE_ID_KEY]),
                                    "input_lengths": [int(v) for v in lengths],
                                    "seq_len": int(raw["input_ids"].shape[1]),
                                    "cu_seqlens_padded": None
                                    if processed.cu_seqlens_padded is None
                                    else [int(v) for v in processed.cu_seqlens_padded],
                                    "rows": int(identity.shape[0]),
                                    "layers": sorted(int(r.layer_number) for r, _ in assignments),
                                }
                            )
                        if len(micro_batches) != n_mb:
                            raise RuntimeError(f"{name} {rank_key}: {len(micro_batches)} micro-batches of {n_mb}")
                        ranks.append(
                            {
                                "dp": d,
                                "pp": pp_rank,
                                "cp": cp_rank,
                                "tp": tp_rank,
                                "key": rank_key,
                                "iterator_args": {k: v for k, v in iterator_args.items() if not callable(v)},
                                "micro_batches": micro_batches,
                            }
                        )
    finally:
        data_module.make_processed_microbatch_iterator = original_iterator
    del torch
    return {"policy": cfg, **config, "ranks": ranks}, arrays


def tiny_config(**extra: Any) -> Any:
    """The small megatron-core MoE config both checks build their model from (``extra``: e.g. an MTP layer)."""
    import torch
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=32,
        num_attention_heads=4,
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=16,
        ffn_hidden_size=64,
        moe_layer_freq=MOE_LAYER_FREQ,
        moe_enable_routing_replay=True,
        moe_token_dispatcher_type="allgather",
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        add_bias_linear=False,
        **extra,
    )


def mtp_outcome(nrl: dict[str, types.ModuleType]) -> dict[str, Any]:
    """NeMo-RL's ``build_router_replay_assignments`` on a real megatron-core GPT model with one MTP layer (CPU,
    gloo, world size 1): which routers it hands decoder routes to, or what it raises."""

    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    from routelog.testing import megatron_on_cpu

    megatron_on_cpu()
    config = tiny_config(mtp_num_layers=1)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=64,
        max_sequence_length=64,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        mtp_block_spec=get_gpt_mtp_block_spec(config, block.layer_specs[-1], use_transformer_engine=False),
    )
    replay = nrl["router_replay"]
    replay._get_tensor_model_parallel_rank = lambda: 0
    replay._get_tensor_model_parallel_world_size = lambda: 1
    routes = torch.zeros((1, 4, NUM_LAYERS, TOPK), dtype=torch.int8)
    routes[..., 1] = 1
    found = [n for _, n in replay._router_replay_instances_for_model(model)]
    try:
        assigned = [int(r.layer_number) for r, _ in replay.build_router_replay_assignments(model, routes)]
        outcome: dict[str, Any] = {"assigned_layer_numbers": assigned}
    except ValueError as exc:
        outcome = {"raises": f"ValueError: {exc}"}
    return {"routers_found": found, **outcome}


def check_routelog(nrl: dict[str, types.ModuleType], logs: list[Any]) -> None:
    """``--check-routelog``: routelog's integration patched into NeMo-RL's real ``data`` module, end to end.

    The driver side runs on NeMo-RL's real ``BatchedDataDict`` (``RolloutRecorder.preserve``); the id columns ride
    the real ``shard_by_batch_size`` and ``get_microbatch_iterator``, which calls routelog's patched
    ``make_processed_microbatch_iterator``. Per micro-batch, a real megatron-core model's routers are armed once by
    NeMo-RL's own ``set_router_replay_forward`` (dense routes, its own missing-route fallback patch installed) and
    once by routelog's replacement, whose row codes went through NeMo-RL's real ``process_microbatch`` and whose
    split is NeMo-RL's real ``_split_for_sequence_parallel``: on every row with a real token but the last of its
    sequence they must select the same experts, and elsewhere routelog leaves the router its own choice. TP = 1 (the
    model is built on one process, and NeMo-RL reads sequence parallelism from the model's config), CP ranks
    simulated."""
    import uuid

    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import routelog
    from routelog.align import ParallelLayout, RankCoords
    from routelog.integrations import nemo_rl as integration

    mtp_outcome(nrl)  # gloo, parallel_state and megatron-core's CPU shims
    config = tiny_config()
    torch.manual_seed(0)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=64,
        max_sequence_length=256,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    spec = routelog.ModelSpec.from_megatron(
        num_layers=NUM_LAYERS, num_moe_experts=NUM_EXPERTS, moe_router_topk=TOPK, moe_layer_freq=MOE_LAYER_FREQ
    )
    routers = {int(m.mlp.router.layer_number): m.mlp.router for m in model.decoder.layers if hasattr(m.mlp, "router")}
    data_module, replay_module = nrl["data"], nrl["router_replay"]
    replay_module._get_tensor_model_parallel_rank = lambda: 0
    replay_module._get_tensor_model_parallel_world_size = lambda: 1
    replay_module._install_missing_route_fallback_patch()  # as validate_router_replay_config does
    train = types.ModuleType("nemo_rl.models.megatron.train")  # the names train.py binds from router_replay
    for name in ("set_router_replay_forward", "set_router_replay_backward", "clear_router_replay"):
        setattr(train, name, getattr(replay_module, name))
    worker = types.ModuleType("nemo_rl.models.policy.workers.megatron_policy_worker")
    worker._should_use_router_replay = lambda **kwargs: False  # type: ignore[attr-defined]

    def selection(hidden: Any) -> dict[int, Any]:
        rows = hidden.shape[0]
        return {n: r(hidden)[1].nonzero()[:, 1].reshape(rows, TOPK).sort(-1).values for n, r in routers.items()}

    compared = fallback = 0
    for name in ("cp2_div16_dp2", "cp2_mxfp8", "hybridep_div1"):
        config_ = CONFIGS[name]
        policy = policy_config(config_)
        flat, lengths = nrl["messages"].batched_message_log_to_flat_message(
            logs, pad_value_dict={"token_ids": PAD_TOKEN}, make_sequence_length_divisible_by=config_["divisible_by"]
        )
        batch_class = nrl["bdd"].BatchedDataDict
        ours = batch_class({"input_ids": flat["token_ids"], "input_lengths": lengths, "index": list(range(len(logs)))})
        dense = batch_class({**ours, "routed_experts": flat["routed_experts"]})
        recorder = integration.RolloutRecorder(f"memory://nemo-rl-check/{uuid.uuid4().hex}", spec=spec)
        recorder.preserve(ours, flat, {"router_replay": {"enabled": True}})
        assert "routed_experts" not in ours and integration.SAMPLE_ID_KEY in ours
        packing = {
            "algorithm": "modified_first_fit_decreasing",
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "sequence_length_pad_multiple": config_["divisible_by"],
            "max_tokens_per_microbatch": config_["mb_tokens"],
        }
        our_shards, _ = ours.shard_by_batch_size(config_["dp"], batch_size=len(logs), sequence_packing_args=packing)
        dense_shards, _ = dense.shard_by_batch_size(config_["dp"], batch_size=len(logs), sequence_packing_args=packing)
        modules = {"data": data_module, "train": train, "worker": worker, "router_replay": replay_module}
        for d in range(config_["dp"]):
            for cp_rank in range(config_["cp"]):
                data_module.get_context_parallel_rank = lambda r=cp_rank: r
                data_module.get_context_parallel_world_size = lambda c=config_["cp"]: c
                options = {"layout": ParallelLayout(cp=config_["cp"]), "rank": RankCoords(cp=cp_rank)}
                # NeMo-RL's own path for the dense copy, then routelog's installed for the id-carrying one
                nemo, _, _, _, _ = data_module.get_microbatch_iterator(dense_shards[d], policy, 1, straggler_timer=None)
                nemo = list(nemo)
                integration.install(recorder.store, modules=modules, **options)
                replayed, _, _, _, _ = data_module.get_microbatch_iterator(
                    our_shards[d], policy, 1, straggler_timer=None
                )
                for mine, theirs in zip(replayed, nemo, strict=True):
                    assert mine.data_dict["index"] == theirs.data_dict["index"]
                    # NeMo-RL's own packing and CP sharding of routelog's row codes: a tensor, one row per local row
                    codes = mine.routed_experts_cp_sharded
                    assert codes.dtype == torch.int64 and tuple(codes.shape[2:]) == (1, 1), codes.shape
                    assert codes.shape[1] == theirs.routed_experts_cp_sharded.shape[1]
                    assert torch.equal(mine.cu_seqlens_padded, theirs.cu_seqlens_padded)
                    hidden = torch.randn(theirs.routed_experts_cp_sharded.shape[1], 1, 32)
                    native = selection(hidden)
                    replay_module.set_router_replay_forward(model, theirs.routed_experts_cp_sharded)
                    by_nemo = selection(hidden)
                    replay_module.clear_router_replay(model)
                    train.set_router_replay_forward(model, mine.routed_experts_cp_sharded)  # routelog's, patched
                    by_routelog = selection(hidden)
                    train.clear_router_replay(model)
                    fed = theirs.data_dict
                    identity = data_module._make_r3_trace_token_identity(fed["input_ids"], fed["input_lengths"])
                    _, _, _, local = data_module._shard_routed_experts_for_cp(
                        None, identity, fed["input_lengths"], torch_cumsum(fed["input_lengths"]),
                        theirs.cu_seqlens_padded, cp_rank, config_["cp"],
                    )  # fmt: skip
                    local = local[0]
                    real = (local[:, 2] == 1) & (local[:, 1] < fed["input_lengths"][local[:, 0].long()] - 1)
                    for n in routers:
                        if not torch.equal(by_routelog[n][real], by_nemo[n][real]):
                            raise RuntimeError(f"{name}: layer {n} differs from NeMo-RL's installation")
                        if not torch.equal(by_routelog[n][~real], native[n][~real]):
                            raise RuntimeError(f"{name}: layer {n} replays rows NeMo-RL pads")
                        sentinel = (theirs.routed_experts_cp_sharded[0, :, n - 1] == -1).all(-1)
                        compared += int(real.sum())
                        fallback += int((sentinel & real).sum())
                integration.uninstall()
        print(f"check {name}: routelog's installation equals NeMo-RL's")
    print(f"checked {compared} router rows against NeMo-RL's own installation, {fallback} of them its -1 fallback")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nemo-rl-git", type=Path, required=True, help="git directory holding commit " + COMMIT)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--check-routelog",
        action="store_true",
        help="also patch routelog's integration into NeMo-RL's real data path and compare installations",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nemo-rl-src-") as tmp:
        src = extract(args.nemo_rl_git, Path(tmp))
        nrl = load_nemo_rl(src)
        import torch

        torch.manual_seed(0)
        rng = np.random.default_rng(20260822)
        sample_ids = [f"grpo-7/{i}" for i in range(len(SAMPLES))]
        rolled = rollout(nrl, rng)
        args.out.mkdir(parents=True, exist_ok=True)
        generation = {k: v.numpy() for k, v in rolled["generation"].items()}
        messages: dict[str, np.ndarray] = {}
        for i, log in enumerate(rolled["logs"]):
            for j, message in enumerate(log):
                messages[f"s{i}_m{j}_tokens"] = message["token_ids"].numpy()
                messages[f"s{i}_m{j}_routes"] = message["routed_experts"].numpy()
        vllm = {f"s{i}_vllm_rows": rows for i, rows in enumerate(rolled["vllm_rows"])}
        np.savez_compressed(args.out / "rollout.npz", **generation, **messages, **vllm)
        manifest: dict[str, Any] = {
            "nemo_rl": {"repository": "github.com/NVIDIA-NeMo/RL", "commit": COMMIT},
            "generator": "tools/make_nemo_rl_fixtures.py",
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "megatron_core": importlib.import_module("megatron.core").__version__,
            "model": {
                "num_layers": NUM_LAYERS,
                "moe_layer_freq": MOE_LAYER_FREQ,
                "num_moe_experts": NUM_EXPERTS,
                "topk": TOPK,
                "carry_dtype": str(nrl["interfaces"].resolve_routed_experts_dtype(NUM_EXPERTS)),
            },
            "sample_ids": sample_ids,
            "samples": [
                {"prompt": p, "generation": g, "vllm_rows": kind, "extra_message": extra}
                for p, g, kind, extra in SAMPLES
            ],
            "messages": [
                [{"role": m["role"], "tokens": int(m["token_ids"].shape[0])} for m in log] for log in rolled["logs"]
            ],
            "envelopes": rolled["envelopes"],
            "configs": {},
        }
        for name, config in CONFIGS.items():
            described, arrays = capture_config(nrl, name, config, rolled["logs"], sample_ids)
            manifest["configs"][name] = described
            np.savez_compressed(args.out / f"{name}.npz", **arrays)
            print(f"{name}: {len(described['ranks'])} ranks, "
                  f"{sum(len(r['micro_batches']) for r in described['ranks'])} rank micro-batches")  # fmt: skip
        manifest["mtp"] = mtp_outcome(nrl)
        if args.check_routelog:
            check_routelog(nrl, rolled["logs"])
        print(f"mtp: {manifest['mtp']}")
        (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
