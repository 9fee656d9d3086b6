"""``routelog check``: every injected capture fault is found (the sample, layer and token range it was injected
at), the same routing without it passes clean, and so do the corpora, the engine fixtures and synthetic routing
(``tools/check_rates.py`` prints the rates measured here at full size)."""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import routelog
from routelog import ModelSpec, Record
from routelog.audit.check import CheckConfigError, CheckResult, Thresholds, check
from routelog.cli import app
from tests.check_faults import (
    CORPUS,
    FAULTS,
    Case,
    corpus,
    engine_fixtures,
    healthy_synthetic,
    missed,
    synthetic,
    token_routed,
)

LISTED = Thresholds(max_findings=10_000)


@cache
def base(name: str) -> Case:
    """Small healthy stores to inject faults into: two steps of 24 records each."""
    if name in ("qwen3moe", "deepseekv3"):
        return corpus(name, steps=(1, 2), limit=24)
    if name == "token-routed":
        return token_routed(name, records=24, steps=2)
    if name == "synthetic":
        return synthetic(name, skew=3.0, locality=0.3, with_token_ids=True, records=24)
    return synthetic(name, records=24)  # "no-token-ids"


BASES = ["qwen3moe", "deepseekv3", "token-routed", "synthetic", "no-token-ids"]


def _applies(fault: str, name: str) -> bool:
    if fault.startswith("layer_offset"):  # seen across steps: synth_records draws a new router per step
        return name in ("qwen3moe", "deepseekv3", "token-routed")
    if name == "no-token-ids":  # without token ids only whole rows held over many rows are stale
        return fault == "stale_rows"
    return True


CASES = [(f, b) for f in FAULTS for b in BASES if _applies(f, b)]


def _check(case: Case) -> CheckResult:
    return check(case.write(), thresholds=LISTED)


@pytest.mark.parametrize(("fault", "name"), CASES, ids=[f"{f}-{b}" for f, b in CASES])
def test_each_injected_fault_is_found(fault: str, name: str) -> None:
    case = FAULTS[fault](base(name), np.random.default_rng(len(fault)))
    assert case.expected, "the injection injected something"
    result = _check(case)
    assert not missed(result, case.expected), [
        f"{f.detector} {f.sample_id} {f.layer} {f.tokens}" for f in result.findings
    ]
    found = {f.detector for f in result.findings}
    assert found == {e.detector for e in case.expected}, "no other detector fires on it"
    warning_only = fault == "all_zero_rows" or name == "no-token-ids"  # incomplete routing; stale without tokens
    assert result.ok == warning_only, result.errors


@pytest.mark.parametrize("name", BASES)
def test_the_same_routing_without_the_fault_passes_clean(name: str) -> None:
    result = _check(base(name))
    assert (result.errors, result.warnings) == (0, 0), result.findings


def test_the_corpora_pass_clean() -> None:
    for name in ("qwen3moe", "deepseekv3"):
        result = check(str(CORPUS / name))
        assert [s.records for s in result.steps] == [192, 69, 64]
        assert (result.errors, result.warnings) == (0, 0), result.findings
        assert all(s.stale_changes == [16] * len(s.stale_changes) for s in result.steps)


def test_engine_fixtures_pass_clean() -> None:
    """The one warning is a true one: NeMo-RL's fixture holds a response whose vLLM output was incomplete."""
    findings = []
    for case in engine_fixtures():
        result = _check(case)
        assert result.errors == 0, (case.name, result.findings)
        findings += [(case.name, f.detector, f.sample_id, f.tokens) for f in result.findings]
    assert findings == [("nemo-rl-chat", "routed_rows", "chatcmpl-nrl1", (9, 12))]


def test_healthy_synthetic_routing_passes_clean() -> None:
    for case in healthy_synthetic():
        result = _check(case)
        assert (result.errors, result.warnings) == (0, 0), (case.name, result.findings)


# -- thresholds, on routing built for them ---------------------------------------------------------------------------
SPEC = ModelSpec(name="check", num_layers=3, moe_layers=(1, 2), num_experts=64, topk=4)


def _records(n: int, tokens: int = 100, seed: int = 0) -> list[Record]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        valid = np.ones(tokens, bool)
        valid[-1] = False
        out.append(
            Record(
                sample_id=f"r{i}",
                expert_ids=np.argsort(rng.random((tokens, 2, 64)), axis=-1)[..., :4],
                prompt_len=20,
                response_len=tokens - 20,
                valid=valid,
                token_ids=rng.integers(0, 1000, tokens),
            )
        )
    return out


def _with(record: Record, **changes: Any) -> Record:
    return dataclasses.replace(record, **changes)


def test_a_stale_run_is_counted_in_token_changes() -> None:
    records = _records(8)
    ids = [np.array(r.expert_ids) for r in records]
    tokens = [np.array(r.token_ids) for r in records]
    ids[0][30:47, 0] = ids[0][30, 0]  # 17 rows: 16 token changes
    ids[1][30:46, 0] = ids[1][30, 0]  # 16 rows: 15 token changes
    ids[2][30:90] = ids[2][30]  # 60 rows of one repeated token: a healthy router may route so
    tokens[2][30:90] = 7
    records = [_with(r, expert_ids=i, token_ids=t) for r, i, t in zip(records, ids, tokens, strict=True)]
    result = _check(Case("stale", SPEC, {0: records}))
    assert [(f.sample_id, f.layer, f.tokens, f.severity) for f in result.findings] == [("r0", 1, (30, 47), "error")]


def test_without_token_ids_only_whole_rows_held_long_are_stale() -> None:
    records = [_with(r, token_ids=None, token_hash="blake2b-128:" + "0" * 32) for r in _records(8)]
    ids = [np.array(r.expert_ids) for r in records]
    ids[0][10:42] = ids[0][10]  # every layer, 32 rows: a warning
    ids[1][10:41] = ids[1][10]  # 31 rows: below stale_min_rows
    ids[2][10:90, 0] = ids[2][10, 0]  # one layer, 80 rows: a repeated token may do that
    records = [_with(r, expert_ids=i) for r, i in zip(records, ids, strict=True)]
    result = _check(Case("stale", SPEC, {0: records}))
    assert [(f.sample_id, f.layer, f.tokens, f.severity) for f in result.findings] == [
        ("r0", None, (10, 42), "warning")
    ]


def test_routed_rows_due_run_from_the_first_routed_row_or_the_prompt_end() -> None:
    records = _records(6)
    valid = [np.array(r.valid) for r in records]
    valid[0][:12] = False  # a missing prefix inside the prompt (prefix cache, prompt start): no fault
    valid[1][-1] = True  # the final token forwarded after all: no fault
    valid[2][:25] = False  # the missing prefix reaches 5 response rows
    valid[3][50:53] = False  # a gap in the response
    valid[3][70:] = False  # ... and a lost tail
    valid[4][:] = False  # nothing to replay
    records = [_with(r, valid=v) for r, v in zip(records, valid, strict=True)]
    result = _check(Case("rows", SPEC, {0: records}))
    got = [(f.sample_id, f.tokens, f.severity) for f in result.findings]
    assert got == [("r2", (20, 25), "warning"), ("r3", (50, 53), "warning"), ("r4", (0, 100), "error")]
    assert "32 of the 99 rows due" in result.findings[1].message


def test_units_and_batches_do_not_change_the_result() -> None:
    case = base("qwen3moe")
    faults = ["eplb_replicas", "duplicate_layer", "stale_rows"]
    for i, fault in enumerate(faults):
        case = FAULTS[fault](case, np.random.default_rng(i))
    url = case.write()
    whole = check(url, thresholds=LISTED)
    split = check(url, thresholds=LISTED, unit_records=5, batch_records=2)
    assert {f.detector for f in whole.findings} == set(faults)
    assert split.model_dump() == whole.model_dump()


@pytest.mark.usefixtures("ray_cluster")
def test_ray_gives_the_same_findings(tmp_path: Path) -> None:
    case = FAULTS["eplb_replicas"](
        FAULTS["stale_rows"](base("qwen3moe"), np.random.default_rng(3)), np.random.default_rng(4)
    )
    url = case.write(str(tmp_path / "store"))
    on_ray = check(url, thresholds=LISTED, unit_records=8, use_ray=True)
    assert on_ray.errors > 0 and on_ray.model_dump() == check(url, thresholds=LISTED).model_dump()


def test_thresholds_are_checked() -> None:
    with pytest.raises(CheckConfigError, match="constant_share"):
        Thresholds(constant_share=0)
    with pytest.raises(CheckConfigError, match="max_findings"):
        Thresholds(max_findings=0)


def test_findings_beyond_max_findings_are_counted() -> None:
    case = FAULTS["no_rows"](base("synthetic"), np.random.default_rng(0))
    result = check(case.write(), thresholds=Thresholds(max_findings=1))
    assert (len(result.findings), result.errors, result.left_out) == (1, 4, 3)
    assert result.steps[0].by_detector == {"routed_rows": 4}


# -- the command line ------------------------------------------------------------------------------------------------
def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout


def test_check_command_exits_1_on_an_error(tmp_path: Path) -> None:
    healthy = base("qwen3moe").write(str(tmp_path / "healthy"))
    code, out = _cli("check", healthy)
    assert code == 0 and "0 errors, 0 warnings healthy" in out
    faulty = FAULTS["zero_logits_layer"](base("qwen3moe"), np.random.default_rng(3))
    url = faulty.write(str(tmp_path / "faulty"))
    code, out = _cli("check", url, "--step", "1")
    layer = faulty.expected[0].layer
    assert code == 1 and f"error: step 1, constant_layer, layer {layer}: 100.0% of the step's" in out
    assert "experts 0..7: what top-k of all-zero router logits picks" in out
    code, out = _cli("check", url, "--json")
    report = json.loads(out)
    assert code == 1 and report["errors"] == 1 and report["findings"][0]["detector"] == "constant_layer"
    assert [s["step"] for s in report["steps"]] == [1, 2]
    with pytest.raises(routelog.errors.RecordNotFoundError, match="no step 9"):
        _cli("check", url, "--step", "9")


def _verl_batch(path: Path, *, stale: bool) -> Path:
    """A veRL batch of 6 sequences of 80 tokens (full layer axis, dense layers zero), one sequence's rows 30-70
    holding one route when ``stale``."""
    spec = ModelSpec.model_validate(json.loads((ENGINES / "verl-0.9.1-batch" / "model_spec.json").read_text()))
    rng = np.random.default_rng(5)
    routes = np.zeros((6, 80, spec.num_layers, spec.topk), np.int16)
    routes[:, :, list(spec.moe_layers)] = np.argsort(rng.random((6, 80, spec.num_moe_layers, 64)), -1)[..., :4]
    if stale:
        routes[2, 30:70] = routes[2, 30]
    np.savez(
        path,
        routed_experts=routes,
        attention_mask=np.ones((6, 80), np.int64),
        input_ids=rng.integers(0, 1000, (6, 80)),
        prompt_length=np.int64(20),
    )
    return path


ENGINES = Path(__file__).parent / "fixtures" / "engines"


@pytest.mark.parametrize("stale", [False, True])
def test_ingest_check_checks_the_step_written(tmp_path: Path, stale: bool) -> None:
    batch = _verl_batch(tmp_path / "batch.npz", stale=stale)
    spec = str(ENGINES / "verl-0.9.1-batch" / "model_spec.json")
    url = str(tmp_path / "store")
    args = ["ingest", str(batch), "--engine", "verl", "--to", url, "--step", "0", "--model-spec", spec, "--check"]
    code, out = _cli(*args, "--json")
    report = json.loads(out)
    assert report["new"] == 6 and report["check"]["errors"] == int(stale)
    assert code == int(stale)
    code, out = _cli(*args)  # again: nothing new, the step checked again
    assert code == int(stale)
    assert ("stale_rows, sample batch/2, every MoE layer, tokens [30, 70)" in out) == stale


def test_the_rates_tool_reports_recall_and_false_positives() -> None:
    """tools/check_rates.py (the full-size numbers of docs/audits.md) on one small case of each kind."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "tools" / "check_rates.py"
    spec = importlib.util.spec_from_file_location("check_rates", path)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    clean = tool.healthy(base("synthetic"))
    assert (clean["errors"], clean["warnings"], clean["false_positive_rate"]) == (0, 0, {})
    found = tool.recall(base("synthetic"), "no_rows", seed=0)
    assert (found["injected"], found["found"], found["recall"], found["other_detectors"]) == (4, 4, 1.0, [])
