"""Build the routing corpus in ``tests/fixtures/corpus``: real routing of two tiny trained MoE models.

No model weights can be downloaded on the development machines, so this tool makes the routing itself:

1. **Text.** The top-level ``*.py`` files of Python's standard library (``sysconfig.get_paths()["stdlib"]``),
   sorted by name; every 10th file (indices 0, 10, 20, ...) is held out, the rest is training text. Tokens are
   bytes: ids 0-255 are the bytes, then ``BOS`` 256, ``EOS`` 257, ``SEP`` 258 (the turn separator, which the
   training text also holds at every triple newline, the break between top-level definitions) and ``PAD`` 259.
2. **Models.** A Qwen3-MoE-style model (``transformers.Qwen3MoeForCausalLM``: every layer MoE, softmax top-k with
   ``norm_topk_prob``) and a DeepSeek-V3-style one (``transformers.DeepseekV3ForCausalLM``: one dense layer first,
   a shared expert, sigmoid scores, group-limited top-k with the ``e_score_correction_bias``), both trained from
   scratch with AdamW on random windows of the training text for a fixed number of steps, on CPU. Each keeps
   its architecture's own balancing, weak as in the originals: the Qwen3-MoE-style model the auxiliary
   load-balancing loss at transformers' default coefficient (``router_aux_loss_coef`` 0.001); the
   DeepSeek-V3-style model no auxiliary loss but DeepSeek-V3's auxiliary-loss-free balancing (after each step
   the selection bias of every expert moves by ``gamma`` = 0.001 towards the mean load). Without any balancing
   the tiny Qwen3-MoE-style router leaves about 40 % of its experts unused.
3. **Recording.** Generation on held-out text through :class:`routelog.engines.hf.RoutingRecorder` (one
   ``generate`` call at a time, left-padded batches, KV cache on), written to one routelog store per model, one
   sealed step per workload: step 0 ``grpo`` (groups of n samples per prompt, all in one batch), step 1
   ``multiturn`` (sessions whose every turn re-sends the whole history), step 2 ``rollouts`` (single samples).
4. **Statistics.** :func:`corpus_stats` reads the stores back and computes, per MoE layer, the expert-load
   imbalance, the normalised entropy of the load, how often a token's top-k set repeats the previous token's,
   and how much the token id alone determines the set; ``stats.json`` holds them and a digest of each step's
   routing, so a regenerated corpus can be compared with the shipped one.

Everything is seeded and runs with ``torch.use_deterministic_algorithms(True)`` on 2 threads, so a re-run on the
same machine and software reproduces the routing (and the digests) exactly; another CPU or another torch build
may round differently. Store documents carry creation times, so the files themselves differ between runs.

    python tools/make_corpus.py                   # the shipped corpus (11-17 minutes on a busy 2-core machine)
    python tools/make_corpus.py --quick            # smoke run into $TMPDIR/routelog-corpus-quick (~15 s)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

import routelog
from routelog.format.documents import Segment

BOS, EOS, SEP, PAD = 256, 257, 258, 259
VOCAB = 260
HOLD_OUT_EVERY = 10
MODELS = ("qwen3moe", "deepseekv3")
WORKLOADS = {0: "grpo", 1: "multiturn", 2: "rollouts"}
WRITER_ID = "make-corpus"
STATS_VERSION = 1
SHIPPED = Path("tests/fixtures/corpus")
QUICK_OUT = Path(tempfile.gettempdir()) / "routelog-corpus-quick"

IntArray = npt.NDArray[np.int64]
Log = Callable[[str], None]


# -- configuration ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainConfig:
    steps: int = 240
    batch: int = 8
    window: int = 512
    lr: float = 3e-3
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    bias_update: float = 1e-3
    """DeepSeek-V3's auxiliary-loss-free balancing speed (its gamma); 0 turns it off."""
    eval_windows: int = 16


@dataclass(frozen=True)
class WorkloadConfig:
    grpo_prompts: int = 24
    grpo_n: int = 8
    grpo_prompt_bytes: tuple[int, int] = (64, 256)
    grpo_new_tokens: int = 128
    sessions: int = 12
    session_turns: tuple[int, int] = (4, 8)
    turn_bytes: tuple[int, int] = (32, 96)
    turn_new_tokens: int = 64
    rollouts: int = 64
    rollout_batch: int = 8
    rollout_prompt_bytes: tuple[int, int] = (64, 256)
    rollout_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 0.95


@dataclass(frozen=True)
class CorpusConfig:
    seed: int = 1234
    threads: int = 2
    train: TrainConfig = field(default_factory=TrainConfig)
    workloads: WorkloadConfig = field(default_factory=WorkloadConfig)

    @classmethod
    def quick(cls) -> CorpusConfig:
        return cls(
            train=TrainConfig(steps=12, batch=4, window=128, warmup=2, eval_windows=2),
            workloads=WorkloadConfig(
                grpo_prompts=2,
                grpo_n=4,
                grpo_new_tokens=16,
                sessions=2,
                session_turns=(2, 3),
                turn_new_tokens=12,
                rollouts=4,
                rollout_batch=2,
                rollout_new_tokens=16,
            ),
        )


def model_configs() -> dict[str, dict[str, Any]]:
    """The keyword arguments of both transformers configs (tiny sizes, real architectures)."""
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "max_position_embeddings": 4096,
        "intermediate_size": 256,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
    }
    return {
        "qwen3moe": {
            **common,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "output_router_logits": False,  # generation needs no router logits; training asks for them
            "router_aux_loss_coef": 0.001,
        },
        "deepseekv3": {
            **common,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "n_routed_experts": 64,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "first_k_dense_replace": 1,
            "n_shared_experts": 1,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
            "kv_lora_rank": 32,
            "q_lora_rank": 64,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "num_nextn_predict_layers": 0,  # transformers runs no multi-token-prediction layer: no mtp stream
        },
    }


# -- text --------------------------------------------------------------------------------------------------------------
@dataclass
class Text:
    """Token stream of a set of files, with where each file starts."""

    files: list[str]
    tokens: IntArray
    starts: list[int]

    def source(self, position: int) -> str:
        i = int(np.searchsorted(np.asarray(self.starts), position, side="right")) - 1
        return f"{self.files[i]}:{position - self.starts[i]}"


def stdlib_files(stdlib: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): the stdlib's top-level ``*.py`` sorted by name, every 10th held out."""
    root = Path(sysconfig.get_paths()["stdlib"]) if stdlib is None else stdlib
    files = sorted(root.glob("*.py"), key=lambda p: p.name)
    if len(files) < 2 * HOLD_OUT_EVERY:
        raise SystemExit(f"make_corpus: only {len(files)} .py files in {root}; need the Python standard library")
    held = [f for i, f in enumerate(files) if i % HOLD_OUT_EVERY == 0]
    train = [f for i, f in enumerate(files) if i % HOLD_OUT_EVERY != 0]
    return train, held


def encode_file(data: bytes) -> IntArray:
    """``BOS`` + bytes + ``EOS``, with ``SEP`` after every triple newline (the break between top-level blocks)."""
    pieces: list[IntArray] = [np.array([BOS], np.int64)]
    parts = data.split(b"\n\n\n")
    for i, part in enumerate(parts):
        pieces.append(np.frombuffer(part, dtype=np.uint8).astype(np.int64))
        if i < len(parts) - 1:
            pieces.append(np.array([10, 10, 10, SEP], np.int64))
    pieces.append(np.array([EOS], np.int64))
    return np.concatenate(pieces)


def load_text(files: Sequence[Path]) -> Text:
    chunks, starts, position = [], [], 0
    for path in files:
        tokens = encode_file(path.read_bytes())
        starts.append(position)
        chunks.append(tokens)
        position += len(tokens)
    return Text([p.name for p in files], np.concatenate(chunks), starts)


class Snippets:
    """Deterministic held-out snippets: a random line start and length, raw bytes only (no special tokens)."""

    def __init__(self, text: Text, seed: int) -> None:
        self.text = text
        self.rng = np.random.default_rng(seed)
        line_starts = np.flatnonzero(text.tokens[:-1] == 10) + 1
        self.line_starts = line_starts[text.tokens[line_starts] < 256]

    def take(self, lo: int, hi: int) -> tuple[IntArray, str]:
        length = int(self.rng.integers(lo, hi + 1))
        while True:
            start = int(self.line_starts[self.rng.integers(len(self.line_starts))])
            piece = self.text.tokens[start : start + length]
            if len(piece) == length and bool((piece < 256).all()):
                return piece.copy(), self.text.source(start)


# -- training ----------------------------------------------------------------------------------------------------------
def build_model(name: str, seed: int) -> Any:
    import torch
    import transformers

    torch.manual_seed(seed)
    kwargs = model_configs()[name]
    make = transformers.Qwen3MoeConfig if name == "qwen3moe" else transformers.DeepseekV3Config
    config: Any = make(**kwargs)
    config._experts_implementation = "grouped_mm"  # the eager per-expert loop is ~50x slower on CPU
    return transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]


def _gates(model: Any) -> list[Any]:
    return [m for n, m in model.named_modules() if n.endswith("mlp.gate") and hasattr(m, "top_k")]


def _lr(step: int, config: TrainConfig) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    cosine = 0.5 * (1 + np.cos(np.pi * progress))
    return float(config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine))


def train(model: Any, text: Text, held: Text, config: TrainConfig, seed: int, log: Log) -> dict[str, Any]:
    """AdamW on random windows of ``text`` for ``config.steps`` steps; returns the loss curve and held-out loss."""
    import torch

    rng = np.random.default_rng(seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "gate.weight" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "gate.weight" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=config.lr,
        betas=(0.9, 0.95),
    )
    gates = _gates(model)
    balance = config.bias_update > 0 and all(hasattr(g, "e_score_correction_bias") for g in gates)
    loads: dict[int, Any] = {}

    def counter(i: int) -> Callable[..., None]:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            loads[i] = torch.bincount(output[2].reshape(-1), minlength=module.num_experts)

        return hook

    handles = [g.register_forward_hook(counter(i)) for i, g in enumerate(gates)] if balance else []
    # the load-balancing loss (coefficient router_aux_loss_coef) is added to the loss when router logits are output
    aux = {"output_router_logits": True} if getattr(model.config, "router_aux_loss_coef", 0.0) > 0 else {}
    model.train()
    curve: list[list[float]] = []
    started = time.perf_counter()
    for step in range(config.steps):
        starts = rng.integers(0, len(text.tokens) - config.window, size=config.batch)
        batch = torch.as_tensor(np.stack([text.tokens[s : s + config.window] for s in starts]))
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, config)
        loss = model(input_ids=batch, labels=batch, **aux).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
        optimizer.step()
        value = float(loss.detach())
        if balance:  # DeepSeek-V3: b_i += gamma * sign(mean load - load_i)
            with torch.no_grad():
                for i, gate in enumerate(gates):
                    load = loads[i].float()
                    gate.e_score_correction_bias += config.bias_update * torch.sign(load.mean() - load)
        if step % 20 == 0 or step == config.steps - 1:
            curve.append([step, round(value, 4)])
            log(f"  step {step:4d}/{config.steps}  loss {value:.3f} nats/byte  ({time.perf_counter() - started:.0f} s)")
    for handle in handles:
        handle.remove()
    model.eval()
    eval_rng = np.random.default_rng(seed + 1)
    starts = eval_rng.integers(0, len(held.tokens) - config.window, size=config.eval_windows)
    with torch.no_grad():
        batch = torch.as_tensor(np.stack([held.tokens[s : s + config.window] for s in starts]))
        held_loss = float(model(input_ids=batch, labels=batch).loss)
    return {
        "steps": config.steps,
        "tokens_seen": config.steps * config.batch * config.window,
        "loss_curve": curve,
        "held_out_loss_nats_per_byte": round(held_loss, 4),
        "held_out_bits_per_byte": round(held_loss / float(np.log(2)), 4),
        "seconds": round(time.perf_counter() - started, 1),
    }


# -- recording ---------------------------------------------------------------------------------------------------------
@dataclass
class Prompt:
    tokens: IntArray
    sample_id: str
    group_id: str | None
    extra: dict[str, Any]
    segments: list[tuple[int, int, str]] = field(default_factory=list)
    """Sources of the prompt's spans (``[start, end)`` in prompt tokens); empty: one ``prompt`` segment."""


@dataclass
class Generated:
    record: routelog.Record
    response: IntArray


def left_pad(prompts: Sequence[IntArray]) -> tuple[IntArray, IntArray]:
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), PAD, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = p
        mask[b, width - len(p) :] = 1
    return ids, mask


def generate_batch(
    model: Any, recorder: Any, prompts: Sequence[Prompt], new_tokens: int, work: WorkloadConfig, seed: int
) -> list[Generated]:
    """One ``generate`` call for ``prompts`` (left-padded), recorded; one record per prompt."""
    import torch

    ids, mask = left_pad([p.tokens for p in prompts])
    input_ids, attention_mask = torch.as_tensor(ids), torch.as_tensor(mask)
    recorder.clear()
    torch.manual_seed(seed)
    with torch.no_grad():
        sequences = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            do_sample=True,
            temperature=work.temperature,
            top_p=work.top_p,
            top_k=0,
            use_cache=True,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )
    records = recorder.records(
        input_ids,
        attention_mask,
        sequences,
        sample_ids=[p.sample_id for p in prompts],
        group_ids=[p.group_id for p in prompts] if any(p.group_id for p in prompts) else None,
        eos_token_id=EOS,
        policy_version=0,
    )
    out = []
    for prompt, recorded in zip(prompts, records, strict=True):
        segments = list(recorded.segments)
        if prompt.segments:  # the recorder's single prompt segment, split by turn
            segments = [Segment(start=a, end=b, policy_version=0, source=s) for a, b, s in prompt.segments]
            end = recorded.n_tokens
            segments.append(Segment(start=recorded.prompt_len, end=end, policy_version=0, source="response"))
        record = replace(recorded, segments=segments, extra=prompt.extra)
        response = np.asarray(record.token_ids, dtype=np.int64)[record.prompt_len :]
        out.append(Generated(record, response))
    return out


def grpo_records(model: Any, recorder: Any, snippets: Snippets, work: WorkloadConfig, seed: int) -> Iterator[Any]:
    for p in range(work.grpo_prompts):
        piece, source = snippets.take(*work.grpo_prompt_bytes)
        tokens = np.concatenate([[BOS], piece]).astype(np.int64)
        group = f"p{p:02d}"
        prompts = [
            Prompt(tokens, f"{group}/{i}", group, {"workload": "grpo", "source": source}) for i in range(work.grpo_n)
        ]
        for generated in generate_batch(model, recorder, prompts, work.grpo_new_tokens, work, seed + p):
            yield generated.record


def multiturn_records(model: Any, recorder: Any, snippets: Snippets, work: WorkloadConfig, seed: int) -> Iterator[Any]:
    """Sessions generated turn by turn, all active sessions of a turn in one batch; each prompt re-sends history."""
    lo, hi = work.session_turns
    turns = [lo + s % (hi - lo + 1) for s in range(work.sessions)]
    history: list[IntArray] = [np.array([BOS], np.int64) for _ in range(work.sessions)]
    spans: list[list[tuple[int, int, str]]] = [[] for _ in range(work.sessions)]
    for t in range(max(turns)):
        prompts = []
        for s in range(work.sessions):
            if t >= turns[s]:
                continue
            piece, source = snippets.take(*work.turn_bytes)
            user = piece if t == 0 else np.concatenate([[SEP], piece]).astype(np.int64)
            start = len(history[s])
            history[s] = np.concatenate([history[s], user])
            spans[s].append((0 if t == 0 else start, len(history[s]), f"turn-{t}/user"))
            extra = {"workload": "multiturn", "session": s, "turn": t, "turns": turns[s], "source": source}
            prompts.append(Prompt(history[s].copy(), f"s{s:02d}/t{t}", f"s{s:02d}", extra, list(spans[s])))
        for prompt, generated in zip(
            prompts, generate_batch(model, recorder, prompts, work.turn_new_tokens, work, seed + t), strict=True
        ):
            s = int(prompt.extra["session"])
            start = len(history[s])
            history[s] = np.concatenate([history[s], generated.response])
            spans[s].append((start, len(history[s]), f"turn-{t}/assistant"))
            yield generated.record


def rollout_records(model: Any, recorder: Any, snippets: Snippets, work: WorkloadConfig, seed: int) -> Iterator[Any]:
    for first in range(0, work.rollouts, work.rollout_batch):
        prompts = []
        for r in range(first, min(first + work.rollout_batch, work.rollouts)):
            piece, source = snippets.take(*work.rollout_prompt_bytes)
            tokens = np.concatenate([[BOS], piece]).astype(np.int64)
            prompts.append(Prompt(tokens, f"r{r:03d}", None, {"workload": "rollouts", "source": source}))
        for generated in generate_batch(model, recorder, prompts, work.rollout_new_tokens, work, seed + first):
            yield generated.record


def record_model(
    name: str, model: Any, held: Text, url: str, config: CorpusConfig, log: Log
) -> tuple[dict[int, dict[str, int]], float]:
    from routelog.engines.hf import RoutingRecorder

    spec = routelog.ModelSpec.from_hf_config(model.config.to_dict(), name=f"corpus/{name}")
    store = routelog.create_store(url, spec, run_id=f"routelog-corpus-{name}")
    work = config.workloads
    makers = {0: grpo_records, 1: multiturn_records, 2: rollout_records}
    counts: dict[int, dict[str, int]] = {}
    started = time.perf_counter()
    with RoutingRecorder(model, spec) as recorder:
        for step, make in makers.items():
            snippets = Snippets(held, config.seed + 100 + step)  # the same prompts for both models
            records = list(make(model, recorder, snippets, work, config.seed + 1000 * (step + 1)))
            with store.writer(step, WRITER_ID, flush_seconds=None, flush_bytes=1 << 30, background=False) as writer:
                for record in records:
                    writer.append(record)
            store.seal(step)
            counts[step] = {"records": len(records), "tokens": sum(r.n_tokens for r in records)}
            log(f"  step {step} {WORKLOADS[step]}: {len(records)} records, {counts[step]['tokens']} tokens")
    return counts, time.perf_counter() - started


# -- statistics --------------------------------------------------------------------------------------------------------
def _set_keys(sorted_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """One integer per top-k set: equal sets (rows of sorted ids, ``[rows, K]``) give equal keys."""
    rows = np.ascontiguousarray(sorted_ids)
    void = rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))).reshape(-1)
    _, keys = np.unique(void, return_inverse=True)
    return keys.reshape(-1).astype(np.int64)


def _layer_stats(
    ids: npt.NDArray[np.integer[Any]], tokens: IntArray, follows: npt.NDArray[np.bool_], num_experts: int
) -> dict[str, float | int]:
    """Statistics of one layer. ``ids`` ``[rows, K]`` routed rows, ``tokens`` their token ids, ``follows[i]``:
    row ``i`` is the next position after row ``i - 1`` in the same record, both routed."""
    k = ids.shape[1]
    load = np.bincount(ids.reshape(-1).astype(np.int64), minlength=num_experts).astype(np.float64)
    p = load / load.sum()
    nz = p[p > 0]
    sorted_ids = np.sort(ids.astype(np.int64), axis=-1)
    keys = _set_keys(sorted_ids)
    pairs = follows[1:]
    same_prev = (keys[1:] == keys[:-1])[pairs]
    now, before = sorted_ids[1:][pairs], sorted_ids[:-1][pairs]
    shared = int((now[:, :, None] == before[:, None, :]).sum())  # the ids of a row are distinct
    combined = tokens * (int(keys.max()) + 1) + keys  # one integer per (token id, set)
    pair_keys, counts = np.unique(combined, return_counts=True)
    best = np.zeros(int(tokens.max()) + 1, dtype=np.int64)
    np.maximum.at(best, pair_keys // (int(keys.max()) + 1), counts)
    return {
        "imbalance": float(load.max() / load.mean()),
        "cv": float(load.std() / load.mean()),
        "entropy_normalized": float(-(nz * np.log2(nz)).sum() / np.log2(num_experts)),
        "unused_experts": int((load == 0).sum()),
        "top_expert_share": float(p.max()),
        "repeat_prev_set": float(same_prev.mean()),
        "overlap_prev": float(shared / (k * len(now))),
        "token_determined": float(best.sum() / len(tokens)),
        "distinct_sets": int(keys.max() + 1),
    }


def _summary(layers: Sequence[dict[str, Any]]) -> dict[str, float]:
    names = ("imbalance", "entropy_normalized", "repeat_prev_set", "overlap_prev", "token_determined")
    out = {f"mean_{n}": float(np.mean([layer[n] for layer in layers])) for n in names}
    out["max_imbalance"] = float(max(layer["imbalance"] for layer in layers))
    out["min_entropy_normalized"] = float(min(layer["entropy_normalized"] for layer in layers))
    return out


def _group_prompt_identical(routings: Sequence[Any]) -> dict[str, Any]:
    """GRPO groups: are the prompt rows of every sample of a group equal (the n samples share one prefill)?"""
    groups: dict[str, list[Any]] = {}
    for routing in routings:
        if routing.info.group_id is not None:
            groups.setdefault(routing.info.group_id, []).append(routing)
    identical = 0
    for members in groups.values():
        first = members[0].expert_ids[: members[0].info.prompt_len]
        identical += all(np.array_equal(first, m.expert_ids[: m.info.prompt_len]) for m in members[1:])
    return {"groups": len(groups), "groups_with_identical_prompt_routing": identical}


def _history_reuse(routings: Sequence[Any]) -> dict[str, Any]:
    """Multi-turn sessions: how much of the history a turn re-sends is routed as in the previous turn's record.

    The rows compared are those both records routed (the previous record's final sampled token has no row); a
    (row, layer) pair counts as identical when its top-k set is. R3 section 4.2 caches routing with the prefix KV
    cache on the premise that identical prefixes route identically; a re-prefill in another batch shape may not.
    """
    by_id = {r.sample_id: r for r in routings}
    pairs, row_layers, same_sets, rows, same_rows = 0, 0, 0, 0, 0
    for sid, routing in by_id.items():
        session, turn = sid.rsplit("/t", 1)
        previous = by_id.get(f"{session}/t{int(turn) - 1}")
        if previous is None:
            continue
        n = previous.info.n_tokens
        both = previous.valid & routing.valid[:n]
        a = np.sort(previous.expert_ids[both], axis=-1)
        b = np.sort(routing.expert_ids[:n][both], axis=-1)
        equal = (a == b).all(axis=-1)  # [rows, layers]
        pairs += 1
        row_layers += equal.size
        same_sets += int(equal.sum())
        rows += equal.shape[0]
        same_rows += int(equal.all(axis=-1).sum())
    return {
        "turn_pairs": pairs,
        "history_rows": rows,
        "identical_row_layer_share": same_sets / row_layers if row_layers else float("nan"),
        "identical_row_share": same_rows / rows if rows else float("nan"),
    }


def step_digest(routings: Sequence[Any]) -> str:
    """SHA-256 over every record's sample id, token ids, valid mask and routing, in sample-id order."""
    digest = hashlib.sha256()
    for routing in sorted(routings, key=lambda r: r.sample_id):
        digest.update(routing.sample_id.encode() + b"\0")
        digest.update(np.asarray(routing.info.token_ids, dtype=np.int64).tobytes())
        digest.update(routing.valid.tobytes())
        digest.update(np.sort(routing.expert_ids.astype(np.int16), axis=-1).tobytes())
    return digest.hexdigest()


def store_stats(url: str) -> dict[str, Any]:
    """The statistics of one corpus store: per step and over all steps, per MoE layer (see :func:`corpus_stats`)."""
    store = routelog.open_store(url)
    spec = store.model_spec
    per_step: dict[str, Any] = {}
    pooled: list[tuple[list[Any], IntArray, npt.NDArray[np.bool_]]] = []
    for step in sorted(WORKLOADS):
        snapshot = store.step(step)
        routings = snapshot.read_many(sorted(snapshot.sample_ids))
        ids, tokens, follows = [], [], []
        for routing in routings:
            rows = np.flatnonzero(routing.valid)
            ids.append(routing.expert_ids[rows])
            tokens.append(np.asarray(routing.info.token_ids, dtype=np.int64)[rows])
            follow = np.zeros(len(rows), dtype=bool)
            follow[1:] = np.diff(rows) == 1
            follows.append(follow)
        all_ids = np.concatenate(ids)  # [rows, L, K]
        all_tokens, all_follows = np.concatenate(tokens), np.concatenate(follows)
        pooled.append(([all_ids], all_tokens, all_follows))
        layers = [
            {"layer": int(spec.moe_layers[j]), **_layer_stats(all_ids[:, j], all_tokens, all_follows, spec.num_experts)}
            for j in range(spec.num_moe_layers)
        ]
        entry: dict[str, Any] = {
            "workload": WORKLOADS[step],
            "records": len(routings),
            "tokens": int(sum(r.info.n_tokens for r in routings)),
            "routed_rows": len(all_tokens),
            "prompt_tokens": int(sum(r.info.prompt_len for r in routings)),
            "response_tokens": int(sum(r.info.response_len for r in routings)),
            "digest": step_digest(routings),
            "summary": _summary(layers),
            "layers": layers,
        }
        if WORKLOADS[step] == "grpo":
            entry["grpo"] = _group_prompt_identical(routings)
        if WORKLOADS[step] == "multiturn":
            entry["multiturn"] = _history_reuse(routings)
        per_step[str(step)] = entry
    ids_all = np.concatenate([p[0][0] for p in pooled])
    tokens_all = np.concatenate([p[1] for p in pooled])
    follows_all = np.concatenate([p[2] for p in pooled])
    layers = [
        {"layer": int(spec.moe_layers[j]), **_layer_stats(ids_all[:, j], tokens_all, follows_all, spec.num_experts)}
        for j in range(spec.num_moe_layers)
    ]
    return {
        "model": spec.name,
        "num_layers": spec.num_layers,
        "moe_layers": list(spec.moe_layers),
        "num_experts": spec.num_experts,
        "topk": spec.topk,
        "steps": per_step,
        "all": {
            "records": sum(s["records"] for s in per_step.values()),
            "tokens": sum(s["tokens"] for s in per_step.values()),
            "routed_rows": len(tokens_all),
            "summary": _summary(layers),
            "layers": layers,
        },
    }


def corpus_stats(root: Path | str) -> dict[str, Any]:
    """Statistics of the corpus under ``root`` (one store per model), as ``stats.json`` holds them.

    Per MoE layer, over the routed rows (prompt and response) of the records:

    - ``imbalance``: max / mean of the expert load (choices per expert); 1 = balanced. ``cv`` is std / mean.
    - ``entropy_normalized``: entropy of the load distribution over log2(E); 1 = every expert equally used.
    - ``repeat_prev_set``: share of routed tokens whose top-k set equals the previous token's set in that layer
      (previous position of the same record, both routed).
    - ``overlap_prev``: mean share of the K experts a token shares with the previous token (|S_t & S_t-1| / K).
    - ``token_determined``: share of rows whose set is the most common set of their token id in that layer (1 =
      the token id alone decides the routing; 1/K-ish sharing is far below).
    """
    root = Path(root)
    return {
        "version": STATS_VERSION,
        "definitions": " ".join((corpus_stats.__doc__ or "").split()),
        "models": {name: store_stats(str((root / name).resolve())) for name in MODELS},
    }


def stats_table(stats: dict[str, Any]) -> str:
    """Markdown table: per model and step, the per-layer means (and the extremes) of the statistics."""
    lines = [
        "| model | step | records | tokens | imbalance mean (max) | entropy/log2 E mean (min) | repeat prev set "
        "| overlap prev | token-determined |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, model in stats["models"].items():
        entries = [(f"{s} {e['workload']}", e) for s, e in model["steps"].items()] + [("all", model["all"])]
        for label, entry in entries:
            s = entry["summary"]
            lines.append(
                f"| {name} | {label} | {entry['records']} | {entry['tokens']} "
                f"| {s['mean_imbalance']:.2f} ({s['max_imbalance']:.2f}) "
                f"| {s['mean_entropy_normalized']:.3f} ({s['min_entropy_normalized']:.3f}) "
                f"| {s['mean_repeat_prev_set']:.1%} | {s['mean_overlap_prev']:.1%} | {s['mean_token_determined']:.1%} |"
            )
    return "\n".join(lines)


def layer_table(stats: dict[str, Any]) -> str:
    """Markdown table: every MoE layer of each model over all steps."""
    lines = [
        "| model | layer | imbalance | entropy/log2 E | unused experts | repeat prev set | overlap prev "
        "| token-determined |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, model in stats["models"].items():
        for layer in model["all"]["layers"]:
            lines.append(
                f"| {name} | {layer['layer']} | {layer['imbalance']:.2f} | {layer['entropy_normalized']:.3f} "
                f"| {layer['unused_experts']} | {layer['repeat_prev_set']:.1%} | {layer['overlap_prev']:.1%} "
                f"| {layer['token_determined']:.1%} |"
            )
    return "\n".join(lines)


# -- main --------------------------------------------------------------------------------------------------------------
def make_corpus(out: Path, config: CorpusConfig, log: Log) -> dict[str, Any]:
    import torch
    import transformers

    torch.set_num_threads(config.threads)
    torch.use_deterministic_algorithms(True)
    train_files, held_files = stdlib_files()
    train_text, held_text = load_text(train_files), load_text(held_files)
    log(
        f"text: {len(train_files)} training files ({len(train_text.tokens)} tokens), "
        f"{len(held_files)} held-out files ({len(held_text.tokens)} tokens)"
    )
    if out.exists():
        for name in MODELS:
            shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    build: dict[str, Any] = {
        "command": "python tools/make_corpus.py " + " ".join(sys.argv[1:]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "routelog": routelog.__version__,
        "platform": platform.platform(),
        "threads": config.threads,
        "config": asdict(config),
        "model_configs": model_configs(),
        "text": {
            "stdlib": str(Path(sysconfig.get_paths()["stdlib"])),
            "rule": f"top-level *.py sorted by name; index % {HOLD_OUT_EVERY} == 0 held out",
            "train_files": len(train_files),
            "train_tokens": len(train_text.tokens),
            "held_out_files": [p.name for p in held_files],
            "held_out_tokens": len(held_text.tokens),
        },
        "models": {},
    }
    for i, name in enumerate(MODELS):
        log(f"{name}: training")
        model = build_model(name, config.seed + i)
        report = train(model, train_text, held_text, config.train, config.seed + 10 + i, log)
        log(f"{name}: held-out loss {report['held_out_bits_per_byte']:.3f} bits/byte; recording")
        counts, seconds = record_model(name, model, held_text, str((out / name).resolve()), config, log)
        build["models"][name] = {
            "parameters": int(sum(p.numel() for p in model.parameters())),
            "training": report,
            "recording_seconds": round(seconds, 1),
            "steps": {str(k): v for k, v in counts.items()},
        }
    build["total_seconds"] = round(time.perf_counter() - started, 1)
    stats = corpus_stats(out)
    (out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    (out / "build.json").write_text(json.dumps(build, indent=1) + "\n")
    return {"build": build, "stats": stats}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--out", type=Path, default=None, help=f"corpus directory (default {SHIPPED}; with --quick {QUICK_OUT})"
    )
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (seconds; not the shipped corpus)")
    parser.add_argument("--train-steps", type=int, default=None, help="training steps per model (default 240)")
    parser.add_argument("--stats-only", action="store_true", help="recompute stats.json from the stores in --out")
    args = parser.parse_args(argv)
    if args.out is None:  # a smoke run never overwrites the shipped corpus unless told to
        args.out = QUICK_OUT if args.quick else SHIPPED

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    if args.stats_only:
        stats = corpus_stats(args.out)
        (args.out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    else:
        config = CorpusConfig.quick() if args.quick else CorpusConfig()
        if args.train_steps is not None:
            config = replace(config, train=replace(config.train, steps=args.train_steps))
        result = make_corpus(args.out, config, log)
        stats = result["stats"]
        log(f"done in {result['build']['total_seconds']:.0f} s")
    print(stats_table(stats))
    print()
    print(layer_table(stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
