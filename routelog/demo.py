"""``routelog demo``: the whole R3 pipeline on CPU with tiny random HF models, and the paper's measurements.

1. *Inference engine*: ``generate`` in bf16 with the KV cache and sampling; the HF recorder captures every router
   call and the records go through the routelog writer into a store.
2. *Training engine*: one fp32 forward over the same tokens, three ways: no replay; R3, with the routing read back
   from the store through the loader (BSHD micro-batch, final-token mask); and a dense model of the same size.
   Replay keeps the recorded experts and computes their weights from the training logits, so the router still
   gets gradients (checked).
3. Router-, token- and sequence-level routing differences (paper Fig. 3), the k3 KL between inference and training
   token probabilities (eq. 2) and F(t=2) (eq. 3), with and without replay, in ``metrics.json`` and ``report.png``.

The DeepSeek-V3.2-style model also has a sparse-attention indexer in every layer: its selections (the key positions
each query attends to) are recorded in generation, stored beside the routing, and replayed from the store in the R3
forward; the indexer diff (share of selected positions the training forward picks differently) goes with the router
diff.

Each model's store keeps what the audits need afterwards: step 0 holds the inference routing with the engine's
log-probs (``logprob_infer``) and the trainer's without replay (``logprob_train``, an annotation); a second store
``<store>-train`` holds the training forward's own routing (no replay), so ``routelog diff``, ``mismatch`` and
``drift`` reproduce the "without R3" figures from storage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog import interrupts
from routelog.align import AlignmentPlan, MicroBatch, Packing, ParallelLayout, RankCoords
from routelog.audit.r3 import compare_routings, extreme_fraction, indexer_diff_rate, k3_kl
from routelog.demo_report import ModelResult
from routelog.engines import hf_indexer
from routelog.engines.hf import RoutingRecorder, replay
from routelog.format.record import Record
from routelog.format.spec import ModelSpec
from routelog.format.values import LOGPROB_INFER, LOGPROB_TRAIN
from routelog.loader import ReplayLoader
from routelog.outputs import written_whole
from routelog.store.store import create_store, open_store

Progress = Callable[[str], None]

DEMO_THREADS = 1
"""torch's intra-op threads for the demo's models: they are so small that a second thread gains nothing idle, and
threads fighting other processes for the cores cost a lot (2-core development machine, ``--quick``: 8.3 s with
torch's default of 2 threads and 7.9-8.1 s with one, idle; with six busy processes beside it, 58 s and 29 s)."""
STAGES_PER_MODEL = 4
MOE_MODELS = ("qwen3_moe", "deepseek_v3", "deepseek_v32")
STAGES = STAGES_PER_MODEL * len(MOE_MODELS) + 2
"""Calls of ``progress`` in one run: four per MoE model, the dense baseline, the report."""


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of the demo (``quick`` for CI)."""

    batch: int = 6
    prompt_len: int = 32
    new_tokens: int = 96
    hidden: int = 256
    layers: int = 8
    experts: int = 64
    topk: int = 8
    index_topk: int = 16
    """Key positions the DeepSeek-V3.2-style model's indexer selects: small enough to bind on most tokens."""
    seed: int = 0

    @classmethod
    def quick(cls) -> DemoConfig:
        return cls(batch=4, prompt_len=16, new_tokens=40, hidden=128, layers=6, experts=32, topk=4, index_topk=8)


def _common(config: DemoConfig) -> dict[str, Any]:
    return {
        "vocab_size": 1024,
        "hidden_size": config.hidden,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": config.hidden // 8,
        "max_position_embeddings": 1024,
        "initializer_range": 0.1,
        "num_hidden_layers": config.layers,
    }


def build_models(config: DemoConfig) -> dict[str, Any]:
    """Tiny random models: Qwen3-MoE style, DeepSeek-V3 style, a dense Qwen3 baseline of the same size, and
    DeepSeek-V3.2 style (V3 with a sparse-attention indexer; built last, so the others' weights stay as they were).

    Weights use ``initializer_range=0.1`` so router margins are realistic; with the HF default of 0.02 nearly all
    logits are ties and routing is close to random.
    """
    import torch
    import transformers

    torch.manual_seed(config.seed)
    common = _common(config)
    moe_ffn = max(16, config.hidden // 2)
    qwen = transformers.Qwen3MoeConfig(
        **common,
        num_experts=config.experts,
        num_experts_per_tok=config.topk,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        intermediate_size=2 * config.hidden,
        moe_intermediate_size=moe_ffn,
    )
    deepseek = transformers.DeepseekV3Config(
        **{**common, "num_key_value_heads": 8, "head_dim": 16},
        n_routed_experts=config.experts,
        num_experts_per_tok=config.topk,
        first_k_dense_replace=2,
        n_group=4,
        topk_group=2,
        intermediate_size=2 * config.hidden,
        moe_intermediate_size=moe_ffn,
        n_shared_experts=1,
        kv_lora_rank=32,
        q_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=32,
        routed_scaling_factor=1.0,
    )
    sparse = transformers.DeepseekV32Config(  # DeepSeek-V3.2: V3's routing plus a sparse-attention indexer
        **{**deepseek.to_dict(), "model_type": "deepseek_v32"},
        index_topk=config.index_topk,
        index_head_dim=32,
        index_n_heads=4,
    )
    dense = transformers.Qwen3Config(**common, intermediate_size=moe_ffn * config.topk)
    models = {}
    for name, cfg in (("qwen3_moe", qwen), ("deepseek_v3", deepseek), ("dense", dense), ("deepseek_v32", sparse)):
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()  # type: ignore[no-untyped-call]
        for module in model.modules():  # DeepSeek-V3's selection bias: small and random, as after training
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.uniform_(-0.02, 0.02)
        models[name] = model
    return models


@dataclass
class Generation:
    """What the inference engine produced for a batch."""

    sequences: Any
    prompt_len: int
    response_lens: list[int]
    logp_infer: list[npt.NDArray[np.float64]]
    """Per sequence: log-probability of each sampled response token under the inference engine."""


def generate(model: Any, prompts: Any, config: DemoConfig, recorder: RoutingRecorder | None) -> Generation:
    """bf16 sampling with the KV cache (temperature 1, no top-k/top-p: the scores are the policy)."""
    import torch

    model.to(torch.bfloat16)
    mask = torch.ones_like(prompts)
    with torch.no_grad():
        out = model.generate(
            prompts,
            attention_mask=mask,
            max_new_tokens=config.new_tokens,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            return_dict_in_generate=True,
            output_scores=True,
            pad_token_id=0,
            eos_token_id=None,
        )
    width = prompts.shape[1]
    new = out.sequences[:, width:]
    logp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)  # [B, N, V]
    sampled = logp.gather(-1, new[..., None]).squeeze(-1).double().numpy()
    return Generation(out.sequences, width, [new.shape[1]] * prompts.shape[0], list(sampled))


def train_forward(model: Any, sequences: Any, prompt_len: int, *, grad: bool = False) -> list[npt.NDArray[np.float64]]:
    """fp32 full-sequence forward; log-probability of each response token under the training engine."""
    import torch

    model.to(torch.float32)
    with torch.set_grad_enabled(grad):
        logits = model(sequences).logits.float()
    logp = torch.log_softmax(logits[:, prompt_len - 1 : -1], -1)
    sampled = logp.gather(-1, sequences[:, prompt_len:, None]).squeeze(-1)
    if grad:
        (-sampled.mean()).backward()  # type: ignore[no-untyped-call]
    return list(sampled.detach().double().numpy())


def _routing(recorder: RoutingRecorder, spec: ModelSpec, batch: int, length: int) -> list[npt.NDArray[np.int64]]:
    """Per sequence ``[T, L, K]`` of the single forward the recorder saw (the router sees the batch flattened)."""
    calls = [recorder.calls[layer][-1].reshape(batch, length, spec.topk) for layer in spec.moe_layers]
    stacked = np.stack(calls, axis=2)
    return [stacked[b] for b in range(batch)]


def run_moe_model(
    name: str, model: Any, prompts: Any, config: DemoConfig, store_url: str, progress: Progress
) -> ModelResult:
    import torch

    spec = ModelSpec.from_hf_config(model.config.to_dict(), name=f"demo/{name}")
    result = ModelResult(name, spec)
    progress(f"{name}: generating (bf16, KV cache, sampling)")
    full = torch.ones_like(prompts)
    with RoutingRecorder(model, spec) as recorder, _indexers(model, spec) as indexers:
        gen = generate(model, prompts, config, recorder)
        sample_ids = [f"{name}-{b}" for b in range(prompts.shape[0])]
        records = recorder.records(prompts, full, gen.sequences, sample_ids=sample_ids, policy_version=0)
    if indexers is not None:
        records = indexers.attach(records, full)
    for record, logp in zip(records, gen.logp_infer, strict=True):
        record.token_values = {LOGPROB_INFER: _per_token(logp, record.prompt_len)}
    progress(f"{name}: writing {len(records)} records to the store")
    store = create_store(store_url, spec, config={"demo": name, "seed": config.seed})
    with interrupts.deferred() as interrupt, store.writer(0, "demo-inference") as writer:
        for record in records:
            interrupt.check()  # Ctrl-C between records, never inside the writer's locks
            writer.append(record)

    length = gen.sequences.shape[1]
    batch = prompts.shape[0]
    inference = [np.asarray(r.expert_ids) for r in records]
    valid = [np.asarray(r.valid) for r in records]

    progress(f"{name}: training forward without replay (fp32)")
    fed = torch.ones_like(gen.sequences)
    with RoutingRecorder(model, spec) as recorder, _indexers(model, spec) as indexers:
        logp_plain = train_forward(model, gen.sequences, gen.prompt_len)
        plain = _routing(recorder, spec, batch, length)
    plain_indexer = None if indexers is None else indexers.attach(records, fed)
    _store_training_side(store, f"{store_url}-train", records, plain, logp_plain)

    progress(f"{name}: training forward with R3 (routing from the store, through the loader)")
    plan = AlignmentPlan(spec, ParallelLayout(), Packing("bshd"), RankCoords(), (MicroBatch(tuple(sample_ids)),))
    with ReplayLoader(store_url, 0, plan, prefetch=0) as loader:
        (mb,) = list(loader)
    # The loader gives Megatron's sequence-major rows [S, B]; HF routers see the batch flattened batch-major.
    by_batch = {
        r.layer: torch.from_numpy(mb.ids[j].reshape(length, batch, -1).transpose(1, 0, 2).reshape(-1, spec.topk))
        for j, r in enumerate(mb.routers)
    }
    mask = torch.from_numpy(mb.mask.reshape(length, batch).T.reshape(-1))
    model.zero_grad(set_to_none=True)
    with contextlib.ExitStack() as stack:
        stack.enter_context(replay(model, spec, by_batch, mask=mask))
        stored = _stored_indexer(store_url, records) if spec.indexer is not None else None
        if stored is not None:  # the indexers' selections from the store, installed before the recorder sees them
            rows = hf_indexer.replay_rows(stored, fed, spec)
            stack.enter_context(hf_indexer.replay(model, spec, rows, gen.sequences, stored))
        recorder = stack.enter_context(RoutingRecorder(model, spec))
        indexers = stack.enter_context(_indexers(model, spec))
        logp_replay = train_forward(model, gen.sequences, gen.prompt_len, grad=True)
        replayed = _routing(recorder, spec, batch, length)
    replayed_indexer = None if indexers is None else indexers.attach(records, fed)
    router_grad = sum(
        float(m.weight.grad.norm()) for m in RoutingRecorder(model, spec).routers.values() if m.weight.grad is not None
    )

    infer = np.concatenate(gen.logp_infer)
    result.logp = {"infer": infer, "no_replay": np.concatenate(logp_plain), "replay": np.concatenate(logp_replay)}
    result.comparisons = {
        "no_replay": compare_routings(list(zip(inference, plain, valid, strict=True))),
        "replay": compare_routings(list(zip(inference, replayed, valid, strict=True))),
    }
    for mode in ("no_replay", "replay"):
        comparison = result.comparisons[mode]
        result.metrics[mode] = {
            "router_diff_rate": comparison.router_diff_rate,
            "token_diff_rate": comparison.token_diff_rate,
            "mean_sequence_diff": comparison.mean_sequence_diff,
            "kl_k3": k3_kl(result.logp[mode], infer),
            "f_t2": extreme_fraction(result.logp[mode], infer, 2.0),
        }
    for mode, trained in (("no_replay", plain_indexer), ("replay", replayed_indexer)):
        if trained is not None:
            pairs = [(np.asarray(r.indexer), np.asarray(t.indexer)) for r, t in zip(records, trained, strict=True)]
            result.metrics[mode]["indexer_diff_rate"] = indexer_diff_rate(pairs)
    result.metrics["router_grad_norm_with_replay"] = router_grad
    result.metrics["tokens"] = int(infer.size)
    result.metrics["moe_layers"] = list(spec.moe_layers)
    result.metrics["store"] = store_url
    result.metrics["train_store"] = f"{store_url}-train"
    return result


def _indexers(model: Any, spec: ModelSpec) -> contextlib.AbstractContextManager[hf_indexer.IndexerRecorder | None]:
    """A recorder of the model's sparse-attention indexers, or nothing for a model without them."""
    return hf_indexer.IndexerRecorder(model, spec) if spec.indexer is not None else contextlib.nullcontext()


def _stored_indexer(store_url: str, records: list[Record]) -> list[Record]:
    """The records with the indexer rows read back from the store (what a trainer replays)."""
    snapshot = open_store(store_url).step(0)
    return [dataclasses.replace(r, indexer=snapshot.read_indexer(r.sample_id)) for r in records]


def _per_token(logp: npt.NDArray[np.float64], prompt_len: int) -> npt.NDArray[np.float32]:
    """A response's log-probs on the record's token axis (NaN on the prompt)."""
    return np.concatenate([np.full(prompt_len, np.nan), logp]).astype(np.float32)


def _store_training_side(
    store: Any, train_url: str, records: list[Record], routing: list[npt.NDArray[np.int64]], logp: list[Any]
) -> None:
    """What a trainer without replay would log: its log-probs as an annotation of the inference records, and its
    own routing of the same tokens in a second store."""
    with store.annotate(0, "demo-trainer") as annotator:
        for record, values in zip(records, logp, strict=True):
            annotator.add(record.sample_id, {LOGPROB_TRAIN: _per_token(values, record.prompt_len)})
    train = create_store(train_url, store.model_spec, config={"demo": "training forward without replay"})
    with interrupts.deferred() as interrupt, train.writer(0, "demo-trainer") as writer:
        for record, ids in zip(records, routing, strict=True):
            interrupt.check()
            writer.append(dataclasses.replace(record, expert_ids=ids, token_values=None, indexer=None))


def run_dense(model: Any, prompts: Any, config: DemoConfig, progress: Progress) -> dict[str, float]:
    progress("dense: generating (bf16) and training forward (fp32)")
    gen = generate(model, prompts, config, None)
    logp = np.concatenate(train_forward(model, gen.sequences, gen.prompt_len))
    infer = np.concatenate(gen.logp_infer)
    return {"kl_k3": k3_kl(logp, infer), "f_t2": extreme_fraction(logp, infer, 2.0)}


def run_demo(
    out_dir: Path,
    *,
    store_url: str | None = None,
    quick: bool = False,
    progress: Progress | None = None,
    started: list[str] | None = None,
) -> dict[str, Any]:
    """Run everything; write ``metrics.json`` and ``report.png`` into ``out_dir`` and return the metrics. Each
    store's URL is appended to ``started`` as its model begins (what an interrupted run leaves behind)."""
    import torch

    say = progress or (lambda message: None)
    config = DemoConfig.quick() if quick else DemoConfig()
    out_dir.mkdir(parents=True, exist_ok=True)
    base = (store_url or str(out_dir / "store")).rstrip("/")
    start = time.perf_counter()
    torch.manual_seed(config.seed)
    torch.set_num_threads(DEMO_THREADS)
    models = build_models(config)
    prompts = torch.randint(1, 1024, (config.batch, config.prompt_len))
    results = []
    for name in MOE_MODELS:
        url = f"{base}/{name}-{time.strftime('%Y%m%d-%H%M%S')}-{config.seed}"
        if started is not None:
            started.append(url)
        torch.manual_seed(config.seed + 1)
        results.append(run_moe_model(name, models[name], prompts, config, url, say))
    torch.manual_seed(config.seed + 1)
    dense = run_dense(models["dense"], prompts, config, say)
    metrics: dict[str, Any] = {r.name: r.metrics | {"dense_kl_k3": dense["kl_k3"]} for r in results}
    metrics["dense"] = dense
    metrics["config"] = {k: getattr(config, k) for k in config.__dataclass_fields__} | {"quick": quick}
    metrics["seconds"] = time.perf_counter() - start
    with written_whole(out_dir / "metrics.json") as partial:
        partial.write_text(json.dumps(metrics, indent=1) + "\n")
    say("drawing report.png")
    from routelog.demo_report import demo_report

    demo_report(results, dense, out_dir / "report.png")
    return metrics
