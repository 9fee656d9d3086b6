"""Routing for ``routelog check`` to judge: healthy routing (the corpora, synthetic routing, the engine fixtures) and
the same routing with one capture fault injected as the bug leaves it in a store. ``tests/test_check.py`` asserts
on it and ``tools/check_rates.py`` measures recall and false-positive rates with it."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import routelog
from routelog import ModelSpec, Record
from routelog.audit.check import CheckResult, Detector, Finding
from routelog.engines.common import Payload, payload_to_record
from routelog.format.record import StreamRows
from routelog.format.spec import StreamSpec
from routelog.synth import SynthConfig, TokenRouter, synth_records, synthetic_spec, zipf_token_ids

CORPUS = Path(__file__).resolve().parent / "fixtures" / "corpus"
Steps = dict[int, list[Record]]


@dataclass(frozen=True)
class Expected:
    """A fault injected: the finding that must name it (``None``: any sample, layer or tokens)."""

    detector: Detector
    step: int
    sample_id: str | None = None
    layer: int | None = None
    """Global layer index."""
    tokens: tuple[int, int] | None = None

    def found_by(self, finding: Finding) -> bool:
        if finding.detector != self.detector or finding.step != self.step:
            return False
        if self.sample_id is not None and finding.sample_id != self.sample_id:
            return False
        if self.layer is not None and finding.layer not in (self.layer, None):
            return False
        if self.tokens is not None and finding.tokens is not None:
            return finding.tokens[0] < self.tokens[1] and self.tokens[0] < finding.tokens[1]
        return True


@dataclass
class Case:
    """A store's worth of routing, and the faults injected into it (none: healthy)."""

    name: str
    spec: ModelSpec
    steps: Steps
    expected: list[Expected] = dataclasses.field(default_factory=list)

    def write(self, url: str | None = None) -> str:
        url = url or f"memory://check/{self.name}/{uuid.uuid4().hex}"
        store = routelog.create_store(url, self.spec)
        for step, records in self.steps.items():
            with store.writer(step, "w") as writer:
                for record in records:
                    writer.append(record)
        return url


def missed(result: CheckResult, expected: list[Expected]) -> list[Expected]:
    """The injected faults no listed finding names (run the check with ``max_findings`` above their count)."""
    return [e for e in expected if not any(e.found_by(f) for f in result.findings)]


# -- healthy routing ------------------------------------------------------------------------------------------------
def corpus(name: str, *, steps: tuple[int, ...] = (0, 1, 2), limit: int | None = None) -> Case:
    """A corpus store's records (``limit`` per step), as records to write again."""
    store = routelog.open_store(str(CORPUS / name))
    out: Steps = {}
    for step in steps:
        snapshot = store.step(step)
        ids = snapshot.sample_ids[:limit]
        out[step] = [r.to_record() for r in snapshot.read_many(ids)]
    return Case(name, store.model_spec, out)


def synthetic(
    name: str,
    *,
    layers: int = 4,
    experts: int = 64,
    topk: int = 8,
    records: int = 48,
    tokens: int = 256,
    steps: int = 2,
    **config: Any,
) -> Case:
    """``routelog synth`` routing (each step its own random router, as ``synth_records`` draws it)."""
    spec = synthetic_spec(layers, experts, topk)
    out = {
        s: list(synth_records(spec, SynthConfig(records=records, tokens=tokens, step=s, **config)))
        for s in range(steps)
    }
    return Case(name, spec, out)


def token_routed(
    name: str,
    *,
    layers: int = 6,
    experts: int = 64,
    topk: int = 8,
    records: int = 48,
    tokens: int = 256,
    steps: int = 3,
) -> Case:
    """Routing that depends on the token (one :class:`TokenRouter` for every step, as a trained model's), over
    Zipf-distributed token ids, so tokens repeat as in text."""
    rng = np.random.default_rng(7)
    spec = synthetic_spec(layers, experts, topk)
    vocab = 2000
    router = TokenRouter.draw(rng, np.arange(vocab), spec, skew=3.0)
    out: Steps = {}
    for step in range(steps):
        out[step] = []
        for i in range(records):
            token_ids = zipf_token_ids(rng, tokens, vocab)
            valid = np.ones(tokens, bool)
            valid[-1] = False
            out[step].append(
                Record(
                    sample_id=f"s{step}-{i:03d}",
                    expert_ids=router.route(rng, token_ids),
                    prompt_len=tokens // 4,
                    response_len=tokens - tokens // 4,
                    valid=valid,
                    token_ids=token_ids,
                )
            )
    return Case(name, spec, out)


def healthy_synthetic() -> list[Case]:
    """The synthetic routing the false-positive rates are measured on."""
    return [
        synthetic("uniform"),
        synthetic("skew3-locality0.3", skew=3.0, locality=0.3, with_token_ids=True),
        synthetic("skew1-locality0.6-ragged", skew=1.0, locality=0.6, ragged=True),
        synthetic("e16-k2", layers=8, experts=16, topk=2, skew=2.0, locality=0.2, with_token_ids=True),
        synthetic("e128-k6", layers=3, experts=128, topk=6, skew=0.5, records=24, tokens=512),
        synthetic("e16-k1", layers=4, experts=16, topk=1, skew=1.0, with_token_ids=True),
        token_routed("token-routed"),
        with_mtp(token_routed("token-routed-mtp"), copy_layer=None),
    ]


def engine_fixtures() -> list[Case]:
    """One store per engine fixture under tests/fixtures/engines, its records as the engine tests ingest them."""
    from tests.test_engine_fixtures import ALL, INGEST, _spec, _trainer_records

    cases = []
    for fixture in ALL:
        if fixture in INGEST:
            records = [o for o in INGEST[fixture](fixture) if isinstance(o, Record)]
        else:
            records = _trainer_records(fixture)
        if records:  # some fixtures hold only samples the engine returned no routing for
            cases.append(Case(fixture, _spec(fixture), {0: records}))
    return cases


# -- faults ---------------------------------------------------------------------------------------------------------
def _replace(record: Record, ids: np.ndarray | None = None, **changes: Any) -> Record:
    return dataclasses.replace(record, expert_ids=record.expert_ids if ids is None else ids, **changes)


def _long(records: list[Record], n: int, min_tokens: int) -> list[int]:
    return [i for i, r in enumerate(records) if r.n_tokens >= min_tokens][:n]


def _changes(record: Record, start: int, stop: int) -> int:
    if record.token_ids is None:
        return stop - start - 1
    tokens = np.asarray(record.token_ids)[start:stop]
    return int((tokens[1:] != tokens[:-1]).sum())


def all_zero_rows(case: Case, rng: np.random.Generator) -> Case:
    """vLLM #54730: routes of zeros for some tokens. Ingest keeps the record and marks those rows missing: run
    through the ingest path itself (``payload_to_record``)."""
    step = min(case.steps)
    records = list(case.steps[step])
    expected = []
    for i in _long(records, 8, 64):
        r = records[i]
        valid = np.asarray(r.valid)
        rows = np.asarray(r.expert_ids)[: r.n_tokens - 1].astype(np.int64)
        start = r.prompt_len + int(rng.integers(0, max(1, r.response_len - 20)))
        stop = min(start + 12, r.n_tokens - 1)
        rows[start:stop] = 0
        missing = ~valid[: r.n_tokens - 1]
        payload = Payload(r.sample_id, rows, missing=missing)
        records[i] = payload_to_record(
            payload, case.spec, sample_id=r.sample_id, prompt_len=r.prompt_len, response_len=r.response_len,
            token_ids=r.token_ids,
        )  # fmt: skip
        expected.append(Expected("routed_rows", step, r.sample_id, tokens=(start, stop)))
    return Case(f"{case.name}+all_zero_rows", case.spec, {**case.steps, step: records}, expected)


def no_rows(case: Case, rng: np.random.Generator) -> Case:
    """A capture that returned nothing for some records, written through the Python API (ingest refuses them)."""
    step = min(case.steps)
    records = list(case.steps[step])
    expected = []
    for i in rng.choice(len(records), size=min(4, len(records)), replace=False).tolist():
        records[i] = _replace(records[i], valid=np.zeros(records[i].n_tokens, bool))
        expected.append(Expected("routed_rows", step, records[i].sample_id))
    return Case(f"{case.name}+no_rows", case.spec, {**case.steps, step: records}, expected)


def zero_logits_layer(case: Case, rng: np.random.Generator) -> Case:
    """One layer routed from all-zero logits (top-k of ties: experts 0..K-1) for every token of a step."""
    step = min(case.steps)
    j = int(rng.integers(0, case.spec.num_moe_layers))
    records = []
    for r in case.steps[step]:
        ids = np.array(r.expert_ids)
        ids[:, j] = np.arange(case.spec.topk)
        records.append(_replace(r, ids))
    expected = [Expected("constant_layer", step, layer=case.spec.moe_layers[j])]
    return Case(f"{case.name}+zero_logits_layer", case.spec, {**case.steps, step: records}, expected)


def stale_rows(
    case: Case, rng: np.random.Generator, *, length: int = 67, one_layer: bool = False, min_changes: int = 32
) -> Case:
    """SGLang #36404: one token's route repeated over the next ``length`` rows (every layer; or ``one_layer``), in
    8 records, over stretches whose tokens change at least ``min_changes`` times (a route held over one repeated
    token is what healthy routing does too)."""
    step = min(case.steps)
    records = list(case.steps[step])
    expected: list[Expected] = []
    for i in _long(records, 64, length + 16):
        if len(expected) == 8:
            break
        r = records[i]
        valid = np.asarray(r.valid)
        for _ in range(20):
            start = int(rng.integers(0, r.n_tokens - length - 1))
            stop = start + length
            if valid[start:stop].all() and _changes(r, start, stop) >= min_changes:
                break
        else:
            continue
        ids = np.array(r.expert_ids)
        j = int(rng.integers(0, case.spec.num_moe_layers))
        if one_layer:
            ids[start + 1 : stop, j] = ids[start, j]
        else:
            ids[start + 1 : stop] = ids[start]
        records[i] = _replace(r, ids)
        layer = case.spec.moe_layers[j] if one_layer else None
        expected.append(Expected("stale_rows", step, r.sample_id, layer, (start, stop)))
    name = "stale_one_layer" if one_layer else "stale_rows"
    return Case(f"{case.name}+{name}", case.spec, {**case.steps, step: records}, expected)


def stale_one_layer(case: Case, rng: np.random.Generator) -> Case:
    return stale_rows(case, rng, length=40, one_layer=True)


def constant_rows(case: Case, rng: np.random.Generator) -> Case:
    """A capture whose layer index never advances: every layer holds layer 0's set, in 4 records."""
    step = min(case.steps)
    records = list(case.steps[step])
    expected = []
    for i in rng.choice(len(records), size=min(4, len(records)), replace=False).tolist():
        ids = np.array(records[i].expert_ids)
        ids[:] = ids[:, :1]
        records[i] = _replace(records[i], ids)
        expected.append(Expected("constant_rows", step, records[i].sample_id))
    return Case(f"{case.name}+constant_rows", case.spec, {**case.steps, step: records}, expected)


def duplicate_layer(case: Case, rng: np.random.Generator) -> Case:
    """One layer's routing recorded in the next layer's place too, for a whole step."""
    step = min(case.steps)
    j = int(rng.integers(0, case.spec.num_moe_layers - 1))
    records = []
    for r in case.steps[step]:
        ids = np.array(r.expert_ids)
        ids[:, j + 1] = ids[:, j]
        records.append(_replace(r, ids))
    expected = [Expected("duplicate_layer", step, layer=case.spec.moe_layers[j + 1])]
    return Case(f"{case.name}+duplicate_layer", case.spec, {**case.steps, step: records}, expected)


def layer_offset(case: Case, rng: np.random.Generator, *, dense_first: bool = False) -> Case:
    """verl #5037: from the last step on, stored layer j holds the routing of layer j - 1 (rolled around: the
    shift alone; ``dense_first``: the first stored layer holds a dense layer's zeros, read as experts 0..K-1)."""
    del rng
    step = max(case.steps)
    records = []
    for r in case.steps[step]:
        ids = np.roll(np.asarray(r.expert_ids), 1, axis=1)
        if dense_first:
            ids[:, 0] = np.arange(case.spec.topk)
        records.append(_replace(r, ids))
    expected = [Expected("layer_offset", step)]
    if dense_first:
        expected.append(Expected("constant_layer", step, layer=case.spec.moe_layers[0]))
    name = "layer_offset_dense_first" if dense_first else "layer_offset"
    return Case(f"{case.name}+{name}", case.spec, {**case.steps, step: records}, expected)


def layer_offset_dense_first(case: Case, rng: np.random.Generator) -> Case:
    return layer_offset(case, rng, dense_first=True)


def eplb_replicas(case: Case, rng: np.random.Generator) -> Case:
    """vLLM #33013: physical IDs under EPLB with redundant experts, kept because the spec was widened to the
    physical count: the busiest experts of each layer have a replica slot after the logical ones, and each of
    their tokens goes to one of the two at random."""
    spec = case.spec
    redundant = max(1, min(8, spec.num_experts // 8))
    wide = ModelSpec.model_validate({**spec.model_dump(), "num_experts": spec.num_experts + redundant})
    step = min(case.steps)
    loads = np.zeros((spec.num_moe_layers, spec.num_experts), np.int64)
    for r in case.steps[step]:
        for j in range(spec.num_moe_layers):
            loads[j] += np.bincount(
                np.asarray(r.expert_ids)[np.asarray(r.valid), j].ravel(), minlength=spec.num_experts
            )
    busiest = np.argsort(-loads, axis=1)[:, :redundant]
    records = []
    for r in case.steps[step]:
        ids = np.array(r.expert_ids, dtype=np.int64)
        for j in range(spec.num_moe_layers):
            for slot, expert in enumerate(busiest[j]):
                moved = (ids[:, j] == expert) & (rng.random(ids[:, j].shape) < 0.5)
                ids[:, j][moved] = spec.num_experts + slot
        records.append(_replace(r, ids))
    expected = [Expected("eplb_replicas", step, layer=layer) for layer in spec.moe_layers]
    return Case(f"{case.name}+eplb_replicas", wide, {**case.steps, step: records}, expected)


def with_mtp(case: Case, *, copy_layer: int | None) -> Case:
    """The spec declaring one MTP layer, each record carrying its routing: a copy of layer ``copy_layer``'s (the
    NeMo-RL #3903 collision), or (None) the last layer's set of the next token, which a healthy MTP layer is
    close to but not equal."""
    spec = case.spec
    mtp = StreamSpec(name="mtp", num_layers=1, universe=spec.num_experts, topk=spec.topk)
    wide = ModelSpec.model_validate({**spec.model_dump(), "mtp_layers": 1, "streams": [mtp.model_dump()]})
    steps: Steps = {}
    for step, records in case.steps.items():
        steps[step] = []
        for r in records:
            ids = np.asarray(r.expert_ids)
            rows = ids[:, -1:] if copy_layer is None else ids[:, copy_layer : copy_layer + 1]
            if copy_layer is None:
                rows = np.roll(rows, -1, axis=0)
            steps[step].append(_replace(r, streams={"mtp": StreamRows(rows, r.valid)}))
    return Case(case.name, wide, steps)


def mtp_collision(case: Case, rng: np.random.Generator) -> Case:
    j = int(rng.integers(0, case.spec.num_moe_layers))
    out = with_mtp(case, copy_layer=j)
    expected = [Expected("mtp_collision", step, layer=case.spec.moe_layers[j]) for step in case.steps]
    return Case(f"{case.name}+mtp_collision", out.spec, out.steps, expected)


FAULTS: dict[str, Callable[[Case, np.random.Generator], Case]] = {
    "all_zero_rows": all_zero_rows,
    "no_rows": no_rows,
    "zero_logits_layer": zero_logits_layer,
    "stale_rows": stale_rows,
    "stale_one_layer": stale_one_layer,
    "constant_rows": constant_rows,
    "duplicate_layer": duplicate_layer,
    "layer_offset": layer_offset,
    "layer_offset_dense_first": layer_offset_dense_first,
    "eplb_replicas": eplb_replicas,
    "mtp_collision": mtp_collision,
}
"""Each fault class (the issue's bugs, as stored), by name."""
