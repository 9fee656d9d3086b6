"""``routelog diff``: the routing of the same records in two stores or steps (the R3 paper's Fig. 3).

Records are matched by sample id; their tokens must be the same (token count, and token hash where both stores
have one): comparing routing of different tokens would be meaningless, so a mismatch is an error naming the
sample. Only rows routed in both are compared.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel

from routelog.audit.kernels import Differences
from routelog.audit.units import WorkUnit, batches, pack, unpack
from routelog.errors import InvalidRecordError, ModelSpecError
from routelog.format.documents import IndexRow


class TokenMismatchError(InvalidRecordError):
    """The same sample id holds different tokens in the two stores compared."""


def diff_unit(unit: WorkUnit, batch_records: int) -> bytes:
    a, b = unit.snapshot(), unit.other_snapshot()
    spec = a.store.model_spec
    if (spec.num_moe_layers, spec.topk) != (b.store.model_spec.num_moe_layers, b.store.model_spec.topk):
        raise ModelSpecError(
            f"{a.store.url} and {b.store.url} have different layer maps or top-k; nothing to compare (diff compares "
            "recordings of one model)"
        )
    layers, k = spec.num_moe_layers, spec.topk
    differences = Differences(layers, k)
    rows = 0
    seq_means: list[float] = []
    shared = [sid for sid in unit.sample_ids if sid in b]
    for sid in shared:
        _check_same_tokens(
            sid, a.info(sid), b.info(sid), f"{a.store.url} step {a.step}", f"{b.store.url} step {b.step}"
        )
    for batch, others in batches([a, b], shared, batch_records=batch_records):
        for left, right in zip(batch, others, strict=True):
            compared, differing = differences.add(left.by_layer, right.by_layer, left.valid & right.valid)
            rows += compared
            if compared:
                seq_means.append(differing / compared)
    return pack(
        {
            "router_hist": differences.router_hist,
            "token_hist": differences.token_hist,
            "layer_diff": differences.layer_diff,
            "rows": rows,
            "seq_means": np.asarray(seq_means, np.float64),
            "matched": len(shared),
            "only_a": len(unit.sample_ids) - len(shared),
        }
    )


def _check_same_tokens(sid: str, a: IndexRow, b: IndexRow, where_a: str, where_b: str) -> None:
    if a.n_tokens != b.n_tokens or (a.token_hash and b.token_hash and a.token_hash != b.token_hash):
        raise TokenMismatchError(
            sid,
            "token_hash",
            f"the record has different tokens in {where_a} ({a.n_tokens} tokens, hash {a.token_hash}) and {where_b} "
            f"({b.n_tokens} tokens, hash {b.token_hash})",
            "compare recordings of the same rollouts (the same sample ids for the same token sequences): check the "
            "steps (--step, --step-b) and the stores",
        )


class LayerRate(BaseModel):
    layer: int
    """Global layer index."""
    diff_rate: float
    """Share of routed rows whose top-k set differs in this layer."""


class DiffResult(BaseModel):
    a: str
    b: str
    records_compared: int
    only_a: int
    only_b: int
    rows_compared: int
    router_diff_rate: float
    """Share of (token, layer) decisions with a different set of experts."""
    token_diff_rate: float
    """Share of tokens with a different set in at least one layer."""
    mean_sequence_diff: float
    """Mean over records of the mean per-token count of differing experts (summed over layers)."""
    router_hist: list[int]
    """``router_hist[d]``: (token, layer) decisions with ``d`` of the K experts differing."""
    token_hist: list[int]
    """``token_hist[d]``: tokens with ``d`` differing experts summed over layers."""
    sequence_means: list[float]
    """Per compared record, sorted: the sequence-level values (histogram them)."""
    layers: list[LayerRate]


def merge_diffs(partials: list[bytes], a: str, b: str, only_b: int, layer_ids: list[int], topk: int) -> DiffResult:
    layers = len(layer_ids)
    nothing: dict[str, npt.NDArray[Any]] = {  # the identity of the sums below, so an empty step A merges like any other
        "router_hist": np.zeros(topk + 1, np.int64),
        "token_hist": np.zeros(layers * topk + 1, np.int64),
        "layer_diff": np.zeros(layers, np.int64),
        "rows": np.zeros((), np.int64),
        "seq_means": np.zeros(0, np.float64),
        "matched": np.zeros((), np.int64),
        "only_a": np.zeros((), np.int64),
    }
    parts = [nothing, *(unpack(p) for p in partials)]

    def total(name: str) -> npt.NDArray[np.int64]:
        out: npt.NDArray[np.int64] = np.sum([p[name] for p in parts], axis=0)
        return out

    router_hist, token_hist, layer_diff = total("router_hist"), total("token_hist"), total("layer_diff")
    rows = int(total("rows"))
    seq = np.sort(np.concatenate([p["seq_means"] for p in parts]))

    return DiffResult(
        a=a,
        b=b,
        records_compared=int(total("matched")),
        only_a=int(total("only_a")),
        only_b=only_b,
        rows_compared=rows,
        router_diff_rate=float(router_hist[1:].sum() / router_hist.sum()) if router_hist.sum() else float("nan"),
        token_diff_rate=float(token_hist[1:].sum() / token_hist.sum()) if token_hist.sum() else float("nan"),
        mean_sequence_diff=math.fsum(seq.tolist()) / seq.size if seq.size else float("nan"),
        router_hist=[int(x) for x in router_hist],
        token_hist=[int(x) for x in token_hist],
        sequence_means=[float(x) for x in seq],
        layers=[
            LayerRate(layer=layer, diff_rate=float(d / rows) if rows else float("nan"))
            for layer, d in zip(layer_ids, layer_diff, strict=True)
        ],
    )
