"""Installing replay into the real megatron-core 0.16 (CPU, gloo, world size 1): routers select exactly the stored
experts, gradients reach the router, recomputation pops the same targets, and wrong setups fail loudly."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import routelog
from routelog import AlignmentError, ModelSpec, Record, ReplayConfigError
from routelog.align import AlignmentPlan, Packing, ParallelLayout, RankCoords, parse_micro_batches
from routelog.align.plan import MicroBatchReplay
from routelog.loader import ReplayLoader
from routelog.store.fidelity import FidelityGate, ReplayFidelityError

pytestmark = pytest.mark.usefixtures("megatron_env")
torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

FREQ = [0, 1, 1, 1, 0, 1, 1, 1]
SPEC = ModelSpec.from_megatron(num_layers=8, num_moe_experts=8, moe_router_topk=2, moe_layer_freq=FREQ)
HIDDEN = 32


def megatron_config(**overrides: Any) -> Any:
    from megatron.core.transformer import TransformerConfig

    fields: dict[str, Any] = {
        "num_layers": 8,
        "hidden_size": HIDDEN,
        "num_attention_heads": 4,
        "num_moe_experts": 8,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": 16,
        "ffn_hidden_size": 64,
        "moe_layer_freq": FREQ,
        "moe_enable_routing_replay": True,
        "moe_token_dispatcher_type": "allgather",
        "use_cpu_initialization": True,
        "params_dtype": torch.float32,
        "add_bias_linear": False,
        "moe_aux_loss_coeff": 0.0,
    }
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_chunks(config: Any, pp_rank: int = 0) -> list[Any]:
    """Real GPTModel chunks (one per virtual stage) of pipeline rank ``pp_rank``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    torch.manual_seed(0)
    vpp = config.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for v in range(vpp):
        block = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, vp_stage=v if vpp > 1 else None, pp_rank=pp_rank
        )
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=block,
                vocab_size=512,
                max_sequence_length=256,
                pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                vp_stage=v if vpp > 1 else None,
                pre_process=v == 0,
                post_process=v == vpp - 1,
            )
        )
    return chunks


@pytest.fixture
def store_url(make_routing: Callable[..., np.ndarray]) -> str:
    import uuid

    url = f"memory://megatron/{uuid.uuid4().hex}"
    rng = np.random.default_rng(0)
    with routelog.open_writer(url, 0, model_spec=SPEC) as writer:
        for i, n in enumerate([13, 22, 9, 17]):
            valid = np.ones(n, bool)
            valid[-1] = False
            writer.append(
                Record(
                    sample_id=f"s{i}",
                    expert_ids=make_routing(rng, n, 6, 8, 2),
                    prompt_len=4,
                    response_len=n - 4,
                    valid=valid,
                    token_ids=np.arange(n) + i,
                )
            )
    return url


def plan(rank: RankCoords | None = None, layout: ParallelLayout | None = None) -> AlignmentPlan:
    return AlignmentPlan(
        SPEC,
        layout or ParallelLayout(),
        Packing("verl"),
        rank or RankCoords(),
        tuple(parse_micro_batches("s0,s1|s2,s3")),
    )


def moe_layers(chunk: Any) -> Iterator[Any]:
    for layer in chunk.decoder.layers:
        if hasattr(layer.mlp, "router"):
            yield layer


def selected(routing_map: Any) -> np.ndarray:
    """Sorted expert IDs per row of a routing map [T, E]."""
    return np.sort(np.nonzero(routing_map.numpy())[1].reshape(routing_map.shape[0], -1), axis=-1)


def embed(chunk: Any, input_ids: Any) -> None:
    """Run the chunk's embedding on ``input_ids`` (``[B, S]``; 1-D: one packed row), as the forward of a chunk of
    the first pipeline stage does before any router (other chunks have no embedding)."""
    if not getattr(chunk, "pre_process", False):
        return
    ids = torch.as_tensor(np.asarray(input_ids, np.int64))
    ids = ids[None] if ids.dim() == 1 else ids
    chunk.embedding(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1))


def fed_tokens(mb: MicroBatchReplay) -> np.ndarray:
    """The tokens a trainer feeds for ``mb`` when it feeds what the rollout generated (0 on padding rows)."""
    assert mb.tokens is not None
    return np.where(mb.tokens >= 0, mb.tokens, 0)


def run_moe_layers(
    chunk: Any, rows: int, seed: int = 1, mb: MicroBatchReplay | None = None
) -> tuple[dict[int, np.ndarray], Any]:
    """Forward every MoE layer of a chunk on random hidden states [T, 1, H]; returns each router's selection. With
    ``mb``, the chunk's embedding first takes the micro-batch's own tokens (as a forward of the first stage does)."""
    if mb is not None:
        embed(chunk, fed_tokens(mb))
    torch.manual_seed(seed)
    seen: dict[int, np.ndarray] = {}
    total = None
    for layer in moe_layers(chunk):
        router = layer.mlp.router
        handle = router.register_forward_hook(
            lambda module, args, out: seen.__setitem__(int(module.layer_number), selected(out[1]))
        )
        hidden = torch.randn(rows, 1, HIDDEN, requires_grad=True)
        out, _ = layer.mlp(hidden)
        total = out.sum() if total is None else total + out.sum()
        handle.remove()
    return seen, total


def test_routers_select_exactly_the_stored_experts_and_gradients_flow(store_url: str) -> None:
    from routelog.megatron import MegatronReplay

    config = megatron_config()
    (chunk,) = build_chunks(config)
    replay = MegatronReplay([chunk], plan(), config=config)
    for mb in ReplayLoader(store_url, 0, plan()):
        with replay.forward(
            mb,
            tokens=[
                np.arange(n) + int(s[1:])
                for s, n in zip(mb.sample_ids, [13, 22, 9, 17][int(mb.sample_ids[0][1:]) :], strict=False)
            ],
        ):
            seen, loss = run_moe_layers(chunk, mb.ids.shape[1], mb=mb)
        for j, router in enumerate(mb.routers):
            np.testing.assert_array_equal(seen[router.layer_number], np.sort(mb.ids[j], axis=-1))
        loss.backward()
        for layer in moe_layers(chunk):
            assert layer.mlp.router.weight.grad is not None
            assert layer.mlp.router.weight.grad.abs().sum() > 0, "softmax weights come from the live logits"
    replay.end_step()
    for layer in moe_layers(chunk):
        assert layer.mlp.router.router_replay.target_topk_idx is None


def test_recompute_pops_the_same_targets_in_order(store_url: str) -> None:
    from routelog.megatron import MegatronReplay

    (chunk,) = build_chunks(megatron_config())
    replay = MegatronReplay([chunk], plan())
    mbs = list(ReplayLoader(store_url, 0, plan()))
    for mb in mbs:  # forward of micro-batch 0 then 1 (activation recomputation deferred to backward)
        with replay.forward(mb):
            run_moe_layers(chunk, mb.ids.shape[1], mb=mb)
    first = next(moe_layers(chunk)).mlp.router
    for mb in mbs:  # recomputation in backward order of 1F1B: oldest first
        _, routing_map = first(torch.randn(mb.ids.shape[1], 1, HIDDEN))
        np.testing.assert_array_equal(selected(routing_map), np.sort(mb.layer_ids(int(first.layer_number)), -1))
    assert first.router_replay.replay_backward_list == []
    replay.end_step()


def test_virtual_stages_are_walked_by_layer_number(store_url: str) -> None:
    from routelog.megatron import MegatronReplay, find_routers

    config = megatron_config(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32
    )
    chunks = build_chunks(config, pp_rank=0)
    assert [(r.vp_stage, r.layer_number) for r in find_routers(chunks)] == [(0, 2), (1, 6)]
    layout = ParallelLayout(pp=2, vpp=2)
    MegatronReplay(chunks, plan(RankCoords(pp=0), layout))
    with pytest.raises(AlignmentError, match="differ from the plan"):
        MegatronReplay(chunks, plan(RankCoords(pp=1), layout))


def test_row_count_mismatch_fails_loudly(store_url: str) -> None:
    from routelog.megatron import MegatronReplay

    (chunk,) = build_chunks(megatron_config())
    replay = MegatronReplay([chunk], plan())
    mb = next(iter(ReplayLoader(store_url, 0, plan())))
    with replay.forward(mb), pytest.raises(AlignmentError, match="the router sees"):
        run_moe_layers(chunk, mb.ids.shape[1] + 1, mb=mb)
    with pytest.raises(ReplayFidelityError, match="inert"):  # the step stays failed: no router took the routes
        replay.end_step()
    for layer in moe_layers(chunk):
        assert layer.mlp.router.router_replay.target_topk_idx is None, "and its routes are cleared all the same"


def test_tokens_that_do_not_match_the_routing_are_refused(store_url: str) -> None:
    from routelog.megatron import MegatronReplay

    (chunk,) = build_chunks(megatron_config())
    replay = MegatronReplay([chunk], plan())
    mb = next(iter(ReplayLoader(store_url, 0, plan())))
    with (
        pytest.raises(AlignmentError, match="tokens fed hash"),
        replay.forward(mb, tokens=[np.arange(13), np.arange(22)]),
    ):
        pass


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"moe_router_fusion": True}, "moe_router_fusion"),
        ({"moe_router_load_balancing_type": "sinkhorn"}, "sinkhorn"),
        ({"moe_expert_capacity_factor": 1.0, "moe_token_drop_policy": "probs"}, "capacity_factor"),
        ({"moe_enable_routing_replay": False}, "moe_enable_routing_replay"),
        ({"moe_router_topk": 3}, "moe_router_topk"),
    ],
)
def test_configurations_that_bypass_replay_are_refused(overrides: dict[str, Any], words: str) -> None:
    from routelog.megatron import check_config

    try:
        config = megatron_config(**overrides)
    except (ValueError, AssertionError) as exc:  # megatron-core itself refuses some combinations on CPU
        pytest.skip(f"megatron-core refuses the configuration itself: {exc}")
    with pytest.raises(ReplayConfigError, match=words):
        check_config(config, SPEC)


def test_r2_recordings_from_megatron_rebuild_records(store_url: str) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from routelog.engines.megatron_r2 import RecordedShard, records_from_recordings
    from routelog.megatron import find_routers

    (chunk,) = build_chunks(megatron_config())
    p = plan()
    routers = find_routers([chunk])
    shards, truth = [], {}
    for router in routers:
        router.module.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    loader = ReplayLoader(store_url, 0, p)
    for mb in loader:
        seen, _ = run_moe_layers(chunk, mb.ids.shape[1], seed=mb.index)
        recorded = [r.module.router_replay.get_recorded_indices().numpy() for r in routers]
        shards.append(RecordedShard(p, mb.index, recorded))
        truth[mb.index] = (mb, seen)
    for router in routers:
        router.module.router_replay.clear_indices()
        router.module.router_replay.clear_router_replay_action()
    snapshot = routelog.open_store(store_url).step(0)
    lengths = {sid: (snapshot.info(sid).prompt_len, snapshot.info(sid).response_len) for sid in p.sample_ids}
    rebuilt = {r.sample_id: r for r in records_from_recordings(shards, lengths)}
    for mb, seen in truth.values():
        real = np.flatnonzero(mb.positions[:, 0] >= 0)
        for router in mb.routers:
            for row in real:
                sid, pos = p.sample_ids[mb.positions[row, 0]], mb.positions[row, 1]
                got = np.sort(np.asarray(rebuilt[sid].expert_ids)[pos, router.moe_index])
                np.testing.assert_array_equal(got, seen[router.layer_number][row])
        assert mb.routers


def test_mtp_routers_are_never_replayed_and_their_recordings_become_the_mtp_stream(store_url: str) -> None:
    """A model with an MTP layer: its router (layer_number past the decoder's) is not addressed by the installer,
    keeps routing natively while the decoder replays, and its R2 recordings are kept apart as the mtp stream."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from routelog.engines.megatron_r2 import RecordedShard, records_from_recordings
    from routelog.megatron import MegatronReplay

    RouterReplay.clear_global_router_replay_instances()
    torch.manual_seed(0)
    config = megatron_config(mtp_num_layers=1)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=512,
        max_sequence_length=256,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        mtp_block_spec=get_gpt_mtp_block_spec(config, block.layer_specs[-1], use_transformer_engine=False),
    )
    (mtp_router,) = [m for name, m in model.named_modules() if isinstance(m, TopKRouter) and name.startswith("mtp")]
    # megatron-core 0.16 numbers the MTP router after the decoder (9); 0.19 restarts at 1, colliding with the
    # decoder's first layer: the installer must find routers by walking the decoder, never by number alone.
    assert int(mtp_router.layer_number) in (9, 1)
    p = plan()
    replay = MegatronReplay([model], p, config=config)
    assert [r.layer_number for r in replay.routers] == [r.layer_number for r in p.routers]
    with ReplayLoader(store_url, 0, p) as loader:
        mb = next(iter(loader))
    rows = mb.ids.shape[1]
    with replay.forward(mb):
        seen, _ = run_moe_layers(model, rows, mb=mb)
        hidden = torch.randn(rows, 1, HIDDEN)
        native = selected(mtp_router(hidden)[1])  # the MTP router routes on its own logits
    for j, router in enumerate(mb.routers):
        np.testing.assert_array_equal(seen[router.layer_number], np.sort(mb.ids[j], axis=-1))
    assert mtp_router.router_replay.router_replay_action is None
    assert native.shape == (rows, 2)
    replay.end_step()
    replay.remove()

    # R2: the MTP router's recording goes to the mtp stream, never into a decoder layer.
    spec = SPEC.model_copy(update={"mtp_layers": 1}).with_mtp_stream()
    p_mtp = AlignmentPlan(spec, ParallelLayout(), Packing("verl"), RankCoords(), p.micro_batches)
    mtp_router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    mtp_router(hidden)
    mtp_rows = mtp_router.router_replay.get_recorded_indices().numpy()
    decoder_rows = [mb.ids[j] for j in range(len(mb.routers))]
    snapshot = routelog.open_store(store_url).step(0)
    lengths = {sid: (snapshot.info(sid).prompt_len, snapshot.info(sid).response_len) for sid in p.sample_ids}
    shard = RecordedShard(p_mtp, mb.index, decoder_rows, mtp_recordings=[mtp_rows])
    rebuilt = {r.sample_id: r for r in records_from_recordings([shard], {s: lengths[s] for s in mb.sample_ids})}
    real = np.flatnonzero(mb.positions[:, 0] >= 0)
    for row in real:
        sid, pos = p.sample_ids[mb.positions[row, 0]], mb.positions[row, 1]
        streams = rebuilt[sid].streams
        assert streams is not None
        np.testing.assert_array_equal(np.asarray(streams["mtp"].expert_ids)[pos, 0], mtp_rows[row])
    mtp_router.router_replay.clear_indices()
    mtp_router.router_replay.clear_router_replay_action()


def test_missing_rows_take_the_routers_own_choice_with_the_router_policy(
    make_routing: Callable[..., np.ndarray],
) -> None:
    """``missing="router"`` (NeMo-RL's policy): rows the engine never routed are left to the router, every other
    row replays; the wrapper also counts how often the router's own choice differs from the replayed one."""
    import uuid

    from routelog.megatron import MaskedTopk, MegatronReplay

    url = f"memory://megatron/{uuid.uuid4().hex}"
    rng = np.random.default_rng(3)
    with routelog.open_writer(url, 0, model_spec=SPEC) as writer:
        for i, n in enumerate([15, 11]):
            valid = np.ones(n, bool)
            valid[[3, 4, n - 1]] = False  # a hole the engine never prefilled, and the final token
            writer.append(
                Record(
                    sample_id=f"s{i}",
                    expert_ids=make_routing(rng, n, 6, 8, 2),
                    prompt_len=2,
                    response_len=n - 2,
                    valid=valid,
                    token_ids=rng.integers(0, 64, n),
                )
            )
    p = AlignmentPlan(
        SPEC, ParallelLayout(), Packing("verl"), RankCoords(), tuple(parse_micro_batches("s0,s1")), missing="router"
    )
    (chunk,) = build_chunks(megatron_config())
    mb = next(iter(ReplayLoader(url, 0, p)))
    native, _ = run_moe_layers(chunk, mb.ids.shape[1], seed=5)  # no replay action: the routers' own choice
    replay = MegatronReplay([chunk], p, config=megatron_config())
    with replay.forward(mb):
        seen, loss = run_moe_layers(chunk, mb.ids.shape[1], seed=5, mb=mb)
    loss.backward()
    assert not mb.mask.all() and mb.mask.any()
    for j, router in enumerate(mb.routers):
        want = np.where(mb.mask[:, None], np.sort(mb.ids[j], axis=-1), native[router.layer_number])
        np.testing.assert_array_equal(seen[router.layer_number], want)
    diff = replay.router_diff()
    for j, router in enumerate(mb.routers):
        rows, differing = diff[router.layer_number]
        assert rows == int(mb.mask.sum())
        expected = (native[router.layer_number][mb.mask] != np.sort(mb.ids[j], -1)[mb.mask]).any(axis=1).sum()
        assert differing == int(expected)
    replay.end_step()
    replay.remove()
    assert not isinstance(next(moe_layers(chunk)).mlp.router.router_replay.get_replay_topk, MaskedTopk), "restored"


# -- replay that cannot go wrong quietly ----------------------------------------------------------------------------
def _embedded_forward(replay: Any, chunk: Any, mb: MicroBatchReplay, input_ids: np.ndarray) -> None:
    """A first-stage forward: the embedding takes ``input_ids``, then every MoE layer routes."""
    with replay.forward(mb):
        embed(chunk, input_ids)
        run_moe_layers(chunk, mb.ids.shape[1])


def test_reordered_samples_are_refused_row_by_row(store_url: str) -> None:
    """The trainer feeds s0 then s1 while the routing was gathered for s1 then s0: same rows in all (no padding),
    so counts and shapes agree; only the tokens row by row tell, and the step fails before the optimizer."""
    from routelog.megatron import MegatronReplay

    (chunk,) = build_chunks(megatron_config())
    claimed = AlignmentPlan(SPEC, ParallelLayout(), Packing("verl"), RankCoords(), tuple(parse_micro_batches("s1,s0")))
    fed = np.concatenate([np.arange(13), np.arange(22) + 1])  # s0's tokens, then s1's (see the fixture)
    replay = MegatronReplay([chunk], claimed)
    mb = next(iter(ReplayLoader(store_url, 0, claimed)))
    _embedded_forward(replay, chunk, mb, fed)
    with pytest.raises(ReplayFidelityError, match=r"row 0 feeds token 0 where sample 's1' had token 1 at position 0"):
        replay.check()
    truthful = MegatronReplay([chunk], claimed)
    _embedded_forward(truthful, chunk, mb, np.concatenate([np.arange(22) + 1, np.arange(13)]))
    truthful.end_step()  # the same micro-batch fed as recorded passes


def test_one_changed_token_is_named_with_its_sample_and_position(store_url: str) -> None:
    from routelog.megatron import MegatronReplay

    (chunk,) = build_chunks(megatron_config())
    replay = MegatronReplay([chunk], plan())
    mb = next(iter(ReplayLoader(store_url, 0, plan())))
    fed = fed_tokens(mb).copy()
    fed[13 + 7] = 63  # s1's token at position 7 (s0 takes the first 13 rows)
    _embedded_forward(replay, chunk, mb, fed)
    with pytest.raises(ReplayFidelityError, match=r"row 20 feeds token 63 where sample 's1' had token 8 at position 7"):
        replay.end_step()


def test_records_without_token_ids_are_refused_unless_the_check_is_off_by_name(
    make_routing: Callable[..., np.ndarray],
) -> None:
    import uuid

    from routelog.megatron import MegatronReplay

    url = f"memory://megatron/{uuid.uuid4().hex}"
    rng = np.random.default_rng(4)
    with routelog.open_writer(url, 0, model_spec=SPEC) as writer:
        for i in range(2):
            writer.append(
                Record(sample_id=f"s{i}", expert_ids=make_routing(rng, 9, 6, 8, 2), prompt_len=3, response_len=6)
            )
    p = AlignmentPlan(SPEC, ParallelLayout(), Packing("verl"), RankCoords(), tuple(parse_micro_batches("s0,s1")))
    (chunk,) = build_chunks(megatron_config())
    mb = next(iter(ReplayLoader(url, 0, p)))
    with pytest.raises(ReplayFidelityError, match=r"\['s0', 's1'\] were stored without token ids.*check_tokens='off'"):
        MegatronReplay([chunk], p).install(mb)
    unchecked = MegatronReplay([chunk], p, check_tokens="off")
    with unchecked.forward(mb):
        seen, _ = run_moe_layers(chunk, mb.ids.shape[1])
    for j, router in enumerate(mb.routers):
        np.testing.assert_array_equal(seen[router.layer_number], np.sort(mb.ids[j], axis=-1))
    unchecked.end_step()


def test_routes_no_router_takes_fail_the_step(store_url: str) -> None:
    """The trainer's replay switch is off: routes are handed over, the routers route natively. Inert, so the step
    fails; the same forward with the action set passes."""
    from routelog.megatron import MegatronReplay

    (chunk,) = build_chunks(megatron_config())
    replay = MegatronReplay([chunk], plan())
    mb = next(iter(ReplayLoader(store_url, 0, plan())))
    replay.install(mb)  # as a trainer that sets the replay action itself would, and then does not
    run_moe_layers(chunk, mb.ids.shape[1], mb=mb)
    with pytest.raises(ReplayFidelityError, match=r"layers \[2, 3, 4, 6, 7, 8\] and no forward took them"):
        replay.end_step()
    with replay.forward(mb):
        run_moe_layers(chunk, mb.ids.shape[1], mb=mb)
    replay.end_step()


def test_a_token_check_that_could_not_run_fails_the_step(store_url: str) -> None:
    """Routes installed for two micro-batches with no forward of the first stage between them: the first one's
    tokens were never seen."""
    from routelog.megatron import MegatronReplay

    (chunk,) = build_chunks(megatron_config())
    replay = MegatronReplay([chunk], plan())
    first, second = list(ReplayLoader(store_url, 0, plan()))
    with replay.forward(first):
        run_moe_layers(chunk, first.ids.shape[1])  # the layers ran, the embedding did not
    with replay.forward(second):
        run_moe_layers(chunk, second.ids.shape[1], mb=second)
    with pytest.raises(ReplayFidelityError, match="could not be checked for micro-batch 0 on virtual stage 0"):
        replay.end_step()


def test_remove_restores_each_router_exactly(store_url: str) -> None:
    """After ``remove()`` no per-router override is left: a class-level patch made later reaches every router."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from routelog.megatron import MegatronReplay

    (chunk,) = build_chunks(megatron_config())
    replays = [layer.mlp.router.router_replay for layer in moe_layers(chunk)]
    replay = MegatronReplay([chunk], plan(), gate=FidelityGate(max_router_diff=None))
    assert all("get_replay_topk" in vars(r) for r in replays)
    replay.remove()
    assert not any("get_replay_topk" in vars(r) for r in replays)
    original = RouterReplay.get_replay_topk
    try:
        RouterReplay.get_replay_topk = lambda self, *args, **kwargs: "patched"  # type: ignore[method-assign]
        assert all(r.get_replay_topk() == "patched" for r in replays)
    finally:
        RouterReplay.get_replay_topk = original  # type: ignore[method-assign]


def test_the_hot_path_never_reads_the_device(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the router diff measured and the tokens checked, no forward makes routelog read a tensor back to the
    host (on a GPU, a synchronisation per router); judging the step reads twice: the tallies and the token check."""
    from pathlib import Path

    from routelog.megatron import MegatronReplay

    package = str(Path(routelog.__file__).parent)
    reads: list[str] = []
    for name in ("__int__", "__bool__", "__float__", "item", "tolist", "numpy", "cpu"):
        original = getattr(torch.Tensor, name)

        def counted(self: Any, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(package):
                reads.append(f"{_name} at {caller}:{sys._getframe(1).f_lineno}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    (chunk,) = build_chunks(megatron_config())
    replay = MegatronReplay([chunk], plan(), gate=FidelityGate(max_router_diff=1.0))
    for mb in ReplayLoader(store_url, 0, plan()):
        with replay.forward(mb):
            run_moe_layers(chunk, mb.ids.shape[1], mb=mb)
    assert reads == [], reads
    counts = replay.end_step()
    assert len(reads) == 2, reads
    assert sum(counts.replayed.values()) > 0


def test_a_vision_language_models_decoder_is_found_under_language_model(store_url: str) -> None:
    """Vision-language MoE models (Qwen-VL-style megatron models) keep the GPT model in ``language_model``, under
    the usual wrappers: routers and the embedding are found there, and replay checks and installs as for a GPT."""
    from routelog.megatron import MegatronReplay

    (chunk,) = build_chunks(megatron_config())

    class VisionLanguageModel(torch.nn.Module):
        def __init__(self, language: Any) -> None:
            super().__init__()
            self.vision_model = torch.nn.Linear(4, 4)
            self.language_model = language

    class Wrapper(torch.nn.Module):  # DDP / Float16Module keep the model in .module
        def __init__(self, module: Any) -> None:
            super().__init__()
            self.module = module

    model = Wrapper(VisionLanguageModel(chunk))
    replay = MegatronReplay([model], plan())
    assert [r.layer_number for r in replay.routers] == [r.layer_number for r in plan().routers]
    for mb in ReplayLoader(store_url, 0, plan()):
        with replay.forward(mb):
            seen, _ = run_moe_layers(chunk, mb.ids.shape[1], mb=mb)
        for j, router in enumerate(mb.routers):
            np.testing.assert_array_equal(seen[router.layer_number], np.sort(mb.ids[j], axis=-1))
    replay.end_step()
