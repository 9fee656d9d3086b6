"""routelog's NeMo-RL integration against NeMo-RL's own code path, captured as fixtures.

``tests/fixtures/nemo_rl/`` was captured from NeMo-RL's code at commit 7ea279ab by
``tools/make_nemo_rl_fixtures.py`` (NeMo-RL cannot be installed here): its real generation-side alignment
(``pad_and_align_routed_expert_indices``, the ``nrlre1:`` codec, the rollout's message routes,
``batched_message_log_to_flat_message``), its real policy-side sharding and packing (``shard_by_batch_size``,
``get_microbatch_iterator``, ``process_microbatch``, ``_shard_routed_experts_for_cp``) and the per-router tensors
its ``build_router_replay_assignments`` hands megatron-core, for CP zigzag, SP/TP, ``divisible_by`` above the
minimum, FP8 and HybridEP totals, PP ``pad_to``, several DP shards and unpacked micro-batches, with NeMo-RL's
debug token identity on every row.

Here the routing is written to a store from the same train data, only sample ids travel, and routelog's
replacement installs each rank's rows into real megatron-core routers (CPU): every row NeMo-RL replays from the
rollout selects exactly NeMo-RL's experts, and every -1 row (NeMo-RL's missing-route fallback) takes the real
``TopKRouter``'s own top-k.
"""

from __future__ import annotations

import collections
import functools
import json
import threading
import types
import uuid
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import routelog
from routelog import AlignmentError, IngestError, ReplayConfigError
from routelog.align import AlignmentPlan, MicroBatch, Packing, ParallelLayout, RankCoords
from routelog.integrations import nemo_rl
from routelog.store.fidelity import ReplayFidelityError, StaleRoutingError, read_fidelity
from routelog.testing import nemo_rl_local_rows
from tests.test_megatron import HIDDEN, SPEC, megatron_config, selected

pytestmark = pytest.mark.usefixtures("megatron_env")
torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

FIXTURES = Path(__file__).parent / "fixtures" / "nemo_rl"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
SAMPLE_IDS: list[str] = MANIFEST["sample_ids"]
STEP = 7
CONFIGS = sorted(MANIFEST["configs"])


@cache
def arrays(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / f"{name}.npz", allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def write_store(config: str, *, seal: bool = True, policy_version: int | None = None) -> routelog.Store:
    """The config's train data (NeMo-RL's flattened rollout), recorded as the driver-side recorder does (each
    record's policy version the step's unless given)."""
    data = arrays(config)
    url = f"memory://nemo-rl/{uuid.uuid4().hex}"
    records = nemo_rl.records_from_batch(
        data["routed_experts"], data["input_ids"], data["input_lengths"], SPEC, sample_ids=SAMPLE_IDS
    )
    recorder = nemo_rl.RolloutRecorder(url, spec=SPEC, first_step=STEP, seal=seal, policy_version=policy_version)
    assert recorder.record(records) == (STEP, SAMPLE_IDS)
    return recorder.store


class PpGroup:
    """megatron-core reads a stage's layer offset from its pipeline group's rank: one process builds any stage."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self._group, self._rank, self._size = group, rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)


@cache
def stage(pp: int, pp_rank: int, mtp: bool = False) -> Any:
    """A real megatron-core GPT model chunk of pipeline stage ``pp_rank`` of ``pp`` (built once per session)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    torch.manual_seed(pp_rank)
    extra: dict[str, Any] = {"pipeline_model_parallel_size": pp, "pipeline_dtype": torch.float32} if pp > 1 else {}
    if mtp:
        extra["mtp_num_layers"] = 1
    config = megatron_config(**extra)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    groups.pp = PpGroup(groups.pp, pp_rank, pp)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=pp_rank)
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=64,
        max_sequence_length=256,
        pg_collection=groups,
        mtp_block_spec=get_gpt_mtp_block_spec(config, block.layer_specs[-1], use_transformer_engine=False)
        if mtp
        else None,
    )


def routers(chunk: Any) -> dict[int, Any]:
    found = [layer.mlp.router for layer in chunk.decoder.layers if hasattr(layer.mlp, "router")]
    return {int(router.layer_number): router for router in found}


def route(chunk: Any, hidden: Any) -> dict[int, np.ndarray]:
    """Every decoder router's selection (sorted expert ids per row) for the hidden states ``[T, 1, H]``."""
    return {n: selected(router(hidden)[1].detach()) for n, router in routers(chunk).items()}


def raw_micro_batches(config: str, rank: dict[str, Any]) -> list[dict[str, Any]]:
    """The micro-batches NeMo-RL's iterator hands ``make_processed_microbatch_iterator`` on this rank: train-data
    rows in the order its sharding and packing put them, sample-id and step columns included."""
    data = arrays(config)
    out = []
    for mb in rank["micro_batches"]:
        rows = [SAMPLE_IDS.index(s) for s in mb[nemo_rl.SAMPLE_ID_KEY]]
        assert [int(data["input_lengths"][r]) for r in rows] == mb["input_lengths"]
        assert data["input_ids"].shape[1] == mb["seq_len"]
        out.append(
            {
                "input_ids": torch.from_numpy(data["input_ids"][rows]),
                "input_lengths": torch.from_numpy(data["input_lengths"][rows]),
                nemo_rl.SAMPLE_ID_KEY: list(mb[nemo_rl.SAMPLE_ID_KEY]),
                nemo_rl.STEP_KEY: [STEP] * len(rows),
            }
        )
    return out


def nemo_sharded(config: str, rank: dict[str, Any], m: int, routed: Any) -> Any:
    """What NeMo-RL's ``process_microbatch`` makes of micro-batch ``m``'s ``routed_experts`` on this rank, before
    the sequence-parallel split: read from the fixture's token identity, which went through NeMo-RL's own packing,
    CP sharding and SP split (the TP ranks' contiguous shares joined again); padding rows get NeMo-RL's
    ``arange(K)`` route, 0 at K = 1. Unpacked, NeMo-RL passes the ``[B, S]`` tensor on with its padding repaired."""
    described = MANIFEST["configs"][config]
    assert routed.dim() == 4 and tuple(routed.shape[2:]) == (1, 1), "routelog's row codes"
    if not described["policy"]["sequence_packing"]["enabled"]:
        return routed
    peers = [rank]
    if described["sp"] and described["tp"] > 1:
        same = ("dp", "cp", "pp")
        peers = sorted(
            (r for r in described["ranks"] if all(r[k] == rank[k] for k in same)), key=lambda r: int(r["tp"])
        )
    identity = np.concatenate([arrays(config)[f"{r['key']}_mb{m}_identity"] for r in peers])
    valid = identity[:, 2] == 1
    out = torch.zeros(identity.shape[0], dtype=routed.dtype)
    out[torch.from_numpy(valid)] = routed[identity[valid, 0], identity[valid, 1], 0, 0]
    return out.reshape(1, -1, 1, 1)


def nemo_iterator(config: str, rank: dict[str, Any]) -> Any:
    """Stands in for NeMo-RL's ``make_processed_microbatch_iterator`` (same signature at 7ea279ab): yields, per
    micro-batch, what its ``process_microbatch`` produced in the fixture (``cu_seqlens_padded``) and its sharding of
    the micro-batch's ``routed_experts`` (:func:`nemo_sharded`)."""

    def make_processed_microbatch_iterator(
        raw_iterator: Iterator[Any],
        cfg: dict[str, Any],
        seq_length_key: str | None,
        pad_individual_seqs_to_multiple_of: int,
        pad_packed_seq_to_multiple_of: int,
        straggler_timer: Any,
        pad_full_seq_to: int | None,
        delegate_pack_to_model: bool = False,
        delegate_mtp_loss_mask_to_model: bool = False,
        model_slices_context_parallel_inputs: bool = False,
    ) -> Iterator[Any]:
        for m, (data, mb) in enumerate(zip(raw_iterator, rank["micro_batches"], strict=True)):
            cu = mb["cu_seqlens_padded"]
            routed = data.get(nemo_rl.ROUTES_KEY)
            yield types.SimpleNamespace(
                data_dict=data,
                cu_seqlens_padded=None if cu is None else torch.tensor(cu, dtype=torch.int32),
                routed_experts=routed,
                routed_experts_cp_sharded=None if routed is None else nemo_sharded(config, rank, m, routed),
            )

    return make_processed_microbatch_iterator


def layout_of(config: dict[str, Any]) -> ParallelLayout:
    return ParallelLayout(tp=config["tp"], cp=config["cp"], pp=config["pp"], sequence_parallel=config["sp"])


def iterate(replay: nemo_rl.NemoRLReplay, config: str, rank: dict[str, Any], raw: list[dict[str, Any]]) -> Any:
    described = MANIFEST["configs"][config]
    return replay.make_processed_microbatch_iterator(
        nemo_iterator(config, rank),
        raw_iterator=iter(raw),
        cfg=described["policy"],
        straggler_timer=None,
        **rank["iterator_args"],
    )


def unexpected(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("NeMo-RL's own function was called for a routelog micro-batch")


def nothing(*args: Any, **kwargs: Any) -> None:
    return None


# -- NeMo-RL's alignment, row for row ------------------------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS)
def test_routelog_places_every_row_where_nemo_rl_puts_it(config: str) -> None:
    """routelog's plan (``Packing("nemo", divisible_by=...)`` from the policy config, ``pad_to`` from NeMo-RL's
    iterator arguments) gives every local row the (sample, position) NeMo-RL's token identity says it is."""
    described = MANIFEST["configs"][config]
    layout = layout_of(described)
    packed = described["policy"]["sequence_packing"]["enabled"]
    for rank in described["ranks"]:
        coords = RankCoords(tp=rank["tp"], cp=rank["cp"], pp=rank["pp"])
        args = rank["iterator_args"]
        for m, mb in enumerate(rank["micro_batches"]):
            ids = tuple(mb[nemo_rl.SAMPLE_ID_KEY])
            batch = (
                MicroBatch(ids, pad_to=args["pad_full_seq_to"]) if packed else MicroBatch(ids, seq_len=mb["seq_len"])
            )
            packing = nemo_rl.nemo_packing(described["policy"]) if packed else Packing("bshd")
            if packed:
                assert packing.nemo_multiples(layout, layout.cp) == (
                    args["pad_individual_seqs_to_multiple_of"],
                    args["pad_packed_seq_to_multiple_of"],
                )
            plan = AlignmentPlan(SPEC, layout, packing, coords, (batch,), missing="router")
            positions = plan.positions(0, mb["input_lengths"])
            identity = arrays(config)[f"{rank['key']}_mb{m}_identity"]
            valid = identity[:, 2] == 1
            assert positions.shape[0] == identity.shape[0] == mb["rows"], (config, rank["key"], m)
            np.testing.assert_array_equal(positions[valid], identity[valid, :2], err_msg=f"{config} {rank['key']}")
            assert (positions[~valid] == -1).all()
            assert sorted(r.layer_number for r in plan.routers) == mb["layers"]


@pytest.mark.parametrize("config", CONFIGS)
def test_replacement_installs_nemo_rls_rows_into_real_routers(config: str) -> None:
    """Per rank and micro-batch, routelog's ``set_router_replay_forward`` makes each real megatron-core router
    select exactly the experts NeMo-RL's ``build_router_replay_assignments`` assigns on every row it replays from
    the rollout; -1 rows (NeMo-RL's missing-route fallback) and padding / final rows take the router's own top-k."""
    described = MANIFEST["configs"][config]
    store = write_store(config)
    data = arrays(config)
    fallback_rows = replayed_rows = 0
    for rank in described["ranks"]:
        chunk = stage(described["pp"], rank["pp"])
        replay = replay_for(store, described, rank)
        try:
            for m, item in enumerate(iterate(replay, config, rank, raw_micro_batches(config, rank))):
                mb = rank["micro_batches"][m]
                codes = item.routed_experts_cp_sharded
                assert isinstance(codes, torch.Tensor) and codes.dtype == torch.int64, "NeMo-RL's own tensor"
                torch.manual_seed(m)
                hidden = torch.randn(mb["rows"], 1, HIDDEN)
                native = route(chunk, hidden)  # no replay armed: the routers' own top-k
                replay.set_router_replay_forward(unexpected, chunk, item.routed_experts_cp_sharded)
                seen = route(chunk, hidden)
                replay.clear_router_replay(nothing, chunk)  # forward-only pass: NeMo-RL clears after each forward
                identity = data[f"{rank['key']}_mb{m}_identity"]
                lengths = np.asarray(mb["input_lengths"])
                real = identity[:, 2] == 1
                final = real & (identity[:, 1] == lengths[identity[:, 0]] - 1)
                assert sorted(seen) == mb["layers"]
                for n in mb["layers"]:
                    nemo = data[f"{rank['key']}_mb{m}_layer{n}"].astype(np.int64)
                    sentinel = (nemo == nemo_rl.MISSING).all(axis=1)
                    replays = real & ~final & ~sentinel
                    np.testing.assert_array_equal(seen[n][replays], np.sort(nemo[replays], axis=1))
                    if replays.any():  # the control: without replay the same routers chose otherwise
                        assert (native[n][replays] != seen[n][replays]).any(axis=1).mean() > 0.5
                    left = ~replays
                    np.testing.assert_array_equal(seen[n][left], native[n][left])
                    # what NeMo-RL puts on the rows left to the router: -1, or arange(K) on padding and final rows
                    dummy = (nemo[left & ~sentinel] == np.arange(SPEC.topk)).all(axis=1)
                    assert dummy.all()
                    fallback_rows += int((real & sentinel).sum())
                    replayed_rows += int(replays.sum())
        finally:
            replay.uninstall()
        assert not any(r.router_replay.router_replay_action for r in routers(chunk).values())
        assert not [t for t in threading.enumerate() if t.name.startswith("routelog-prefetch")], "loader stopped"
    assert replayed_rows > 0
    assert fallback_rows > 0, "sample 2's short vLLM routing and sample 4's unrouted message reach some rank"


def test_training_forward_then_recomputation_pops_the_same_routes() -> None:
    """Training: after NeMo-RL's ``set_router_replay_backward`` a recomputed router (activation checkpointing)
    selects what the forward did, missing rows included; the schedule's final clear empties every router."""
    config = "tp2_sp_cp2"
    described = MANIFEST["configs"][config]
    rank = described["ranks"][3]
    store = write_store(config)
    chunk = stage(1, 0)
    replay = replay_for(store, described, rank)
    hiddens, forwards = [], []
    try:
        for m, item in enumerate(iterate(replay, config, rank, raw_micro_batches(config, rank))):
            torch.manual_seed(10 + m)
            hidden = torch.randn(rank["micro_batches"][m]["rows"], 1, HIDDEN)
            replay.set_router_replay_forward(unexpected, chunk, item.routed_experts_cp_sharded)
            forwards.append(route(chunk, hidden))
            replay.set_router_replay_backward(unexpected, chunk)
            hiddens.append(hidden)
        for hidden, forward in zip(hiddens, forwards, strict=True):  # 1F1B recomputation: oldest first
            torch.manual_seed(99)
            recomputed = route(chunk, hidden)
            for n in forward:
                np.testing.assert_array_equal(recomputed[n], forward[n])
        replay.clear_router_replay(nothing, [chunk])  # megatron_forward_backward's final clear (a chunk list)
        for router in routers(chunk).values():
            assert router.router_replay.target_topk_idx is None and not router.router_replay.replay_backward_list
        (key,) = replay.fidelity()
        assert key == (STEP, "train")
    finally:
        replay.uninstall()


def test_mtp_routers_never_receive_decoder_routes() -> None:
    """A model with an MTP layer: NeMo-RL at 7ea279ab walks every module with ``router_replay`` and
    ``layer_number`` (on megatron-core 0.16 it then refuses the MTP router's layer 9; 0.19 numbers it 1 and hands it
    decoder layer 1's routes). routelog walks the decoder only: the MTP router keeps routing on its own."""
    outcome = MANIFEST["mtp"]
    assert 9 in outcome["routers_found"] and "Router layer 9" in outcome["raises"]
    config = "hybridep_div1"
    described = MANIFEST["configs"][config]
    (rank,) = described["ranks"]
    store = write_store(config)
    chunk = stage(1, 0, mtp=True)
    (mtp_router,) = [m for name, m in chunk.named_modules() if name.startswith("mtp") and hasattr(m, "router_replay")]
    replay = replay_for(store, described, rank)
    try:
        item = next(iter(iterate(replay, config, rank, raw_micro_batches(config, rank))))
        replay.set_router_replay_forward(unexpected, chunk, item.routed_experts_cp_sharded)
        assert mtp_router.router_replay.router_replay_action is None
        assert mtp_router.router_replay.target_topk_idx is None
        assert all(r.router_replay.target_topk_idx is not None for r in routers(chunk).values())
        route(chunk, torch.randn(rank["micro_batches"][0]["rows"], 1, HIDDEN))  # the forward's decoder routers
        replay.set_router_replay_backward(unexpected, chunk)
        assert mtp_router.router_replay.router_replay_action is None, "recomputation would pop an empty list"
        replay.clear_router_replay(nothing, chunk)
    finally:
        replay.uninstall()


# -- the rollout side ---------------------------------------------------------------------------------------------
def rollout() -> dict[str, np.ndarray]:
    return arrays("rollout")


def moe_rows(rows: np.ndarray) -> np.ndarray:
    """vLLM's full layer axis -> the MoE layers, each row's experts sorted (routelog stores sets)."""
    return np.sort(rows[:, list(SPEC.moe_layers)].astype(np.int64), axis=-1)


def test_records_from_generation_keep_vllms_rows_and_leave_the_rest_to_the_router() -> None:
    out = rollout()
    keys = ("output_ids", "generation_lengths", "unpadded_sequence_lengths", "routed_experts")
    generation = {k: torch.from_numpy(out[k]) for k in keys}
    records = nemo_rl.records_from_generation(generation, SPEC, sample_ids=SAMPLE_IDS, policy_version=3)
    assert out["routed_experts"].dtype == np.int8, "NeMo-RL's carry dtype for 8 experts"
    for i, (record, sample) in enumerate(zip(records, MANIFEST["samples"], strict=True)):
        n = sample["prompt"] + sample["generation"]
        vllm = out[f"s{i}_vllm_rows"]
        routed = min(vllm.shape[0], n - 1)  # a surplus final row is dropped, a short one leaves -1 rows
        assert (record.prompt_len, record.response_len) == (sample["prompt"], sample["generation"])
        np.testing.assert_array_equal(record.token_ids, out["output_ids"][i, :n])
        assert record.valid is not None
        np.testing.assert_array_equal(record.valid, np.arange(n) < routed)
        np.testing.assert_array_equal(np.sort(record.expert_ids[:routed], -1), moe_rows(vllm[:routed]))
        assert int(out["r3_routed_experts_missing_routes"][i]) == n - 1 - routed
        assert record.policy_version == 3 and record.engine == "vllm"


def test_records_from_messages_equal_the_flattened_train_data() -> None:
    """Per-message routes (tensors, or NeMo-RL's own ``nrlre1:`` envelopes) and the flattened ``train_data`` give the
    same records: messages back-filled with -1 and the final row are left to the router, environment messages'
    ``arange(K)`` rows are replayed as NeMo-RL replays them."""
    out, data = rollout(), arrays("tp2_sp_cp2")
    batch = nemo_rl.records_from_batch(
        data["routed_experts"], data["input_ids"], data["input_lengths"], SPEC, sample_ids=SAMPLE_IDS
    )
    for i, (sid, messages) in enumerate(zip(SAMPLE_IDS, MANIFEST["messages"], strict=True)):
        as_tensors = [
            {
                "role": m["role"],
                "token_ids": torch.from_numpy(out[f"s{i}_m{j}_tokens"]),
                "routed_experts": torch.from_numpy(out[f"s{i}_m{j}_routes"]),
            }
            for j, m in enumerate(messages)
        ]
        as_envelopes = [{**m, "routed_experts": e} for m, e in zip(as_tensors, MANIFEST["envelopes"][i], strict=True)]
        for log in (as_tensors, as_envelopes):
            record = nemo_rl.records_from_messages(log, SPEC, sample_id=sid)
            assert record.prompt_len == messages[0]["tokens"]
            np.testing.assert_array_equal(record.token_ids, batch[i].token_ids)
            np.testing.assert_array_equal(record.valid, batch[i].valid)
            valid = np.asarray(record.valid)
            np.testing.assert_array_equal(record.expert_ids[valid], batch[i].expert_ids[valid])
    unrouted = batch[4]  # its trailing 2-token user message was back-filled with -1 by NeMo-RL
    assert unrouted.valid is not None and not unrouted.valid[-2:].any() and unrouted.valid[:-2].all()
    environment = batch[3]  # a trailing environment message: arange(K) dummies, which NeMo-RL replays
    assert environment.valid is not None and environment.valid[:-1].all()
    np.testing.assert_array_equal(environment.expert_ids[-3:-1], [[[0, 1]] * 6] * 2)
    # a message without routes at all is left to the router, like NeMo-RL's -1 back-fill
    bare = [{"role": "user", "token_ids": out["s0_m0_tokens"], "routed_experts": None}]
    bare.append({"role": "assistant", "token_ids": out["s0_m1_tokens"], "routed_experts": out["s0_m1_routes"]})
    record = nemo_rl.records_from_messages(bare, SPEC, sample_id="bare")
    assert record.valid is not None and not record.valid[:5].any() and record.valid[5:-1].all()


def test_a_partly_missing_row_is_refused_naming_the_sample() -> None:
    data = arrays("tp2_sp_cp2")
    routes = data["routed_experts"].copy()
    routes[1, 2, 1, 0] = -1
    with pytest.raises(IngestError, match=r"sample 'grpo-7/1'.*row 2 is -1 in some slots only"):
        nemo_rl.records_from_batch(routes, data["input_ids"], data["input_lengths"], SPEC, sample_ids=SAMPLE_IDS)


def test_the_driver_writes_each_batch_once_and_carries_only_sample_ids() -> None:
    """The replacement of ``grpo._preserve_router_replay_routed_experts``: ``train_data`` and ``logprob_data`` of one
    batch share one step (written and sealed once), hold sample ids and no dense routes; the next batch is the next
    step; the store holds what NeMo-RL would have replayed, with the tokens' hashes."""
    data = arrays("tp2_sp_cp2")
    url = f"memory://nemo-rl/{uuid.uuid4().hex}"
    grpo = types.ModuleType("nemo_rl.algorithms.grpo")
    original = nothing
    grpo._preserve_router_replay_routed_experts = original  # type: ignore[attr-defined]
    recorder = nemo_rl.install_driver(url, grpo=grpo, spec=SPEC)
    policy = {"router_replay": {"enabled": True}}
    lengths = torch.from_numpy(data["input_lengths"])
    for expected_step in (0, 1):
        flat = collections.UserDict(
            {
                "token_ids": torch.from_numpy(data["input_ids"]),
                "routed_experts": torch.from_numpy(data["routed_experts"]),
                "token_loss_mask": torch.from_numpy((np.arange(data["input_ids"].shape[1]) >= 5)[None].repeat(6, 0)),
            }
        )
        train_data = collections.UserDict({"input_ids": flat["token_ids"], "input_lengths": lengths})
        logprob_data = collections.UserDict({"input_ids": flat["token_ids"], "input_lengths": lengths})
        for target in (train_data, logprob_data):
            target[nemo_rl.ROUTES_KEY] = flat[nemo_rl.ROUTES_KEY]  # as if NeMo-RL had copied it before
            grpo._preserve_router_replay_routed_experts(target, flat, policy)
            assert nemo_rl.ROUTES_KEY not in target
            assert target[nemo_rl.STEP_KEY] == [expected_step] * 6
            assert target[nemo_rl.SAMPLE_ID_KEY] == [f"s{expected_step}/{b}" for b in range(6)]
    store = routelog.open_store(url)
    assert store.steps() == [0, 1]
    snapshot = store.step(1)
    assert snapshot.sealed and sorted(snapshot.sample_ids) == sorted(f"s1/{b}" for b in range(6))
    info = snapshot.info("s1/0")
    assert (info.prompt_len, info.n_tokens) == (5, int(data["input_lengths"][0]))
    assert info.token_hash == routelog.token_hash(data["input_ids"][0, : info.n_tokens])
    disabled = collections.UserDict({"input_lengths": lengths})
    grpo._preserve_router_replay_routed_experts(disabled, flat, {"router_replay": {"enabled": False}})
    assert nemo_rl.SAMPLE_ID_KEY not in disabled, "router replay off: NeMo-RL's behaviour, nothing carried"
    recorder.uninstall()
    assert grpo._preserve_router_replay_routed_experts is original


# -- failing closed ------------------------------------------------------------------------------------------------
def one_rank(config: str = "tp2_sp_cp2") -> tuple[dict[str, Any], dict[str, Any]]:
    described = MANIFEST["configs"][config]
    return described, described["ranks"][0]


def replay_for(
    store: routelog.Store, described: dict[str, Any], rank: dict[str, Any], **options: Any
) -> nemo_rl.NemoRLReplay:
    coords = RankCoords(tp=rank["tp"], cp=rank["cp"], pp=rank["pp"])
    split = nemo_rl_local_rows(tp_rank=rank["tp"], tp_size=described["tp"], sequence_parallel=described["sp"])
    options.setdefault("local_rows", split)
    return nemo_rl.NemoRLReplay(store, layout=layout_of(described), rank=coords, **options)


def test_routing_of_another_policy_version_is_refused_unless_opted_out() -> None:
    """The driver recorded step 7's rollout as generated by policy version 6: the worker refuses it at the first
    micro-batch, before any router runs, naming the sample and both versions; ``policy_versions="any"`` or a rule
    that takes version 6 replays it."""
    described, rank = one_rank()
    store = write_store("tp2_sp_cp2", policy_version=6)
    assert store.step(STEP).read("grpo-7/0").info.policy_version == 6
    chunk = stage(1, 0)
    for options, refused in (
        ({}, True),
        ({"policy_versions": "any"}, False),
        ({"policy_versions": lambda s: {s - 1}}, False),
    ):
        replay = replay_for(store, described, rank, **options)
        try:
            item = next(iter(iterate(replay, "tp2_sp_cp2", rank, raw_micro_batches("tp2_sp_cp2", rank))))
            if refused:
                with pytest.raises(
                    StaleRoutingError, match=r"sample 'grpo-7/\d'.*policy version 6.*takes version 7 only"
                ):
                    replay.set_router_replay_forward(unexpected, chunk, item.routed_experts_cp_sharded)
            else:
                replay.set_router_replay_forward(unexpected, chunk, item.routed_experts_cp_sharded)
        finally:
            replay.uninstall()


def test_tokens_or_lengths_other_than_the_recorded_ones_are_refused() -> None:
    described, rank = one_rank()
    store = write_store("tp2_sp_cp2")
    chunk = stage(1, 0)
    raw = raw_micro_batches("tp2_sp_cp2", rank)
    raw[0]["input_ids"] = raw[0]["input_ids"].clone()
    raw[0]["input_ids"][1, 3] += 1
    replay = replay_for(store, described, rank)
    try:
        item = next(iter(iterate(replay, "tp2_sp_cp2", rank, raw)))
        with pytest.raises(AlignmentError, match=r"grpo-7/1.*tokens fed hash"):
            replay.set_router_replay_forward(unexpected, chunk, item.routed_experts_cp_sharded)
    finally:
        replay.uninstall()
    raw = raw_micro_batches("tp2_sp_cp2", rank)
    raw[1]["input_lengths"] = raw[1]["input_lengths"] - 1
    replay = replay_for(store, described, rank)
    try:
        item = next(iter(iterate(replay, "tp2_sp_cp2", rank, raw)))
        with pytest.raises(AlignmentError, match="field 'input_lengths': NeMo-RL feeds 10 tokens, step 7 holds 11"):
            replay.set_router_replay_forward(unexpected, chunk, item.routed_experts_cp_sharded)
    finally:
        replay.uninstall()


def test_nemo_rls_own_sharding_places_the_rows() -> None:
    """NeMo-RL's sharding is authoritative: a NeMo-RL that puts the rows elsewhere than routelog's model of its
    packing (here, the two CP halves of each sequence swapped, and a policy config claiming FP8 padding NeMo-RL's
    iterator does not apply) still gets each recorded route at the token NeMo-RL put there; codes outside the
    micro-batch, a NeMo-RL that drops the codes, or one whose split returns another shape are refused, naming it."""
    config = "tp2_sp_cp2"
    described, rank = one_rank(config)
    store = write_store(config)
    chunk = stage(1, 0)
    raw = raw_micro_batches(config, rank)
    snapshot = store.step(STEP)

    def altered(change: Any) -> Any:
        """NeMo-RL's iterator, each processed micro-batch changed by ``change``."""
        make = nemo_iterator(config, rank)

        @functools.wraps(make)  # NeMo-RL's signature
        def iterator(*args: Any, **kwargs: Any) -> Iterator[Any]:
            for item in make(*args, **kwargs):
                change(item)
                yield item

        return iterator

    def swapped(item: Any) -> None:
        rows = item.routed_experts_cp_sharded
        half = rows.shape[1] // 2
        item.routed_experts_cp_sharded = torch.cat([rows[:, half:], rows[:, :half]], dim=1)

    megatron = {**described["policy"]["megatron_cfg"], "fp8_cfg": {"enabled": True, "fp8_recipe": "blockwise"}}
    replay = replay_for(store, described, rank)
    try:
        for m, item in enumerate(
            replay.make_processed_microbatch_iterator(
                altered(swapped),
                raw_iterator=iter(raw),
                cfg={**described["policy"], "megatron_cfg": megatron},
                straggler_timer=None,
                **rank["iterator_args"],
            )
        ):
            codes = item.routed_experts_cp_sharded
            replay.set_router_replay_forward(unexpected, chunk, codes)
            torch.manual_seed(m)
            seen = route(chunk, torch.randn(rank["micro_batches"][m]["rows"], 1, HIDDEN))
            replay.clear_router_replay(nothing, chunk)
            local = nemo_rl_local_rows(tp_rank=rank["tp"], tp_size=2, sequence_parallel=True)(None, codes)
            flat = local.reshape(-1).numpy() - 1
            width = raw[m]["input_ids"].shape[1]
            checked = 0
            for row, code in enumerate(flat):
                if code < 0:
                    continue
                sid = raw[m][nemo_rl.SAMPLE_ID_KEY][code // width]
                record = snapshot.read(sid)
                if not record.valid[code % width] or code % width == record.info.n_tokens - 1:
                    continue
                for layer in seen:
                    want = np.sort(record.ids[code % width, SPEC.moe_layers.index(layer - 1)])
                    np.testing.assert_array_equal(seen[layer][row], want, err_msg=f"{sid} {code % width} {layer}")
                checked += 1
            assert checked > 0
    finally:
        replay.uninstall()

    def first_item(make: Any, **options: Any) -> tuple[nemo_rl.NemoRLReplay, Any]:
        replay = replay_for(store, described, rank, **options)
        items = replay.make_processed_microbatch_iterator(
            make,
            raw_iterator=iter(raw_micro_batches(config, rank)),
            cfg=described["policy"],
            straggler_timer=None,
            **rank["iterator_args"],
        )
        return replay, items

    def outside(item: Any) -> None:
        item.routed_experts_cp_sharded = item.routed_experts_cp_sharded + 10_000

    replay, items = first_item(altered(outside))
    with pytest.raises(AlignmentError, match="row codes outside the micro-batch's tokens"):
        replay.set_router_replay_forward(unexpected, chunk, next(iter(items)).routed_experts_cp_sharded)
    replay.uninstall()

    def dropped(item: Any) -> None:
        item.routed_experts_cp_sharded = None

    replay, items = first_item(altered(dropped))
    with pytest.raises(ReplayConfigError, match="left micro-batch 0's routed_experts_cp_sharded empty"):
        next(iter(items))
    replay.uninstall()
    replay, items = first_item(nemo_iterator(config, rank), local_rows=lambda config, routed: routed)
    with pytest.raises(ReplayConfigError, match=r"gave shape \(1, \d+, 1, 1\)"):
        replay.set_router_replay_forward(unexpected, chunk, next(iter(items)).routed_experts_cp_sharded)
    replay.uninstall()


def test_samples_the_step_does_not_hold_are_refused() -> None:
    described, rank = one_rank()
    store = write_store("tp2_sp_cp2")
    raw = raw_micro_batches("tp2_sp_cp2", rank)
    raw[0][nemo_rl.SAMPLE_ID_KEY] = ["grpo-7/0", "elsewhere", "grpo-7/2"]
    replay = replay_for(store, described, rank)
    try:
        item = next(iter(iterate(replay, "tp2_sp_cp2", rank, raw)))
        with pytest.raises(AlignmentError, match=r"sample 'elsewhere' .* is not in step 7"):
            replay.set_router_replay_forward(unexpected, stage(1, 0), item.routed_experts_cp_sharded)
    finally:
        replay.uninstall()


def test_without_sample_ids_nemo_rls_own_code_runs() -> None:
    """Micro-batches that carry NeMo-RL's dense routes, and every call about them, go to NeMo-RL's functions."""
    described, rank = one_rank()
    replay = replay_for(write_store("tp2_sp_cp2"), described, rank)
    raw = raw_micro_batches("tp2_sp_cp2", rank)
    for data in raw:
        del data[nemo_rl.SAMPLE_ID_KEY], data[nemo_rl.STEP_KEY]
    items = list(iterate(replay, "tp2_sp_cp2", rank, raw))
    assert [i.routed_experts_cp_sharded for i in items] == [None, None]
    calls: list[str] = []
    tensor = torch.zeros(1, 4, 8, 2)
    replay.set_router_replay_forward(lambda model, routed: calls.append("forward"), stage(1, 0), tensor)
    replay.set_router_replay_backward(lambda model: calls.append("backward"), stage(1, 0))
    replay.clear_router_replay(lambda model: calls.append("clear"), stage(1, 0))
    assert calls == ["forward", "backward", "clear"]
    check = replay.should_use_router_replay
    assert check(lambda **kw: False, enabled=True, data={nemo_rl.SAMPLE_ID_KEY: []}, stage="train", require=True)
    assert not check(lambda **kw: False, enabled=True, data={nemo_rl.SAMPLE_ID_KEY: []}, stage="ref", require=False)
    assert check(lambda **kw: kw["stage"] == "x", enabled=True, data={}, stage="x", require=True)
    with pytest.raises(ReplayFidelityError, match=r"policy\.router_replay\.enabled=true"):  # never inert
        check(lambda **kw: False, enabled=False, data={nemo_rl.SAMPLE_ID_KEY: []}, stage="train", require=False)
    assert not check(lambda **kw: False, enabled=False, data={}, stage="train", require=False)  # NeMo-RL's own


# -- installing and publishing ---------------------------------------------------------------------------------------
def fake_nemo_rl() -> dict[str, types.ModuleType]:
    modules = {}
    for key, name, functions in (
        ("data", "nemo_rl.models.megatron.data", ("make_processed_microbatch_iterator",)),
        ("train", "nemo_rl.models.megatron.train", ("set_router_replay_forward", "set_router_replay_backward",
                                                    "clear_router_replay")),
        ("worker", "nemo_rl.models.policy.workers.megatron_policy_worker", ("_should_use_router_replay",)),
    ):  # fmt: skip
        module = types.ModuleType(name)
        for function in functions:
            setattr(module, function, nothing)
        modules[key] = module
    return modules


def test_install_patches_nemo_rls_names_in_the_namespaces_that_call_them(monkeypatch: pytest.MonkeyPatch) -> None:
    store = write_store("tp2_sp_cp2")
    modules = fake_nemo_rl()
    with pytest.raises(ReplayConfigError, match=nemo_rl.URL_ENV):
        nemo_rl.install(modules=modules)
    monkeypatch.setenv(nemo_rl.URL_ENV, store.url)
    replay = nemo_rl.install(modules=modules)
    try:
        assert nemo_rl.install(modules=modules) is replay, "a second call keeps the first installation"
        assert modules["train"].set_router_replay_forward._routelog is replay
        assert modules["train"].clear_router_replay.__wrapped__ is nothing
        assert modules["data"].make_processed_microbatch_iterator._routelog is replay
        assert modules["worker"]._should_use_router_replay._routelog is replay
        assert replay.store.url == store.url
    finally:
        nemo_rl.uninstall()
    assert (
        modules["train"].set_router_replay_forward is nothing and modules["worker"]._should_use_router_replay is nothing
    )
    del modules["train"].clear_router_replay
    with pytest.raises(ReplayConfigError, match="has no clear_router_replay"):
        nemo_rl.install(store, modules=modules)
    assert modules["train"].set_router_replay_forward is nothing, "nothing patched: all or nothing"
    nemo_rl.uninstall()


def test_router_diff_is_published_per_step_and_phase() -> None:
    """The measured router diff of the log-prob pass and of training go to the store as fidelity documents of the
    step, one writer per rank."""
    config = "hybridep_div1"
    described = MANIFEST["configs"][config]
    (rank,) = described["ranks"]
    store = write_store(config)
    chunk = stage(1, 0)
    replay = replay_for(store, described, rank, fidelity_writer="policy")
    try:
        for train in (False, True):
            for m, item in enumerate(iterate(replay, config, rank, raw_micro_batches(config, rank))):
                torch.manual_seed(m)
                replay.set_router_replay_forward(unexpected, chunk, item.routed_experts_cp_sharded)
                route(chunk, torch.randn(rank["micro_batches"][m]["rows"], 1, HIDDEN))
                if train:
                    replay.set_router_replay_backward(unexpected, chunk)
                else:
                    replay.clear_router_replay(nothing, chunk)
            replay.clear_router_replay(nothing, chunk)
        pending = replay.flush()
    finally:
        replay.uninstall()
    assert sorted(pending) == [(STEP, "logprob"), (STEP, "train")]
    records = {r.phase: r for r in read_fidelity(store, STEP)}
    assert sorted(records) == ["logprob", "train"]
    data = arrays(config)
    routed_rows = sum(  # every row but the final ones and NeMo-RL's -1 rows
        int((data["routed_experts"][b, : n - 1] != nemo_rl.MISSING).any(axis=(1, 2)).sum())
        for b, n in enumerate(data["input_lengths"])
    )
    for record in records.values():
        assert record.writer_id == "policy-pp0-cp0-tp0-dp0" and record.samples == len(SAMPLE_IDS)
        assert record.layers == list(SPEC.moe_layers)
        assert set(record.replayed_rows) == {routed_rows}
        assert all(0 <= d <= r for d, r in zip(record.differing_rows, record.replayed_rows, strict=True))


def test_fixtures_name_their_provenance() -> None:
    assert MANIFEST["nemo_rl"]["commit"] == nemo_rl.NEMO_RL_COMMIT
    assert MANIFEST["generator"] == "tools/make_nemo_rl_fixtures.py"
    assert set(CONFIGS) >= {"tp2_sp_cp2", "cp2_div16_dp2", "tp2_sp_fp8_blockwise", "pp2_cp2", "unpacked_tp2_sp"}
    covered = {(c["tp"], c["cp"], c["pp"], c["dp"]) for c in MANIFEST["configs"].values()}
    assert any(t > 1 and cp > 1 for t, cp, _, _ in covered) and any(pp > 1 and dp > 1 for _, _, pp, dp in covered)
