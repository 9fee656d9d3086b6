"""Rollout Routing Replay end to end on CPU, step by step (``routelog demo`` runs the same flow on two models).

record (bf16 generate) -> store -> loader (aligned, final-token mask) -> replay in an fp32 forward -> metrics.

    python examples/r3_on_cpu.py [STORE_URL]
"""

from __future__ import annotations

import contextlib
import sys
import tempfile

from routelog.extras import exit_unless_installed

exit_unless_installed("examples/r3_on_cpu.py", "hf")

import numpy as np
import torch
import transformers

import routelog
from routelog.align import AlignmentPlan, MicroBatch, Packing, ParallelLayout, RankCoords
from routelog.audit.r3 import compare_routings, k3_kl
from routelog.engines.hf import RoutingRecorder, replay
from routelog.loader import ReplayLoader

if len(sys.argv) > 1:
    url = sys.argv[1]
else:  # a scratch store, removed when the script ends
    scratch = tempfile.TemporaryDirectory(prefix="routelog-r3-")
    url = scratch.name
torch.manual_seed(0)
config = transformers.Qwen3MoeConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    num_experts=32,
    num_experts_per_tok=4,
    mlp_only_layers=[0],
    initializer_range=0.1,  # realistic router margins (0.02 makes routing near-random)
)
model = transformers.AutoModelForCausalLM.from_config(config).eval()
spec = routelog.ModelSpec.from_hf_config(config.to_dict(), name="tiny-qwen3-moe")
prompts = torch.randint(1, 512, (4, 16))

# 1. Inference engine: bf16 sampling with the KV cache; every router call is recorded.
model.to(torch.bfloat16)
with RoutingRecorder(model, spec) as recorder, torch.no_grad():
    out = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=32,
        do_sample=True,
        top_k=0,
        top_p=1.0,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    ids = [f"seq-{b}" for b in range(4)]
    records = recorder.records(prompts, torch.ones_like(prompts), out.sequences, sample_ids=ids)
logp_infer = (
    torch.stack([s.float().log_softmax(-1) for s in out.scores], 1).gather(-1, out.sequences[:, 16:, None]).squeeze(-1)
)

# 2. Store: the records, missing final rows and all.
with routelog.open_writer(url, step=0, model_spec=spec, writer_id="rollout") as writer:
    for record in records:
        writer.append(record)

# 3. Trainer: load this rank's routing aligned to its micro-batch (one BSHD micro-batch here).
plan = AlignmentPlan(spec, ParallelLayout(), Packing("bshd"), RankCoords(), (MicroBatch(tuple(ids)),))
(mb,) = list(ReplayLoader(url, 0, plan))
length, batch = out.sequences.shape[1], 4
to_hf = {
    r.layer: mb.ids[j].reshape(length, batch, -1).transpose(1, 0, 2).reshape(-1, spec.topk)
    for j, r in enumerate(mb.routers)
}  # Megatron rows are sequence-major; HF flattens batch-major
mask = mb.mask.reshape(length, batch).T.reshape(-1)


def train_logp(replayed: bool) -> tuple[torch.Tensor, list[np.ndarray]]:
    model.to(torch.float32)
    # Replay's hook is registered first, so the recorder (registered after it) sees the replayed selection.
    forcing = replay(model, spec, to_hf, mask=mask) if replayed else contextlib.nullcontext()
    with forcing, RoutingRecorder(model, spec) as rec, torch.no_grad():
        logits = model(out.sequences).logits
    routes = np.stack([rec.calls[layer][0].reshape(batch, length, -1) for layer in spec.moe_layers], axis=2)
    logp = logits[:, 15:-1].float().log_softmax(-1).gather(-1, out.sequences[:, 16:, None]).squeeze(-1)
    return logp, list(routes)


# 4. Compare: routing differences and the k3 KL, without and with replay.
for replayed in (False, True):
    logp_train, routes = train_logp(replayed)
    diff = compare_routings([(r.expert_ids, t, r.valid) for r, t in zip(records, routes, strict=True)])
    print(
        f"{'with' if replayed else 'without'} R3: router diff {diff.router_diff_rate:.2%}, "
        f"KL k3 {k3_kl(logp_train.numpy(), logp_infer.numpy()):.2e}"
    )
print(f"store: {url}")
