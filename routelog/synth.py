"""Synthetic routing for tests, benchmarks and examples.

Uniform routing is the codec's worst case (and the entropy bound's reference). Real routers are skewed (some
experts popular per layer) and temporally local (a token often reuses the previous token's experts); ``skew`` and
``locality`` add both, and ragged lengths mimic a batch of rollouts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.errors import ModelSpecError, SynthConfigError
from routelog.format.documents import Segment
from routelog.format.limits import MAX_MOE_LAYERS
from routelog.format.record import Record, token_hash
from routelog.format.spec import ModelSpec
from routelog.format.values import LOGPROB_INFER

VOCAB_SIZE = 32000
_REJECTION_ROUNDS = 8


@dataclass(frozen=True)
class SynthConfig:
    """What :func:`synth_records` generates."""

    records: int
    tokens: int
    """Tokens per record (the mean when ``ragged``)."""
    seed: int = 0
    ragged: bool = False
    """Lengths uniform in ``[tokens/2, 3*tokens/2]``."""
    skew: float = 0.0
    """0 = uniform experts; s > 0 draws per-layer expert popularity from Dirichlet(1/s)."""
    locality: float = 0.0
    """Probability that a token reuses the previous token's expert set in a layer."""
    prompt_fraction: float = 0.25
    sample_prefix: str = ""
    group_size: int = 8
    """Records per GRPO group."""
    step: int = 0
    missing_final_row: bool = True
    """Mark the final token's row missing, as every inference engine leaves it."""
    with_token_ids: bool = False
    logprob_noise: float | None = None
    """If set, attach ``logprob_infer`` (log-probs of the sampled response tokens, NaN on the prompt); the matching
    training log-probs are :func:`synth_training_logprobs` with this noise."""
    """Store the token ids (the hash is always stored)."""

    def __post_init__(self) -> None:
        problems = []
        if self.records < 0:
            problems.append(f"records must be >= 0, got {self.records}")
        if self.tokens < 2:
            problems.append(f"tokens must be >= 2 (a prompt token and a response token), got {self.tokens}")
        if not 0 <= self.locality < 1:
            problems.append(f"locality must be in [0, 1), got {self.locality}")
        if not 0 <= self.skew < math.inf:
            problems.append(f"skew must be a number >= 0, got {self.skew}")
        if self.logprob_noise is not None and not 0 <= self.logprob_noise < math.inf:
            problems.append(f"logprob_noise must be a number >= 0, got {self.logprob_noise}")
        if problems:
            raise SynthConfigError("; ".join(problems))


def random_topk(
    rng: np.random.Generator, n: int, num_experts: int, k: int, popularity: npt.NDArray[np.float64] | None = None
) -> npt.NDArray[np.int64]:
    """``[n, k]`` rows of k distinct experts, each row an independent draw (weighted without replacement).

    Draws k experts independently and redraws rows with a repeat (fast when k << E); rows still repeating after
    a few rounds, or every row when k is large, use exact Gumbel top-k over all experts.
    """
    if k * 4 > num_experts:
        return _gumbel_topk(rng, n, num_experts, k, popularity)
    cdf = None if popularity is None else np.cumsum(popularity)

    def draw(m: int) -> npt.NDArray[np.int64]:
        if cdf is None:
            return rng.integers(0, num_experts, size=(m, k))
        picks = np.searchsorted(cdf, rng.random((m, k)) * cdf[-1], side="right")
        drawn: npt.NDArray[np.int64] = np.minimum(picks, num_experts - 1).astype(np.int64)
        return drawn

    rows = draw(n)
    todo = np.arange(n)
    for _ in range(_REJECTION_ROUNDS):
        ordered = np.sort(rows[todo], axis=1)
        todo = todo[(ordered[:, 1:] == ordered[:, :-1]).any(axis=1)]
        if todo.size == 0:
            return rows
        rows[todo] = draw(todo.size)
    rows[todo] = _gumbel_topk(rng, todo.size, num_experts, k, popularity)
    return rows


def _gumbel_topk(
    rng: np.random.Generator, n: int, num_experts: int, k: int, popularity: npt.NDArray[np.float64] | None
) -> npt.NDArray[np.int64]:
    keys = np.log(popularity) if popularity is not None else np.zeros(num_experts)
    gumbel = keys - np.log(-np.log(rng.random((n, num_experts))))
    chosen: npt.NDArray[np.int64] = np.argpartition(-gumbel, k - 1, axis=1)[:, :k].astype(np.int64)
    return chosen


def synth_routing(
    rng: np.random.Generator,
    n_tokens: int,
    spec: ModelSpec,
    popularity: list[npt.NDArray[np.float64]] | None,
    locality: float,
) -> npt.NDArray[Any]:
    """``[n_tokens, n_moe_layers, topk]`` routing in the spec's storage dtype."""
    layers, k, e = spec.num_moe_layers, spec.topk, spec.num_experts
    out = np.empty((n_tokens, layers, k), dtype=spec.id_dtype)
    for j in range(layers):
        out[:, j] = random_topk(rng, n_tokens, e, k, None if popularity is None else popularity[j])
    if locality > 0 and n_tokens > 1:
        # Each (token, layer) keeps the previous token's set with probability `locality`: forward-fill the
        # index of the last fresh draw.
        fresh = rng.random((n_tokens, layers)) >= locality
        fresh[0] = True
        source = np.where(fresh, np.arange(n_tokens)[:, None], 0)
        np.maximum.accumulate(source, axis=0, out=source)
        out = out[source, np.arange(layers)[None, :]]
    return out


def zipf_token_ids(rng: np.random.Generator, n_tokens: int, vocab_size: int, exponent: float = 1.0) -> npt.NDArray[Any]:
    """``n_tokens`` int32 token ids drawn with probability proportional to ``rank ** -exponent`` over the vocabulary
    (text's Zipf law), the ranks shuffled over the ids so that frequent tokens are not the small ids."""
    weights = np.arange(1, vocab_size + 1, dtype=np.float64) ** -exponent
    ranks = rng.choice(vocab_size, size=n_tokens, p=weights / weights.sum())
    ids: npt.NDArray[Any] = rng.permutation(vocab_size).astype(np.int32)[ranks]
    return ids


@dataclass(frozen=True)
class TokenRouter:
    """A model whose routing depends on the token: per layer, the experts' popularity (Dirichlet(1/skew), as
    :class:`SynthConfig`'s ``skew``) and a preferred set for each token id it knows (drawn from that popularity).
    One router routes every record of a step alike, as a trained model's router would."""

    ids: npt.NDArray[np.int64]
    """The token ids with a preferred set, ascending."""
    popularity: npt.NDArray[np.float64]
    """``[layers, E]``."""
    preferred: npt.NDArray[Any]
    """``[layers, len(ids), K]`` in the spec's storage dtype."""

    @classmethod
    def draw(
        cls, rng: np.random.Generator, token_ids: npt.NDArray[Any], spec: ModelSpec, skew: float = 3.0
    ) -> TokenRouter:
        """A router knowing the ids in ``token_ids`` (only those present get a preferred set, so a 150k vocabulary
        costs what its tokens do)."""
        if skew <= 0:
            raise ValueError("skew must be > 0")
        layers, k, e = spec.num_moe_layers, spec.topk, spec.num_experts
        ids = np.unique(np.asarray(token_ids)).astype(np.int64)
        popularity = np.stack([rng.dirichlet(np.full(e, 1.0 / skew)) for _ in range(layers)])
        preferred = np.stack([random_topk(rng, ids.size, e, k, popularity[j]) for j in range(layers)])
        return cls(ids, popularity, preferred.astype(spec.id_dtype))

    def route(
        self, rng: np.random.Generator, token_ids: npt.NDArray[Any], preferred_share: float = 0.6
    ) -> npt.NDArray[Any]:
        """``[n_tokens, layers, K]``: each token-layer takes its id's preferred set with probability
        ``preferred_share``, else a fresh draw from the layer's popularity. Every id must be one the router knows."""
        if not 0 <= preferred_share <= 1:
            raise ValueError("preferred_share must be in [0, 1]")
        index = np.searchsorted(self.ids, np.asarray(token_ids, np.int64))
        if index.size and (index.max() >= self.ids.size or (self.ids[index] != token_ids).any()):
            raise ValueError("token ids the router was not drawn for")
        layers, _, k = self.preferred.shape
        out = np.empty((index.size, layers, k), dtype=self.preferred.dtype)
        for j in range(layers):
            fresh = random_topk(rng, index.size, self.popularity.shape[1], k, self.popularity[j])
            takes = rng.random(index.size) < preferred_share
            out[:, j] = np.where(takes[:, None], self.preferred[j][index], fresh)
        return out


def token_dependent_routing(
    rng: np.random.Generator,
    token_ids: npt.NDArray[Any],
    spec: ModelSpec,
    *,
    preferred_share: float = 0.6,
    skew: float = 3.0,
) -> npt.NDArray[Any]:
    """``[n_tokens, n_moe_layers, topk]`` routing that depends on the token, from a :class:`TokenRouter` drawn for
    these tokens alone: in each layer, each token id has a preferred set (drawn once per id, from the layer's
    skewed expert popularity) that a token takes with probability ``preferred_share``; otherwise its set is a fresh
    draw from that popularity (Dirichlet(1/skew), as :class:`SynthConfig`'s ``skew``). Records routed by separate
    calls get separate routers: route a step's records with one :class:`TokenRouter` to share it."""
    if not 0 <= preferred_share <= 1 or skew <= 0:
        raise ValueError("preferred_share must be in [0, 1] and skew > 0")
    return TokenRouter.draw(rng, token_ids, spec, skew).route(rng, token_ids, preferred_share)


def synth_records(spec: ModelSpec, config: SynthConfig) -> Iterator[Record]:
    """Deterministic synthetic records (same ``seed`` and ``step`` -> same records; another step, other routing)."""
    # Each step draws its own routing (a run's steps differ, as training's do); step 0 keeps the seed alone.
    rng = np.random.default_rng(config.seed if config.step == 0 else [config.seed, config.step])
    popularity = (
        [rng.dirichlet(np.full(spec.num_experts, 1.0 / config.skew)) for _ in range(spec.num_moe_layers)]
        if config.skew > 0
        else None
    )
    for i in range(config.records):
        n = (
            int(rng.integers(max(2, config.tokens // 2), config.tokens * 3 // 2 + 1))
            if config.ragged
            else config.tokens
        )
        prompt = min(n - 1, max(1, round(n * config.prompt_fraction)))
        ids = synth_routing(rng, n, spec, popularity, config.locality)
        tokens = rng.integers(0, VOCAB_SIZE, size=n)
        valid = np.ones(n, dtype=bool)
        if config.missing_final_row:
            valid[-1] = False
        group = i // max(1, config.group_size)
        values = None
        if config.logprob_noise is not None:
            infer = np.full(n, np.nan, np.float32)
            # Own generator: attaching log-probs must not change the routing or tokens of later records.
            values_rng = np.random.default_rng([config.seed, i, 1])
            infer[prompt:] = np.log(values_rng.beta(5.0, 1.0, size=n - prompt) + 1e-6)
            values = {LOGPROB_INFER: infer}
        yield Record(
            sample_id=f"{config.sample_prefix}{i:06d}",
            expert_ids=ids,
            prompt_len=prompt,
            response_len=n - prompt,
            valid=valid,
            token_ids=tokens if config.with_token_ids else None,
            token_hash=None if config.with_token_ids else token_hash(tokens),
            group_id=f"{config.sample_prefix}g{group:05d}",
            policy_version=config.step,
            engine="synthetic",
            segments=(
                Segment(start=0, end=prompt, policy_version=config.step, source="prompt"),
                Segment(start=prompt, end=n, policy_version=config.step, source="response"),
            ),
            token_values=values,
        )


def synth_training_logprobs(infer: npt.NDArray[np.float32], noise: float, seed: int) -> npt.NDArray[np.float32]:
    """What a trainer would report for these tokens: the inference log-probs with Gaussian noise on the log scale
    (capped at 0), the shape of the train-inference mismatch the R3 paper measures."""
    rng = np.random.default_rng(seed)
    train = infer.astype(np.float64) + rng.normal(0.0, noise, size=infer.shape)
    out: npt.NDArray[np.float32] = np.minimum(train, 0.0).astype(np.float32)
    return out


def synthetic_spec(layers: int, experts: int, topk: int) -> ModelSpec:
    """An all-MoE model spec for synthetic routing."""
    if not 1 <= layers <= MAX_MOE_LAYERS:  # before listing the layers: 2**31 of them would exhaust memory first
        raise ModelSpecError(f"layers: {layers} MoE layers; the format stores 1 to {MAX_MOE_LAYERS}")
    return ModelSpec(
        name="synthetic",
        architecture="synthetic",
        num_layers=layers,
        moe_layers=tuple(range(layers)),
        num_experts=experts,
        topk=topk,
    )
