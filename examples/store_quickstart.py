"""Write a step of routing to a store, read back one pipeline stage's layers for two records.

python examples/store_quickstart.py [STORE_URL]      (default: a temporary local directory, removed at the end)
"""

from __future__ import annotations

import sys
import tempfile

import numpy as np

import routelog

if len(sys.argv) > 1:
    url = sys.argv[1]
else:  # a scratch store, removed when the script ends
    scratch = tempfile.TemporaryDirectory(prefix="routelog-example-")
    url = scratch.name

# A DeepSeek-V3-style layer map: 3 dense layers, then MoE layers with 64 experts, top-6.
spec = routelog.ModelSpec.from_hf_config(
    {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 12,
        "first_k_dense_replace": 3,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_group": 8,
        "topk_group": 4,
    }
)
rng = np.random.default_rng(0)
with routelog.open_writer(url, step=0, model_spec=spec, writer_id="rollout-0") as writer:
    for i in range(4):
        n_tokens = 100 + 10 * i
        ids = np.argsort(rng.random((n_tokens, spec.num_moe_layers, spec.num_experts)), axis=-1)[..., : spec.topk]
        valid = np.ones(n_tokens, dtype=bool)
        valid[-1] = False  # engines never forward the final sampled token
        writer.append(
            routelog.Record(
                sample_id=f"req-{i}/0",
                expert_ids=ids,
                prompt_len=20,
                response_len=n_tokens - 20,
                valid=valid,
                token_ids=rng.integers(0, 32000, n_tokens),
            )
        )

snapshot = routelog.open_store(url).step(0)
stage = [spec.moe_index(layer) for layer in range(6, 12)]  # a pipeline stage holding global layers 6..11
for routing in snapshot.read_many(["req-1/0", "req-3/0"], moe_layers=stage):
    print(
        routing.sample_id,
        routing.expert_ids.shape,
        "global layers",
        routing.layers,
        "missing rows",
        int((~routing.valid).sum()),
    )
print(f"store: {url}")
