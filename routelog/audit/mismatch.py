"""``routelog mismatch``: training-inference mismatch per step from the stored log-probs (the R3 paper's Fig. 5),
and the router diff the trainer measured while replaying.

Per step, over tokens that have both ``logprob_infer`` and ``logprob_train``: the k3 estimate of
KL(pi_infer || pi_train) and F(t), the share of tokens whose probability ratio exceeds ``t`` either way. Per step
with replay-fidelity documents (:mod:`routelog.store.fidelity`), per layer the share of replayed rows whose trainer
router would have chosen other experts. Only the values objects and those documents are read, never routing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel

from routelog.audit.units import WorkUnit, pack, unpack
from routelog.errors import ValuesNotFoundError
from routelog.format.values import LOGPROB_INFER, LOGPROB_TRAIN
from routelog.store.fidelity import read_fidelity, step_fidelity
from routelog.store.root import StoreRoot

THRESHOLDS = (1.5, 2.0, 5.0)
"""The paper's t values for F(t)."""
_VALUES_BATCH = 1024


def mismatch_unit(unit: WorkUnit, batch_records: int) -> bytes:
    del batch_records  # values are small: read a unit's at once
    snapshot = unit.snapshot()
    partials: list[float] = []
    exceed = np.zeros(len(THRESHOLDS), np.int64)
    tokens = records = 0
    ids = list(unit.sample_ids)
    for start in range(0, len(ids), _VALUES_BATCH):
        values = snapshot.token_values(ids[start : start + _VALUES_BATCH], [LOGPROB_INFER, LOGPROB_TRAIN])
        for sid in ids[start : start + _VALUES_BATCH]:
            columns = values[sid]
            if LOGPROB_INFER not in columns or LOGPROB_TRAIN not in columns:
                continue
            infer = columns[LOGPROB_INFER].astype(np.float64)
            train = columns[LOGPROB_TRAIN].astype(np.float64)
            both = np.isfinite(infer) & np.isfinite(train)
            if not both.any():
                continue
            log_ratio = train[both] - infer[both]
            partials.append(float(np.sum(np.expm1(log_ratio) - log_ratio)))
            exceed += [int((np.abs(log_ratio) > math.log(t)).sum()) for t in THRESHOLDS]
            tokens += int(both.sum())
            records += 1
    return pack(
        {
            "step": unit.step,
            "k3_partials": np.asarray(partials, np.float64),
            "exceed": exceed,
            "tokens": tokens,
            "records": records,
        }
    )


class StepMismatch(BaseModel):
    step: int
    records: int
    """Records with both log-prob columns."""
    tokens: int
    """Tokens compared (both log-probs finite)."""
    kl_k3: float
    extreme: dict[str, float]
    """F(t) keyed by ``t`` (``"1.5"``, ``"2"``, ``"5"``)."""


class StepRouterDiff(BaseModel):
    step: int
    replayed_rows: int
    """Replayed (row, layer) pairs counted by the training ranks."""
    router_diff: float
    """Share of them whose trainer router would have chosen another set."""
    by_layer: dict[str, float]
    """Router diff per global layer index."""
    token_mismatches: int
    trainer_steps: list[int] = []


class MismatchResult(BaseModel):
    url: str
    steps: list[StepMismatch]
    """Steps with tokens that have both log-probs."""
    steps_without_logprobs: list[int] = []
    """Steps audited whose records lack one of the two columns: left out of ``steps``."""
    router_diff: list[StepRouterDiff] = []
    """Steps whose training ranks published replay fidelity (``routelog.store.fidelity``)."""


def router_diffs(store: StoreRoot, steps: Sequence[int]) -> list[StepRouterDiff]:
    """Per step with fidelity documents, the trainer's router diff (all ranks and phases summed)."""
    out = []
    for step in steps:
        records = read_fidelity(store, step)
        if not records:
            continue
        counts = step_fidelity(records)
        rows = sum(counts.replayed.values())
        out.append(
            StepRouterDiff(
                step=step,
                replayed_rows=rows,
                router_diff=sum(counts.differing.values()) / rows if rows else 0.0,
                by_layer={str(layer): diff for layer, diff in counts.router_diff().items()},
                token_mismatches=counts.token_mismatches,
                trainer_steps=sorted({r.trainer_step for r in records if r.trainer_step is not None}),
            )
        )
    return out


def merge_mismatch(partials: list[bytes], url: str, router_diff: Sequence[StepRouterDiff] = ()) -> MismatchResult:
    by_step: dict[int, list[dict[str, np.ndarray]]] = {}
    for data in partials:
        part = unpack(data)
        by_step.setdefault(int(part["step"]), []).append(part)
    steps, without = [], []
    for step, parts in sorted(by_step.items()):
        tokens = sum(int(p["tokens"]) for p in parts)
        if not tokens:
            without.append(step)
            continue
        exceed = np.sum([p["exceed"] for p in parts], axis=0)
        # fsum is the correctly rounded exact sum: the same whatever the order partials arrive in.
        kl = math.fsum(x for p in parts for x in p["k3_partials"].tolist()) / tokens
        steps.append(
            StepMismatch(
                step=step,
                records=sum(int(p["records"]) for p in parts),
                tokens=tokens,
                kl_k3=kl,
                extreme={f"{t:g}": float(e / tokens) for t, e in zip(THRESHOLDS, exceed, strict=True)},
            )
        )
    if not steps and not router_diff:
        raise ValuesNotFoundError(
            f"{url}: no record of step(s) {without} has both {LOGPROB_INFER} and {LOGPROB_TRAIN}: record the "
            f"engine's log-probs as {LOGPROB_INFER} when writing and add the trainer's as {LOGPROB_TRAIN} with "
            "Store.annotate (see the README's audits section), or publish replay fidelity from the trainer "
            "(write_fidelity in routelog.store.fidelity, or an integration's fidelity_writer)"
        )
    return MismatchResult(url=url, steps=steps, steps_without_logprobs=without, router_diff=list(router_diff))
