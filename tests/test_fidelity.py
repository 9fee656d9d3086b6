"""Replay fidelity measured while training, on the real megatron-core router (CPU): the router diff per layer and
step, published per rank, summed across ranks, and a gate that fails closed."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import routelog
from routelog import Record
from routelog.align import AlignmentPlan, Packing, ParallelLayout, RankCoords, parse_micro_batches
from routelog.format.documents import FidelityRecord, utc_now
from routelog.loader import ReplayLoader
from routelog.store.fidelity import (
    FidelityGate,
    ReplayFidelityError,
    StepFidelity,
    fidelity_over_steps,
    read_fidelity,
    step_fidelity,
    wilson_lower_bound,
    write_fidelity,
)
from tests.test_megatron import SPEC, build_chunks, megatron_config, run_moe_layers

pytestmark = pytest.mark.usefixtures("megatron_env")
torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

LENGTHS = [21, 17, 30]


@pytest.fixture
def store_url(make_routing: Callable[..., np.ndarray]) -> str:
    url = f"memory://fidelity/{uuid.uuid4().hex}"
    rng = np.random.default_rng(7)
    for step in (0, 1):
        with routelog.open_writer(url, step, model_spec=SPEC) as writer:
            for i, n in enumerate(LENGTHS):
                valid = np.ones(n, bool)
                valid[-1] = False
                writer.append(
                    Record(
                        sample_id=f"s{i}",
                        expert_ids=make_routing(rng, n, 6, 8, 2),
                        prompt_len=5,
                        response_len=n - 5,
                        valid=valid,
                        token_ids=np.arange(n) + 100 * i,
                        policy_version=step,
                    )
                )
    return url


def _plan() -> AlignmentPlan:
    return AlignmentPlan(SPEC, ParallelLayout(), Packing("verl"), RankCoords(), tuple(parse_micro_batches("s0,s1|s2")))


def _train_step(replay: object, chunk: object, url: str, step: int) -> dict[int, tuple[int, int]]:
    """Replay one step; returns per layer number the (replayed rows, differing rows) counted by brute force."""
    from routelog.megatron import MegatronReplay

    assert isinstance(replay, MegatronReplay)
    expected: dict[int, tuple[int, int]] = {}
    mbs = list(ReplayLoader(url, step, _plan()))
    natives = [run_moe_layers(chunk, mb.ids.shape[1], seed=step + 11)[0] for mb in mbs]  # before any replay action
    for mb, native in zip(mbs, natives, strict=True):
        tokens = [np.arange(LENGTHS[int(s[1:])]) + 100 * int(s[1:]) for s in mb.sample_ids]
        with replay.forward(mb, tokens=tokens):
            run_moe_layers(chunk, mb.ids.shape[1], seed=step + 11, mb=mb)
        for j, router in enumerate(mb.routers):
            rows, differing = expected.get(router.layer_number, (0, 0))
            replayed = np.sort(mb.ids[j], axis=-1)[mb.mask]
            differs = int((native[router.layer_number][mb.mask] != replayed).any(axis=1).sum())
            expected[router.layer_number] = (rows + int(mb.mask.sum()), differing + differs)
    return expected


def test_each_step_counts_the_routers_own_disagreement_per_layer(store_url: str) -> None:
    from routelog.megatron import MegatronReplay

    (chunk,) = build_chunks(megatron_config())
    replay = MegatronReplay([chunk], _plan(), gate=FidelityGate(max_router_diff=None))
    store = routelog.open_store(store_url)
    for step in (0, 1):
        expected = _train_step(replay, chunk, store_url, step)
        counts = replay.end_step()
        assert counts.samples == 3
        assert {layer + 1: (counts.replayed[layer], counts.differing[layer]) for layer in counts.replayed} == expected
        assert all(0 < d <= r for r, d in expected.values()), "random routes: the router mostly picks others"
        write_fidelity(store, step, "train-dp0", counts, trainer_step=10 + step, phase="train")
    (record,) = read_fidelity(store, 1)
    assert (record.trainer_step, record.phase, record.samples) == (11, "train", 3)
    assert record.layers == sorted(layer - 1 for layer in expected)
    over = fidelity_over_steps(store, store.steps())
    assert sorted(over) == [0, 1]
    assert over[1].router_diff() == {layer - 1: d / r for layer, (r, d) in sorted(expected.items())}


def test_ranks_documents_add_up() -> None:
    url = f"memory://fidelity/{uuid.uuid4().hex}"
    with routelog.open_writer(url, 0, model_spec=SPEC):
        pass  # creates the store
    store = routelog.open_store(url)
    for rank, (rows, differing) in enumerate([(100, 10), (300, 60)]):
        counts = StepFidelity(samples=2)
        counts.add(1, rows, differing)
        counts.add(5, rows, 0)
        write_fidelity(store, 0, f"train-dp{rank}", counts)
    write_fidelity(store, 0, "train-dp0", StepFidelity())  # a second document of one rank takes the next number
    records = read_fidelity(store, 0)
    assert [r.name for r in records] == [
        "train-dp0.00000000.json",
        "train-dp0.00000001.json",
        "train-dp1.00000000.json",
    ]
    total = step_fidelity(records)
    assert total.router_diff() == {1: 70 / 400, 5: 0.0}
    assert total.samples == 4


def test_the_gate_stops_training_when_the_router_diff_is_too_high(store_url: str) -> None:
    from routelog.megatron import MegatronReplay

    (chunk,) = build_chunks(megatron_config())
    replay = MegatronReplay([chunk], _plan(), gate=FidelityGate(max_router_diff=0.05))
    _train_step(replay, chunk, store_url, 0)
    with pytest.raises(ReplayFidelityError, match=r"disagrees with the replayed routing on .*% of layer"):
        replay.end_step()
    lenient = MegatronReplay([chunk], _plan(), gate=FidelityGate(max_router_diff=0.05, on_exceed="warn"))
    _train_step(lenient, chunk, store_url, 0)
    with pytest.warns(RuntimeWarning, match="disagrees"):
        lenient.end_step()
    relaxed = MegatronReplay([chunk], _plan(), gate=FidelityGate(max_router_diff=1.0))
    _train_step(relaxed, chunk, store_url, 0)
    relaxed.end_step()


@pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")  # megatron-core's
def test_the_gate_refuses_routing_recorded_for_other_tokens(store_url: str) -> None:
    from routelog.megatron import MegatronReplay

    (chunk,) = build_chunks(megatron_config())
    mb = next(iter(ReplayLoader(store_url, 0, _plan())))
    wrong = [np.arange(LENGTHS[0]), np.arange(LENGTHS[1])]  # s1's tokens start at 100
    strict = MegatronReplay([chunk], _plan(), gate=FidelityGate())
    with pytest.raises(ReplayFidelityError, match="tokens fed hash"), strict.forward(mb, tokens=wrong):
        pass
    monitor = MegatronReplay([chunk], _plan(), gate=FidelityGate(on_token_mismatch="warn", max_router_diff=None))
    with pytest.warns(RuntimeWarning, match="tokens fed hash"), monitor.forward(mb, tokens=wrong):
        run_moe_layers(chunk, mb.ids.shape[1], mb=mb)
    assert monitor.end_step().token_mismatches == 1


def test_a_total_disagreement_fails_even_a_small_step() -> None:
    """The gate's noise floor is statistical: every row differing fails a 20 % gate from three rows on, and a few
    rows that differ by chance do not trip it."""
    gate = FidelityGate(max_router_diff=0.2)

    def counts(rows: int, differing: int) -> StepFidelity:
        out = StepFidelity()
        out.add(3, rows, differing)
        return out

    for rows in (3, 10, 1000):
        with pytest.raises(ReplayFidelityError, match=f"100.0% of layer 3's {rows} rows"):
            gate.check(counts(rows, rows), "step 0")
    gate.check(counts(2, 2), "step 0")  # two rows prove nothing
    gate.check(counts(40, 12), "step 0")  # 30 % of 40 rows: not beyond doubt above 20 %
    with pytest.raises(ReplayFidelityError):
        gate.check(counts(4000, 1200), "step 0")  # 30 % of 4000 rows is
    assert wilson_lower_bound(0, 0, 3.0) == 0.0
    assert wilson_lower_bound(50, 100, 0.0) == 0.5
    assert 0.35 < wilson_lower_bound(50, 100, 3.0) < 0.5


def test_a_fidelity_document_must_be_consistent() -> None:
    base = {"step": 0, "writer_id": "r", "seq": 0, "created_at": utc_now(), "samples": 1, "layers": [1, 2]}
    FidelityRecord(**base, replayed_rows=[5, 5], differing_rows=[1, 0])
    with pytest.raises(ValueError, match="one count per layer"):
        FidelityRecord(**base, replayed_rows=[5], differing_rows=[1])
    with pytest.raises(ValueError, match=r"\[0, replayed_rows\]"):
        FidelityRecord(**base, replayed_rows=[5, 5], differing_rows=[6, 0])


def test_mismatch_shows_the_router_diff_over_training(tmp_path: Path) -> None:
    """``routelog mismatch`` (text, JSON and figure) over steps whose ranks published fidelity, without log-probs."""
    from typer.testing import CliRunner

    from routelog.cli import app

    url = str(tmp_path / "store")
    for step in range(4):
        with routelog.open_writer(url, step, model_spec=SPEC):
            pass
    store = routelog.open_store(url)
    for step in range(4):
        for rank in range(2):
            counts = StepFidelity(samples=8)
            counts.add(1, 1000, 10 * (step + 1) + rank)
            counts.add(5, 1000, 5)
            write_fidelity(store, step, f"train-dp{rank}", counts, trainer_step=100 + step)
    runner = CliRunner()
    text = runner.invoke(app, ["mismatch", url, "--plot", str(tmp_path / "m.png")])
    assert text.exit_code == 0, text.output
    overall = 100 * (40 + 41 + 5 + 5) / 4000
    assert (
        f"step 3: the trainer's routers disagree with the replayed routing on {overall:.2f} % of 4,000" in text.output
    )
    assert "(most: layer 1, 4.05 %)" in text.output
    assert (tmp_path / "m.png").stat().st_size > 10_000
    data = json.loads(runner.invoke(app, ["mismatch", url, "--json"]).output)
    assert [d["step"] for d in data["router_diff"]] == [0, 1, 2, 3]
    assert data["router_diff"][0]["by_layer"] == {"1": 21 / 2000, "5": 0.005}
    assert data["router_diff"][2]["trainer_steps"] == [102]
