"""Log vLLM and SGLang responses as you get them, then ingest them into a store.

vLLM 0.22+ (``--enable-return-routed-experts``) returns ``choices[i].routed_experts`` as base64 of a ``.npy`` file;
send ``"return_token_ids": true`` so the response carries the token ids. SGLang returns
``meta_info["routed_experts"]`` as base64 of raw int32 when the request has ``"return_routed_experts": true``.
Write each exchange as one JSONL line ``{"request": ..., "response": ...}`` and run, for example:

    routelog ingest rollouts.jsonl --engine vllm --model-spec config.json --to s3://bucket/run-1 --step 12

This script does the same in Python with two hand-made responses (a DeepSeek-V3-style model: dense layers first).

    python examples/ingest_engines.py [STORE_URL]
"""

from __future__ import annotations

import base64
import io
import sys
import tempfile

import numpy as np

import routelog
from routelog.engines import sglang, to_full_axis, vllm

if len(sys.argv) > 1:
    url = sys.argv[1]
else:  # a scratch store, removed when the script ends
    scratch = tempfile.TemporaryDirectory(prefix="routelog-ingest-")
    url = scratch.name
spec = routelog.ModelSpec.from_hf_config(
    {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 6,
        "first_k_dense_replace": 2,
        "n_routed_experts": 32,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
    }
)
rng = np.random.default_rng(0)
prompt, output = list(range(10, 18)), list(range(100, 112))
n_rows = len(prompt) + len(output) - 1  # the final sampled token is never forwarded
moe_rows = np.argsort(rng.random((n_rows, spec.num_moe_layers, spec.num_experts)), axis=-1)[..., : spec.topk]
full_rows = to_full_axis(moe_rows, spec)  # engines report every decoder layer, dense ones as zeros

buffer = io.BytesIO()
np.save(buffer, full_rows.astype(np.uint8))
vllm_response = {
    "id": "cmpl-1",
    "prompt_token_ids": prompt,
    "choices": [{"index": 0, "token_ids": output, "routed_experts": base64.b64encode(buffer.getvalue()).decode()}],
}
sglang_request = {"input_ids": prompt, "return_routed_experts": True}
sglang_response = {
    "output_ids": output,
    "meta_info": {"id": "rid-1", "routed_experts": base64.b64encode(full_rows.astype("<i4").tobytes()).decode()},
}

with routelog.open_writer(url, step=0, model_spec=spec, writer_id="ingest") as writer:
    for record in vllm.records_from_http(vllm_response, spec, policy_version=0):
        writer.append(record)
    for record in sglang.records_from_http(sglang_response, spec, request=sglang_request, policy_version=0):
        writer.append(record)

snapshot = routelog.open_store(url).step(0)
for routing in snapshot.read_many(snapshot.sample_ids):
    print(
        routing.sample_id,
        routing.info.engine,
        routing.expert_ids.shape,
        "layers",
        routing.layers,
        "missing rows",
        int((~routing.valid).sum()),
    )
