"""veRL 0.9.1's own router replay beside routelog's integration on the layouts issue #15 lists: virtual pipeline
stages with dense layers, the MoE-only layer axis with PP > 1, and short sequences under context parallelism.

The routers are megatron-core 0.16.1's (CPU, one gloo process) with veRL's ``RouterReplay`` patch, and every veRL
function named is veRL's own. A world of one process cannot hold a PP or CP group, so two things are simulated and
said so where they are: the pipeline / context-parallel rank and size that megatron-core's ``parallel_state``
reports (veRL, megatron-core and routelog all read them there), and the PP all-gather inside veRL's ``pp_gather``,
which is handed each stage's local routes exactly as that collective returns them.

What veRL 0.9.1 gets wrong (``verl/utils/megatron/router_replay_utils.py``): R2 with a custom
``pipeline_model_parallel_layout`` and VPP. ``pp_gather`` (line 758) slices each PP stage's recorded MoE-only routes
with ``get_moe_num_layers_to_build(tf_config, vp_stage, pp_stage)``, but with a layout neither veRL's
``get_num_layers_to_build`` (lines 70-75) nor megatron-core's ``get_transformer_layer_offset``
(``transformer_layer.py`` lines 50-53, called by veRL at line 210) passes ``pp_stage`` on, so every stage is sliced
with the calling rank's per-chunk MoE counts. The gathered axis is out of layer order and ``set_router_replay_data``
(lines 523-540, by MoE ordinal) hands routers other layers' routes. R3 (rows indexed by each router's
``layer_number``) is right on these layouts, and so is its THD/CP packing of sequences shorter than 2*CP: the tests
assert that too, next to routelog's rows (routelog reads a custom layout's chunks in
``routelog.integrations.megatron.layout_from_config``).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

import routelog
from tests.test_integration_verl import agent_loop_batch
from tests.test_megatron import HIDDEN, SPEC, build_chunks, embed, megatron_config, moe_layers, selected

pytestmark = [
    pytest.mark.usefixtures("megatron_env", "verl_patched", "engine_restored"),
    pytest.mark.verl,
    pytest.mark.filterwarnings("ignore::UserWarning"),  # veRL warns about every engine it cannot import here
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
verl = pytest.importorskip("verl")

STEP = 3
L_FULL = SPEC.num_layers


@pytest.fixture
def engine_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo routelog's ``install()`` patches of veRL's engine after the test; veRL's replay tensors stay on CPU."""
    from verl.utils.megatron import router_replay_utils
    from verl.workers.engine.megatron import transformer_impl as impl

    engine = impl.MegatronEngineWithLMHead
    monkeypatch.setattr(engine, "prepare_model_inputs", engine.prepare_model_inputs)
    monkeypatch.setattr(impl, "set_router_replay_data", impl.set_router_replay_data)
    monkeypatch.setattr(impl.MegatronEngine, "forward_backward_batch", impl.MegatronEngine.forward_backward_batch)
    monkeypatch.setattr(router_replay_utils, "device_name", "cpu")  # veRL's device is "cuda"


def _parallel_state(
    monkeypatch: pytest.MonkeyPatch,
    *,
    pp: int = 1,
    pp_rank: int = 0,
    vpp: int | None = None,
    cp: int = 1,
    cp_rank: int = 0,
) -> None:
    """Simulated: the ranks and sizes ``parallel_state`` reports to megatron-core, veRL and routelog."""
    from megatron.core import parallel_state

    for name, value in (
        ("get_pipeline_model_parallel_world_size", pp),
        ("get_pipeline_model_parallel_rank", pp_rank),
        ("get_virtual_pipeline_model_parallel_world_size", vpp),
        ("get_context_parallel_world_size", cp),
        ("get_context_parallel_rank", cp_rank),
    ):
        monkeypatch.setattr(parallel_state, name, lambda *_, _value=value, **__: _value)


def _stage_chunks(monkeypatch: pytest.MonkeyPatch, config: Any, pp_rank: int) -> list[Any]:
    """PP rank ``pp_rank``'s model chunks (PP = VPP = 2), built by megatron-core as that rank builds them. Simulated:
    the PP rank it reads, from ``parallel_state`` and from the PP group (``get_pg_rank``, for layer numbers)."""
    from megatron.core import parallel_state
    from megatron.core.transformer import transformer_block, transformer_layer
    from megatron.core.utils import get_pg_rank

    _parallel_state(monkeypatch, pp=2, pp_rank=pp_rank, vpp=2)
    group = parallel_state.get_pipeline_model_parallel_group()
    for module in (transformer_block, transformer_layer):
        monkeypatch.setattr(module, "get_pg_rank", lambda g=None: pp_rank if g is group else get_pg_rank(g))
    return build_chunks(config, pp_rank=pp_rank)


def _rollout(prompts: Sequence[int], responses: Sequence[int], routes: Sequence[np.ndarray]) -> Any:
    """The agent loop's batch of these samples (each sample's full-axis routes ``[n, layers, K]``)."""
    uids = [f"p{i}" for i in range(len(prompts))]
    return agent_loop_batch(np.random.default_rng(len(prompts)), prompts, responses, routes, uids)


def _write(batch: Any) -> str:
    """The rollout side: routes to a store, sample ids into the batch."""
    from routelog.integrations.verl import write_batch

    url = f"memory://verl-layouts/{uuid.uuid4().hex}"
    with routelog.open_writer(url, STEP, model_spec=SPEC) as writer:
        write_batch(writer, batch)
    return url


def _route(chunk: Any, rows: int) -> dict[int, np.ndarray]:
    """Every MoE router of the chunk on ``rows`` hidden states: the sorted experts it selects per row."""
    seen = {}
    for layer in moe_layers(chunk):
        _, routing_map = layer.mlp.router(torch.randn(rows, 1, HIDDEN))
        seen[int(layer.layer_number)] = selected(routing_map.detach())
    return seen


def _routelog_forward(replay: Any, mb: Any, config: Any, chunk: Any, vp: int, params: Any, rows: int) -> Any:
    """One chunk's forward with routelog installed, as veRL's ``forward_step`` drives it: the patched
    ``prepare_model_inputs`` and ``set_router_replay_data``, then the chunk called with ``packed_seq_params``."""
    from verl.utils.megatron.router_replay_patch import RouterReplayAction
    from verl.utils.megatron.router_replay_utils import set_model_router_replay_action
    from verl.workers.engine.megatron import transformer_impl as impl

    inputs = impl.MegatronEngineWithLMHead.prepare_model_inputs(None, mb)
    set_model_router_replay_action(chunk, RouterReplayAction.REPLAY_FORWARD)
    impl.set_router_replay_data(inputs["routed_experts"], None, config, vp_rank=vp, model=chunk)
    replay._pre_forward(chunk, (), {"packed_seq_params": params})
    from verl.models.mcore.util import preprocess_thd_engine

    embed(chunk, preprocess_thd_engine(mb["input_ids"], pre_process=True)[0])  # the rank's packed input_ids
    seen = _route(chunk, rows)
    set_model_router_replay_action(chunk, RouterReplayAction.REPLAY_BACKWARD)
    return seen


def _gather_order(local: dict[int, list[list[int]]], *, custom_layout: bool) -> list[int]:
    """The layers along the MoE-only axis veRL's ``pp_gather`` assembles on the last stage: for each virtual stage,
    each PP stage's slice of its local routes (its chunks' MoE layers, in chunk order), the slice bounds summed from
    per-chunk MoE counts: the stage's own, or with a custom pipeline layout the calling (last) stage's."""
    last = max(local)
    order: list[int] = []
    for v in range(len(local[last])):
        for p in sorted(local):
            counts = [len(chunk) for chunk in local[last if custom_layout else p]]
            flat = [n for chunk in local[p] for n in chunk]
            start = sum(counts[:v])
            order += flat[start : start + counts[v]]
    return order


@pytest.mark.parametrize(
    "layout",
    [None, "Et|ttt|tt|ttL"],
    ids=["uniform-split", "pipeline-layout"],
)
def test_vpp_with_dense_layers_and_the_moe_only_axis_over_pp(
    monkeypatch: pytest.MonkeyPatch, layout: str | None
) -> None:
    """PP = 2 x VPP = 2 over 8 layers, layers 1 and 5 dense (1-based), with megatron's uniform split (two layers per
    chunk) or a custom ``pipeline_model_parallel_layout`` whose first chunk holds only dense layer 1.

    veRL's R2 (routes recorded by the routers, gathered over PP on the MoE-only axis, replayed by MoE ordinal) is
    right with the uniform split and, with the layout, gives four of the six MoE layers another layer's routes (the
    order ``_gather_order`` derives); its R3 (full axis by layer number, MoE-only axis by ordinal) is right on both.
    routelog, given the same true routes through the store, installs every router's own.

    Simulated: the PP rank and size (``parallel_state``, and the PP group's rank megatron-core numbers layers by),
    and the PP all-gather in ``pp_gather``. Real: each stage's chunks as megatron-core builds that rank's, their
    routers recording, veRL's ``merge_router_topk_indices``, ``reorder_and_merge_vpp_layers``, ``pp_gather`` and
    ``set_router_replay_data``; routelog's ``install()`` driven as veRL's ``forward_step`` calls it.
    """
    from verl.models.mcore.util import preprocess_thd_engine
    from verl.utils.megatron import router_replay_utils as utils
    from verl.utils.megatron.router_replay_patch import RouterReplayAction
    from verl.workers.utils.padding import left_right_2_no_padding

    from routelog.integrations import verl as integration

    config = megatron_config(
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_layout=layout,
    )
    config.fp8 = None
    prompts, responses = [4, 2, 3], [3, 4, 1]
    lengths = [p + r for p, r in zip(prompts, responses, strict=True)]
    ids = torch.nested.as_nested_tensor(
        [torch.arange(n) for n in lengths], layout=torch.jagged
    )  # veRL's packing reads only the lengths
    _, params, _ = preprocess_thd_engine(ids, pre_process=True)
    rows = int(params.cu_seqlens_q_padded[-1])
    assert rows == sum(lengths)  # TP = CP = 1: one packed row per token

    # R2's record pass: each stage's chunks record what their routers compute, veRL merges, orders and gathers.
    chunks: dict[int, list[Any]] = {}
    local: dict[int, Any] = {}
    truth: dict[int, np.ndarray] = {}  # layer number -> the experts its router computed for each packed row
    for p in (0, 1):
        chunks[p] = _stage_chunks(monkeypatch, config, p)
        recorded: list[Any] = []
        for v, chunk in enumerate(chunks[p]):
            utils.set_model_router_replay_action(chunk, RouterReplayAction.RECORD)
            truth.update(_route(chunk, rows))
            utils.merge_router_topk_indices(None, ids, recorded, config, vp_rank=v, model=chunk)
        local[p] = utils.reorder_and_merge_vpp_layers(recorded, 1, 2, config.microbatch_group_size_per_vp_stage)
    layers = {p: [[int(x.layer_number) for x in moe_layers(c)] for c in chunks[p]] for p in chunks}
    assert sorted(n for p in layers for chunk in layers[p] for n in chunk) == [i + 1 for i in SPEC.moe_layers]
    if layout is not None:
        assert layers[0][0] == [], "the first chunk holds only a dense layer"

    def all_gather_object(out: list[Any], obj: Any, group: Any = None) -> None:  # simulated PP all-gather
        out[:] = [local[0], local[1]]

    with pytest.MonkeyPatch.context() as gather:
        gather.setattr(utils.mpu, "get_pipeline_model_parallel_group", lambda *_, **__: "pp")
        gather.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
        gather.setattr(torch.distributed, "all_gather_object", all_gather_object)
        _parallel_state(gather, pp=2, pp_rank=1, vpp=2)  # the last stage's gather is what veRL returns
        r2_routes = utils.pp_gather(local[1], config)

    order = _gather_order(layers, custom_layout=layout is not None)
    assert len(order) == len(SPEC.moe_layers) == int(r2_routes.unbind()[0].shape[1])
    assert (order == sorted(order)) == (layout is None), "out of layer order exactly with the pipeline layout"

    # veRL's actor update: R2 replays the gathered axis by MoE ordinal; R3 the engine's routes (either axis).
    full = torch.zeros((rows, L_FULL, SPEC.topk), dtype=torch.int16)
    for number, experts in truth.items():
        full[:, number - 1] = torch.from_numpy(experts.astype(np.int16))
    cu = params.cu_seqlens_q_padded.tolist()
    r3_routes = torch.nested.as_nested_tensor([full[a:b] for a, b in itertools.pairwise(cu)], layout=torch.jagged)
    moe_axis = list(SPEC.moe_layers)  # an engine that returns MoE layers only: veRL indexes it by MoE ordinal
    r3_moe = torch.nested.as_nested_tensor(
        [full[a:b, moe_axis] for a, b in itertools.pairwise(cu)], layout=torch.jagged
    )
    wrong = set()
    for p in (0, 1):
        _parallel_state(monkeypatch, pp=2, pp_rank=p, vpp=2)
        for v, chunk in enumerate(chunks[p]):
            if not layers[p][v]:
                continue  # veRL's forward_step arms no replay on a chunk without routers
            for routes, mode in ((r2_routes, "R2"), (r3_routes, "R3"), (r3_moe, "R3")):
                utils.set_model_router_replay_action(chunk, RouterReplayAction.REPLAY_FORWARD)
                utils.set_router_replay_data(routes, None, config, vp_rank=v, model=chunk)
                seen = _route(chunk, rows)
                for number in layers[p][v]:
                    source = order[SPEC.moe_index(number - 1)] if mode == "R2" else number
                    np.testing.assert_array_equal(seen[number], truth[source])
                    if source != number:
                        wrong.add(number)
                        assert (seen[number] != truth[number]).any(axis=1).mean() > 0.5
                for layer in moe_layers(chunk):
                    layer.mlp.router.router_replay.clear_indices()
    assert bool(wrong) == (layout is not None)

    # routelog: the same true routes through the store, installed at each chunk's forward.
    per_sample = [full[a:b].numpy() for a, b in itertools.pairwise(cu)]
    batch = _rollout(prompts, responses, per_sample)
    url = _write(batch)
    mb = left_right_2_no_padding(batch.to_tensordict())
    replay = integration.install(url)
    for p in (0, 1):
        _parallel_state(monkeypatch, pp=2, pp_rank=p, vpp=2)
        for v, chunk in enumerate(chunks[p]):
            if not layers[p][v]:
                continue
            seen = _routelog_forward(replay, mb, config, chunk, v, params, rows)
            for number in layers[p][v]:
                np.testing.assert_array_equal(seen[number], truth[number])
    counts = replay.end_step()  # both simulated ranks' chunks live in this process: every MoE layer, every row
    assert counts.replayed == {n - 1: rows for n in truth}
    replay.remove()


@pytest.mark.parametrize("cp", [2, 4])
def test_sequences_shorter_than_2cp_under_context_parallelism(monkeypatch: pytest.MonkeyPatch, cp: int) -> None:
    """Zigzag CP with sequences of 1, 2 and 3 tokens: each is padded to 2*CP rows, so some CP ranks hold none of its
    tokens (the 1-token one has no routed token at all: its only token is the last). veRL's R3 path
    (``align_r3_router_replay_data``, ``build_r3_replay_mask``, ``set_router_replay_data``, as its ``forward_step``
    calls them) and routelog's integration both put every routed token's route on the row where that CP rank's
    model computes it, which veRL's own ``preprocess_thd_engine`` decides for the model's input.

    Simulated: the CP rank and size in ``parallel_state`` (``context_parallel_size`` on the config, which routelog
    reads); the chunk is built without CP, which its routers do not depend on.
    """
    from verl.models.mcore.util import preprocess_thd_engine
    from verl.utils.megatron import router_replay_utils as utils
    from verl.utils.megatron.router_replay_patch import RouterReplayAction
    from verl.workers.utils.padding import left_right_2_no_padding

    from routelog.integrations import verl as integration

    prompts, responses = [1, 1, 2, 3, 4], [0, 1, 1, 2, 5]
    lengths = [p + r for p, r in zip(prompts, responses, strict=True)]
    assert min(lengths) == 1 and sorted(lengths)[:3] == [1, 2, 3]
    rng = np.random.default_rng(cp)
    routes = []
    for n in lengths:
        rows = np.zeros((n, L_FULL, SPEC.topk), np.int16)  # the last token is never routed; dense layers are zeros
        chosen = np.argsort(rng.random((n - 1, len(SPEC.moe_layers), SPEC.num_experts)), axis=-1)[..., : SPEC.topk]
        rows[: n - 1, list(SPEC.moe_layers)] = chosen
        routes.append(rows)
    batch = _rollout(prompts, responses, routes)
    carried = left_right_2_no_padding(batch.to_tensordict())  # veRL's R3: the routes travel in the micro-batch
    url = _write(batch)
    mb = left_right_2_no_padding(batch.to_tensordict())  # routelog's: only sample ids do

    config = megatron_config()
    config.fp8 = None
    (chunk,) = build_chunks(config)
    config.context_parallel_size = cp
    coords = torch.nested.as_nested_tensor(  # (sample + 1, position + 1) per token; padding packs as 0
        [torch.stack([torch.full((n,), i + 1), torch.arange(1, n + 1)], dim=1) for i, n in enumerate(lengths)],
        layout=torch.jagged,
    )

    def routes_at(sample: np.ndarray, position: np.ndarray, routed: np.ndarray, number: int) -> np.ndarray:
        picked = zip(sample, position, routed, strict=True)
        return np.stack([routes[i][t, number - 1] if ok else routes[0][0, 0] for i, t, ok in picked]).astype(np.int64)

    local: list[tuple[Any, int, np.ndarray, dict[int, np.ndarray]]] = []
    for rank in range(cp):
        _parallel_state(monkeypatch, cp=cp, cp_rank=rank)
        _, params, _ = preprocess_thd_engine(mb["input_ids"], pre_process=True)  # what the model is given
        where = preprocess_thd_engine(coords, pre_process=True)[0][0].numpy() - 1  # [local rows, 2]; -1: padding
        rows = where.shape[0]
        assert rows == int(params.cu_seqlens_q_padded[-1]) // cp
        sample, position = where[:, 0], where[:, 1]
        routed = (sample >= 0) & (position < np.asarray(lengths)[sample] - 1)
        want = {  # the true route of each local row's token (rows without one: never compared)
            n: np.sort(routes_at(sample, position, routed, n), axis=-1) for n in (i + 1 for i in SPEC.moe_layers)
        }
        local.append((params, rows, routed, want))

        # veRL's own R3 installation of the routes it carried, as its forward_step calls it.
        input_ids = carried["input_ids"]
        targets = utils.align_r3_router_replay_data(carried["routed_experts"], input_ids)
        mask = utils.build_r3_replay_mask(input_ids, carried["response_mask"])
        utils.set_model_router_replay_action(chunk, RouterReplayAction.REPLAY_FORWARD)
        utils.set_router_replay_data(targets, None, config, 0, replay_mask=mask, model=chunk)
        installed = next(moe_layers(chunk)).mlp.router.router_replay.target_replay_mask
        np.testing.assert_array_equal(installed.numpy(), routed)  # it replays exactly the routed tokens' rows
        seen = _route(chunk, rows)
        for number, expected in want.items():
            np.testing.assert_array_equal(seen[number][routed], expected[routed])
        for layer in moe_layers(chunk):
            layer.mlp.router.router_replay.clear_indices()
        utils.set_model_router_replay_action(chunk, RouterReplayAction.REPLAY_BACKWARD)

    # routelog's integration on the same micro-batch, rank by rank: each forward reading its share, or aligning rows
    # the pass read ahead (veRL's wrapped forward_backward_batch starts the read).
    for read_ahead in (False, True):
        replay = integration.install(url)
        for rank, (params, rows, routed, want) in enumerate(local):
            _parallel_state(monkeypatch, cp=cp, cp_rank=rank)
            if read_ahead:
                replay.begin_pass(mb, config)
            seen = _routelog_forward(replay, mb, config, chunk, 0, params, rows)
            for number, expected in want.items():
                np.testing.assert_array_equal(seen[number][routed], expected[routed])
        assert replay.prefetched == (cp if read_ahead else 0)
        counts = replay.end_step()  # every CP rank's routed rows, once
        assert set(counts.replayed.values()) == {sum(lengths) - len(lengths)}
        replay.remove()
