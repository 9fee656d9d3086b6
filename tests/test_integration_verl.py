"""veRL 0.9.1 (real ``DataProto``, ``left_right_2_no_padding``, ``rearrange_micro_batches``, ``preprocess_thd_engine``,
its ``RouterReplay`` patch and its engine module) with routelog's integration, on megatron-core on CPU.

The rollout side writes the agent loop's batch and leaves only sample ids in it; the training side installs each
micro-batch's rows at the chunk's forward, aligned to the ``packed_seq_params`` veRL gives the model, and they equal
veRL's own packing of the true routes at every token (with and without FP8 padding, dynamic micro-batches)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import routelog
from routelog.align import ParallelLayout
from tests.test_megatron import HIDDEN, SPEC, embed, megatron_config, moe_layers, selected

pytestmark = [
    pytest.mark.usefixtures("megatron_env"),
    pytest.mark.verl,
    pytest.mark.filterwarnings("ignore::UserWarning"),  # veRL warns about every engine it cannot import here
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
verl = pytest.importorskip("verl")

PROMPT, RESPONSE = 12, 10
PROMPTS = [3, 12, 7, 5, 9, 4]
RESPONSES = [10, 2, 6, 9, 5, 8]
L_FULL = SPEC.num_layers


def rollout_batch(rng: np.random.Generator) -> tuple[Any, np.ndarray]:
    """A batch laid out as veRL's agent loop returns it, and the full-axis routes ``[B, P+R, layers, K]``."""
    routes = []
    for p, r in zip(PROMPTS, RESPONSES, strict=True):
        rows = p + r - 1  # the engine routes every fed token; the last sampled one never is
        chosen = np.zeros((p + r, L_FULL, SPEC.topk), np.int16)
        chosen[:rows] = np.argsort(rng.random((rows, L_FULL, SPEC.num_experts)), axis=-1)[..., : SPEC.topk]
        chosen[:, [i for i in range(L_FULL) if i not in SPEC.moe_layers]] = 0  # dense layers: zeros, as SGLang
        routes.append(chosen)
    uids = [f"p{i // 2}" for i in range(len(PROMPTS))]
    batch = agent_loop_batch(rng, PROMPTS, RESPONSES, routes, uids, widths=(PROMPT, RESPONSE))
    return batch, batch.batch["routed_experts"].numpy().copy()


def agent_loop_batch(
    rng: np.random.Generator,
    prompts: Sequence[int],
    responses: Sequence[int],
    routes: Sequence[np.ndarray],
    uids: Sequence[str],
    *,
    widths: tuple[int, int] | None = None,
) -> Any:
    """A ``DataProto`` as veRL's agent loop returns it: left-padded prompts and right-padded responses (``widths``,
    default the longest), random token ids, and each sample's full-axis routes ``[n, layers, K]`` at its tokens."""
    from verl import DataProto
    from verl.utils.model import compute_position_id_with_mask

    width_p, width_r = widths or (max(prompts), max(responses))
    b = len(prompts)
    prompt_ids = torch.zeros((b, width_p), dtype=torch.long)
    response_ids = torch.zeros((b, width_r), dtype=torch.long)
    mask = torch.zeros((b, width_p + width_r), dtype=torch.long)
    dense = np.zeros((b, width_p + width_r, L_FULL, SPEC.topk), np.int16)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[i, width_p - p :] = torch.from_numpy(rng.integers(1, 64, p))
        response_ids[i, :r] = torch.from_numpy(rng.integers(1, 64, r))
        mask[i, width_p - p : width_p + r] = 1
        dense[i, width_p - p : width_p + r] = routes[i]
    return DataProto.from_dict(
        tensors={
            "prompts": prompt_ids,
            "responses": response_ids,
            "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
            "attention_mask": mask,
            "position_ids": compute_position_id_with_mask(mask),
            "response_mask": mask[:, width_p:].clone(),
            "routed_experts": torch.from_numpy(dense),
        },
        non_tensors={"uid": np.array(list(uids), dtype=object)},
        meta_info={"temperature": 1.0},
    )


def _write(rng: np.random.Generator, policy_version: int | None = None) -> tuple[str, Any, np.ndarray]:
    from routelog.integrations.verl import write_batch

    url = f"memory://verl/{uuid.uuid4().hex}"
    batch, routes = rollout_batch(rng)
    with routelog.open_writer(url, 7, model_spec=SPEC) as writer:
        ids = write_batch(writer, batch, policy_version=policy_version)
    assert ids == ["p0/0", "p0/1", "p1/0", "p1/1", "p2/0", "p2/1"]
    return url, batch, routes


def test_the_rollout_side_writes_the_routes_and_carries_only_sample_ids() -> None:
    from routelog.integrations.verl import SAMPLE_ID_KEY, STEP_KEY

    url, batch, routes = _write(np.random.default_rng(0))
    assert batch.batch.get("routed_experts", None) is None
    assert batch.meta_info[STEP_KEY] == 7
    snapshot = routelog.open_store(url).step(7)
    mask = batch.batch["attention_mask"].numpy().astype(bool)
    for i, sid in enumerate(batch.non_tensor_batch[SAMPLE_ID_KEY]):
        got = snapshot.read(sid)
        want = routes[i][mask[i]][:, list(SPEC.moe_layers)]
        np.testing.assert_array_equal(got.expert_ids[:-1], np.sort(want[:-1], axis=-1))
        assert not got.valid[-1], "the final token was never routed"
        assert got.info.group_id == batch.non_tensor_batch["uid"][i]
    # a DP split and a micro-batch reorder carry the ids with the rows
    part = batch.select_idxs([5, 0, 3])
    assert list(part.non_tensor_batch[SAMPLE_ID_KEY]) == ["p2/1", "p0/0", "p1/1"]


def _gpt(config: Any) -> Any:
    """A one-chunk megatron-core GPT model (its routers carry veRL's RouterReplay once the patch is applied)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    torch.manual_seed(0)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=64,
        max_sequence_length=256,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )


def restore_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo ``routelog.integrations.verl.install``'s patches of veRL's engine module after the test."""
    from verl.workers.engine.megatron import transformer_impl as impl

    engine = impl.MegatronEngineWithLMHead
    monkeypatch.setattr(engine, "prepare_model_inputs", engine.prepare_model_inputs)
    monkeypatch.setattr(impl, "set_router_replay_data", impl.set_router_replay_data)
    monkeypatch.setattr(impl.MegatronEngine, "forward_backward_batch", impl.MegatronEngine.forward_backward_batch)


def replay_micro_batches(
    replay: Any, batch: Any, routes: np.ndarray, *, fp8: str | None, max_token_len: int, prefetch: bool
) -> list[Any]:
    """veRL's training side on ``batch`` (a rollout ``DataProto`` carrying routelog's ids): its own split into
    micro-batches, ``prepare_model_inputs`` and ``set_router_replay_data`` (patched by ``replay``) and its THD packing
    of each micro-batch; every MoE router of a megatron-core chunk must choose the true route (``routes``, the dense
    ``[B, P+R, layers, K]`` veRL itself would have carried) of the token it computes on, while the same routers on the
    same input without replay (the control) choose otherwise on most rows. Returns the micro-batches."""
    from verl.models.mcore.util import preprocess_thd_engine
    from verl.utils.megatron import router_replay_patch as verl_replay
    from verl.utils.megatron.router_replay_utils import set_model_router_replay_action
    from verl.utils.seqlen_balancing import rearrange_micro_batches
    from verl.workers.engine.megatron import transformer_impl as impl
    from verl.workers.utils.padding import left_right_2_no_padding

    config = megatron_config()
    config.fp8 = fp8  # only veRL's packing reads it here: FP8 pads each sequence to 16 and the total to 128
    chunk = _gpt(config)
    assert all(isinstance(layer.mlp.router.router_replay, verl_replay.RouterReplay) for layer in moe_layers(chunk))
    data = left_right_2_no_padding(batch.to_tensordict())
    if prefetch:
        replay.begin_pass(data, config)
    micro_batches, indices = rearrange_micro_batches(data, max_token_len=max_token_len)
    assert len(micro_batches) > 1

    def route(hidden: torch.Tensor) -> dict[int, np.ndarray]:
        """Each MoE layer's chosen experts for ``hidden`` (sorted per row)."""
        seen: dict[int, np.ndarray] = {}
        for layer in moe_layers(chunk):
            handle = layer.mlp.router.register_forward_hook(
                lambda module, args, out: seen.__setitem__(int(module.layer_number), selected(out[1].detach()))
            )
            layer.mlp(hidden)
            handle.remove()
        return seen

    for mb, order in zip(micro_batches, indices, strict=True):
        inputs = impl.MegatronEngineWithLMHead.prepare_model_inputs(None, mb)  # veRL's own, patched
        fed, params, _ = preprocess_thd_engine(mb["input_ids"], pre_process=True, use_fp8_padding=fp8 is not None)
        rows = int(params.cu_seqlens_q_padded[-1])
        hidden = torch.randn(rows, 1, HIDDEN)
        set_model_router_replay_action(chunk, None)
        native = route(hidden)  # the control: the same routers on the same input, no replay
        set_model_router_replay_action(chunk, verl_replay.RouterReplayAction.REPLAY_FORWARD)
        impl.set_router_replay_data(inputs["routed_experts"], None, config, vp_rank=0, model=chunk)
        # What veRL's forward hands the model: its own THD packing of the micro-batch.
        replay._pre_forward(chunk, (), {"packed_seq_params": params})
        embed(chunk, fed)  # the model's first stage takes veRL's packed input_ids
        seen = route(hidden)
        # veRL's own packing of the true routes puts each token's row where the model computes it.
        truth = [torch.from_numpy(routes[i][batch.batch["attention_mask"][i].bool().numpy()]) for i in order]
        packed, _, _ = preprocess_thd_engine(
            torch.nested.as_nested_tensor(truth, layout=torch.jagged), pre_process=True, use_fp8_padding=fp8 is not None
        )
        real = np.zeros(rows, bool)
        cu = params.cu_seqlens_q_padded.tolist()
        for j, i in enumerate(order):
            n = int(batch.batch["attention_mask"][i].sum()) - 1  # the last token has no route
            real[cu[j] : cu[j] + n] = True
        for layer in moe_layers(chunk):
            number = int(layer.layer_number)
            want = np.sort(packed[0, :, number - 1].numpy().astype(np.int64), axis=-1)
            np.testing.assert_array_equal(seen[number][real], want[real])
            changed = (native[number][real] != want[real]).any(axis=-1).mean()
            assert changed > 0.5, f"layer {number}: the routers' own choice already equals the routes ({changed})"
        set_model_router_replay_action(chunk, verl_replay.RouterReplayAction.REPLAY_BACKWARD)
    return list(micro_batches)


@pytest.mark.parametrize(
    ("fp8", "max_token_len", "prefetch"),
    [(None, 24, True), (None, 60, False), ("e4m3", 24, False), ("e4m3", 60, True)],
)
def test_each_micro_batch_installs_the_rows_the_model_computes_on(
    verl_patched: None, monkeypatch: pytest.MonkeyPatch, fp8: str | None, max_token_len: int, prefetch: bool
) -> None:
    """veRL's own split and THD packing; each router gets the true route of the token it computes on, whether the
    pass's records were read ahead in the background (``begin_pass``, as the wrapped ``forward_backward_batch``
    does) or at each forward."""
    from routelog.integrations import verl as integration

    restore_engine(monkeypatch)
    url, batch, routes = _write(np.random.default_rng(1))
    replay = integration.install(url, fidelity_writer="train-dp0")
    micro_batches = replay_micro_batches(replay, batch, routes, fp8=fp8, max_token_len=max_token_len, prefetch=prefetch)
    assert replay.prefetched == (len(micro_batches) if prefetch else 0), "every forward aligned rows read ahead"
    counts = replay.end_step(phase="train")
    assert counts.samples == len(PROMPTS)
    (record,) = routelog.store.fidelity.read_fidelity(routelog.open_store(url), 7)
    assert record.phase == "train" and record.samples == len(PROMPTS)
    replay.remove()
    assert ParallelLayout().tp == 1


@pytest.mark.parametrize("rule", ["step", "any"])
def test_routing_of_another_policy_version_is_refused_unless_opted_out(
    verl_patched: None, monkeypatch: pytest.MonkeyPatch, rule: str
) -> None:
    """The rollout of step 7 recorded as generated by policy version 6 (say, a batch left over from the previous
    step): veRL's own micro-batch preparation, then the model's forward pre-hook refuses it by default, naming the
    sample and both versions, before any router runs; ``policy_versions="any"`` replays it."""
    from verl.models.mcore.util import preprocess_thd_engine
    from verl.utils.seqlen_balancing import rearrange_micro_batches
    from verl.workers.engine.megatron import transformer_impl as impl
    from verl.workers.utils.padding import left_right_2_no_padding

    from routelog.integrations import verl as integration
    from routelog.store.fidelity import StaleRoutingError

    monkeypatch.setattr(
        impl.MegatronEngineWithLMHead, "prepare_model_inputs", impl.MegatronEngineWithLMHead.prepare_model_inputs
    )
    monkeypatch.setattr(impl, "set_router_replay_data", impl.set_router_replay_data)
    monkeypatch.setattr(impl.MegatronEngine, "forward_backward_batch", impl.MegatronEngine.forward_backward_batch)
    url, batch, _ = _write(np.random.default_rng(3), policy_version=6)
    assert routelog.open_store(url).step(7).read("p0/0").info.policy_version == 6
    config = megatron_config()
    config.fp8 = None
    chunk = _gpt(config)
    replay = integration.install(url, policy_versions=rule)  # type: ignore[arg-type]
    try:
        micro_batches, _ = rearrange_micro_batches(left_right_2_no_padding(batch.to_tensordict()), max_token_len=60)
        mb = micro_batches[0]
        inputs = impl.MegatronEngineWithLMHead.prepare_model_inputs(None, mb)
        impl.set_router_replay_data(inputs["routed_experts"], None, config, vp_rank=0, model=chunk)
        _, params, _ = preprocess_thd_engine(mb["input_ids"], pre_process=True, use_fp8_padding=False)
        if rule == "step":
            with pytest.raises(StaleRoutingError, match=r"sample 'p\d/\d'.*policy version 6.*takes version 7 only"):
                replay._pre_forward(chunk, (), {"packed_seq_params": params})
        else:
            replay._pre_forward(chunk, (), {"packed_seq_params": params})
            layer = next(iter(moe_layers(chunk)))
            assert layer.mlp.router.router_replay.target_topk_idx is not None, "the routes were installed"
    finally:
        replay.remove()


def test_a_micro_batch_without_sample_ids_is_refused() -> None:
    from verl.workers.utils.padding import left_right_2_no_padding

    from routelog.errors import AlignmentError
    from routelog.integrations.verl import VerlReplay

    url, batch, _ = _write(np.random.default_rng(2))
    del batch.non_tensor_batch["routelog_sample_id"]
    data = left_right_2_no_padding(batch.to_tensordict())
    with pytest.raises(AlignmentError, match="write_batch"):
        VerlReplay(url).note_inputs(data)


def test_bshd_without_remove_padding_replays_where_the_model_computes(
    verl_patched: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``use_remove_padding=False``: veRL's model runs on a padded ``[B, S]`` batch (its ``preprocess_bshd_engine``)
    while veRL's own ``set_router_replay_data`` still packs the routes as THD, so its rows do not match the tokens
    the routers see. routelog aligns to the input the model is given: row ``s * B + b`` is token ``s`` of sample
    ``b``."""
    from verl.models.mcore.util import preprocess_bshd_engine
    from verl.utils.megatron import router_replay_patch as verl_replay
    from verl.utils.megatron import router_replay_utils
    from verl.utils.megatron.router_replay_utils import set_model_router_replay_action
    from verl.workers.engine.megatron import transformer_impl as impl
    from verl.workers.utils.padding import left_right_2_no_padding

    from routelog.integrations import verl as integration

    monkeypatch.setattr(
        impl.MegatronEngineWithLMHead, "prepare_model_inputs", impl.MegatronEngineWithLMHead.prepare_model_inputs
    )
    monkeypatch.setattr(impl, "set_router_replay_data", impl.set_router_replay_data)
    monkeypatch.setattr(impl.MegatronEngine, "forward_backward_batch", impl.MegatronEngine.forward_backward_batch)
    url, batch, routes = _write(np.random.default_rng(3))
    config = megatron_config()
    config.fp8 = None
    chunk = _gpt(config)
    mb = left_right_2_no_padding(batch.select_idxs([0, 1, 2]).to_tensordict())  # one micro-batch of three samples
    order = [0, 1, 2]
    bshd, _, _ = preprocess_bshd_engine(mb["input_ids"], pre_process=True)  # what the model is given
    width = int(bshd.shape[1])
    rows = width * len(order)
    mask = batch.batch["attention_mask"].bool().numpy()
    truth = [torch.from_numpy(routes[i][mask[i]]) for i in order]

    # veRL's own installation: THD-packed rows, not the B x S rows the routers see (on CPU: its device is "cuda").
    monkeypatch.setattr(router_replay_utils, "device_name", "cpu")
    router_replay_utils.set_router_replay_data(
        torch.nested.as_nested_tensor(truth, layout=torch.jagged), None, config, vp_rank=0, model=chunk
    )
    first = next(moe_layers(chunk)).mlp.router.router_replay
    assert int(first.target_topk_idx.shape[0]) == sum(int(m.sum()) for m in mask[:3]) != rows
    for layer in moe_layers(chunk):
        layer.mlp.router.router_replay.clear_indices()

    replay = integration.install(url)
    inputs = impl.MegatronEngineWithLMHead.prepare_model_inputs(None, mb)
    set_model_router_replay_action(chunk, verl_replay.RouterReplayAction.REPLAY_FORWARD)
    impl.set_router_replay_data(inputs["routed_experts"], None, config, vp_rank=0, model=chunk)
    replay._pre_forward(chunk, (), {"input_ids": bshd})
    embed(chunk, bshd)
    for layer in moe_layers(chunk):
        _, routing_map = layer.mlp.router(torch.randn(width, len(order), HIDDEN))  # [S, B, H], as Megatron runs it
        chosen = selected(routing_map.detach())
        number = int(layer.layer_number)
        for b, i in enumerate(order):
            n = int(mask[i].sum()) - 1
            want = np.sort(routes[i][mask[i]][:n, number - 1].astype(np.int64), axis=-1)
            np.testing.assert_array_equal(chosen[np.arange(n) * len(order) + b], want)
    set_model_router_replay_action(chunk, verl_replay.RouterReplayAction.REPLAY_BACKWARD)
    replay.end_step()
    replay.remove()


@pytest.mark.parametrize("mode", ["disabled", "R2"])
def test_a_training_pass_that_never_asks_for_routes_fails(
    verl_patched: None, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """veRL's replay switch off (or R2, which replays the trainer's own recording): the batch carries routelog's
    sample ids, veRL's forward step prepares each micro-batch and never asks for routes. The training pass fails,
    naming the switch, before veRL's optimizer step; a forward-only pass (a reference model's log-probs) is not
    judged, and with the switch on the same pass passes."""
    from types import SimpleNamespace

    from verl.utils.seqlen_balancing import rearrange_micro_batches
    from verl.workers.engine.megatron import transformer_impl as impl
    from verl.workers.utils.padding import left_right_2_no_padding

    from routelog.integrations import verl as integration
    from routelog.store.fidelity import ReplayFidelityError

    for name in ("prepare_model_inputs",):
        monkeypatch.setattr(impl.MegatronEngineWithLMHead, name, getattr(impl.MegatronEngineWithLMHead, name))
    monkeypatch.setattr(impl, "set_router_replay_data", impl.set_router_replay_data)
    url, batch, _ = _write(np.random.default_rng(5))
    config = megatron_config()
    config.fp8 = None
    chunk = _gpt(config)
    micro_batches, _ = rearrange_micro_batches(left_right_2_no_padding(batch.to_tensordict()), max_token_len=60)

    def verl_forward_backward_batch(self: Any, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
        """veRL's loop as far as replay goes: each micro-batch's inputs prepared; routes asked for only when its
        engine's replay is on (``MegatronEngine.forward_step``)."""
        for mb in data:
            inputs = impl.MegatronEngineWithLMHead.prepare_model_inputs(None, mb)
            if self.enable_routing_replay and self.engine_config.router_replay.mode == "R3":
                impl.set_router_replay_data(inputs["routed_experts"], None, config, vp_rank=0, model=chunk)
        return {}

    monkeypatch.setattr(impl.MegatronEngine, "forward_backward_batch", verl_forward_backward_batch)
    replay = integration.install(url)

    def engine(mode: str) -> Any:
        return SimpleNamespace(
            enable_routing_replay=mode != "disabled",
            engine_config=SimpleNamespace(router_replay=SimpleNamespace(mode=mode)),
        )

    try:
        with pytest.raises(ReplayFidelityError, match=rf"replayed none of them.*router_replay.mode='{mode}'"):
            impl.MegatronEngine.forward_backward_batch(engine(mode), micro_batches, None)
        impl.MegatronEngine.forward_backward_batch(engine(mode), micro_batches, None, forward_only=True)
        impl.MegatronEngine.forward_backward_batch(engine("R3"), micro_batches, None)
        assert replay.armed == len(micro_batches)
    finally:
        replay.remove()


@pytest.mark.parametrize("configured", [True, False])
def test_the_verl_plugin_installs_replay_by_configuration(tmp_path: Path, configured: bool) -> None:
    """veRL loads routelog's ``verl.plugins`` entry point at ``import verl`` in every process: with ``ROUTELOG_URL``
    in the environment (a Ray job's runtime env), veRL's Megatron engine and its agent-loop workers (the legacy and
    the V1 ones, Ray's copy of the V1 class included) are patched as soon as they are imported, with no code in the
    workers; without it, veRL runs untouched."""
    import os
    import subprocess
    import sys

    url = str(tmp_path / "store")
    routelog.create_store(url, SPEC)
    probe = (
        "import verl\n"
        "from verl.workers.engine.megatron import transformer_impl as impl\n"
        "from verl.trainer.ppo.v1 import agent_loop_tq as v1\n"
        "from verl.experimental.agent_loop import agent_loop as legacy\n"
        "ray_class = v1.AgentLoopWorkerTQ.__ray_metadata__.modified_class\n"
        "workers = [type(vars(c)[m]).__module__ for c, m in ((legacy.AgentLoopWorker, '_agent_loop_postprocess'),"
        " (legacy.AgentLoopWorker, '_run_agent_loop'), (ray_class, '_agent_loop_postprocess'))]\n"
        "engine = [impl.set_router_replay_data.__module__, impl.MegatronEngine.forward_backward_batch.__module__]\n"
        "print(*engine, *workers)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUTELOG_")}
    if configured:
        env |= {"ROUTELOG_URL": url, "ROUTELOG_FIDELITY_WRITER": "train", "ROUTELOG_MAX_ROUTER_DIFF": "0.2"}
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", probe], capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    owners = result.stdout.split()[-5:]
    if configured:
        assert owners[:2] == ["routelog.integrations.verl"] * 2, result.stdout
        assert owners[2:] == ["routelog.integrations.verl_agent_loop"] * 3, result.stdout
    else:
        assert not any(owner.startswith("routelog") for owner in owners), result.stdout
        assert owners[2:] == ["builtins"] * 3, result.stdout  # veRL's own functions
