"""Alignment as a pure function: across every rank of a layout, each valid (sample, position, layer) of the stored
routing is replayed exactly once, with the stored experts; everything else is a distinct dummy, masked."""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import routelog
from routelog import AlignmentError, ModelSpec, Record, Segment
from routelog.align import (
    AlignmentPlan,
    MicroBatch,
    Packing,
    ParallelLayout,
    RankCoords,
    chunk_layers,
    gather,
    pack,
    parse_micro_batches,
    zigzag_chunks,
)
from routelog.format.routing import RecordRouting
from routelog.store.fidelity import StaleRoutingError

N_LAYERS = 8


def spec_with_dense_prefix(dense: int) -> ModelSpec:
    return ModelSpec(
        name=f"dense{dense}", num_layers=N_LAYERS, moe_layers=tuple(range(dense, N_LAYERS)), num_experts=16, topk=4
    )


def routings_for(
    spec: ModelSpec, lengths: list[int], make_routing: Callable[..., np.ndarray], seed: int
) -> dict[str, RecordRouting]:
    """Store records in memory and read them back whole (the store round trip is tested elsewhere)."""
    import uuid

    rng = np.random.default_rng(seed)
    url = f"memory://align/{uuid.uuid4().hex}"
    with routelog.open_writer(url, 0, model_spec=spec) as writer:
        for i, n in enumerate(lengths):
            valid = np.ones(n, bool)
            valid[-1] = False
            if i % 2:
                valid[n // 3 : n // 3 + 2] = False
            writer.append(
                Record(
                    sample_id=f"s{i}",
                    expert_ids=make_routing(rng, n, spec.num_moe_layers, spec.num_experts, spec.topk),
                    prompt_len=1,
                    response_len=n - 1,
                    valid=valid,
                    token_ids=rng.integers(0, 99, n),
                )
            )
    snapshot = routelog.open_store(url).step(0)
    return {r.sample_id: r for r in snapshot.read_many(snapshot.sample_ids)}


def subset(routing: RecordRouting, moe_layers: list[int]) -> RecordRouting:
    """The same record as a loader reading only ``moe_layers`` would see it."""
    return RecordRouting(
        info=routing.info,
        by_layer=routing.by_layer[moe_layers],
        valid=routing.valid,
        moe_layers=tuple(moe_layers),
        layers=tuple(routing.layers[j] for j in moe_layers),
        topk_order=routing.topk_order,
        num_moe_layers=routing.num_moe_layers,
    )


def thd_boundaries(lengths: tuple[int, ...], layout: ParallelLayout, extra: int) -> tuple[int, ...]:
    """A trainer's own cu_seqlens_padded: each sequence to 2*CP*TP, the last one `extra` multiples longer."""
    multiple = (2 * layout.cp if layout.cp > 1 else 1) * layout.tp
    cu = [0]
    for i, n in enumerate(lengths):
        padded = -(-n // multiple) * multiple + (extra * multiple if i == len(lengths) - 1 else 0)
        cu.append(cu[-1] + padded)
    return tuple(cu)


def all_ranks(layout: ParallelLayout) -> list[RankCoords]:
    return [RankCoords(tp=t, cp=c, pp=p) for t in range(layout.tp) for c in range(layout.cp) for p in range(layout.pp)]


def check_union(
    spec: ModelSpec,
    layout: ParallelLayout,
    packing: Packing,
    batches: list[MicroBatch],
    routings: dict[str, RecordRouting],
) -> int:
    """Every valid stored entry replayed exactly once over all ranks, with the stored experts; returns the count."""
    hits: dict[tuple[str, int, int], int] = {}
    for rank in all_ranks(layout):
        plan = AlignmentPlan(spec, layout, packing, rank, tuple(batches))
        local = {sid: subset(r, plan.moe_layers) for sid, r in routings.items()}
        for m in range(len(batches)):
            replay = gather(plan, m, local)
            ids = replay.ids
            # Every row, replayed or dummy, is a valid top-k set: K distinct experts in range.
            assert ids.size == 0 or (ids.min() >= 0 and ids.max() < spec.num_experts)
            assert (np.sort(ids, axis=-1)[..., 1:] != np.sort(ids, axis=-1)[..., :-1]).all()
            names = plan.sample_ids
            for row in np.flatnonzero(replay.mask):
                sid, pos = names[replay.positions[row, 0]], int(replay.positions[row, 1])
                for j, router in enumerate(replay.routers):
                    key = (sid, pos, router.layer)
                    hits[key] = hits.get(key, 0) + 1
                    want = np.sort(routings[sid].by_layer[router.moe_index, pos])
                    np.testing.assert_array_equal(np.sort(ids[j, row]), want)
            padding = replay.positions[:, 0] == -1
            assert not replay.mask[padding].any()
    expected = {
        (sid, pos, layer)
        for batch in batches
        for sid in batch.sample_ids
        for pos in np.flatnonzero(routings[sid].valid)
        for layer in spec.moe_layers
    }
    assert set(hits) == expected, "every valid entry must be covered"
    assert set(hits.values()) == {1}, "and exactly once"
    return len(hits)


SWEEP = [
    (pp, vpp, cp, tp, kind, dense, fp8)
    for pp, vpp, cp, tp, kind, dense, fp8 in itertools.product(
        (1, 2, 4),
        (1, 2),
        (1, 2),
        (1, 2),
        ("verl", "slime", "slime-allgather", "nemo", "bshd", "thd"),
        (0, 1, 3),
        (False, True),
    )
    if not (vpp > 1 and pp == 1) and not (fp8 and kind in ("slime", "slime-allgather", "bshd", "thd"))
]


@pytest.mark.parametrize(("pp", "vpp", "cp", "tp", "kind", "dense", "fp8"), SWEEP)
def test_every_valid_entry_is_replayed_exactly_once(
    pp: int, vpp: int, cp: int, tp: int, kind: str, dense: int, fp8: bool, make_routing: Callable[..., np.ndarray]
) -> None:
    spec = spec_with_dense_prefix(dense)
    lengths = [7, 19, 4, 33, 12, 26]
    routings = routings_for(spec, lengths, make_routing, seed=pp * 100 + cp * 10 + tp + dense)
    layout = ParallelLayout(tp=tp, cp=cp, pp=pp, vpp=vpp)
    packing = Packing(kind=kind, fp8=fp8, fp8_block=16)  # type: ignore[arg-type]
    groups = [("s0", "s1", "s2"), ("s3", "s4", "s5")]
    batches = []
    for m, group in enumerate(groups):
        cu = thd_boundaries(tuple(lengths[int(s[1:])] for s in group), layout, extra=m) if kind == "thd" else None
        batches.append(MicroBatch(group, cu_seqlens_padded=cu))
    assert check_union(spec, layout, packing, batches, routings) > 0


@pytest.mark.parametrize("cp_layout", ["contiguous"])
@pytest.mark.parametrize(("cp", "tp"), [(2, 1), (2, 2), (4, 1)])
def test_contiguous_cp_layout(cp_layout: str, cp: int, tp: int, make_routing: Callable[..., np.ndarray]) -> None:
    spec = spec_with_dense_prefix(1)
    lengths = [9, 30, 17]
    routings = routings_for(spec, lengths, make_routing, seed=cp + tp)
    layout = ParallelLayout(tp=tp, cp=cp, cp_layout=cp_layout)  # type: ignore[arg-type]
    batches = [MicroBatch(("s0", "s1", "s2"))]
    assert check_union(spec, layout, Packing("verl"), batches, routings) > 0


def test_dynamic_cp_size_per_micro_batch(make_routing: Callable[..., np.ndarray]) -> None:
    """verl's dynamic CP: each micro-batch has its own CP group size; a rank outside it holds no rows."""
    spec = spec_with_dense_prefix(0)
    routings = routings_for(spec, [10, 21, 8, 40], make_routing, seed=5)
    layout = ParallelLayout(cp=4)
    batches = (MicroBatch(("s0", "s1"), cp=2, cp_rank=None), MicroBatch(("s2", "s3"), cp=4))
    hits = set()
    for cp_rank in range(4):
        for m, batch in enumerate(batches):
            size = batch.cp or 4
            if cp_rank >= size:
                continue
            plan = AlignmentPlan(spec, layout, Packing("verl"), RankCoords(cp=cp_rank), batches)
            replay = gather(plan, m, {sid: subset(r, plan.moe_layers) for sid, r in routings.items()})
            for row in np.flatnonzero(replay.mask):
                key = (plan.sample_ids[replay.positions[row, 0]], int(replay.positions[row, 1]))
                assert key not in hits
                hits.add(key)
    assert hits == {(sid, p) for sid, r in routings.items() for p in np.flatnonzero(r.valid)}


def test_micro_batch_order_is_the_trainers(make_routing: Callable[..., np.ndarray]) -> None:
    """Token-balanced splits reorder samples: rows follow the micro-batch lists, not the store."""
    spec = spec_with_dense_prefix(0)
    routings = routings_for(spec, [5, 6, 7], make_routing, seed=6)
    plan = AlignmentPlan(spec, ParallelLayout(), Packing("verl"), RankCoords(), tuple(parse_micro_batches("s2,s0|s1")))
    replay = gather(plan, 0, routings)
    real = replay.positions[:, 0] != -1
    assert [plan.sample_ids[i] for i in dict.fromkeys(replay.positions[real, 0])] == ["s2", "s0"]
    assert replay.positions[:7, 1].tolist() == list(range(7))


def test_trainer_packing_rules() -> None:
    """The formulas of each trainer's packer (README, "Replay in the trainer"), on one micro-batch."""
    layout = ParallelLayout(tp=2, cp=2)
    packed = pack([5, 13], Packing("verl"), layout)
    assert packed.padded == (8, 16)  # multiples of TP*CP*2 = 8
    fp8 = pack([5, 13], Packing("verl", fp8=True), layout)
    assert fp8.padded[0] == 16 and sum(fp8.padded) % (8 * 128) == 0  # lcm(16, 8) per sequence, total to 8*128
    contiguous = pack([5, 13], Packing("verl"), ParallelLayout(tp=2, cp=2, cp_layout="contiguous"))
    assert contiguous.padded == (8, 16)  # TP*CP = 4 per sequence with contiguous CP
    assert pack([5, 14], Packing("verl"), ParallelLayout(tp=2, cp=2, cp_layout="contiguous")).padded == (8, 16)
    assert pack([5, 9], Packing("verl"), ParallelLayout(tp=1, cp=2, cp_layout="contiguous")).padded == (6, 10)
    slime = pack([5, 13], Packing("slime"), layout)
    assert slime.padded == (8, 16) and (sum(slime.padded) // 2 + slime.local_tail) % 256 == 0
    allgather = pack([5, 13], Packing("slime-allgather"), layout)
    assert allgather.padded[0] == 5 and sum(allgather.padded) == 2 * 2 * 128 and allgather.cp_layout == "contiguous"
    nemo = pack([5, 13], Packing("nemo", fp8=True, fp8_block=128), layout)
    assert nemo.padded[0] == 8 and sum(nemo.padded) % (128 * 8) == 0
    for block in (16, 32):
        assert sum(pack([5, 13], Packing("nemo", fp8=True, fp8_block=block), layout).padded) % (block * 8) == 0
    hybrid = pack([5, 13], Packing("nemo", hybrid_ep=True), layout)  # HybridEP pads without FP8 too
    assert sum(hybrid.padded) == 128 * 8
    divisible = pack([5, 13], Packing("nemo", divisible_by=24), layout)
    assert divisible.padded == (24, 24)
    with pytest.raises(AlignmentError, match="multiple of 8"):
        pack([5, 13], Packing("nemo", divisible_by=12), layout)
    nemo_pp = pack([5, 13], Packing("nemo"), layout, pad_to=40)
    assert sum(nemo_pp.padded) == 40
    with pytest.raises(AlignmentError, match="fp8_block"):
        Packing("nemo", fp8=True, fp8_block=64)


def test_nemo_pads_every_micro_batch_to_one_total_under_pp(make_routing: Callable[..., np.ndarray]) -> None:
    """NeMo-RL with PP pads every micro-batch of the step to the largest, rounded to the total multiple."""
    spec = spec_with_dense_prefix(1)
    lengths = [7, 19, 4, 33, 12]
    routings = routings_for(spec, lengths, make_routing, seed=21)
    layout = ParallelLayout(tp=2, pp=2)
    batches = (MicroBatch(("s0", "s1")), MicroBatch(("s2", "s3", "s4")))
    plan = AlignmentPlan(spec, layout, Packing("nemo", fp8=True, fp8_block=32), RankCoords(), batches)
    resolved = plan.with_lengths({sid: r.info.n_tokens for sid, r in routings.items()})
    totals = {b.pad_to for b in resolved.micro_batches}
    assert totals == {-(-(8 + 34 + 12 + 4) // 64) * 64}  # the largest packed micro-batch (58) to 32*TP = 64
    assert check_union(spec, layout, resolved.packing, list(resolved.micro_batches), routings) > 0
    for m in range(2):
        assert (
            resolved.positions(m, [lengths[int(s[1:])] for s in resolved.micro_batches[m].sample_ids]).shape[0]
            == 64 // 2
        )


def test_policy_version_filter_replays_only_the_chosen_weights(make_routing: Callable[..., np.ndarray]) -> None:
    """A partial rollout resumed after a weight update: by default the old weights' tokens are refused as stale
    (naming the sample and span); with ``other_versions="missing"`` they are not replayed, the rest is."""
    spec = spec_with_dense_prefix(0)
    rng = np.random.default_rng(4)
    url = f"memory://align/{uuid.uuid4().hex}"
    with routelog.open_writer(url, 0, model_spec=spec) as writer:
        writer.append(
            Record(
                sample_id="resumed",
                expert_ids=make_routing(rng, 20, spec.num_moe_layers, spec.num_experts, spec.topk),
                prompt_len=4,
                response_len=16,
                policy_version=8,
                segments=[
                    Segment(start=0, end=4, source="prompt", policy_version=7),
                    Segment(start=4, end=12, source="response", policy_version=7),
                    Segment(start=12, end=20, source="resumed", policy_version=8),
                ],
            )
        )
    routing = routelog.open_store(url).step(0).read("resumed")
    plan = AlignmentPlan(
        spec,
        ParallelLayout(),
        Packing("verl"),
        RankCoords(),
        (MicroBatch(("resumed",)),),
        policy_versions=frozenset({8}),
    )
    with pytest.raises(StaleRoutingError, match=r"sample 'resumed': tokens 0\.\.4 .*policy version 7.*version 8"):
        gather(plan, 0, {"resumed": routing})
    replay = gather(dataclasses.replace(plan, other_versions="missing"), 0, {"resumed": routing})
    assert replay.mask[:12].sum() == 0 and replay.mask[12:20].all()
    assert gather(dataclasses.replace(plan, policy_versions=frozenset({7, 8})), 0, {"resumed": routing}).mask.all()
    unversioned = dataclasses.replace(
        routing, info=routing.info.model_copy(update={"policy_version": None, "segments": []})
    )
    with pytest.raises(StaleRoutingError, match="no recorded policy version"):
        gather(plan, 0, {"resumed": unversioned})
    with pytest.raises(AlignmentError, match="other_versions"):
        dataclasses.replace(plan, other_versions="ignore")  # type: ignore[arg-type]


def test_bad_layouts_are_typed_errors() -> None:
    spec = spec_with_dense_prefix(0)
    with pytest.raises(AlignmentError, match="sequence parallelism"):
        ParallelLayout(tp=2, sequence_parallel=False)
    with pytest.raises(AlignmentError, match="2\\*CP"):
        zigzag_chunks(10, 2, 0)
    with pytest.raises(AlignmentError, match="two micro-batches"):
        AlignmentPlan(spec, ParallelLayout(), Packing(), RankCoords(), tuple(parse_micro_batches("a,b|b")))
    with pytest.raises(AlignmentError, match="cu_seqlens_padded"):
        pack([5, 6], Packing("thd"), ParallelLayout())
    with pytest.raises(AlignmentError, match="does not hold"):
        pack([5, 6], Packing("thd"), ParallelLayout(), cu_seqlens_padded=[0, 4, 10])
    with pytest.raises(AlignmentError, match="outside"):
        AlignmentPlan(spec, ParallelLayout(pp=2), Packing(), RankCoords(pp=2), ())
    with pytest.raises(AlignmentError, match="split over TP"):
        AlignmentPlan(
            spec, ParallelLayout(tp=2), Packing("thd"), RankCoords(), (MicroBatch(("a",), cu_seqlens_padded=(0, 5)),)
        ).positions(0, [5])


# -- against megatron-core's own functions ---------------------------------------------------------------------
PIPELINES = [
    {"pp": 2},
    {"pp": 4},
    {"pp": 2, "vpp": 2},
    {"pp": 4, "vpp": 2},
    {"pp": 2, "account_for_embedding": True, "account_for_loss": True},
    {"pp": 4, "vpp": 2, "account_for_embedding": True, "account_for_loss": True, "num_layers": 14},
    {"pp": 4, "first_stage_layers": 1, "last_stage_layers": 3},
    {"pp": 4, "vpp": 2, "first_stage_layers": 2, "last_stage_layers": 4, "num_layers": 18},
    {"pp": 3, "first_stage_layers": 2},
]


@pytest.mark.parametrize("case", PIPELINES, ids=[str(c) for c in PIPELINES])
def test_layer_split_matches_megatron_core(case: dict[str, int], megatron_env: None) -> None:
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    case = dict(case)
    num_layers = case.pop("num_layers", 8)
    layout = ParallelLayout(**case)  # type: ignore[arg-type]
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        account_for_embedding_in_pipeline_split=layout.account_for_embedding,
        account_for_loss_in_pipeline_split=layout.account_for_loss,
        pipeline_dtype=torch.float32,
    )
    covered = []
    for p in range(layout.pp):
        for v in range(layout.virtual_stages):
            vp = v if layout.vpp > 1 else None
            offset = get_transformer_layer_offset(config, vp_stage=vp, pp_rank=p)
            count = get_num_layers_to_build(config, vp_stage=vp, pp_rank=p)
            assert chunk_layers(layout, num_layers, p, v) == range(offset, offset + count)
            covered.extend(range(offset, offset + count))
    assert sorted(covered) == list(range(num_layers))


class _CpGroup:
    """Stands in for a CP process group of ``size`` ranks (one process cannot hold several); megatron-core only
    asks it for its size and this rank (0.16 through the group, 0.19 through ``torch.distributed``, patched in the
    test to answer for it)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize(("cp", "length"), [(2, 8), (2, 24), (4, 32), (3, 12)])
def test_zigzag_matches_megatron_cp_batch_split(
    cp: int, length: int, megatron_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import inspect

    import torch
    from megatron.core.utils import get_batch_on_this_cp_rank

    for name, answer in (("get_world_size", _CpGroup.size), ("get_rank", _CpGroup.rank)):
        real = getattr(torch.distributed, name)

        def patched(group: Any = None, *, _real: Any = real, _answer: Any = answer) -> int:
            return int(_answer(group)) if isinstance(group, _CpGroup) else int(_real(group))

        monkeypatch.setattr(torch.distributed, name, patched)

    # megatron-core 0.19 added a required ``is_hybrid_cp`` argument (False: the plain zigzag split).
    extra = {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters else {}
    for rank in range(cp):
        batch = {"tokens": torch.arange(length)[None]}
        split = get_batch_on_this_cp_rank(batch, cp_group=_CpGroup(cp, rank), **extra)["tokens"][0].numpy()
        np.testing.assert_array_equal(zigzag_chunks(length, cp, rank), split)


def test_explicit_stage_layers(make_routing: Callable[..., np.ndarray]) -> None:
    """An explicit per-(pp rank, virtual stage) layer list, uneven on purpose: still every entry exactly once."""
    spec = spec_with_dense_prefix(1)
    routings = routings_for(spec, [9, 14, 6], make_routing, seed=9)
    layout = ParallelLayout(pp=2, vpp=2, stage_layers=(((0,), (3, 4, 5)), ((1, 2), (6, 7))))
    assert [chunk_layers(layout, N_LAYERS, p, v) for p in range(2) for v in range(2)] == [
        range(1),
        range(3, 6),
        range(1, 3),
        range(6, 8),
    ]
    assert check_union(spec, layout, Packing("nemo"), [MicroBatch(("s0", "s1", "s2"))], routings) > 0
