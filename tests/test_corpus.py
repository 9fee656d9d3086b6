"""The shipped routing corpus (``tests/fixtures/corpus``, made by ``tools/make_corpus.py``) opens, verifies, matches
its ``stats.json``, and holds routing that is not trivial: imbalanced, token-dependent, GRPO groups sharing their
prompt's routing. Reads only; no model is built or run here."""

from __future__ import annotations

import importlib.util
import json
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import routelog
from routelog import audit

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "fixtures" / "corpus"
MODELS = ("qwen3moe", "deepseekv3")


@cache
def make_corpus() -> ModuleType:
    """``tools/make_corpus.py`` as a module (tools/ is not a package); its heavy imports are inside functions."""
    spec = importlib.util.spec_from_file_location("make_corpus", ROOT / "tools" / "make_corpus.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@cache
def shipped_stats() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CORPUS / "stats.json").read_text())
    return data


@cache
def recomputed_stats() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(json.dumps(make_corpus().corpus_stats(CORPUS)))
    return data


@pytest.mark.parametrize("name", MODELS)
def test_store_opens_and_every_step_verifies(name: str) -> None:
    store = routelog.open_store(str(CORPUS / name))
    report = store.verify()
    assert report.ok, report
    spec = store.model_spec
    assert spec.num_experts == 64 and spec.topk == 8
    for step, workload in make_corpus().WORKLOADS.items():
        snapshot = store.step(step)
        assert len(snapshot) > 0
        for info in snapshot.infos():
            assert info.engine == "transformers" and info.token_ids is not None
            assert info.extra is not None and json.loads(info.extra)["workload"] == workload


def test_deepseek_spec_has_a_dense_first_layer_and_group_limited_sigmoid_routing() -> None:
    spec = routelog.open_store(str(CORPUS / "deepseekv3")).model_spec
    assert spec.moe_layers[0] == 1 and 0 not in spec.moe_layers
    assert spec.router.score_function == "sigmoid" and spec.router.n_group == 8 and spec.router.topk_group == 4
    qwen = routelog.open_store(str(CORPUS / "qwen3moe")).model_spec
    assert qwen.moe_layers == tuple(range(qwen.num_layers)) and qwen.router.score_function == "softmax"


def test_stats_json_is_what_the_stores_give() -> None:
    assert recomputed_stats() == shipped_stats()


@pytest.mark.parametrize("name", MODELS)
def test_load_statistics_agree_with_routelog_stats(name: str) -> None:
    ours = shipped_stats()["models"][name]["all"]["layers"]
    theirs = audit.stats(str(CORPUS / name)).layers
    assert [layer["layer"] for layer in ours] == [layer.layer for layer in theirs]
    for mine, other in zip(ours, theirs, strict=True):
        assert mine["imbalance"] == pytest.approx(other.imbalance, rel=1e-12)
        assert mine["entropy_normalized"] == pytest.approx(other.entropy_normalized, rel=1e-12)


@pytest.mark.parametrize("name", MODELS)
def test_routing_is_imbalanced_and_token_dependent(name: str) -> None:
    model = shipped_stats()["models"][name]
    layers = model["all"]["layers"]
    assert max(layer["imbalance"] for layer in layers) > 1.5, "some layer's expert load is visibly imbalanced"
    assert all(layer["entropy_normalized"] < 0.999 for layer in layers)
    for layer in layers:
        # neither constant (every token the same set) nor random (consecutive sets of a top-8-of-64 router almost
        # never repeat by chance; 8/64 of the experts shared on average)
        assert 0.0 < layer["repeat_prev_set"] < 0.99
        assert 8 / 64 < layer["overlap_prev"] < 1.0
        assert layer["distinct_sets"] > 50
    assert model["all"]["summary"]["mean_token_determined"] > 0.1


@pytest.mark.parametrize("name", MODELS)
def test_grpo_samples_of_a_group_share_the_prompt_routing(name: str) -> None:
    snapshot = routelog.open_store(str(CORPUS / name)).step(0)
    groups: dict[str, list[Any]] = {}
    for routing in snapshot.read_many(snapshot.sample_ids):
        assert routing.info.group_id is not None
        groups.setdefault(routing.info.group_id, []).append(routing)
    assert len(groups) > 1
    for members in groups.values():
        assert len(members) > 1
        prompt_len = members[0].info.prompt_len
        first = members[0].expert_ids[:prompt_len]
        assert (first >= 0).all()
        for other in members[1:]:
            assert other.info.prompt_len == prompt_len
            np.testing.assert_array_equal(other.expert_ids[:prompt_len], first)
        responses = {m.info.token_hash for m in members}
        assert len(responses) > 1, "the samples of a group differ in their responses"
    grpo = shipped_stats()["models"][name]["steps"]["0"]["grpo"]
    assert grpo["groups_with_identical_prompt_routing"] == grpo["groups"] == len(groups)


@pytest.mark.parametrize("name", MODELS)
def test_multiturn_turns_resend_the_history(name: str) -> None:
    snapshot = routelog.open_store(str(CORPUS / name)).step(1)
    by_id = {r.sample_id: r for r in snapshot.read_many(snapshot.sample_ids)}
    assert len({r.info.group_id for r in by_id.values()}) > 1
    for sid, routing in by_id.items():
        session, turn = sid.split("/t")
        if turn == "0":
            continue
        previous = by_id[f"{session}/t{int(turn) - 1}"]
        n = previous.info.n_tokens
        tokens = np.asarray(routing.info.token_ids)
        np.testing.assert_array_equal(tokens[:n], np.asarray(previous.info.token_ids))
        sources = [segment.source for segment in routing.info.segments]
        assert sources[-2:] == [f"turn-{turn}/user", "response"]
    reuse = shipped_stats()["models"][name]["steps"]["1"]["multiturn"]
    assert reuse["turn_pairs"] == len(by_id) - len({r.info.group_id for r in by_id.values()})
    assert 0.5 < reuse["identical_row_layer_share"] <= 1.0, "re-sent history mostly routes as before"
