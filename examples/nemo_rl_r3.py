"""NeMo-RL with routelog: the rollout's routing goes to a store, ``train_data`` carries sample ids, and each policy
worker replays its own rows and layers (``routelog.integrations.nemo_rl``).

In a real run you add these lines (NeMo-RL at commit 7ea279ab, ``policy.router_replay.enabled: true``):

    # driver script, before init_ray() and grpo.setup(...)
    from routelog.integrations import nemo_rl as routelog_nemo_rl
    routelog_nemo_rl.install_driver(URL, spec=routelog.ModelSpec.from_hf_config(hf_config))
    os.environ[routelog_nemo_rl.URL_ENV] = URL          # init_ray() forwards the environment to the workers
    setup(..., policy_factory=functools.partial(Policy, worker_extension_cls_fqn="my_workers.RoutelogWorker"))

    # my_workers.py, importable by the workers
    @ray.remote(runtime_env=get_runtime_env_for_policy_worker("megatron_policy_worker"))
    class RoutelogWorker(MegatronPolicyWorkerImpl):
        def __init__(self, *args, **kwargs):
            routelog_nemo_rl.install(gate=FidelityGate(max_router_diff=0.2), fidelity_writer="policy")
            super().__init__(*args, **kwargs)

NeMo-RL cannot be installed here, so this script runs the same hooks on CPU: stand-ins for the NeMo-RL functions
routelog replaces (``grpo._preserve_router_replay_routed_experts``, ``data.make_processed_microbatch_iterator``,
``train.set_router_replay_forward`` / ``clear_router_replay``, ``megatron_policy_worker._should_use_router_replay``)
are patched exactly as in a worker, and a tiny megatron-core 0.16 GPT model's routers replay the rollout.

    python examples/nemo_rl_r3.py [STORE_URL]
"""

from __future__ import annotations

import sys
import tempfile
import types
import warnings
from collections import UserDict
from collections.abc import Iterator
from typing import Any

from routelog.extras import exit_unless_installed

exit_unless_installed("examples/nemo_rl_r3.py", "megatron")

import numpy as np
import torch
import torch.distributed as dist

import routelog
from routelog.integrations import nemo_rl as routelog_nemo_rl
from routelog.testing import megatron_on_cpu, nemo_rl_local_rows

# megatron-core warns, once per module, that Transformer Engine and Apex (GPU packages) are missing: expected here.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
# megatron-core on CPU: one gloo process, its parallel state, and the two shims its CPU path needs.
megatron_on_cpu()

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

FREQ, E, K, DIVISIBLE_BY = [0, 1, 1, 1], 8, 2, 4
spec = routelog.ModelSpec.from_megatron(num_layers=4, num_moe_experts=E, moe_router_topk=K, moe_layer_freq=FREQ)
rng = np.random.default_rng(0)

# -- the driver: NeMo-RL's flattened rollout, as grpo_train builds it -------------------------------------------
lengths = [11, 7, 14]
S = -(-max(lengths) // DIVISIBLE_BY) * DIVISIBLE_BY  # batched_message_log_to_flat_message's padded width
tokens = torch.zeros(len(lengths), S, dtype=torch.int64)
routes = torch.zeros(len(lengths), S, len(FREQ), K, dtype=torch.int8)  # vLLM's full layer axis, int8 for E = 8
for b, n in enumerate(lengths):
    tokens[b, :n] = torch.from_numpy(rng.integers(1, 64, n))
    for layer, moe in enumerate(FREQ):
        if moe:
            routes[b, :n, layer] = torch.from_numpy(np.argsort(rng.random((n, E)), axis=-1)[:, :K])
    routes[b, n - 1] = torch.arange(K)  # the final token: never forwarded, a dummy route
routes[1, 3:5] = routelog_nemo_rl.MISSING  # rows vLLM did not return: NeMo-RL's -1 sentinel
flat_messages = UserDict({"token_ids": tokens, "routed_experts": routes})
train_data = UserDict({"input_ids": tokens, "input_lengths": torch.tensor(lengths)})
policy_config = {
    "router_replay": {"enabled": True},
    "make_sequence_length_divisible_by": DIVISIBLE_BY,
    "sequence_packing": {"enabled": True},
    "megatron_cfg": {"tensor_model_parallel_size": 1, "context_parallel_size": 1, "sequence_parallel": False},
}

if len(sys.argv) > 1:
    url = sys.argv[1]
else:  # a scratch store, removed when the script ends
    scratch = tempfile.TemporaryDirectory(prefix="routelog-nemo-rl-")
    url = scratch.name
grpo = types.ModuleType("nemo_rl.algorithms.grpo")  # stand-in: install_driver imports the real module
grpo._preserve_router_replay_routed_experts = lambda target, flat, config: None  # type: ignore[attr-defined]
routelog_nemo_rl.install_driver(url, grpo=grpo, spec=spec)
grpo._preserve_router_replay_routed_experts(train_data, flat_messages, policy_config)
print(
    f"driver: step {train_data[routelog_nemo_rl.STEP_KEY][0]} written; train_data carries "
    f"{train_data[routelog_nemo_rl.SAMPLE_ID_KEY]} and no routed_experts: {'routed_experts' not in train_data}"
)


# -- a policy worker: NeMo-RL's functions, patched by install() ----------------------------------------------------
def make_processed_microbatch_iterator(
    raw_iterator: Iterator[Any],
    cfg: dict[str, Any],
    seq_length_key: str | None,
    pad_individual_seqs_to_multiple_of: int,
    pad_packed_seq_to_multiple_of: int,
    straggler_timer: Any,
    pad_full_seq_to: int | None,
    delegate_pack_to_model: bool = False,
    delegate_mtp_loss_mask_to_model: bool = False,
    model_slices_context_parallel_inputs: bool = False,
) -> Iterator[Any]:
    """Stand-in for NeMo-RL's: packs each sequence, and its ``routed_experts`` rows, to
    ``pad_individual_seqs_to_multiple_of`` (CP = TP = 1; pad rows take the route ``arange(K)``)."""
    for data in raw_iterator:
        padded = [-(-int(n) // pad_individual_seqs_to_multiple_of) * pad_individual_seqs_to_multiple_of
                  for n in data["input_lengths"]]  # fmt: skip
        routed = data["routed_experts"]  # routelog's row codes, [B, S, 1, 1]
        rows = []
        for b, (n, width) in enumerate(zip(data["input_lengths"].tolist(), padded, strict=True)):
            pad = torch.arange(routed.shape[-1], dtype=routed.dtype).expand(width - n, *routed.shape[2:])
            rows.append(torch.cat([routed[b, :n], pad]))
        yield types.SimpleNamespace(
            data_dict=data,
            cu_seqlens_padded=torch.tensor(np.cumsum([0, *padded])),
            routed_experts_cp_sharded=torch.cat(rows)[None],
        )


stand_ins = {
    "data": types.ModuleType("nemo_rl.models.megatron.data"),
    "train": types.ModuleType("nemo_rl.models.megatron.train"),
    "worker": types.ModuleType("nemo_rl.models.policy.workers.megatron_policy_worker"),
}
stand_ins["data"].make_processed_microbatch_iterator = make_processed_microbatch_iterator  # type: ignore[attr-defined]
for name in ("set_router_replay_forward", "set_router_replay_backward", "clear_router_replay"):
    setattr(stand_ins["train"], name, lambda *args: None)
stand_ins["worker"]._should_use_router_replay = lambda **kwargs: False  # type: ignore[attr-defined]
# In a real worker: install() with the store from URL_ENV; NeMo-RL's own normalisation and sequence-parallel split
# of the rows (router_replay._split_for_sequence_parallel) are what nemo_rl_local_rows stands in for.
routelog_nemo_rl.install(url, modules=stand_ins, local_rows=nemo_rl_local_rows())

config = TransformerConfig(
    num_layers=len(FREQ),
    hidden_size=32,
    num_attention_heads=4,
    num_moe_experts=E,
    moe_router_topk=K,
    moe_ffn_hidden_size=16,
    ffn_hidden_size=64,
    moe_layer_freq=FREQ,
    moe_enable_routing_replay=True,  # what policy.router_replay.enabled sets
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
train = stand_ins["train"]
assert stand_ins["worker"]._should_use_router_replay(enabled=True, data=train_data, stage="train", require=True)
micro_batches = [
    {k: v[rows] if hasattr(v, "shape") else [v[r] for r in rows] for k, v in train_data.items()}
    for rows in ([0, 1], [2])
]  # fmt: skip  (NeMo-RL's sequence-packing bins)
iterator = stand_ins["data"].make_processed_microbatch_iterator(
    raw_iterator=iter(micro_batches),
    cfg=policy_config,
    seq_length_key="input_lengths",
    pad_individual_seqs_to_multiple_of=DIVISIBLE_BY,
    pad_packed_seq_to_multiple_of=1,
    straggler_timer=None,
    pad_full_seq_to=None,
)
store = routelog.open_store(url)
for processed in iterator:  # what forward_with_post_processing_fn does per micro-batch
    train.set_router_replay_forward(model, processed.routed_experts_cp_sharded)  # NeMo-RL's tensor of row codes
    sample_ids = processed.data_dict[routelog_nemo_rl.SAMPLE_ID_KEY]
    step = processed.data_dict[routelog_nemo_rl.STEP_KEY][0]
    cu = processed.cu_seqlens_padded.tolist()
    replayed = fallback = 0
    for router in (layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")):
        hidden = torch.randn(cu[-1], 1, 32)  # the packed micro-batch, as the MoE layer sees it
        chosen = np.sort(np.nonzero(router(hidden)[1].numpy())[1].reshape(-1, K), axis=-1)
        moe_index = spec.moe_index(int(router.layer_number) - 1)
        for sid, start in zip(sample_ids, cu, strict=False):
            stored = store.step(step).read(sid)
            rows = np.flatnonzero(stored.valid)
            assert (chosen[start + rows] == np.sort(stored.expert_ids[rows, moe_index], -1)).all()
            replayed += rows.size
            fallback += stored.info.n_tokens - rows.size
    train.clear_router_replay(model)  # forward-only here (NeMo-RL's prev-logprob pass)
    print(
        f"micro-batch {list(sample_ids)}: {replayed} router rows replayed, {fallback} left to the router "
        "(-1 rows and final tokens)"
    )
print("routers selected the recorded experts on every replayed row")
routelog_nemo_rl.uninstall()
dist.destroy_process_group()
