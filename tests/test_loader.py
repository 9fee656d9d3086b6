"""The loader reads only a rank's records and layers, prefetches, works under a spawn DataLoader; R2 recordings map
back to records; the align CLI writes what a rank receives."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import routelog
from routelog import ModelSpec, PartOptions, Record
from routelog.align import (
    AlignmentPlan,
    MicroBatch,
    MicroBatchReplay,
    Packing,
    ParallelLayout,
    RankCoords,
    gather,
    parse_micro_batches,
)
from routelog.cli import app
from routelog.engines.megatron_r2 import RecordedShard, records_from_recordings
from routelog.loader import ReplayDataset, ReplayLoader

SPEC = ModelSpec(name="loader", num_layers=8, moe_layers=(1, 2, 3, 5, 6, 7), num_experts=32, topk=4)


def write_step(url: str, make_routing: Callable[..., np.ndarray], n: int = 8, seed: int = 0) -> dict[str, Record]:
    rng = np.random.default_rng(seed)
    records = {}
    with routelog.open_writer(
        url, 0, model_spec=SPEC, options=PartOptions(chunk_rows=64, chunk_layers=2), flush_bytes=4000
    ) as writer:
        for i in range(n):
            tokens = int(rng.integers(20, 90))
            valid = np.ones(tokens, bool)
            valid[-1] = False
            record = Record(
                sample_id=f"r{i}",
                expert_ids=make_routing(rng, tokens, 6, 32, 4),
                prompt_len=5,
                response_len=tokens - 5,
                valid=valid,
                token_ids=rng.integers(0, 1000, tokens),
            )
            writer.append(record)
            records[record.sample_id] = record
    return records


def plan_for(rank: RankCoords, batches: str = "r0,r3|r1,r2,r7|r5") -> AlignmentPlan:
    layout = ParallelLayout(tp=2, cp=2, pp=2, vpp=2)
    return AlignmentPlan(SPEC, layout, Packing("verl"), rank, tuple(parse_micro_batches(batches)))


def test_loader_matches_the_pure_alignment_on_every_backend(
    store_url: str, make_routing: Callable[..., np.ndarray]
) -> None:
    write_step(store_url, make_routing)
    snapshot = routelog.open_store(store_url).step(0)
    everything = {r.sample_id: r for r in snapshot.read_many(snapshot.sample_ids)}
    for rank in (RankCoords(tp=1, cp=0, pp=1), RankCoords(tp=0, cp=1, pp=0)):
        plan = plan_for(rank)
        from tests.test_align import subset

        local = {sid: subset(r, plan.moe_layers) for sid, r in everything.items()}
        with ReplayLoader(store_url, 0, plan, prefetch=2) as loader:
            replays = list(loader)
        assert [r.index for r in replays] == [0, 1, 2]
        for replay in replays:
            expected = gather(plan, replay.index, local)
            np.testing.assert_array_equal(replay.ids, expected.ids)
            np.testing.assert_array_equal(replay.mask, expected.mask)
            np.testing.assert_array_equal(replay.positions, expected.positions)


def test_loader_reads_only_its_records_and_layers(memory_url: str, make_routing: Callable[..., np.ndarray]) -> None:
    write_step(memory_url, make_routing, n=16)
    store = routelog.open_store(memory_url)
    storage = store.storage
    fetched: list[tuple[str, int, int]] = []
    original = storage.read_ranges

    def counting(ranges: list[tuple[str, int, int]], *into: memoryview) -> list[Any]:
        fetched.extend(ranges)
        return original(ranges, *into)

    storage.read_ranges = counting  # type: ignore[method-assign]
    plan = plan_for(RankCoords(pp=1), batches="r0,r1")
    with ReplayLoader(store, 0, plan, prefetch=0) as loader:
        (replay,) = list(loader)
    # pp rank 1 builds layers 2-3 (virtual stage 0) and 6-7 (stage 1): MoE axis positions 1, 2, 4, 5.
    assert plan.moe_layers == [1, 2, 4, 5]
    assert [(r.vp_stage, r.layer_number) for r in replay.routers] == [(0, 3), (0, 4), (1, 7), (1, 8)]
    total = sum(o.size for c in store.step(0).commits for o in c.objects if "/c/" in o.key)
    assert sum(stop - start for _, start, stop in fetched) < total / 3


def test_dataloader_with_spawn_workers(tmp_path: Path, make_routing: Callable[..., np.ndarray]) -> None:
    torch = pytest.importorskip("torch")
    url = str(tmp_path / "store")
    write_step(url, make_routing)
    plan = plan_for(RankCoords(tp=1, cp=1, pp=0))
    dataset = ReplayDataset(url, 0, plan)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    items = list(loader)
    assert [int(item["index"]) for item in items] == [0, 1, 2], "micro-batches arrive in order"
    direct = list(ReplayLoader(url, 0, plan, prefetch=0))
    for item, replay in zip(items, direct, strict=True):
        assert torch.equal(item["ids"], torch.from_numpy(replay.ids))
        assert item["ids"].dtype == torch.int64


def test_recordings_of_every_rank_rebuild_the_records(memory_url: str, make_routing: Callable[..., np.ndarray]) -> None:
    """megatron-core R2: each rank's recorded [T_local, K] per router, given the layout, back to records."""
    records = write_step(memory_url, make_routing)
    batches = "r0,r3|r1,r2,r7|r5"
    snapshot = routelog.open_store(memory_url).step(0)
    shards = []
    layout = ParallelLayout(tp=2, cp=2, pp=2, vpp=2)
    for rank in [RankCoords(tp=t, cp=c, pp=p) for t in range(2) for c in range(2) for p in range(2)]:
        plan = AlignmentPlan(SPEC, layout, Packing("slime"), rank, tuple(parse_micro_batches(batches)))
        for replay in ReplayLoader(snapshot.store, 0, plan, prefetch=0):
            recorded = replay.ids.copy()
            shards.append(RecordedShard(plan, replay.index, list(recorded)))
    wanted = ["r0", "r3", "r1", "r2", "r7", "r5"]
    lengths = {sid: (records[sid].prompt_len, records[sid].response_len) for sid in wanted}
    rebuilt = records_from_recordings(shards, lengths)
    for record in rebuilt:
        original = records[record.sample_id]
        valid = np.asarray(original.valid)
        # The trainer routes every input token, the final one too: a recording has no missing rows.
        assert np.asarray(record.valid).all()
        np.testing.assert_array_equal(
            np.sort(np.asarray(record.expert_ids)[valid], -1), np.sort(np.asarray(original.expert_ids)[valid], -1)
        )
    with pytest.raises(routelog.IngestError, match="some MoE layers only"):
        records_from_recordings([s for s in shards if s.plan.rank.pp == 0], lengths)


def assert_written(written: Any, direct: list[MicroBatchReplay]) -> None:
    """The align command's arrays are the loader's."""
    for replay in direct:
        m = replay.index
        np.testing.assert_array_equal(written[f"mb{m}_positions"], replay.positions)
        for j, router in enumerate(replay.routers):
            np.testing.assert_array_equal(written[f"mb{m}_layer{router.layer_number}_ids"], replay.ids[j])
            np.testing.assert_array_equal(written[f"mb{m}_layer{router.layer_number}_mask"], replay.mask)


def test_align_cli_writes_what_a_rank_receives(tmp_path: Path, make_routing: Callable[..., np.ndarray]) -> None:
    url = str(tmp_path / "store")
    write_step(url, make_routing)
    batches = tmp_path / "mbs.txt"
    batches.write_text("r0,r3|r1,r2,r7|r5\n")
    out = tmp_path / "rank.npz"
    result = CliRunner().invoke(
        app,
        [
            "align",
            url,
            "--step",
            "0",
            "--micro-batches",
            f"@{batches}",
            "--packing",
            "verl",
            "--tp",
            "2",
            "--cp",
            "2",
            "--pp",
            "2",
            "--vpp",
            "2",
            "--rank",
            "tp=1,cp=0,pp=1",
            "--out",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    direct = list(ReplayLoader(url, 0, plan_for(RankCoords(tp=1, cp=0, pp=1)), prefetch=0))
    with np.load(out, allow_pickle=False) as written:
        assert_written(written, direct)
        assert sorted(k for k in written.files if k.startswith("mb0_layer") and k.endswith("_ids")) == [
            "mb0_layer3_ids",
            "mb0_layer4_ids",
            "mb0_layer7_ids",
            "mb0_layer8_ids",
        ]


def test_plan_spec_must_describe_the_stored_axis(memory_url: str, make_routing: Callable[..., np.ndarray]) -> None:
    write_step(memory_url, make_routing, n=2)
    wrong = SPEC.model_copy(update={"num_experts": 64})
    plan = AlignmentPlan(wrong, ParallelLayout(), Packing(), RankCoords(), (MicroBatch(("r0",)),))
    with pytest.raises(routelog.ModelSpecError, match="does not describe"):
        ReplayLoader(memory_url, 0, plan).load(0)
    assert uuid


ALIGN_CASES: list[tuple[list[str], dict[str, Any], dict[str, Any], dict[str, Any]]] = [
    # (CLI options, ParallelLayout, Packing, AlignmentPlan extras (micro-batch fields per batch under "batches"))
    (["--packing", "verl", "--fp8", "--tp", "2", "--cp", "2"], {"tp": 2, "cp": 2}, {"kind": "verl", "fp8": True}, {}),
    (
        ["--packing", "slime-allgather", "--cp", "2", "--tp", "2", "--slime-pad-multiplier", "4"],
        {"cp": 2, "tp": 2},
        {"kind": "slime-allgather", "slime_pad_multiplier": 4},
        {},
    ),
    (
        ["--packing", "nemo", "--tp", "2", "--pp", "2", "--divisible-by", "4", "--fp8", "--fp8-block", "32"],
        {"tp": 2, "pp": 2},
        {"kind": "nemo", "divisible_by": 4, "fp8": True, "fp8_block": 32},
        {},
    ),
    (["--packing", "nemo", "--hybrid-ep", "--cp", "2"], {"cp": 2}, {"kind": "nemo", "hybrid_ep": True}, {}),
    (
        ["--packing", "thd", "--cu-seqlens", "0,96,192|0,96,192,296|0,96", "--tp", "2"],
        {"tp": 2},
        {"kind": "thd"},
        {
            "batches": [
                {"cu_seqlens_padded": (0, 96, 192)},
                {"cu_seqlens_padded": (0, 96, 192, 296)},
                {"cu_seqlens_padded": (0, 96)},
            ]
        },
    ),
    (
        ["--packing", "bshd", "--seq-len", "96", "--cp", "2"],
        {"cp": 2},
        {"kind": "bshd"},
        {"batches": [{"seq_len": 96}] * 3},
    ),
    (
        ["--pp", "2", "--vpp", "2", "--stage-layers", "0;2,3|1;4,5", "--rank", "pp=1"],
        {"pp": 2, "vpp": 2, "stage_layers": (((0,), (2, 3)), ((1,), (4, 5)))},
        {"kind": "verl"},
        {"rank": RankCoords(pp=1)},
    ),
    (
        [
            "--cp",
            "4",
            "--micro-batch-cp",
            "2,4,2",
            "--rank",
            "cp=1",
            "--policy-version",
            "1",
            "--other-versions",
            "missing",
            "--missing",
            "router",
        ],
        {"cp": 4},
        {"kind": "verl"},
        {
            "batches": [{"cp": 2}, {"cp": 4}, {"cp": 2}],
            "rank": RankCoords(cp=1),
            "policy_versions": frozenset({1}),
            "other_versions": "missing",
            "missing": "router",
        },
    ),
    (
        ["--pp", "2", "--account-for-embedding", "--account-for-loss", "--rank", "pp=1"],
        {"pp": 2, "account_for_embedding": True, "account_for_loss": True},
        {"kind": "verl"},
        {"rank": RankCoords(pp=1)},
    ),
]


@pytest.mark.parametrize(("options", "layout", "packing", "extras"), ALIGN_CASES, ids=lambda v: str(v)[:40])
def test_align_cli_and_api_give_identical_arrays(
    tmp_path: Path,
    make_routing: Callable[..., np.ndarray],
    options: list[str],
    layout: dict[str, Any],
    packing: dict[str, Any],
    extras: dict[str, Any],
) -> None:
    """Everything the Python plan can say, the align command can say, with the same arrays as the result."""
    url = str(tmp_path / "store")
    write_step(url, make_routing)
    groups = "r0,r3|r1,r2,r7|r5"
    out = tmp_path / "rank.npz"
    result = CliRunner().invoke(
        app,
        ["align", url, "--step", "0", "--micro-batches", groups, "--out", str(out), *options],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    batch_fields = extras.get("batches", [{}] * 3)
    batches = tuple(
        MicroBatch(b.sample_ids, **fields) for b, fields in zip(parse_micro_batches(groups), batch_fields, strict=True)
    )
    plan = AlignmentPlan(
        SPEC,
        ParallelLayout(**layout),
        Packing(**packing),
        extras.get("rank", RankCoords()),
        batches,
        missing=extras.get("missing", "dummy"),
        policy_versions=extras.get("policy_versions"),
        other_versions=extras.get("other_versions", "refuse"),
    )
    direct = list(ReplayLoader(url, 0, plan, prefetch=0))
    with np.load(out, allow_pickle=False) as written:
        assert len(written.files) == sum(1 + 2 * len(r.routers) for r in direct)
        assert_written(written, direct)
