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
from routelog.fidelity import FidelityGate, ReplayFidelityError, StaleRoutingError, read_fidelity
from routelog.integrations.megatron import ReplayHook
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
        counts = hook.end_step(trainer_step=step)
        assert counts.samples == 3
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
