"""The megatron-core forward-step hook, driven by megatron-core's own schedule (``forward_backward_no_pipelining``)
on CPU: every micro-batch's routers take the stored experts, recomputation in the backward pops the same ones,
and the step's router diff is published and judged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import routelog
from routelog.align import Packing, ParallelLayout, RankCoords
from routelog.align.plan import MicroBatchReplay
from routelog.errors import AlignmentError
from routelog.integrations.megatron import ReplayHook
from routelog.store.fidelity import FidelityGate, ReplayFidelityError, StaleRoutingError, read_fidelity
from tests.test_fidelity import LENGTHS, store_url  # noqa: F401  (store_url: the fixture)
from tests.test_megatron import HIDDEN, SPEC, build_chunks, embed, fed_tokens, megatron_config, moe_layers, selected

pytestmark = pytest.mark.usefixtures("megatron_env")
torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

MICRO_BATCHES = [["s0", "s1"], ["s2"]]


def _tokens(mb: MicroBatchReplay) -> list[np.ndarray]:
    """The token ids the records of ``mb`` were written with (see the fixture)."""
    return [np.arange(LENGTHS[int(s[1:])]) + 100 * int(s[1:]) for s in mb.sample_ids]


def _drive(
    hook: ReplayHook,
    chunks: list[Any],
    order: list[int],
    seen: dict[tuple[int, int], dict[int, np.ndarray]],
    tokens_of: Callable[[MicroBatchReplay], list[np.ndarray]] = _tokens,
) -> None:
    """Call the wrapped forward step as megatron-core's schedules do, ``forward_step_func(data_iterator, model)``
    once per (micro-batch, model chunk), chunks in ``order`` (each chunk sees its micro-batches in order), then run
    the backward. (The schedules themselves allocate on ``cuda`` and cannot run on CPU.)"""
    calls = dict.fromkeys(range(len(chunks)), 0)

    def forward_step(data_iterator: Any, model: Any) -> tuple[Any, Callable[..., Any]]:
        chunk = chunks.index(model)
        m = calls[chunk]
        calls[chunk] += 1
        rows = hook.micro_batch(m).ids.shape[1]
        embed(model, fed_tokens(hook.micro_batch(m)))  # the first stage's embedding takes the micro-batch's tokens
        routed: dict[int, np.ndarray] = {}
        total = None
        for layer in moe_layers(model):
            handle = layer.mlp.router.register_forward_hook(
                lambda module, args, out: routed.__setitem__(int(module.layer_number), selected(out[1].detach()))
            )
            out, _ = layer.mlp(torch.randn(rows, 1, HIDDEN, requires_grad=True))
            handle.remove()
            total = out.sum() if total is None else total + out.sum()
        seen[(chunk, m)] = routed
        return total, lambda output: (output, {"loss": output.detach()})

    wrapped = hook.wrap(forward_step, tokens_of=tokens_of)
    outputs = [wrapped(iter(()), chunks[c])[0] for c in order]
    for output in outputs:
        if output is not None:
            output.backward()


def _check(hook: ReplayHook, seen: dict[tuple[int, int], dict[int, np.ndarray]]) -> None:
    for (chunk, m), routed in seen.items():
        mb = hook.micro_batch(m)
        for j, router in enumerate(mb.routers):
            if router.vp_stage == chunk:
                np.testing.assert_array_equal(routed[router.layer_number], np.sort(mb.ids[j], axis=-1))


def test_the_hook_replays_every_micro_batch_of_megatrons_schedule(store_url: str) -> None:  # noqa: F811
    config = megatron_config()
    (chunk,) = build_chunks(config)
    hook = ReplayHook(
        store_url,
        [chunk],
        layout=ParallelLayout(),
        rank=RankCoords(),
        packing=Packing("verl"),
        config=config,
        fidelity_writer="train-dp0",
    )
    for step in (0, 1):
        hook.begin_step(step, MICRO_BATCHES)
        seen: dict[tuple[int, int], dict[int, np.ndarray]] = {}
        _drive(hook, [chunk], [0, 0], seen)
        assert len(seen) == 2
        _check(hook, seen)
        first = hook.micro_batch(0)
        counts = hook.end_step(trainer_step=step)
        assert counts.samples == 3
        # The control: with the routes cleared, the same routers choose other experts on most rows.
        hidden = torch.randn(first.ids.shape[1], 1, HIDDEN)
        for j, router in enumerate(first.routers):
            (layer,) = [layer for layer in moe_layers(chunk) if layer.layer_number == router.layer_number]
            with torch.no_grad():
                native = selected(layer.mlp.router(hidden.reshape(-1, HIDDEN))[1])
            assert (native != np.sort(first.ids[j], axis=-1))[first.mask].any(axis=-1).mean() > 0.5
    store = routelog.open_store(store_url)
    for step in (0, 1):
        (record,) = read_fidelity(store, step)
        assert record.writer_id == "train-dp0" and record.trainer_step == step
        assert record.layers == list(SPEC.moe_layers)
        assert set(record.replayed_rows) == {sum(LENGTHS) - 3}, "every routed row of the step, once per layer"
    for layer in moe_layers(chunk):
        assert layer.mlp.router.router_replay.target_topk_idx is None, "end_step cleared the routes"


def test_the_hook_fails_closed(store_url: str) -> None:  # noqa: F811
    config = megatron_config()
    (chunk,) = build_chunks(config)
    hook = ReplayHook(
        store_url,
        [chunk],
        layout=ParallelLayout(),
        rank=RankCoords(),
        packing=Packing("verl"),
        gate=FidelityGate(max_router_diff=0.01),
    )
    hook.begin_step(0, MICRO_BATCHES)
    with pytest.raises(ReplayFidelityError, match="disagrees"):  # judged at the step's last forward
        _drive(hook, [chunk], [0, 0], {})
    assert all(layer.mlp.router.weight.grad is None for layer in moe_layers(chunk)), "no backward ran, no update"
    hook.end_step()
    hook.begin_step(0, MICRO_BATCHES)
    with pytest.raises(ReplayFidelityError, match="tokens fed hash"):  # the trainer fed s1's tokens as s0's
        _drive(hook, [chunk], [0, 0], {}, tokens_of=lambda mb: [_tokens(mb)[-1]] * len(mb.sample_ids))


def test_stale_routing_is_refused_by_default(store_url: str) -> None:  # noqa: F811
    """Each step's records carry the step as their policy version: a hook that takes another version (one-step
    off-policy training pointed at on-policy routing) refuses at the first micro-batch's load, before any forward;
    ``policy_versions="any"`` is the explicit opt-out."""
    config = megatron_config()
    (chunk,) = build_chunks(config)
    common: dict[str, Any] = {"layout": ParallelLayout(), "rank": RankCoords(), "packing": Packing("verl")}
    lagged = ReplayHook(store_url, [chunk], policy_versions=lambda step: {step - 1}, **common)
    lagged.begin_step(1, MICRO_BATCHES)
    with pytest.raises(StaleRoutingError, match=r"sample 's0'.*policy version 1.*takes version 0 only"):
        _drive(lagged, [chunk], [0, 0], {})
    lagged.end_step()
    lagged.remove()
    for rule in ("step", "any"):
        hook = ReplayHook(store_url, [chunk], policy_versions=rule, **common)  # type: ignore[arg-type]
        hook.begin_step(1, MICRO_BATCHES)
        seen: dict[tuple[int, int], dict[int, np.ndarray]] = {}
        _drive(hook, [chunk], [0, 0], seen)
        _check(hook, seen)
        hook.end_step()
        hook.remove()
    with pytest.raises(AlignmentError, match="policy_versions must be"):
        ReplayHook(store_url, [chunk], policy_versions="latest", **common)  # type: ignore[arg-type]


def test_virtual_pipeline_chunks_interleave_each_with_its_own_cursor(store_url: str) -> None:  # noqa: F811
    """Interleaved 1F1B runs chunk 0 ahead of chunk 1; each chunk still takes the micro-batches in order."""
    config = megatron_config(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32
    )
    chunks = build_chunks(config, pp_rank=0)
    hook = ReplayHook(
        store_url, chunks, layout=ParallelLayout(pp=2, vpp=2), rank=RankCoords(pp=0), packing=Packing("verl")
    )
    hook.begin_step(0, MICRO_BATCHES)
    seen: dict[tuple[int, int], dict[int, np.ndarray]] = {}
    _drive(hook, chunks, [0, 0, 1, 1], seen)
    assert sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    _check(hook, seen)
    hook.end_step()


def test_the_trainers_logprobs_become_an_annotation_next_to_the_engines(store_url: str) -> None:  # noqa: F811
    from routelog import audit

    config = megatron_config()
    (chunk,) = build_chunks(config)
    hook = ReplayHook(
        store_url, [chunk], layout=ParallelLayout(), rank=RankCoords(), packing=Packing("verl"), fidelity_writer="t0"
    )
    hook.begin_step(0, MICRO_BATCHES)
    _drive(hook, [chunk], [0, 0], {})
    rng = np.random.default_rng(0)
    for i, n in enumerate(LENGTHS):
        hook.record_logprobs(f"s{i}", np.log(rng.uniform(0.2, 1.0, n)))
    hook.end_step()
    snapshot = routelog.open_store(store_url).step(0)
    assert snapshot.value_columns() == ["logprob_train"]
    result = audit.mismatch(store_url, [0])
    assert [d.step for d in result.router_diff] == [0], "the router diff of the step is published beside them"


def test_megatron_lms_train_step_is_wrapped_in_one_line(store_url: str) -> None:  # noqa: F811
    """``hook.train_step(train_step, micro_batches=...)``: Megatron-LM's ``train_step`` signature, its
    ``forward_backward_func`` called with ``forward_step_func=`` (twice when its rerun state machine reruns the
    step), then the optimizer. Every forward replays its micro-batch's routes, the step ends after the optimizer and
    publishes its router diff; a step that fails its judgement raises before the optimizer and is cleared."""
    config = megatron_config()
    (chunk,) = build_chunks(config)
    common: dict[str, Any] = {"layout": ParallelLayout(), "rank": RankCoords(), "packing": Packing("verl")}
    seen: dict[tuple[int, int], dict[int, np.ndarray]] = {}
    wanted: dict[tuple[int, int], dict[int, np.ndarray]] = {}
    updates: list[int] = []
    position = {"m": 0}

    def forward_step(data_iterator: Any, model: Any) -> tuple[Any, Callable[..., Any]]:
        """The user's forward step: the micro-batch's tokens into the embedding, then every MoE layer."""
        m = position["m"]
        position["m"] += 1
        replay = hook.micro_batch(m)
        embed(model, fed_tokens(replay))
        routed: dict[int, np.ndarray] = {}
        total = None
        for layer in moe_layers(model):
            handle = layer.mlp.router.register_forward_hook(
                lambda module, args, out: routed.__setitem__(int(module.layer_number), selected(out[1].detach()))
            )
            out, _ = layer.mlp(torch.randn(replay.ids.shape[1], 1, HIDDEN, requires_grad=True))
            handle.remove()
            total = out.sum() if total is None else total + out.sum()
        seen[(0, m)] = routed
        wanted[(0, m)] = {r.layer_number: np.sort(replay.ids[j], axis=-1) for j, r in enumerate(replay.routers)}
        return total, lambda output: (output, {"loss": output.detach()})

    def forward_backward_func(*, forward_step_func: Any, data_iterator: Any, model: Any, num_microbatches: int) -> Any:
        """megatron-core's schedule as far as replay goes: the forward step per micro-batch, then the backward."""
        position["m"] = 0
        outputs = [forward_step_func(data_iterator, model[0])[0] for _ in range(num_microbatches)]
        for output in outputs:
            output.backward()
        return outputs

    def train_step(
        forward_step_func: Any,
        data_iterator: Any,
        model: Any,
        optimizer: Any,
        opt_param_scheduler: Any,
        config: Any,
        forward_backward_func: Any,
        iteration: int | None = None,
    ) -> str:
        """Megatron-LM's ``train_step`` as far as replay goes (its rerun state machine reruns once here)."""
        for _ in range(2):
            forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model, num_microbatches=2
            )
        updates.append(iteration or 0)
        return "ok"

    hook = ReplayHook(store_url, [chunk], config=config, fidelity_writer="train-dp0", **common)
    wrapped = hook.train_step(train_step, micro_batches=lambda iteration: MICRO_BATCHES)
    for iteration in (0, 1):
        seen.clear()
        assert wrapped(forward_step, iter(()), [chunk], None, None, config, forward_backward_func, iteration=iteration)
        assert sorted(seen) == [(0, 0), (0, 1)]
        for key, routed in seen.items():
            assert routed.keys() == wanted[key].keys()
            for number, ids in routed.items():
                np.testing.assert_array_equal(ids, wanted[key][number])
    assert updates == [0, 1]
    store = routelog.open_store(store_url)
    assert [r.trainer_step for step in (0, 1) for r in read_fidelity(store, step)] == [0, 1]
    assert hook.step is None, "each step ended after the optimizer"
    hook.remove()

    strict = ReplayHook(store_url, [chunk], config=config, gate=FidelityGate(max_router_diff=0.01), **common)
    hook = strict  # the forward step reads the hook being driven
    failing = strict.train_step(train_step, micro_batches=lambda iteration: MICRO_BATCHES)
    with pytest.raises(ReplayFidelityError, match="disagrees"):
        failing(forward_step, iter(()), [chunk], None, None, config, forward_backward_func, iteration=0)
    assert updates == [0, 1], "no optimizer step"
    assert strict.step is None and all(
        layer.mlp.router.router_replay.target_topk_idx is None for layer in moe_layers(chunk)
    ), "the failed step was cleared"
    strict.remove()
