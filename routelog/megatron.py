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
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from routelog.align.plan import AlignmentPlan, MicroBatchReplay
from routelog.errors import AlignmentError, ReplayConfigError
from routelog.format.record import token_hash
from routelog.format.spec import ModelSpec
from routelog.store.fidelity import FidelityGate, ReplayFidelityError, StepFidelity


@dataclass(frozen=True)
class ChunkRouter:
    """A ``TopKRouter`` found in a model chunk's decoder."""

    vp_stage: int
    layer_number: int
    module: Any


def language_model(chunk: Any) -> Any:
    """The GPT model of a model chunk (the module holding ``decoder`` and, on the first stage, ``embedding``),
    through wrappers that keep it in ``.module`` (DDP, Float16Module) and vision-language models that keep it in
    ``.language_model``; None when there is none."""
    current = chunk
    for _ in range(8):
        if hasattr(current, "decoder"):
            return current
        current = getattr(current, "module", None) or getattr(current, "language_model", None)
        if current is None:
            break
    return None


def _decoder(chunk: Any) -> Any:
    model = language_model(chunk)
    if model is None:
        raise ReplayConfigError(f"{type(chunk).__name__} has no decoder (expected a megatron-core GPTModel chunk)")
    return model.decoder


def _embedding(chunk: Any) -> Any:
    """The embedding of a model chunk that has one (the first pipeline stage), else None: it takes the chunk's
    ``input_ids`` before any router runs."""
    model = language_model(chunk)
    if model is None or not getattr(model, "pre_process", True):
        return None
    return getattr(model, "embedding", None)


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


def router_rows(input_ids: Any, plan: AlignmentPlan) -> Any:
    """The token id at each of this rank's router rows, from the ``input_ids`` a model chunk's embedding takes
    (``[B, S]``; ``[1, T]`` when packed): megatron-core embeds them as ``[S, B, H]`` (rows sequence-major,
    ``s * B + b``) and, with sequence parallelism, scatters the sequence over the TP ranks."""
    rows = input_ids.transpose(0, 1).reshape(-1)
    layout = plan.layout
    if layout.sp and layout.tp > 1:
        share = int(rows.shape[0]) // layout.tp
        rows = rows[plan.rank.tp * share : (plan.rank.tp + 1) * share]
    return rows


def rows_of_sequences(replay: MicroBatchReplay, sequences: Sequence[npt.ArrayLike]) -> npt.NDArray[np.int64]:
    """The token id at each of ``replay``'s rows, from the token sequences a trainer feeds (one per sample, in
    ``replay.sample_ids`` order): where its packing puts each sample's tokens, by the plan's positions. -1 on
    padding rows; -2 where a sequence is shorter than the row's position (never a stored token)."""
    if len(sequences) != len(replay.sample_ids):
        raise AlignmentError(
            f"micro-batch {replay.index}: {len(sequences)} token sequences for {len(replay.sample_ids)} samples"
        )
    arrays = [np.asarray(t, np.int64).reshape(-1) for t in sequences]
    lengths = np.array([a.size for a in arrays], np.int64)
    flat = np.concatenate([*arrays, np.full(1, -2, np.int64)])  # the last entry answers positions past an end
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    out = np.full(replay.positions.shape[0], -1, np.int64)
    real = np.flatnonzero(replay.positions[:, 0] >= 0)
    sample = replay.positions[real, 0] - replay.first_index
    position = replay.positions[real, 1]
    inside = position < lengths[sample]
    out[real] = np.where(inside, flat[np.where(inside, offsets[sample] + position, flat.size - 1)], -2)
    return out


def refuse_unverified(replay: MicroBatchReplay, opt_out: str) -> None:
    """Raise :class:`~routelog.store.fidelity.ReplayFidelityError` when records of ``replay`` were stored without token
    ids (nothing proves their routing belongs to the tokens fed); ``opt_out`` says how the caller turns the check
    off."""
    if replay.unverified:
        raise ReplayFidelityError(
            f"micro-batch {replay.index}: samples {list(replay.unverified[:5])} were stored without token ids, so "
            f"nothing proves their routing belongs to the tokens fed; store token ids (Record.token_ids), or {opt_out}"
        )


def row_mismatch(replay: MicroBatchReplay, fed: npt.NDArray[np.int64]) -> str | None:
    """Why the routing of ``replay`` does not belong to the tokens ``fed`` at its rows (one token id per router
    row), naming the first row that differs; None when every row whose token is known matches."""
    stored = replay.tokens
    if stored is None:
        return None
    if fed.shape != stored.shape:
        return f"micro-batch {replay.index}: the model is fed {fed.shape[0]} rows, the routing has {stored.shape[0]}"
    known = stored >= 0
    wrong = np.flatnonzero(known & (fed != stored))
    if not wrong.size:
        return None
    row = int(wrong[0])
    sample, position = replay.sample_at(row)
    return (
        f"micro-batch {replay.index}: row {row} feeds token {int(fed[row])} where sample {sample!r} had token "
        f"{int(stored[row])} at position {position} ({wrong.size} of {int(known.sum())} rows differ); the micro-batch "
        "order or content differs from the rollout, so the routing belongs to other tokens"
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


@dataclass
class _Override:
    """An attribute set on one object, undone exactly: the object's own attribute put back, or removed when it had
    none (so a patch of its class made later reaches it again)."""

    target: Any
    name: str
    original: Any
    had_own: bool
    value: Any

    def restore(self) -> None:
        if vars(self.target).get(self.name) is not self.value:
            return  # overridden again since, by someone else: theirs to undo
        if self.had_own:
            setattr(self.target, self.name, self.original)
        else:
            delattr(self.target, self.name)


def _override(target: Any, name: str, value: Any) -> _Override:
    undo = _Override(target, name, getattr(target, name), name in vars(target), value)
    setattr(target, name, value)
    return undo


class _TakenCount:
    """Counts a router's forward passes that took replayed routes (``REPLAY_FORWARD`` with targets set), without
    touching the device: routes handed to a router that never takes them are an inert replay."""

    def __init__(self, router_replay: Any) -> None:
        self.replay = router_replay
        self.forwards = 0
        self._undo = _override(router_replay, "get_replay_topk", self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _is(self.replay.router_replay_action, "REPLAY_FORWARD") and self.replay.target_topk_idx is not None:
            self.forwards += 1
        return self._undo.original(*args, **kwargs)

    def restore(self) -> None:
        self._undo.restore()


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
        self.tally: Any = None
        """On the router's device, the forward passes' (replayed rows, of those the rows whose native top-k set
        differs from the replayed one, rows without a recorded route): added to without reading the device."""
        self._undo = _override(router_replay, "get_replay_topk", self)
        self._original = self._undo.original

    def push(self, mask: Any) -> None:
        self.current = mask
        self.queued.append(mask)

    def clear(self) -> None:
        self.current, self.queued = None, []

    def restore(self) -> None:
        self._undo.restore()

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
            counts = torch.stack([mask.sum(), (mask & ~same).sum(), (~mask).sum()])
            self.tally = counts if self.tally is None else self.tally + counts.to(self.tally.device)
        indices = torch.where(mask[:, None], target, native) if self.use_native_for_missing else target
        return scores.gather(1, indices), indices


TokenCheck = Literal["rows", "off"]


class MegatronReplay:
    """Hands one rank's replay tensors to megatron-core's routers, micro-batch by micro-batch, and proves the
    replay did what it should before the optimizer step (:meth:`check`).

    - **Row by row**: the embedding of a chunk that has one (the first pipeline stage) reports the ``input_ids``
      it takes; each router row's token is compared with the token its routing was recorded for (on the device;
      read once per step), so reordered samples or changed tokens fail, naming the sample, position and both
      tokens. Records stored without token ids are refused. ``check_tokens="off"`` turns both off, by name.
    - **Never inert**: a router handed routes that no forward took (the trainer's replay switch off, a replay
      action never set), or a token check that could not run (an embedding that never saw a micro-batch it was
      owed), fails the step.
    - **Fidelity**: with the plan's ``missing="router"`` (or ``measure=True``, or a ``gate``) each router's replay
      is wrapped by :class:`MaskedTopk`: rows without a recorded route take the router's own top-k, and
      :meth:`router_diff` reports, per layer, how often the router's own choice differs from the replayed one;
      the ``gate`` judges it.

    :meth:`end_step` checks (unless :meth:`check` already did), clears the routes and returns the step's counts
    (:class:`~routelog.store.fidelity.StepFidelity`, to publish with :func:`~routelog.store.fidelity.write_fidelity`).
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
        check_tokens: TokenCheck = "rows",
    ) -> None:
        """``vp_stages``: the virtual stages of ``model_chunks`` when they are not all of this rank's chunks in
        order (a trainer that hands one chunk at a time)."""
        if config is not None:
            check_config(config, plan.spec)
        if check_tokens not in ("rows", "off"):
            raise ValueError(f"check_tokens must be 'rows' or 'off', got {check_tokens!r}")
        self.plan = plan
        self.gate = gate
        self.check_tokens = check_tokens
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
        self._taken = {r.layer_number: _TakenCount(r.module.router_replay) for r in self.routers}
        self._embedded: set[int] = set()
        """Virtual stages whose chunk has an embedding (checks the tokens fed)."""
        stages = range(len(model_chunks)) if vp_stages is None else vp_stages
        for vp_stage, chunk in zip(stages, model_chunks, strict=True):
            embedding = _embedding(chunk)
            if embedding is not None and check_tokens == "rows":
                self._embedded.add(vp_stage)
                self._handles.append(embedding.register_forward_pre_hook(self._token_hook(vp_stage), with_kwargs=True))
        self._reset_step()

    def _reset_step(self) -> None:
        self._owed: dict[int, MicroBatchReplay] = {}
        """Per chunk with an embedding: the micro-batch installed whose tokens it has not seen yet."""
        self._fed: list[tuple[MicroBatchReplay, Any, Any]] = []
        """(micro-batch, its rows' token ids as fed, the count of rows that differ): on the device until checked."""
        self._unchecked: list[str] = []
        self._handed: dict[int, int] = {}
        """Per layer number: micro-batches whose routes it was handed this step."""
        self._taken_before = {n: t.forwards for n, t in self._taken.items()}
        self._judged = False
        self._taken_at_judgement: dict[int, int] = {}
        self._read: dict[int, tuple[int, int, int]] | None = None
        """The tallies the last judgement read (what the step counted, once judged)."""

    def router_diff(self) -> dict[int, tuple[int, int]]:
        """Per ``layer_number``: (replayed rows, rows whose native top-k differs), since construction."""
        return {n: (rows, differing) for n, (rows, differing, _) in self._tallies().items()}

    def _tallies(self) -> dict[int, tuple[int, int, int]]:
        """Per ``layer_number``, every :class:`MaskedTopk`'s tally since construction: one read of the device."""
        if not self._masked:
            return {}
        import torch

        zero = torch.zeros(3, dtype=torch.int64)
        tallies = [zero if m.tally is None else m.tally.to("cpu", non_blocking=True) for m in self._masked.values()]
        values = torch.stack(tallies).tolist()  # the step's one read (of all routers at once)
        return {n: (int(v[0]), int(v[1]), int(v[2])) for n, v in zip(self._masked, values, strict=True)}

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

    def _token_hook(self, vp_stage: int) -> Any:
        import torch

        def fed(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            replay = self._owed.pop(vp_stage, None)  # the first embedding call of the forward (MTP calls it again)
            if replay is None or input_ids is None:
                return
            if replay.tokens is None:  # a micro-batch built without its records' tokens: the check cannot run
                self._unchecked.append(f"micro-batch {replay.index} on virtual stage {vp_stage} (no stored tokens)")
                return
            rows = router_rows(input_ids, self.plan)
            if int(rows.shape[0]) != replay.tokens.shape[0]:
                raise AlignmentError(
                    f"micro-batch {replay.index}: the model is fed {int(rows.shape[0])} token rows, the routing has "
                    f"{replay.tokens.shape[0]}; the packing, CP/SP split or micro-batch differs from the plan"
                )
            stored = torch.from_numpy(replay.tokens).to(rows.device, non_blocking=True)
            differing = ((stored >= 0) & (rows != stored)).sum()  # stays on the device until the step is judged
            self._fed.append((replay, rows, differing))

        return fed

    @contextmanager
    def forward(
        self,
        replay: MicroBatchReplay,
        *,
        vp_stage: int | None = None,
        device: Any = None,
        tokens: Sequence[npt.ArrayLike] | None = None,
        fed_rows: npt.ArrayLike | None = None,
    ) -> Iterator[None]:
        """Replay ``replay`` in the forward run inside the block (one model chunk, or all with ``vp_stage=None``)."""
        # Actions are set on this model's decoder routers only: a process-global flip would also reach MTP routers
        # and orphans of a decoder built twice, which have no targets.
        for router in self.routers:
            router.module.router_replay.set_router_replay_action(_action(router.module.router_replay, "REPLAY_FORWARD"))
        self.install(replay, vp_stage=vp_stage, device=device, tokens=tokens, fed_rows=fed_rows)
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
        fed_rows: npt.ArrayLike | None = None,
    ) -> None:
        """Hand ``replay``'s targets to the routers of one model chunk (all with ``vp_stage=None``) without
        touching the replay action: for trainers that set it themselves around their forward step (veRL).
        ``tokens`` (per sample, in ``replay.sample_ids`` order) are also checked against the stored hashes.
        ``fed_rows``: the token id at each row, from the data the trainer is about to feed (see
        :func:`rows_of_sequences`), checked row by row now instead of at the chunk's embedding."""
        import torch

        if self.check_tokens == "rows":
            refuse_unverified(replay, "replay them unchecked with check_tokens='off'")
        if tokens is not None:
            try:
                check_tokens(replay, tokens)
            except AlignmentError as exc:
                if self.gate is None:
                    raise
                self._step.token_mismatches += 1
                self.gate.token_mismatch(str(exc))
        if fed_rows is not None and self.check_tokens == "rows":
            why = row_mismatch(replay, np.asarray(fed_rows, np.int64))
            if why is not None:
                self._step.token_mismatches += 1
                (self.gate or _STRICT).token_mismatch(why)
        for stage in self._embedded if fed_rows is None else ():
            if vp_stage is None or vp_stage == stage:
                missed = self._owed.get(stage)
                if missed is not None:
                    self._unchecked.append(f"micro-batch {missed.index} on virtual stage {stage}")
                self._owed[stage] = replay
        if vp_stage is None or vp_stage == 0:  # a micro-batch visits every model chunk: count its records once
            self._step.samples += len(replay.sample_ids)
        by_layer = {r.layer_number: j for j, r in enumerate(replay.routers)}
        mask = torch.from_numpy(replay.mask)
        for router in self.routers:
            if vp_stage is None or router.vp_stage == vp_stage:
                target = torch.from_numpy(replay.ids[by_layer[router.layer_number]])
                router.module.router_replay.set_target_indices(target if device is None else target.to(device))
                self._handed[router.layer_number] = self._handed.get(router.layer_number, 0) + 1
                if router.layer_number in self._masked:
                    self._masked[router.layer_number].push(mask if device is None else mask.to(device))

    def _counts(self, *, reread: bool = True) -> StepFidelity:
        """The step's counts so far (per global layer index); ``reread=False`` reuses the last read of the tallies."""
        counts = StepFidelity(samples=self._step.samples, token_mismatches=self._step.token_mismatches)
        if reread or self._read is None:
            self._read = self._tallies()
        for layer_number, now in self._read.items():
            before = self._counted.get(layer_number, (0, 0, 0))
            counts.add(layer_number - 1, *(a - b for a, b in zip(now, before, strict=True)))
        return counts

    def check(self) -> StepFidelity:
        """Judge the step so far, before the optimizer step: raises
        :class:`~routelog.store.fidelity.ReplayFidelityError` when a row was fed another token than its routing was
        recorded for, a token check could not run, a router never took the routes it was handed, or the ``gate`` finds
        the router diff too high. Reads the device once. Returns the step's counts so far."""
        self._judged = True
        self._taken_at_judgement = {n: t.forwards for n, t in self._taken.items()}
        counts = self._counts()
        unchecked = self._unchecked + [
            f"micro-batch {r.index} on virtual stage {stage}" for stage, r in sorted(self._owed.items())
        ]
        if unchecked:
            raise ReplayFidelityError(
                f"the tokens fed could not be checked for {', '.join(unchecked[:3])}: the chunk's embedding never "
                "ran between the routes' installation and the next one (install each micro-batch right before its "
                "forward), or turn the check off by name with check_tokens='off'"
            )
        inert = [
            n
            for n, handed in sorted(self._handed.items())
            if handed and self._taken[n].forwards == self._taken_before[n]
        ]
        if inert:
            raise ReplayFidelityError(
                f"routes were handed to the routers of layers {inert} and no forward took them: replay is inert. "
                "The trainer's replay switch is off (veRL: router_replay.mode='R3'; megatron-core: "
                "moe_enable_routing_replay=True) or nothing set RouterReplayAction.REPLAY_FORWARD before the forward"
            )
        if self._fed:
            import torch

            differing = int(torch.stack([d.reshape(()) for _, _, d in self._fed]).sum())  # the one device read
            if differing:
                for replay, rows, _ in self._fed:
                    why = row_mismatch(replay, rows.cpu().numpy().astype(np.int64))
                    if why is not None:
                        counts.token_mismatches += 1
                        self._step.token_mismatches += 1
                        (self.gate or _STRICT).token_mismatch(why)
                        break
        if self.gate is not None:
            self.gate.check(counts, "routing replay")
        return counts

    def end_step(self) -> StepFidelity:
        """Clear every target and the action after the optimizer step; returns the step's replay-fidelity counts
        (per global layer index; empty unless measured), judged by :meth:`check` unless it already ran."""
        try:
            if not self._judged:
                return self.check()
            # No router forward since the judgement (the generic hook judges at the step's last forward): the
            # tallies it read are the step's, and the device is not read again.
            forwards = {n: t.forwards for n, t in self._taken.items()}
            return self._counts(reread=forwards != self._taken_at_judgement)
        finally:
            for router in self.routers:
                router.module.router_replay.clear_indices()
                router.module.router_replay.clear_router_replay_action()
            for masked in self._masked.values():
                masked.clear()
            self._counted = self._read if self._read is not None else self._tallies()
            self._step = StepFidelity()
            self._reset_step()

    def remove(self) -> None:
        """Remove every hook and wrapper, restoring each router's replay exactly as it was."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for taken in self._taken.values():
            taken.restore()
        self._taken.clear()
        for masked in self._masked.values():
            masked.restore()
        self._masked.clear()


_STRICT = FidelityGate(max_router_diff=None)
"""Judges token mismatches only, and raises: for a replay without a gate of its own."""
