"""Rollout Routing Replay in veRL 0.9 with routelog, on CPU: what the two added lines do, end to end.

Driver side, after the rollout: ``write_batch(writer, batch)`` writes the agent loop's ``routed_experts`` to the store
and leaves only ``routelog_sample_id`` in the batch. Worker side, before the engine is built:
``routelog.integrations.verl.install(url)`` patches veRL's Megatron engine so each micro-batch's rows are read
(only this rank's) and installed into the routers when the model chunk runs, aligned to the packing veRL gives it.

This script runs veRL's own batch and split code (``DataProto``, ``left_right_2_no_padding``,
``rearrange_micro_batches``, ``preprocess_thd_engine``, its ``RouterReplay`` patch) with a tiny megatron-core model
on CPU (gloo, one process) and checks every routed token. Needs the veRL test dependencies (see the README).

    python examples/verl_r3.py [STORE_URL]
"""

from __future__ import annotations

import sys
import tempfile
import warnings

from routelog.extras import exit_unless_installed

exit_unless_installed("examples/verl_r3.py", "megatron", "verl")

import numpy as np
import torch
import torch.distributed as dist

from routelog.testing import megatron_on_cpu

warnings.filterwarnings("ignore")  # veRL and megatron-core warn about every optional package missing on CPU
# megatron-core on CPU: one gloo process, its parallel state, and the two shims its CPU path needs.
megatron_on_cpu()

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from verl import DataProto
from verl.models.mcore.util import preprocess_thd_engine
from verl.utils.megatron.router_replay_patch import RouterReplayAction, apply_router_replay_patch
from verl.utils.megatron.router_replay_utils import set_model_router_replay_action
from verl.utils.model import compute_position_id_with_mask
from verl.utils.seqlen_balancing import rearrange_micro_batches
from verl.workers.engine.megatron import transformer_impl
from verl.workers.utils.padding import left_right_2_no_padding

import routelog
from routelog.integrations import verl as integration

apply_router_replay_patch()  # what veRL's engine does before building the model: its RouterReplay in every router

freq = [0, 1, 1, 1]
spec = routelog.ModelSpec.from_megatron(num_layers=4, num_moe_experts=8, moe_router_topk=2, moe_layer_freq=freq)
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

# -- the rollout: a batch as veRL's agent loop returns it (left-padded prompts, right-padded responses) ----------
rng = np.random.default_rng(0)
P, R, lengths = 8, 8, [(3, 8), (8, 2), (5, 6), (2, 7)]
prompts, responses = torch.zeros((4, P), dtype=torch.long), torch.zeros((4, R), dtype=torch.long)
mask = torch.zeros((4, P + R), dtype=torch.long)
routes = np.zeros((4, P + R, 4, 2), np.int16)  # the engine's full layer axis; the dense layer 0 holds zeros
for i, (p, r) in enumerate(lengths):
    prompts[i, P - p :] = torch.from_numpy(rng.integers(1, 64, p))
    responses[i, :r] = torch.from_numpy(rng.integers(1, 64, r))
    mask[i, P - p : P + r] = 1
    routes[i, P - p : P + r - 1, 1:] = np.argsort(rng.random((p + r - 1, 3, 8)), axis=-1)[..., :2]
batch = DataProto.from_dict(
    tensors={
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": mask,
        "position_ids": compute_position_id_with_mask(mask),
        "response_mask": mask[:, P:].clone(),
        "routed_experts": torch.from_numpy(routes),
    },
    non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)},
)
if len(sys.argv) > 1:
    url = sys.argv[1]
else:  # a scratch store, removed when the script ends
    scratch = tempfile.TemporaryDirectory(prefix="routelog-verl-")
    url = scratch.name
with routelog.open_writer(url, step=1, model_spec=spec, writer_id="driver") as writer:
    ids = integration.write_batch(writer, batch)  # line 1: routing to the store, sample ids into the batch
print(f"rollout: wrote {ids}; the batch now carries {sorted(batch.non_tensor_batch)} and no routed_experts")

# -- the training worker ----------------------------------------------------------------------------------------
replay = integration.install(url, fidelity_writer="train-dp0")  # line 2: in every worker, before the engine
data = left_right_2_no_padding(batch.to_tensordict())
micro_batches, order = rearrange_micro_batches(data, max_token_len=24)  # veRL's dynamic micro-batches
for mb, samples in zip(micro_batches, order, strict=True):
    # What veRL's forward_step does per micro-batch, then the model's forward on the packing veRL gives it.
    inputs = transformer_impl.MegatronEngineWithLMHead.prepare_model_inputs(None, mb)
    set_model_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
    transformer_impl.set_router_replay_data(inputs["routed_experts"], None, config, vp_rank=0, model=model)
    input_ids, packed, _ = preprocess_thd_engine(mb["input_ids"], pre_process=True)
    replay._pre_forward(model, (), {"packed_seq_params": packed})  # the hook the chunk's forward triggers
    # The forward starts at the embedding: the token fed at each row is checked against the recorded one.
    model.embedding(input_ids=input_ids, position_ids=torch.arange(input_ids.shape[1])[None])
    rows = int(packed.cu_seqlens_q_padded[-1])
    starts = packed.cu_seqlens_q_padded.tolist()
    for layer in model.decoder.layers:
        if not hasattr(layer.mlp, "router"):
            continue
        _, routing_map = layer.mlp.router(torch.randn(rows, 1, 32))
        chosen = np.sort(np.nonzero(routing_map.numpy())[1].reshape(rows, 2), axis=-1)
        for j, i in enumerate(samples):
            n = int(mask[i].sum()) - 1  # routed tokens of sample i (the last one has no route)
            want = np.sort(routes[i][mask[i].bool().numpy()][:n, int(layer.layer_number) - 1], axis=-1)
            assert (chosen[starts[j] : starts[j] + n] == want).all()
    set_model_router_replay_action(model, RouterReplayAction.REPLAY_BACKWARD)
    print(f"micro-batch {[ids[i] for i in samples]}: {rows} packed rows, every routed token took its rollout experts")
counts = replay.end_step(phase="train")
# The router diff: per layer, the share of replayed rows where the training router's own top-k differs from the
# replayed one. The rollout's routes here are random and the model random-init, so the trainer would choose
# otherwise almost everywhere (close to 1); in real training it is a few percent, and FidelityGate(max_router_diff)
# fails the step above its threshold.
diff = {layer: round(share, 3) for layer, share in counts.router_diff().items()}
print(f"router diff published for step 1 (random routes on a random model: near 1 by construction): {diff}")
dist.destroy_process_group()
