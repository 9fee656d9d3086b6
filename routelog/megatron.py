"""Installing replay tensors into megatron-core's ``RouterReplay`` (megatron-core >= 0.16, optional dependency).

Routers are found by walking each model chunk's ``decoder`` for ``TopKRouter`` modules with a ``router_replay``,
keyed by their global ``layer_number``: never by position in ``RouterReplay.global_router_replay_instances``, which
also holds MTP routers and the orphans of a decoder built twice (verl #7340). Per micro-batch the installer sets
``REPLAY_FORWARD``, hands every router of the chunk its int64 targets, and flips to ``REPLAY_BACKWARD`` after the
forward, so activation recomputation pops the same tensors in FIFO order; :meth:`MegatronReplay.end_step` clears
them. Configurations in which replay would be silently bypassed or wrong are refused before training.

>>> replay = MegatronReplay(model_chunks, plan, config=model_config)                        # doctest: +SKIP
>>> for mb in ReplayLoader(url, step, plan):                                                # doctest: +SKIP
...     with replay.forward(mb, vp_stage=0, tokens=tokens_of(mb)):
...         loss = forward_step(...)
>>> replay.end_step()                                                                        # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.align.plan import AlignmentPlan, MicroBatchReplay
from routelog.errors import AlignmentError, ReplayConfigError
from routelog.fidelity import FidelityGate, StepFidelity
from routelog.record import token_hash
from routelog.spec import ModelSpec


@dataclass(frozen=True)
class ChunkRouter:
    """A ``TopKRouter`` found in a model chunk's decoder."""

    vp_stage: int
    layer_number: int
    module: Any


def _decoder(chunk: Any) -> Any:
    """The ``decoder`` of a model chunk, through wrappers (DDP, Float16Module) that keep it in ``.module``."""
    current = chunk
    for _ in range(8):
        if hasattr(current, "decoder"):
            return current.decoder
        current = getattr(current, "module", None)
        if current is None:
            break
    raise ReplayConfigError(f"{type(chunk).__name__} has no decoder (expected a megatron-core GPTModel chunk)")


def find_routers(model_chunks: Sequence[Any], vp_stages: Sequence[int] | None = None) -> list[ChunkRouter]:
    """Every replay-enabled ``TopKRouter`` under each chunk's decoder, in forward order (MTP routers excluded);
    ``vp_stages`` names the chunks' virtual stages when they are not all of this rank's, in order."""
    from megatron.core.transformer.moe.router import TopKRouter

    found = []
    stages = range(len(model_chunks)) if vp_stages is None else vp_stages
    for vp_stage, chunk in zip(stages, model_chunks, strict=True):
        routers = [m for m in _decoder(chunk).modules() if isinstance(m, TopKRouter)]
        for router in sorted(routers, key=lambda r: int(r.layer_number)):
            if getattr(router, "router_replay", None) is None:
                raise ReplayConfigError(
                    f"router of layer {router.layer_number} has no router_replay: build the model with "
                    "moe_enable_routing_replay=True (--moe-enable-routing-replay)"
                )
            found.append(ChunkRouter(vp_stage, int(router.layer_number), router))
    return found


def check_config(config: Any, spec: ModelSpec) -> None:
    """Refuse configurations in which replay would be bypassed or wrong (megatron-core checks none of them)."""
    problems = []
    if not getattr(config, "moe_enable_routing_replay", False):
        problems.append("moe_enable_routing_replay is off: the routers have no RouterReplay")
    if getattr(config, "moe_router_fusion", False):
        problems.append("moe_router_fusion=True returns before compute_topk, so replay is silently ignored")
    balancing = str(getattr(config, "moe_router_load_balancing_type", "") or "")
    if "sinkhorn" in balancing or "quantile" in balancing:
        problems.append(f"moe_router_load_balancing_type={balancing!r} bypasses compute_topk, so replay is ignored")
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        problems.append("moe_expert_capacity_factor drops tokens after routing, including replayed routes")
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        problems.append(
            "overlap_moe_expert_parallel_comm interleaves sub-micro-batches, which breaks the global replay action"
        )
    if getattr(config, "num_moe_experts", spec.num_experts) != spec.num_experts:
        problems.append(f"num_moe_experts={config.num_moe_experts}, the routing has {spec.num_experts} experts")
    if getattr(config, "moe_router_topk", spec.topk) != spec.topk:
        problems.append(f"moe_router_topk={config.moe_router_topk}, the routing has top-{spec.topk}")
    if problems:
        raise ReplayConfigError("routing replay cannot run with this configuration: " + "; ".join(problems))


def check_tokens(replay: MicroBatchReplay, token_ids: Sequence[npt.ArrayLike]) -> None:
    """Prove the routing belongs to the tokens about to be fed: their hashes must match the stored ones."""
    if len(token_ids) != len(replay.sample_ids):
        raise AlignmentError(
            f"micro-batch {replay.index}: {len(token_ids)} token sequences for {len(replay.sample_ids)} samples"
        )
    for sid, stored, tokens in zip(replay.sample_ids, replay.token_hashes, token_ids, strict=True):
        fed = token_hash(np.asarray(tokens))
        if stored is not None and stored != fed:
            raise AlignmentError(
                f"sample {sid!r}: the tokens fed hash to {fed}, the routing was recorded for "
                f"{stored}; the micro-batch order or content differs from the rollout"
            )


def _action(router_replay: Any, name: str) -> Any:
    """The ``RouterReplayAction`` member ``name`` of the enum ``router_replay``'s own class uses: megatron-core's,
    or a trainer's own copy (veRL patches its ``RouterReplay`` and enum into ``TopKRouter``; equal names, unequal
    members)."""
    import sys

    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    own = getattr(sys.modules.get(type(router_replay).__module__), "RouterReplayAction", RouterReplayAction)
    return own[name]


def _is(action: Any, name: str) -> bool:
    """Whether ``action`` is the member ``name`` of any ``RouterReplayAction`` enum."""
    return getattr(action, "name", None) == name


class MaskedTopk:
    """Wraps one router's ``RouterReplay.get_replay_topk`` so that rows whose mask is False take the router's own
    top-k (the ``router`` missing-route policy), and counts how often the router's own choice differs from the
    replayed one on the replayed rows.

    Masks are queued beside megatron-core's targets: the forward uses the newest, recomputation in the backward
    pops the oldest with its target, exactly as ``replay_backward_list`` does.
    """

    def __init__(self, router_replay: Any, *, use_native_for_missing: bool) -> None:
        self.replay = router_replay
        self.use_native_for_missing = use_native_for_missing
        self.current: Any = None
        self.queued: list[Any] = []
        self.rows = 0
        """Replayed rows seen by forward passes."""
        self.differing = 0
        """Of those, rows whose native top-k set differs from the replayed one."""
        self.fallback = 0
        """Rows without a recorded route seen by forward passes (they take the router's own top-k)."""
        self._original = router_replay.get_replay_topk
        router_replay.get_replay_topk = self

    def push(self, mask: Any) -> None:
        self.current = mask
        self.queued.append(mask)

    def clear(self) -> None:
        self.current, self.queued = None, []

    def restore(self) -> None:
        self.replay.get_replay_topk = self._original

    def __call__(
        self,
        scores: Any,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Any = None,
    ) -> tuple[Any, Any]:
        import torch

        action = self.replay.router_replay_action
        if _is(action, "REPLAY_FORWARD") and self.current is not None:
            target, mask, forward = self.replay.target_topk_idx, self.current, True
        elif _is(action, "REPLAY_BACKWARD") and self.queued:
            target, mask, forward = self.replay.replay_backward_list.pop(0), self.queued.pop(0), False
            trainer_masks = getattr(self.replay, "replay_backward_mask_list", None)  # veRL's RouterReplay
            if trainer_masks:
                trainer_masks.pop(0)
        else:
            return self._original(scores, topk, num_groups, group_topk, default_compute_topk)  # type: ignore[no-any-return]
        target = target.to(scores.device)
        mask = mask.to(scores.device)
        _, native = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if forward:
            same = (torch.sort(native, dim=1).values == torch.sort(target, dim=1).values).all(dim=1)
            self.rows += int(mask.sum())
            self.differing += int((mask & ~same).sum())
            self.fallback += int((~mask).sum())
        indices = torch.where(mask[:, None], target, native) if self.use_native_for_missing else target
        return scores.gather(1, indices), indices


class MegatronReplay:
    """Hands one rank's replay tensors to megatron-core's routers, micro-batch by micro-batch.

    With the plan's ``missing="router"`` (or ``measure=True``, or a ``gate``) each router's replay is wrapped by
    :class:`MaskedTopk`: rows without a recorded route take the router's own top-k, and :meth:`router_diff`
    reports, per layer, how often the router's own choice differs from the replayed one; :meth:`end_step` returns
    the step's counts (:class:`~routelog.fidelity.StepFidelity`, to publish with
    :func:`~routelog.fidelity.write_fidelity`) after the ``gate`` checked them.
    """

    def __init__(
        self,
        model_chunks: Sequence[Any],
        plan: AlignmentPlan,
        *,
        config: Any = None,
        measure: bool = False,
        gate: FidelityGate | None = None,
        vp_stages: Sequence[int] | None = None,
    ) -> None:
        """``vp_stages``: the virtual stages of ``model_chunks`` when they are not all of this rank's chunks in
        order (a trainer that hands one chunk at a time)."""
        if config is not None:
            check_config(config, plan.spec)
        self.plan = plan
        self.gate = gate
        self._step = StepFidelity()
        self._counted: dict[int, tuple[int, int, int]] = {}
        self.routers = find_routers(model_chunks, vp_stages)
        found = [(r.vp_stage, r.layer_number) for r in self.routers]
        expected = [(r.vp_stage, r.layer_number) for r in plan.routers if vp_stages is None or r.vp_stage in vp_stages]
        if found != expected:
            raise AlignmentError(
                f"the model's routers (vp_stage, layer_number) {found} differ from the plan's {expected}: the "
                "pipeline layout or the model spec does not match the model"
            )
        self._handles = [r.module.register_forward_pre_hook(self._check_rows_hook(r)) for r in self.routers]
        self._masked: dict[int, MaskedTopk] = {}
        if plan.missing == "router" or measure or gate is not None:
            self._masked = {
                r.layer_number: MaskedTopk(r.module.router_replay, use_native_for_missing=plan.missing == "router")
                for r in self.routers
            }

    def router_diff(self) -> dict[int, tuple[int, int]]:
        """Per ``layer_number``: (replayed rows, rows whose native top-k differs), since construction."""
        return {n: (m.rows, m.differing) for n, m in self._masked.items()}

    def _check_rows_hook(self, router: ChunkRouter) -> Any:
        def check(module: Any, args: tuple[Any, ...]) -> None:
            replay = module.router_replay
            hidden = args[0]
            tokens = int(hidden.shape[0] * hidden.shape[1]) if hidden.dim() == 3 else int(hidden.shape[0])
            action = replay.router_replay_action
            target = None
            if _is(action, "REPLAY_FORWARD"):
                target = replay.target_topk_idx
            elif _is(action, "REPLAY_BACKWARD") and replay.replay_backward_list:
                target = replay.replay_backward_list[0]
            if target is not None and int(target.shape[0]) != tokens:
                raise AlignmentError(
                    f"layer {router.layer_number}: the router sees {tokens} tokens, the replay holds "
                    f"{int(target.shape[0])} rows; the packing, CP/SP split or micro-batch differs from the plan"
                )

        return check

    @contextmanager
    def forward(
        self,
        replay: MicroBatchReplay,
        *,
        vp_stage: int | None = None,
        device: Any = None,
        tokens: Sequence[npt.ArrayLike] | None = None,
    ) -> Iterator[None]:
        """Replay ``replay`` in the forward run inside the block (one model chunk, or all with ``vp_stage=None``)."""
        # Actions are set on this model's decoder routers only: a process-global flip would also reach MTP routers
        # and orphans of a decoder built twice, which have no targets.
        for router in self.routers:
            router.module.router_replay.set_router_replay_action(_action(router.module.router_replay, "REPLAY_FORWARD"))
        self.install(replay, vp_stage=vp_stage, device=device, tokens=tokens)
        try:
            yield
        finally:
            # Recomputation in the backward pass pops the targets just set, oldest first.
            for router in self.routers:
                replay_ = router.module.router_replay
                replay_.set_router_replay_action(_action(replay_, "REPLAY_BACKWARD"))

    def install(
        self,
        replay: MicroBatchReplay,
        *,
        vp_stage: int | None = None,
        device: Any = None,
        tokens: Sequence[npt.ArrayLike] | None = None,
    ) -> None:
        """Hand ``replay``'s targets to the routers of one model chunk (all with ``vp_stage=None``) without
        touching the replay action: for trainers that set it themselves around their forward step (veRL)."""
        import torch

        if tokens is not None:
            try:
                check_tokens(replay, tokens)
            except AlignmentError as exc:
                if self.gate is None:
                    raise
                self._step.token_mismatches += 1
                self.gate.token_mismatch(str(exc))
        if vp_stage is None or vp_stage == 0:  # a micro-batch visits every model chunk: count its records once
            self._step.samples += len(replay.sample_ids)
        by_layer = {r.layer_number: j for j, r in enumerate(replay.routers)}
        mask = torch.from_numpy(replay.mask)
        for router in self.routers:
            if vp_stage is None or router.vp_stage == vp_stage:
                target = torch.from_numpy(replay.ids[by_layer[router.layer_number]])
                router.module.router_replay.set_target_indices(target if device is None else target.to(device))
                if router.layer_number in self._masked:
                    self._masked[router.layer_number].push(mask if device is None else mask.to(device))

    def end_step(self) -> StepFidelity:
        """Clear every target and the action after the optimizer step; returns the step's replay-fidelity counts
        (per global layer index; empty unless measured) once the gate has checked them."""
        for router in self.routers:
            router.module.router_replay.clear_indices()
            router.module.router_replay.clear_router_replay_action()
        for masked in self._masked.values():
            masked.clear()
        counts, self._step = self._step, StepFidelity()
        for layer_number, masked in self._masked.items():
            before = self._counted.get(layer_number, (0, 0, 0))
            now = (masked.rows, masked.differing, masked.fallback)
            counts.add(layer_number - 1, *(a - b for a, b in zip(now, before, strict=True)))
            self._counted[layer_number] = now
        if self.gate is not None:
            self.gate.check(counts, "routing replay")
        return counts

    def remove(self) -> None:
        """Remove the row-count hooks and the replay wrappers."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for masked in self._masked.values():
            masked.restore()
        self._masked.clear()
