"""slime R3 through a store: every rank records exactly what slime's own code records, reading only its own rows.

The fixtures under ``tests/fixtures/slime/`` were captured from slime's real code at THUDM/slime commit 624b824a
by ``tools/make_slime_fixtures.py``: slime's ``build_dp_schedule`` split a rollout over DP ranks and micro-batches,
and for every (DP, TP, CP, PP) rank slime's real ``MegatronTrainRayActor.fill_routing_replay`` (with
``prepare_routed_experts_for_routing_replay`` and ``slice_with_cp``, ``mpu`` set to that rank, megatron-core's own
layer split) recorded its tensors into slime's ``RoutingReplay``; each fixture stores the rollout and every tensor
recorded. Here the same rollout goes through :func:`write_samples`, :class:`SlimeReplay` records its lazy references,
and what they materialize when slime pops them must be, for every rank, the same tensors (values, int32, shape,
router and micro-batch order), padding rows included. slime is not installable, so its row placement is
:func:`routelog.testing.slime_prepare`; these comparisons are what proves that stand-in equal to slime's code.
"""

from __future__ import annotations

import json
import sys
import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import routelog
from routelog import AlignmentError, DuplicateSampleError, IngestError, ModelSpecError, ReplayConfigError
from routelog.align import RankCoords
from routelog.format.part import PartOptions
from routelog.integrations import slime
from routelog.integrations.slime import SlimeReplay
from routelog.integrations.slime_source import RolloutSource
from routelog.store.fidelity import ReplayFidelityError, StaleRoutingError
from routelog.testing import SlimeRoutingReplay, slime_prepare

torch = pytest.importorskip("torch")

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "slime"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.npz"))
ROLLOUT = 7


class StubReplay:
    """slime's ``RoutingReplay`` as ``fill_routing_replay`` uses it: ``record`` appends one entry per micro-batch
    (slime keeps an object with ``materialize_for_routing_replay`` as is)."""

    def __init__(self) -> None:
        self.top_indices_list: list[Any] = []

    def record(self, top_indices: Any) -> None:
        assert hasattr(top_indices, "materialize_for_routing_replay"), "routelog records lazy references"
        self.top_indices_list.append(top_indices)


def popped(replays: list[StubReplay], stage: str = "forward") -> list[list[Any]]:
    """Per router, per micro-batch: the tensors slime's routers get when they pop, in slime's order (micro-batch by
    micro-batch, each router once)."""
    count = len(replays[0].top_indices_list) if replays else 0
    out: list[list[Any]] = [[] for _ in replays]
    for m in range(count):
        for r, replay in enumerate(replays):
            out[r].append(replay.top_indices_list[m].materialize_for_routing_replay(stage))
    return out


def prepare_of(fixture: Fixture | Any, rank: RankCoords) -> Any:
    """The stand-in for slime's row placement on ``rank`` of the fixture's (or args') parallel sizes."""
    c = (
        fixture.config
        if isinstance(fixture, Fixture)
        else {
            "tp": fixture.tensor_model_parallel_size,
            "cp": fixture.context_parallel_size,
        }
    )
    return slime_prepare(tp_rank=rank.tp, tp_size=c["tp"], cp_rank=rank.cp, cp_size=c["cp"])


def replay_of(fixture: Fixture, url: str, rank: RankCoords, **options: Any) -> SlimeReplay:
    return SlimeReplay(url, rank=rank, prepare=prepare_of(fixture, rank), **options)


@dataclass
class Fixture:
    name: str
    meta: dict[str, Any]
    arrays: Any

    @property
    def config(self) -> dict[str, Any]:
        return self.meta["config"]  # type: ignore[no-any-return]

    def samples(self) -> list[SimpleNamespace]:
        """The rollout as slime's SGLang path leaves it (``Sample``-like objects)."""
        out = []
        for i, index in enumerate(self.arrays["sample_index"]):
            out.append(
                SimpleNamespace(
                    tokens=self.arrays[f"tokens__{i}"].tolist(),
                    response_length=int(self.arrays["response_length"][i]),
                    rollout_routed_experts=torch.as_tensor(self.arrays[f"experts__{i}"]),
                    index=int(index),
                    group_index=int(index) // 2,
                    metadata={},
                )
            )
        return out

    def args(self) -> SimpleNamespace:
        """slime's (Megatron) arguments of the configuration."""
        c = self.config
        return SimpleNamespace(
            num_layers=c["num_layers"],
            num_experts=c["num_experts"],
            moe_router_topk=c["topk"],
            moe_layer_freq=c["moe_layer_freq"],
            tensor_model_parallel_size=c["tp"],
            context_parallel_size=c["cp"],
            pipeline_model_parallel_size=c["pp"],
            virtual_pipeline_model_parallel_size=c["vpp"],
            decoder_first_pipeline_num_layers=c["num_layers_in_first_pipeline_stage"],
            sequence_parallel=c["sequence_parallel"],
            allgather_cp=c["allgather_cp"],
            data_pad_size_multiplier=c["data_pad_size_multiplier"],
        )

    def rollout_data(self, dp: int) -> dict[str, Any]:
        """DP rank ``dp``'s ``rollout_data`` as slime ships it with routelog: no ``rollout_routed_experts``."""
        partition = self.meta["partitions"][dp]
        return {
            "partition": partition,
            "tokens": [torch.as_tensor(self.arrays[f"tokens__{j}"]) for j in partition],
            "sample_indices": [int(self.arrays["sample_index"][j]) for j in partition],
            "micro_batch_indices": self.meta["micro_batch_indices"][dp],
            "num_microbatches": self.meta["num_microbatches"],
        }

    def ranks(self) -> Iterator[tuple[int, RankCoords]]:
        c = self.config
        for d in range(c["dp"]):
            for t in range(c["tp"]):
                for cp in range(c["cp"]):
                    for p in range(c["pp"]):
                        yield d, RankCoords(tp=t, cp=cp, pp=p)

    def expected(self, dp: int, rank: RankCoords) -> list[list[np.ndarray]]:
        """What slime's code recorded on that rank: per router, per micro-batch."""
        key = f"dp{dp}_tp{rank.tp}_cp{rank.cp}_pp{rank.pp}"
        routers = self.meta["routers"][key]
        return [
            [self.arrays[f"out__{key}__r{r}_m{m}"] for m in range(sum(self.meta["num_microbatches"]))]
            for r in range(routers)
        ]


def load(name: str) -> Fixture:
    arrays = np.load(FIXTURES / f"{name}.npz", allow_pickle=False)
    return Fixture(name, json.loads(str(arrays["meta"])), arrays)


def written(fixture: Fixture) -> str:
    """A fresh store holding the fixture's rollout as step ``ROLLOUT``, written by the rollout side."""
    url = f"memory://slime/{fixture.name}/{uuid.uuid4().hex}"
    ids = slime.write_samples(url, ROLLOUT, fixture.samples(), spec=slime.spec_from_args(fixture.args()))
    assert ids == [f"{ROLLOUT}/{i}" for i in range(len(fixture.arrays["sample_index"]))]
    return url


def assert_recorded(
    replays: list[StubReplay], expected: list[list[np.ndarray]], where: str, stage: str = "forward"
) -> None:
    assert len(replays) == len(expected), where
    for r, (replay, want) in enumerate(zip(replays, expected, strict=True)):
        assert len(replay.top_indices_list) == len(want), f"{where} router {r}"
    assert_tensors(popped(replays, stage), expected, where)


def assert_tensors(tensors: list[list[Any]], expected: list[list[np.ndarray]], where: str) -> None:
    """Per router, per micro-batch: the tensors slime's routers got are the ones slime's code recorded."""
    assert len(tensors) == len(expected), where
    for r, (got_r, want) in enumerate(zip(tensors, expected, strict=True)):
        assert len(got_r) == len(want), f"{where} router {r}"
        for m, (got, ref) in enumerate(zip(got_r, want, strict=True)):
            assert got.dtype == torch.int32 and got.device.type == "cpu" and got.is_contiguous(), (where, r, m)
            np.testing.assert_array_equal(got.numpy(), ref, err_msg=f"{where} router {r} micro-batch {m}")


def test_fixtures_are_the_ones_captured_from_slime() -> None:
    captured = {
        "cp2_zigzag",
        "pp2_vpp2_cp2",
        "pp3_uneven_freq2",
        "tp2_cp2_allgather",
        "tp2_cp2_zigzag",
        "tp2_default_mult",
        "tp2_sp",
    }
    assert set(NAMES) == captured
    for name in NAMES:
        meta = load(name).meta
        assert meta["slime_commit"] == "624b824a898ab0ec1fcb4d373004c7f3852bf515"
        assert set(meta["sources_sha256"]) >= {
            "slime/backends/megatron_utils/actor.py",
            "slime/backends/megatron_utils/cp_utils.py",
        }


@pytest.mark.parametrize("name", NAMES)
def test_every_rank_records_exactly_what_slime_records(name: str) -> None:
    """TP/SP, zigzag CP, --allgather-cp, PP with virtual and uneven stages, dense layers (list and int
    moe_layer_freq), several micro-batches per DP rank in slime's order, both padding multipliers."""
    fixture = load(name)
    url = written(fixture)
    args = fixture.args()
    for dp, rank in fixture.ranks():
        replay = replay_of(fixture, url, rank, prefetch=dp)  # no read-ahead, and one micro-batch ahead
        replays = [StubReplay() for _ in fixture.expected(dp, rank)]
        data = fixture.rollout_data(dp)
        report = replay.record(ROLLOUT, args, data, replays, num_microbatches=data["num_microbatches"])
        assert_recorded(replays, fixture.expected(dp, rank), f"{name} dp{dp} {rank}")
        assert report.micro_batches == sum(fixture.meta["num_microbatches"])
        source = replay.source
        assert source is not None and source.builds == report.micro_batches  # each built once, kept for backward
        assert source.host_bytes == sum(4 * e.size for want in fixture.expected(dp, rank) for e in want)
        assert_recorded(replays, fixture.expected(dp, rank), f"{name} dp{dp} {rank} backward", "backward")
        assert source.host_bytes == 0 and source.builds == report.micro_batches  # released after the backward pops
        replay.close()


def test_a_token_sglang_never_routed_gets_distinct_placeholder_experts() -> None:
    """The one documented difference: slime would replay SGLang's all-zero row (expert 0, K times); the record
    marks it missing and the rank replays distinct valid experts there. Every other row is slime's."""
    fixture = load("cp2_zigzag")
    samples = fixture.samples()
    routes = samples[0].rollout_routed_experts.clone()
    routes[2] = 0  # token 2 of sample 0: never captured
    samples[0].rollout_routed_experts = routes
    url = f"memory://slime/zero/{uuid.uuid4().hex}"
    slime.write_samples(url, ROLLOUT, samples, spec=slime.spec_from_args(fixture.args()))
    assert not routelog.open_store(url).step(ROLLOUT).read(f"{ROLLOUT}/0").valid[2]
    dp = next(d for d, part in enumerate(fixture.meta["partitions"]) if 0 in part)
    rank = RankCoords(cp=0)  # zigzag: chunk 0 of sample 0 holds token 2
    replays = [StubReplay() for _ in fixture.expected(dp, rank)]
    replay_of(fixture, url, rank).record(ROLLOUT, fixture.args(), fixture.rollout_data(dp), replays)
    differing = 0
    for tensors, want in zip(popped(replays), fixture.expected(dp, rank), strict=True):
        for got, ref in zip(tensors, want, strict=True):
            rows = np.flatnonzero((got.numpy() != ref).any(axis=1))
            differing += rows.size
            for row in rows:
                ids = got.numpy()[row]
                assert len(set(ids.tolist())) == ids.size and ids.min() >= 0, ids
    assert differing == len(replays)  # one row per router: token 2 of sample 0


@pytest.fixture
def megatron_chunks() -> Any:
    pytest.importorskip("megatron.core")
    from megatron.core.transformer import TransformerConfig

    def build(fixture: Fixture) -> list[Any]:
        c = fixture.config
        config = TransformerConfig(
            num_layers=c["num_layers"],
            hidden_size=32,
            num_attention_heads=4,
            num_moe_experts=c["num_experts"],
            moe_router_topk=c["topk"],
            moe_layer_freq=c["moe_layer_freq"],
            pipeline_model_parallel_size=c["pp"],
            virtual_pipeline_model_parallel_size=c["vpp"],
            num_layers_in_first_pipeline_stage=c["num_layers_in_first_pipeline_stage"],
            pipeline_dtype=torch.float32,
        )
        # slime's self.model: DDP-wrapped chunks whose .module.config is the TransformerConfig
        return [SimpleNamespace(module=SimpleNamespace(config=config)) for _ in range(c["vpp"] or 1)]

    return build


@pytest.fixture
def fake_slime(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """``slime.utils.routing_replay`` (``RoutingReplay.all_routing_replays`` and its lazy-resource registry), slime's
    row placement (``cp_utils``, :func:`routelog.testing.slime_prepare` on the current rank) and ``mpu``'s rank
    getters, as a training process sees them."""
    routing_replay = types.ModuleType("slime.utils.routing_replay")
    registry = SimpleNamespace(all_routing_replays=[], lazy_resources=[])
    registry.register_lazy_resource = registry.lazy_resources.append
    routing_replay.RoutingReplay = registry  # type: ignore[attr-defined]
    ranks = SimpleNamespace(tp=0, cp=0, pp=0, tp_size=1, cp_size=1)
    cp_utils = types.ModuleType("slime.backends.megatron_utils.cp_utils")

    def prepare_routed_experts_for_routing_replay(*args: Any, **kwargs: Any) -> Any:
        place = slime_prepare(tp_rank=ranks.tp, tp_size=ranks.tp_size, cp_rank=ranks.cp, cp_size=ranks.cp_size)
        return place(*args, **kwargs)

    cp_utils.prepare_routed_experts_for_routing_replay = prepare_routed_experts_for_routing_replay  # type: ignore[attr-defined]
    for name, module in (
        ("slime", types.ModuleType("slime")),
        ("slime.utils", types.ModuleType("slime.utils")),
        ("slime.utils.routing_replay", routing_replay),
        ("slime.backends", types.ModuleType("slime.backends")),
        ("slime.backends.megatron_utils", types.ModuleType("slime.backends.megatron_utils")),
        ("slime.backends.megatron_utils.cp_utils", cp_utils),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: ranks.tp)
    monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: ranks.cp)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: ranks.pp)
    return SimpleNamespace(registry=registry, ranks=ranks)


class DataIterator:
    """slime's ``DataIterator`` (``megatron_utils/data.py``): an offset over ``micro_batch_indices``."""

    def __init__(self, rollout_data: dict[str, Any], micro_batch_indices: list[list[int]]) -> None:
        self.rollout_data, self.micro_batch_indices, self.offset = rollout_data, micro_batch_indices, 0

    def get_next(self, keys: list[str]) -> dict[str, Any]:
        indices = self.micro_batch_indices[self.offset]
        self.offset += 1
        return {k: [self.rollout_data[k][i] for i in indices] for k in keys}

    def reset(self) -> DataIterator:
        self.offset = 0
        return self


def registry() -> Any:
    return sys.modules["slime.utils.routing_replay"].RoutingReplay


class Actor:
    """The parts of slime's ``MegatronTrainRayActor`` its R3 path touches: ``train`` calls ``train_actor``, which
    calls ``fill_routing_replay``, runs the log-prob pass (``replay_forward``: every router pops each micro-batch)
    and the training pass (``replay_backward``), then ``RoutingReplay.clear_all`` (which closes the lazy
    resources)."""

    def __init__(self, args: Any, model: list[Any]) -> None:
        self.args, self.model = args, model
        self.popped: dict[str, list[list[Any]]] = {}

    def train(self, rollout_id: int, rollout_data: dict[str, Any]) -> None:
        self.train_actor(rollout_id, rollout_data)

    def train_actor(self, rollout_id: int, rollout_data: dict[str, Any]) -> None:
        iterators = [DataIterator(rollout_data, rollout_data["micro_batch_indices"]) for _ in self.model]
        if self.args.use_rollout_routing_replay:
            self.fill_routing_replay(iterators, rollout_data["num_microbatches"], rollout_data)
        assert all(it.offset == 0 for it in iterators)
        self.passes(sum(rollout_data["num_microbatches"]))
        for resource in registry().lazy_resources:  # slime's RoutingReplay.clear_all
            resource.close()
        registry().lazy_resources.clear()

    def passes(self, micro_batches: int) -> None:
        replays = registry().all_routing_replays
        for stage in ("forward", "backward"):
            self.popped[stage] = [[] for _ in replays]
            for _ in range(micro_batches):
                for r, replay in enumerate(replays):
                    self.popped[stage][r].append(getattr(replay, f"pop_{stage}")())

    def fill_routing_replay(self, data_iterator: Any, num_microbatches: Any, rollout_data: Any) -> None:
        raise AssertionError("slime's own fill_routing_replay needs rollout_routed_experts")


@pytest.mark.parametrize("name", ["pp2_vpp2_cp2", "pp3_uneven_freq2", "tp2_cp2_allgather"])
def test_the_patched_actor_replays_from_megatrons_ranks_and_layer_split(
    name: str, megatron_chunks: Any, fake_slime: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``install`` as ``--custom-megatron-init-path`` calls it: the rollout id comes from ``train_actor``, ranks
    from megatron's ``parallel_state``, layers from megatron-core's split of the actor's own chunks, the rows'
    places from slime's ``cp_utils``; the lazy resource is registered with slime and closed by its ``clear_all``."""
    fixture = load(name)
    url = written(fixture)
    monkeypatch.setenv(slime.URL_ENV, url)

    class MegatronTrainRayActor(Actor):
        pass

    args = fixture.args()
    args.use_rollout_routing_replay = True
    replay = slime.install(args, actor_class=MegatronTrainRayActor)
    assert MegatronTrainRayActor.fill_routing_replay is not Actor.fill_routing_replay
    actor = MegatronTrainRayActor(args, megatron_chunks(fixture))
    fake_slime.ranks.tp_size, fake_slime.ranks.cp_size = fixture.config["tp"], fixture.config["cp"]
    for dp, rank in fixture.ranks():
        fake_slime.ranks.tp, fake_slime.ranks.cp, fake_slime.ranks.pp = rank.tp, rank.cp, rank.pp
        expected = fixture.expected(dp, rank)
        fake_slime.registry.all_routing_replays = [SlimeRoutingReplay() for _ in expected]
        data = fixture.rollout_data(dp)
        data["rollout_routed_experts"] = ["left by a custom convert function"]
        actor.train(ROLLOUT, data)
        assert "rollout_routed_experts" not in data  # deleted after filling, as slime does
        for stage in ("forward", "backward"):
            assert_tensors(actor.popped[stage], expected, f"{name} dp{dp} {rank} {stage}")
        assert replay.last_report is not None and replay.last_report.routers == len(expected)
        assert replay.source is None  # the rollout ended
        with pytest.raises(ReplayConfigError, match="after the rollout's routing was closed"):
            fake_slime.registry.all_routing_replays[0].top_indices_list[0].materialize_for_routing_replay("forward")
    assert getattr(actor, "_routelog_rollout_id", None) is None
    with pytest.raises(ReplayConfigError, match="outside train_actor"):
        actor.fill_routing_replay([], [1], fixture.rollout_data(0))
    args.use_rollout_routing_replay = False
    with pytest.raises(ReplayConfigError, match="--use-rollout-routing-replay is off"):
        actor.train(ROLLOUT, fixture.rollout_data(0))


def slime_compute_topk_factory(module: types.ModuleType) -> Any:
    """slime's ``get_routing_replay_compute_topk`` (``slime/utils/routing_replay.py``), reduced to the stages
    used here: ``replay_forward`` / ``replay_backward`` pop the current router's next micro-batch and gather its
    probabilities."""

    def get_routing_replay_compute_topk(old_compute_topk: Any) -> Any:
        def compute_topk(scores: Any, topk: int, num_groups: Any = None, group_topk: Any = None) -> Any:
            import os

            stage = os.environ.get("ROUTING_REPLAY_STAGE")
            if stage in ("replay_forward", "replay_backward"):
                replay = module.ROUTING_REPLAY
                top_indices = replay.pop_forward() if stage == "replay_forward" else replay.pop_backward()
                assert top_indices.shape == (scores.shape[0], topk)
                return scores.gather(1, top_indices.long()), top_indices
            return old_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)

        return compute_topk

    return get_routing_replay_compute_topk


@pytest.mark.parametrize("stages", [("replay_forward", "replay_backward"), ("replay_backward",)])
def test_the_router_diff_is_measured_judged_and_published(
    stages: tuple[str, ...], fake_slime: types.SimpleNamespace, megatron_chunks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a gate and a fidelity writer, each replaying ``compute_topk`` also runs the router's own top-k: rows
    where it disagrees count (padding and final tokens never do), once per router and micro-batch whether slime
    runs its log-prob pass or reuses the training pass's; the gate judges the rollout after ``train_actor``, and
    before each optimizer step within it, so a failing rollout updates no weight; and each rank publishes its
    counts."""
    from routelog.store.fidelity import FidelityGate, ReplayFidelityError, read_fidelity

    fixture = load("tp2_sp")
    url = written(fixture)
    module = sys.modules["slime.utils.routing_replay"]
    module.get_routing_replay_compute_topk = slime_compute_topk_factory(module)  # type: ignore[attr-defined]
    original_factory = module.get_routing_replay_compute_topk  # type: ignore[attr-defined]
    topk, experts = fixture.config["topk"], fixture.config["num_experts"]
    fake_slime.ranks.tp_size = 2
    expected = {tp: fixture.expected(0, RankCoords(tp=tp)) for tp in range(2)}

    def native(scores: Any, k: int, num_groups: Any = None, group_topk: Any = None) -> Any:
        return torch.topk(scores, k, dim=1)

    class MegatronTrainRayActor(Actor):
        def passes(self, micro_batches: int) -> None:
            # each pass: every router of every micro-batch, in slime's order
            want = expected[fake_slime.ranks.tp]
            for stage in stages:
                monkeypatch.setenv("ROUTING_REPLAY_STAGE", stage)
                for m in range(micro_batches):
                    for r, replay in enumerate(registry().all_routing_replays):
                        target = torch.as_tensor(want[r][m]).long()
                        scores = torch.rand(target.shape[0], experts)
                        scores.scatter_(1, target, 2.0)  # the router agrees with the replayed set...
                        scores[::4] = torch.rand(target[::4].shape[0], experts)  # ...except on every 4th row
                        scores[::4].scatter_(1, target[::4], -1.0)
                        module.ROUTING_REPLAY = replay  # type: ignore[attr-defined]
                        compute_topk = module.get_routing_replay_compute_topk(native)  # type: ignore[attr-defined]
                        _, chosen = compute_topk(scores, topk)
                        assert torch.equal(chosen.long(), target)  # replay itself is untouched
            self.optimizer.step()  # slime's train_one_step, after the training forward and backward

    class Optimizer:
        def __init__(self) -> None:
            self.updates = 0

        def step(self) -> tuple[bool, float, int]:
            self.updates += 1
            return True, 1.0, 0

    args = fixture.args()
    args.use_rollout_routing_replay = True
    gate = FidelityGate(max_router_diff=0.5)
    replay = slime.install(args, url=url, actor_class=MegatronTrainRayActor, gate=gate, fidelity_writer="train")
    actor = MegatronTrainRayActor(args, megatron_chunks(fixture))
    actor.optimizer = Optimizer()  # type: ignore[attr-defined]
    for tp in range(2):
        fake_slime.ranks.tp = tp
        fake_slime.registry.all_routing_replays = [SlimeRoutingReplay() for _ in range(6)]
        actor.train(ROLLOUT, fixture.rollout_data(0))
    records = read_fidelity(routelog.open_store(url), ROLLOUT)
    assert sorted(r.writer_id for r in records) == ["train-r0", "train-r0"]  # one process here: global rank 0
    total = routelog.store.fidelity.step_fidelity(records)
    routed = sum(len(fixture.arrays[f"tokens__{j}"]) - 1 for j in fixture.meta["partitions"][0])
    assert set(total.replayed.values()) == {routed}  # every routed token once per router, over both TP ranks
    diff = total.router_diff()
    assert all(0.15 < d < 0.35 for d in diff.values()), diff  # about every 4th row
    assert replay.meter is None  # ended with the rollout
    replay.gate = FidelityGate(max_router_diff=0.1)
    fake_slime.registry.all_routing_replays = [SlimeRoutingReplay() for _ in range(6)]
    assert actor.optimizer.updates == 2  # type: ignore[attr-defined]
    with pytest.raises(ReplayFidelityError, match="rollout 7"):
        actor.train(ROLLOUT, fixture.rollout_data(0))
    assert actor.optimizer.updates == 2, "judged before the optimizer step: no update"  # type: ignore[attr-defined]
    assert "step" not in vars(actor.optimizer), "the optimizer's own step is back"  # type: ignore[attr-defined]
    assert replay.source is None or replay.source.closed  # a failed rollout releases its routing too
    slime.patch(MegatronTrainRayActor, replay)()  # undo restores slime's factory
    assert module.get_routing_replay_compute_topk is original_factory  # type: ignore[attr-defined]


def test_a_replay_that_no_router_takes_or_cannot_measure_fails(
    fake_slime: types.SimpleNamespace, megatron_chunks: Any
) -> None:
    """Never silently inert: the routes are recorded into slime's RoutingReplay and no replaying forward pops them
    (slime's switch off in its forward), so the rollout fails before its optimizer step, gate or no gate; and
    without slime's compute_topk factory (its API drifted) a gate cannot measure anything, so installing it fails,
    naming the API; without slime's lazy-resource API or its row placement, the fill fails, naming them."""
    from routelog.store.fidelity import FidelityGate, ReplayFidelityError

    fixture = load("tp2_sp")
    url = written(fixture)
    module = sys.modules["slime.utils.routing_replay"]
    args = fixture.args()
    args.use_rollout_routing_replay = True
    fake_slime.ranks.tp_size = 2

    class NoFactory(Actor):
        pass

    with pytest.raises(ReplayConfigError, match="no get_routing_replay_compute_topk"):
        slime.install(args, url=url, actor_class=NoFactory, gate=FidelityGate(max_router_diff=0.5))
    module.get_routing_replay_compute_topk = slime_compute_topk_factory(module)  # type: ignore[attr-defined]

    class Optimizer:
        updates = 0

        def step(self) -> None:
            Optimizer.updates += 1

    class MegatronTrainRayActor(Actor):
        def passes(self, micro_batches: int) -> None:
            self.optimizer.step()  # trains without ever reaching the replaying compute_topk

    for gate in (FidelityGate(max_router_diff=0.5), None):
        replay = slime.install(args, url=url, actor_class=MegatronTrainRayActor, gate=gate)
        actor = MegatronTrainRayActor(args, megatron_chunks(fixture))
        actor.optimizer = Optimizer()  # type: ignore[attr-defined]
        fake_slime.registry.all_routing_replays = [SlimeRoutingReplay() for _ in range(6)]
        with pytest.raises(ReplayFidelityError, match=r"rollout 7: routes of \d+ micro-batches .* inert"):
            actor.train(ROLLOUT, fixture.rollout_data(0))
        assert Optimizer.updates == 0
        slime.patch(MegatronTrainRayActor, replay)()

    class Plain(Actor):
        pass

    replay = slime.install(args, url=url, actor_class=Plain)
    actor = Plain(args, megatron_chunks(fixture))
    fake_slime.registry.all_routing_replays = [SlimeRoutingReplay() for _ in range(6)]
    cp_utils = sys.modules["slime.backends.megatron_utils.cp_utils"]
    place = cp_utils.prepare_routed_experts_for_routing_replay  # type: ignore[attr-defined]
    del cp_utils.prepare_routed_experts_for_routing_replay  # type: ignore[attr-defined]
    with pytest.raises(ReplayConfigError, match="no prepare_routed_experts_for_routing_replay"):
        actor.train(ROLLOUT, fixture.rollout_data(0))

    def shifted(*a: Any, **kw: Any) -> Any:
        return place(*a, **{**kw, "num_experts": kw["num_experts"] - 1})  # a slime whose pad routes changed

    cp_utils.prepare_routed_experts_for_routing_replay = shifted  # type: ignore[attr-defined]
    with pytest.raises(ReplayConfigError, match="slime's padding changed"):
        actor.train(ROLLOUT, fixture.rollout_data(0))
    cp_utils.prepare_routed_experts_for_routing_replay = place  # type: ignore[attr-defined]
    del fake_slime.registry.register_lazy_resource
    with pytest.raises(ReplayConfigError, match="no register_lazy_resource"):
        actor.train(ROLLOUT, fixture.rollout_data(0))
    slime.patch(Plain, replay)()


def test_patch_is_idempotent_and_undone(tmp_path: Path) -> None:
    class MegatronTrainRayActor(Actor):
        pass

    first = SlimeReplay(str(tmp_path / "a"))
    second = SlimeReplay(str(tmp_path / "b"))
    undo = slime.patch(MegatronTrainRayActor, first)
    patched_fill, patched_train_actor = MegatronTrainRayActor.fill_routing_replay, MegatronTrainRayActor.train_actor
    assert slime.patch(MegatronTrainRayActor, second) is undo
    assert MegatronTrainRayActor.train_actor is patched_train_actor  # not wrapped twice
    assert MegatronTrainRayActor.fill_routing_replay is patched_fill
    undo()
    assert MegatronTrainRayActor.fill_routing_replay is Actor.fill_routing_replay
    assert MegatronTrainRayActor.train_actor is Actor.train_actor
    assert "fill_routing_replay" not in MegatronTrainRayActor.__dict__


def test_a_rank_reads_only_its_own_rows_and_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """slime ships every TP x CP x PP rank the whole DP-local payload (all layers, int32); a routelog rank reads
    its micro-batches' records and its stage's layers only. Bytes are counted at the storage's ranged reads."""

    rng = np.random.default_rng(3)
    layers, experts, topk = 8, 64, 4
    freq = [0, 1, 1, 1, 1, 1, 1, 1]
    args = SimpleNamespace(
        num_layers=layers,
        num_experts=experts,
        moe_router_topk=topk,
        moe_layer_freq=freq,
        tensor_model_parallel_size=2,
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        sequence_parallel=True,
        allgather_cp=False,
        data_pad_size_multiplier=128,
    )
    samples = []
    for _ in range(16):
        n = int(rng.integers(1500, 2500))
        routes = np.zeros((n - 1, layers, topk), np.int32)
        routes[:, 1:] = np.argsort(rng.random((n - 1, layers - 1, experts)), axis=-1)[..., :topk]
        samples.append(
            SimpleNamespace(
                tokens=rng.integers(0, 50_000, n).tolist(), response_length=n // 2, rollout_routed_experts=routes
            )
        )
    url = f"memory://slime/bytes/{uuid.uuid4().hex}"
    # Inner chunks of 512 rows and 1 layer: each record spans several, as 4k-64k-token responses span the
    # default 4096-row chunks.
    options = PartOptions(topk_order="score", chunk_rows=512, chunk_layers=1)
    slime.write_samples(url, ROLLOUT, samples, spec=slime.spec_from_args(args), options=options)
    partitions = [list(range(0, 16, 2)), list(range(1, 16, 2))]  # DP = 2
    store = routelog.open_store(url)
    storage = store.storage
    read_ranges = storage.read_ranges
    fetched: list[int] = []

    def counting(ranges: list[tuple[str, int, int]], *into: memoryview) -> list[Any]:
        fetched.extend(stop - start for _, start, stop in ranges)
        return read_ranges(ranges, *into)

    monkeypatch.setattr(storage, "read_ranges", counting)  # the loader reads a rank's chunks only (no gap merging)
    read_when_started: list[int] = []  # what record had read when it started the read-ahead (its last step)
    start = RolloutSource.start

    def started(source: RolloutSource) -> None:
        read_when_started.append(len(fetched))
        start(source)

    monkeypatch.setattr(RolloutSource, "start", started)
    data = {
        "partition": partitions[0],
        "tokens": [torch.as_tensor(samples[j].tokens) for j in partitions[0]],
        "micro_batch_indices": [[0, 1], [2, 3], [4, 5], [6, 7]],
    }
    payload = sum(samples[j].rollout_routed_experts.nbytes for j in partitions[0])  # what slime ships each rank
    per_rank = {}
    for pp in range(2):
        fetched.clear()
        replays = [StubReplay() for _ in range(3 if pp == 0 else 4)]  # layer 0 is dense
        rank = RankCoords(tp=1, cp=1, pp=pp)
        report = SlimeReplay(store, rank=rank, prepare=prepare_of(args, rank)).record(ROLLOUT, args, data, replays)
        # record reads no routing: the first read is the read-ahead's (which starts as record returns) or a pop's
        assert read_when_started == [0]
        read_when_started.clear()
        recorded = sum(t.nbytes for tensors in popped(replays) for t in tensors)
        per_rank[pp] = sum(fetched)
        assert report.routers == len(replays) and report.micro_batches == 4
        assert recorded < payload / 4  # its CP half, its SP half, its stage's layers
    stored = sum(o.size for c in store.step(ROLLOUT).commits for o in c.objects if "/c/" in o.key)
    print(f"slime ships {payload} B to every rank; routelog ranks read {per_rank} B of {stored} B stored")
    for pp, read in per_rank.items():
        assert read < payload / 15, (pp, read, payload)  # compressed, this DP rank's records, this stage's layers
        assert read < 0.2 * stored, (pp, read, stored)  # half the records, under half the layers


def test_rollout_function_writes_the_routing_and_strips_it(tmp_path: Path) -> None:
    fixture = load("tp2_cp2_zigzag")  # agentic siblings share Sample.index: the ids are positions
    args = fixture.args()
    nested = [fixture.samples()[i : i + 4] for i in range(0, 12, 4)]
    calls: list[bool] = []

    def inner(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
        calls.append(evaluation)
        return SimpleNamespace(samples=nested, metrics={"n": 1})

    url = str(tmp_path / "store")
    generate = slime.wrap_rollout_function(inner, url)
    output = generate(args, ROLLOUT, None)
    flat = [s for group in output.samples for s in group]
    assert all(s.rollout_routed_experts is None for s in flat)
    assert [s.metadata[slime.SAMPLE_ID_KEY] for s in flat] == [f"{ROLLOUT}/{i}" for i in range(12)]
    snapshot = routelog.open_store(url).step(ROLLOUT)
    spec = snapshot.store.model_spec
    for i in range(12):
        routing = snapshot.read(f"{ROLLOUT}/{i}")
        experts = fixture.arrays[f"experts__{i}"]
        assert routing.expert_ids.shape[0] == experts.shape[0] + 1
        # SGLang's order is kept (score order), dense layers dropped, the final token has no route
        np.testing.assert_array_equal(routing.expert_ids[:-1], experts[:, list(spec.moe_layers)])
        assert not routing.valid[-1]
    assert generate(args, ROLLOUT, None, evaluation=True).samples is nested  # evaluation passes through
    assert calls == [False, True]


def test_generate_rollout_reads_the_store_and_inner_function_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "store")
    monkeypatch.setenv(slime.URL_ENV, url)
    monkeypatch.setenv(slime.ROLLOUT_FUNCTION_ENV, f"{__name__}._legacy_rollout")
    samples = slime.generate_rollout(load("tp2_sp").args(), 3, None)
    assert all(s.rollout_routed_experts is None for s in samples)
    assert routelog.open_store(url).step(3).sample_ids == [f"3/{i}" for i in range(12)]
    monkeypatch.delenv(slime.URL_ENV)
    with pytest.raises(ReplayConfigError, match=slime.URL_ENV):
        slime.generate_rollout(load("tp2_sp").args(), 3, None)


def _legacy_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """A legacy rollout function: returns the samples themselves."""
    return load("tp2_sp").samples()


def test_a_regenerated_rollout_replaces_the_stale_records(tmp_path: Path) -> None:
    """After a restart slime generates rollout k again: same ids, other tokens."""
    fixture = load("tp2_sp")
    url = str(tmp_path / "store")
    spec = slime.spec_from_args(fixture.args())
    first = fixture.samples()
    slime.write_samples(url, ROLLOUT, first, spec=spec)
    again = fixture.samples()
    again[2].tokens = [t + 1 for t in again[2].tokens]
    with pytest.raises(DuplicateSampleError, match="other tokens"):
        slime.write_samples(url, ROLLOUT, again, on_conflict="error")
    slime.write_samples(url, ROLLOUT, again)
    snapshot = routelog.open_store(url).step(ROLLOUT)
    assert snapshot.info(f"{ROLLOUT}/2").token_hash == routelog.token_hash(np.asarray(again[2].tokens))
    assert len(snapshot) == 12
    assert slime.write_samples(url, ROLLOUT, again) == [f"{ROLLOUT}/{i}" for i in range(12)]  # a re-send: no-op


def test_strip_routing_of_train_data_and_samples() -> None:
    samples = load("tp2_sp").samples()
    samples[0].metadata = None
    assert slime.strip_routing(samples, [f"x/{i}" for i in range(12)]) == 12
    assert samples[0].metadata is None and samples[1].metadata == {slime.SAMPLE_ID_KEY: "x/1"}
    train_data = {"tokens": [[1, 2]], "rollout_routed_experts": [np.zeros((1, 8, 2), np.int32)]}
    assert slime.strip_routing(train_data) == 1 and "rollout_routed_experts" not in train_data
    assert slime.strip_routing(train_data) == 0


def test_failures_name_the_sample_and_the_fix(tmp_path: Path) -> None:
    fixture = load("tp2_sp")
    url = written(fixture)
    args = fixture.args()
    rank = RankCoords()
    data = fixture.rollout_data(0)

    def record(data: dict[str, Any], replays: int = 6, **kw: Any) -> None:
        replay = replay_of(fixture, url, rank, **kw)
        replay.record(ROLLOUT, args, data, [StubReplay() for _ in range(replays)])
        replay.close()

    with pytest.raises(AlignmentError, match=r"no routing for samples \['8/0'.*generate_rollout"):
        replay_of(fixture, url, rank).record(8, args, data, [StubReplay() for _ in range(6)])
    with pytest.raises(ReplayConfigError, match=r"7 RoutingReplay instances.*MTP"):
        record(data, replays=7)
    shorter = {**data, "tokens": [t[:-1] for t in data["tokens"]]}
    with pytest.raises(AlignmentError, match=r"sample '7/\d+': the trainer feeds \d+ tokens, its routing was"):
        record(shorter)
    other = {**data, "tokens": [t + 1 for t in data["tokens"]]}
    with pytest.raises(
        ReplayFidelityError, match=r"sample '7/\d+': position 0 feeds token \d+ where the rollout had token \d+"
    ):
        record(other)
    record(other, check_tokens=False)  # only the lengths are checked then
    one = [t.clone() for t in data["tokens"]]
    one[0][3] += 1  # one token of the first sample, same length
    with pytest.raises(ReplayFidelityError, match=r"position 3 feeds .* \(1 of \d+ positions differ\)"):
        record({**data, "tokens": one})
    without = {k: v for k, v in data.items() if k != "tokens"}
    with pytest.raises(ReplayFidelityError, match=r"rollout_data has no 'tokens'.*keep slime's 'tokens' key"):
        record(without, check_tokens=False)  # slime itself places rows by them
    with pytest.raises(ModelSpecError, match=r"num_experts=16 \(store: 10\)"):
        replay_of(fixture, url, rank).record(ROLLOUT, SimpleNamespace(**{**vars(args), "num_experts": 16}), data, [])
    with pytest.raises(AlignmentError, match="'partition'"):
        record({k: v for k, v in data.items() if k != "partition"})
    with pytest.raises(AlignmentError, match="num_microbatches sums to 9"):
        replay_of(fixture, url, rank).record(ROLLOUT, args, data, [], num_microbatches=[9])
    with pytest.raises(StaleRoutingError, match=r"sample '7/\d+'.*policy version 7.*takes version 6 only"):
        record(data, policy_versions=lambda rollout: {rollout - 1})  # one-step off-policy, on-policy routing
    record(data, policy_versions="any")  # turned off by name
    stale = f"memory://slime/{fixture.name}/{uuid.uuid4().hex}"
    slime.write_samples(stale, ROLLOUT, fixture.samples(), spec=slime.spec_from_args(args), policy_version=3)
    with pytest.raises(StaleRoutingError, match=r"policy version 3.*takes version 7 only"):
        replay_of(fixture, stale, rank).record(ROLLOUT, args, data, [StubReplay() for _ in range(6)])
    samples = fixture.samples()
    samples[3].rollout_routed_experts = None
    with pytest.raises(IngestError, match=r"sample '1/3' \(Sample.index 3\).*--use-rollout-routing-replay"):
        slime.write_samples(str(tmp_path / "s"), 1, samples, spec=slime.spec_from_args(args))


def test_layout_from_args_matches_megatrons_split(megatron_chunks: Any) -> None:
    for name in NAMES:
        fixture = load(name)
        args = fixture.args()
        from_args = slime.layout_from_args(args)
        from_megatron = slime.layout_from_args(args, megatron_chunks(fixture))
        spec = slime.spec_from_args(args)
        from routelog.align import local_routers

        for pp in range(fixture.config["pp"]):
            assert local_routers(from_args, spec, pp) == local_routers(from_megatron, spec, pp), (name, pp)


@pytest.mark.usefixtures("megatron_env")
def test_replay_changes_a_real_routers_choice(
    fake_slime: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: megatron-core's real ``TopKRouter`` (CPU), wired as slime's megatron patch wires it (its
    ``compute_topk`` wrapped by slime's replaying factory, a forward pre-hook naming the router's ``RoutingReplay``).
    Replaying, every router selects exactly the recorded experts of the token on each row slime routes; the same
    routers on the same hidden states without replay choose otherwise on most of those rows."""
    from tests.test_megatron import HIDDEN, SPEC, build_chunks, megatron_config, moe_layers, selected

    rng = np.random.default_rng(5)
    args = SimpleNamespace(
        num_layers=SPEC.num_layers,
        num_experts=SPEC.num_experts,
        moe_router_topk=SPEC.topk,
        moe_layer_freq=[int(SPEC.is_moe(layer)) for layer in range(SPEC.num_layers)],
        tensor_model_parallel_size=1,
        sequence_parallel=False,
        data_pad_size_multiplier=4,
        use_rollout_routing_replay=True,
    )
    samples = []
    for _ in range(6):
        n = int(rng.integers(12, 30))
        routes = np.zeros((n - 1, SPEC.num_layers, SPEC.topk), np.int32)
        for layer in SPEC.moe_layers:
            routes[:, layer] = np.argsort(rng.random((n - 1, SPEC.num_experts)), axis=-1)[:, : SPEC.topk]
        samples.append(SimpleNamespace(tokens=rng.integers(0, 64, n).tolist(), response_length=n // 2,
                                       rollout_routed_experts=routes))  # fmt: skip
    url = f"memory://slime/control/{uuid.uuid4().hex}"
    slime.write_samples(url, ROLLOUT, samples, spec=slime.spec_from_args(args))
    data = {
        "partition": list(range(6)),
        "tokens": [torch.tensor(s.tokens) for s in samples],
        "micro_batch_indices": [[0, 1], [2, 3, 4], [5]],
    }
    module = sys.modules["slime.utils.routing_replay"]
    module.get_routing_replay_compute_topk = slime_compute_topk_factory(module)  # type: ignore[attr-defined]
    (chunk,) = build_chunks(megatron_config())
    layers = list(moe_layers(chunk))
    replays = [SlimeRoutingReplay() for _ in layers]
    for layer, replay in zip(layers, replays, strict=True):  # slime's patch of megatron-core, on the real router
        router = layer.mlp.router
        router.register_forward_pre_hook(lambda *a, r=replay: setattr(module, "ROUTING_REPLAY", r))
        adapter = types.SimpleNamespace(
            get_replay_topk=lambda scores, topk, num_groups, group_topk, default: (
                module.get_routing_replay_compute_topk(default)(scores, topk, num_groups, group_topk)  # type: ignore[attr-defined]
            )
        )
        monkeypatch.setattr(router, "router_replay", adapter)
    SlimeReplay(url, rank=RankCoords(), prepare=slime_prepare()).record(ROLLOUT, args, data, replays)
    place = slime_prepare()
    routed = changed = 0
    for batch in data["micro_batch_indices"]:
        native_place = place(  # what slime itself would record from the routing it ships, padding included
            [torch.from_numpy(samples[j].rollout_routed_experts) for j in batch],
            [data["tokens"][j] for j in batch],
            num_experts=SPEC.num_experts,
            data_pad_size_multiplier=4,
            sequence_parallel=False,
            allgather_cp=False,
        )
        real = np.concatenate([np.r_[np.ones(len(samples[j].tokens) - 1, bool), False] for j in batch])
        real = np.r_[real, np.zeros(native_place.shape[0] - real.size, bool)]
        hidden = torch.randn(native_place.shape[0], 1, HIDDEN)
        monkeypatch.delenv("ROUTING_REPLAY_STAGE", raising=False)
        native = {int(layer.layer_number): selected(layer.mlp.router(hidden)[1].detach()) for layer in layers}
        monkeypatch.setenv("ROUTING_REPLAY_STAGE", "replay_forward")
        seen = {int(layer.layer_number): selected(layer.mlp.router(hidden)[1].detach()) for layer in layers}
        for number, mine in seen.items():
            want = np.sort(native_place[:, number - 1].numpy().astype(np.int64), axis=-1)
            np.testing.assert_array_equal(mine[real], want[real])
            routed += int(real.sum())
            changed += int((native[number][real] != want[real]).any(axis=-1).sum())
    assert routed > 0 and changed / routed > 0.5, (changed, routed)
