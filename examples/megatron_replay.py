"""Replaying stored routing in a megatron-core training step (the install path a trainer copies).

Each rank builds one plan from what the trainer already knows (its micro-batches, packing and parallel layout),
loads only its share in the background, and hands each micro-batch to the routers around the forward step:

    plan = AlignmentPlan(spec, ParallelLayout(tp=2, cp=2, pp=4, vpp=2), Packing("verl"),
                         RankCoords(tp=tp_rank, cp=cp_rank, pp=pp_rank), micro_batches)
    replay = MegatronReplay(model_chunks, plan, config=model_config)   # refuses fused routers, sinkhorn, ...
    for mb in ReplayLoader(url, step, plan):                            # prefetches the next micro-batches
        with replay.forward(mb, vp_stage=chunk):
            output = forward_step(...)                                  # routers select the rollout's experts
    ...backward (recomputation pops the same targets)...
    replay.check()                                  # before optimizer.step(): tokens fed row by row, routes taken
    optimizer.step()
    replay.end_step()

This script runs that flow for real on CPU with megatron-core 0.16: a tiny GPT model with dense and MoE layers,
routing written to a local store, and every MoE layer's routing checked against the store.

    python examples/megatron_replay.py [STORE_URL]
"""

from __future__ import annotations

import sys
import tempfile
import warnings

from routelog.extras import exit_unless_installed

exit_unless_installed("examples/megatron_replay.py", "megatron")

import numpy as np
import torch
import torch.distributed as dist

import routelog
from routelog.align import AlignmentPlan, Packing, ParallelLayout, RankCoords, parse_micro_batches
from routelog.loader import ReplayLoader
from routelog.megatron import MegatronReplay
from routelog.testing import megatron_on_cpu

# megatron-core warns, once per module, that Transformer Engine and Apex (GPU packages) are missing: expected here.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
# megatron-core on CPU: one gloo process, its parallel state, and the two shims its CPU path needs.
megatron_on_cpu()

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

freq = [0, 1, 1, 1]
config = TransformerConfig(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    num_moe_experts=8,
    moe_router_topk=2,
    moe_ffn_hidden_size=16,
    ffn_hidden_size=64,
    moe_layer_freq=freq,
    moe_enable_routing_replay=True,
    moe_token_dispatcher_type="allgather",
    use_cpu_initialization=True,
    params_dtype=torch.float32,
    add_bias_linear=False,
)
model = GPTModel(
    config=config,
    transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
    vocab_size=64,
    max_sequence_length=128,
    pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
)

spec = routelog.ModelSpec.from_megatron(num_layers=4, num_moe_experts=8, moe_router_topk=2, moe_layer_freq=freq)
if len(sys.argv) > 1:
    url = sys.argv[1]
else:  # a scratch store, removed when the script ends
    scratch = tempfile.TemporaryDirectory(prefix="routelog-megatron-")
    url = scratch.name
rng = np.random.default_rng(0)
tokens = {}
with routelog.open_writer(url, step=0, model_spec=spec) as writer:
    for i, n in enumerate([11, 20, 7]):
        tokens[f"s{i}"] = rng.integers(0, 64, n)
        ids = np.argsort(rng.random((n, spec.num_moe_layers, 8)), axis=-1)[..., :2]
        valid = np.ones(n, bool)
        valid[-1] = False
        writer.append(
            routelog.Record(
                sample_id=f"s{i}",
                expert_ids=ids,
                prompt_len=3,
                response_len=n - 3,
                valid=valid,
                token_ids=tokens[f"s{i}"],
            )
        )

plan = AlignmentPlan(spec, ParallelLayout(), Packing("verl"), RankCoords(), tuple(parse_micro_batches("s0,s1|s2")))
replay = MegatronReplay([model], plan, config=config)
for mb in ReplayLoader(url, 0, plan):
    fed = torch.from_numpy(np.concatenate([tokens[sid] for sid in mb.sample_ids]))[None]  # veRL's packing, TP = 1
    with replay.forward(mb):
        # A forward starts at the embedding: routelog compares the token fed at every router row with the token
        # its routing was recorded for (a reordered or changed micro-batch fails the step before the optimizer).
        model.embedding(input_ids=fed, position_ids=torch.arange(fed.shape[1])[None])
        for j, layer in enumerate(layer for layer in model.decoder.layers if hasattr(layer.mlp, "router")):
            hidden = torch.randn(mb.ids.shape[1], 1, 32)  # this rank's packed tokens, as the MoE layer sees them
            _, routing_map = layer.mlp.router(hidden)
            chosen = np.sort(np.nonzero(routing_map.numpy())[1].reshape(-1, 2), axis=-1)
            assert (chosen == np.sort(mb.ids[j], axis=-1)).all()
    print(
        f"micro-batch {mb.index}: {mb.ids.shape[1]} rows x {len(mb.routers)} routers replayed "
        f"({int(mb.mask.sum())} recorded, {int((~mb.mask).sum())} padding/missing with distinct dummies)"
    )
replay.end_step()  # judges the step: tokens row by row, routes taken by every router
dist.destroy_process_group()
