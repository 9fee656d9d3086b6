"""Expert load: how often each expert of each MoE layer was chosen, and ``routelog stats`` built on it."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from routelog.audit.kernels import Counts, add_expert_counts
from routelog.audit.units import WorkUnit, batches, pack, unpack


def load_unit(unit: WorkUnit, batch_records: int) -> bytes:
    """Partial load of one unit: ``counts [L, E]``, records, tokens and routed rows of its step."""
    snapshot = unit.snapshot()
    spec = snapshot.store.model_spec
    counts = np.zeros((spec.num_moe_layers, spec.num_experts), np.int64)
    tokens = rows = 0
    for (batch,) in batches([snapshot], unit.sample_ids, batch_records=batch_records):
        for routing in batch:
            add_expert_counts(routing.by_layer, routing.valid, counts)
            tokens += routing.info.n_tokens
            rows += int(routing.valid.sum())
    return pack({"step": unit.step, "counts": counts, "records": len(unit.sample_ids), "tokens": tokens, "rows": rows})


class StepLoad(BaseModel):
    """Expert load of one step (or of several merged)."""

    records: int = 0
    tokens: int = 0
    rows: int = 0
    """Token rows that carry routing (tokens minus missing rows)."""
    counts: list[list[int]]
    """``[n_moe_layers][num_experts]`` choices."""

    def array(self) -> Counts:
        return np.asarray(self.counts, np.int64)


def merge_loads(partials: list[bytes]) -> dict[int, StepLoad]:
    """Sum partial loads per step (integers: exact in any order)."""
    totals: dict[int, tuple[Counts, int, int, int]] = {}
    for data in partials:
        part = unpack(data)
        step = int(part["step"])
        counts, records, tokens, rows = totals.get(step, (np.zeros_like(part["counts"]), 0, 0, 0))
        totals[step] = (
            counts + part["counts"],
            records + int(part["records"]),
            tokens + int(part["tokens"]),
            rows + int(part["rows"]),
        )
    return {
        step: StepLoad(records=r, tokens=t, rows=w, counts=c.tolist()) for step, (c, r, t, w) in sorted(totals.items())
    }


class LayerStats(BaseModel):
    layer: int
    """Global layer index."""
    load: list[int]
    """Choices per expert."""
    imbalance: float
    """max / mean of the load (1 = perfectly balanced)."""
    cv: float
    """Coefficient of variation (std / mean) of the load."""
    entropy_bits: float
    """Entropy of the load distribution over experts."""
    entropy_normalized: float
    """``entropy_bits / log2(num_experts)``: 1 = uniform use of all experts."""


class StatsResult(BaseModel):
    url: str
    steps: list[int]
    records: int
    tokens: int
    rows: int
    stored_bytes: int
    """Every object of the steps' parts (routing, values, streams, indexes)."""
    bytes_per_token_layer: float
    """The routing arrays' bytes per stored token row and MoE layer, as ``routelog inspect`` prints it
    (:func:`routelog.store.summary.bytes_per_token_layer`)."""
    num_experts: int
    topk: int
    layers: list[LayerStats]


def layer_stats(layer: int, load: Counts) -> LayerStats:
    total = int(load.sum())
    mean = total / load.size if load.size else 0.0
    p = load / total if total else np.zeros(load.shape)
    nonzero = p[p > 0]
    entropy = float(-(nonzero * np.log2(nonzero)).sum())
    return LayerStats(
        layer=layer,
        load=[int(x) for x in load],
        imbalance=float(load.max() / mean) if mean else float("nan"),
        cv=float(load.std() / mean) if mean else float("nan"),
        entropy_bits=entropy,
        entropy_normalized=entropy / float(np.log2(load.size)) if load.size > 1 else float("nan"),
    )
