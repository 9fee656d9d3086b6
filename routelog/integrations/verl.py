"""veRL 0.9 (Megatron engine): routing goes to the store, sample ids ride the ``DataProto``, each worker installs its
own rows through :class:`~routelog.megatron.MegatronReplay`.

veRL carries the rollout's routing as a dense ``batch["routed_experts"]`` ``[bsz, prompt + response, L, K]`` int16
through every DP dispatch and micro-batch split, and each worker packs it again for its forward (verl #6211: a
45 GB pipeline broadcast). Here:

* **rollout side** (driver, after ``generate_sequences``): :func:`write_batch` writes every row of the batch as a
  record and replaces the tensor by a ``routelog_sample_id`` column (and the store step in ``meta_info``);
* **training side** (every Megatron worker, before the engine is built): :func:`install` patches three points of
  ``verl.workers.engine.megatron.transformer_impl``: ``prepare_model_inputs`` notes the micro-batch's sample ids
  and tokens; ``set_router_replay_data`` (which veRL calls per micro-batch and model chunk) arms the chunk instead
  of packing a tensor; and a forward pre-hook on the chunk installs the rows when the model is called, aligned to
  the ``packed_seq_params`` (THD) or the input width (BSHD) **the model is actually given**, never re-derived, so
  FP8 padding, length buckets, dynamic CP and BSHD without remove-padding land where the model computes. Each rank
  reads only its own records and pipeline-stage layers. ``forward_backward_batch`` is wrapped to start reading the
  pass's records in the background before its first micro-batch (``prefetch``: whole records, so under CP or
  sequence parallelism a rank reads more than its share of records longer than a chunk) and to end the step:
  the router diff is judged by the gate and published (:mod:`routelog.store.fidelity`).

veRL sets the replay actions itself (its own ``RouterReplay`` class and enum, which :mod:`routelog.megatron`
accepts); ``actor.megatron.router_replay.mode=R3`` stays on, ``rollout.enable_rollout_routing_replay`` may be off
(the engine no longer needs to return routing through the batch once the rollout writes it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from routelog.align import AlignmentPlan, MicroBatch, Packing
from routelog.align.plan import MicroBatchReplay, MissingPolicy, OtherVersions, PolicyVersions, gather, versions_for
from routelog.engines.verl import records_from_batch
from routelog.errors import AlignmentError
from routelog.format.routing import RecordRouting
from routelog.format.spec import ModelSpec
from routelog.integrations.megatron import layout_from_config, rank_from_parallel_state
from routelog.loader import ReplayLoader
from routelog.megatron import MegatronReplay, language_model
from routelog.store.fidelity import FidelityGate, ReplayFidelityError, StepFidelity, write_fidelity
from routelog.store.reader import StepSnapshot
from routelog.store.store import Store, open_store
from routelog.store.writer import StepWriter

SAMPLE_ID_KEY = "routelog_sample_id"
"""The ``non_tensor_batch`` column that replaces ``routed_experts``."""
STEP_KEY = "routelog_step"
"""The ``meta_info`` entry naming the store step the batch's routing was written to."""
ROUTES_KEY = "routed_experts"


def sample_ids_of(batch: Any) -> list[str]:
    """Unique, stable ids for a batch's rows: veRL's ``uid`` names the prompt (shared by its ``rollout.n``
    samples), so the n-th row of a uid is ``<uid>/<n>``; row numbers without uids."""
    uids = batch.non_tensor_batch.get("uid")
    if uids is None:
        return [str(i) for i in range(len(batch))]
    seen: dict[str, int] = {}
    out = []
    for uid in uids:
        n = seen.get(str(uid), 0)
        seen[str(uid)] = n + 1
        out.append(f"{uid}/{n}")
    return out


def write_batch(
    writer: StepWriter,
    batch: Any,
    *,
    spec: ModelSpec | None = None,
    sample_ids: Sequence[str] | None = None,
    policy_version: int | None = None,
) -> list[str]:
    """Write the routing of every row of a rollout ``DataProto`` to ``writer``'s step, then drop the dense tensor
    from the batch and carry the sample ids instead; returns the ids.

    The batch is veRL's agent-loop output: ``prompts`` (left-padded), ``input_ids``, ``attention_mask`` and
    ``routed_experts`` ``[bsz, P + R, L, K]`` (rows from the first real prompt token; padding and the final token
    0).
    """
    spec = spec or writer.store.model_spec
    tensors = batch.batch
    if tensors.get(ROUTES_KEY, None) is None:
        raise AlignmentError(
            f"the batch has no {ROUTES_KEY!r}: enable actor_rollout_ref.rollout.enable_rollout_routing_replay "
            "so the agent loop returns the engine's routing"
        )
    ids = list(sample_ids) if sample_ids is not None else sample_ids_of(batch)
    uids = batch.non_tensor_batch.get("uid")
    records = records_from_batch(
        tensors[ROUTES_KEY].cpu().numpy(),
        tensors["attention_mask"].cpu().numpy(),
        int(tensors["prompts"].shape[1]),
        spec,
        input_ids=tensors["input_ids"].cpu().numpy(),
        sample_ids=ids,
        group_ids=None if uids is None else [str(u) for u in uids],
        policy_version=writer.step if policy_version is None else policy_version,
    )
    for record in records:
        writer.append(record)
    del tensors[ROUTES_KEY]
    batch.non_tensor_batch[SAMPLE_ID_KEY] = np.array(ids, dtype=object)
    batch.meta_info[STEP_KEY] = writer.step
    return ids


def carried_ids(batch: Any) -> tuple[tuple[str, ...], int]:
    """The sample ids and store step a micro-batch carries: columns written by :func:`write_batch` (ids per row,
    the step in ``meta_info``), or each row's ``extra_fields`` written by the agent-loop workers
    (:mod:`routelog.integrations.verl_agent_loop`; the only form on veRL's V1 TransferQueue path)."""
    from verl.utils import tensordict_utils as tu

    ids, step = tu.get(batch, SAMPLE_ID_KEY), tu.get(batch, STEP_KEY)
    extra = tu.get(batch, "extra_fields") if ids is None else None
    if ids is None and extra is not None:
        rows = [e if isinstance(e, Mapping) else {} for e in _listed(extra)]
        ids = [r.get(SAMPLE_ID_KEY) for r in rows]
        step = [r.get(STEP_KEY) for r in rows]
    if ids is None or step is None or any(i is None for i in _listed(ids)):
        raise AlignmentError(
            f"the micro-batch carries no {SAMPLE_ID_KEY!r} / {STEP_KEY!r} (in its columns or extra_fields): write "
            "the rollout with routelog.integrations.verl.write_batch on the driver, or let the agent-loop workers "
            "write it (ROUTELOG_URL in their environment, routelog.integrations.verl_agent_loop), before computing "
            "log-probs or updating the actor"
        )
    steps = {int(s) for s in (_listed(step) if not isinstance(step, int | np.integer) else [step])}
    if len(steps) != 1:
        raise AlignmentError(f"one micro-batch mixes store steps {sorted(steps)}: its rows' routing cannot be read")
    return tuple(str(i) for i in _listed(ids)), steps.pop()


def _listed(value: Any) -> list[Any]:
    """A per-row non-tensor column as a list (numpy object arrays, tensordict stacks, lists)."""
    tolist = getattr(value, "tolist", None)
    return list(tolist() if callable(tolist) else value)


@dataclass(frozen=True)
class _MicroBatchInput:
    """What ``prepare_model_inputs`` saw of the micro-batch about to be forwarded."""

    step: int
    sample_ids: tuple[str, ...]


@dataclass(frozen=True)
class _Armed:
    micro_batch: _MicroBatchInput
    config: Any
    vp_stage: int
    local_cp_size: int | None


@dataclass(frozen=True)
class _Ahead:
    """A pass's records being read in the background (:meth:`VerlReplay.begin_pass`)."""

    step: int
    sample_ids: frozenset[str]
    layers: tuple[int, ...]
    routings: Future[dict[str, RecordRouting]]


class VerlReplay:
    """One worker's replay: see the module docs; :func:`install` creates one and patches veRL with it."""

    def __init__(
        self,
        store: Store | str,
        *,
        spec: ModelSpec | None = None,
        missing: MissingPolicy = "router",
        gate: FidelityGate | None = None,
        fidelity_writer: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        cache: int = 4,
        policy_versions: PolicyVersions = "step",
        other_versions: OtherVersions = "refuse",
        prefetch: bool = True,
    ) -> None:
        self.store = store if isinstance(store, Store) else open_store(store, storage_options=storage_options)
        self.prefetch = prefetch
        self.prefetched = 0
        """Micro-batches whose rows came from the pass's background read (no read of the store at their forward)."""
        self._ahead: _Ahead | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.noted = 0
        """Micro-batches carrying routelog's sample ids that veRL prepared for a forward (``prepare_model_inputs``)."""
        self.armed = 0
        """Micro-batches veRL asked routes for (``set_router_replay_data``): fewer on a training pass is inert."""
        self.spec = spec or self.store.model_spec
        self.missing = missing
        self.policy_versions, self.other_versions = policy_versions, other_versions
        versions_for(policy_versions, 0)  # a bad rule fails here, not at the first step
        self.gate = gate or FidelityGate(max_router_diff=None)
        self.fidelity_writer = fidelity_writer
        self._local = threading.local()
        self._armed: dict[int, _Armed] = {}
        self._hooked: dict[int, Any] = {}
        self._replays: dict[tuple[int, int], MegatronReplay] = {}
        self._loaded: OrderedDict[tuple[Any, ...], MicroBatchReplay] = OrderedDict()
        self._cache = cache
        self._step: int | None = None
        self._snapshot: StepSnapshot | None = None

    # -- the three patched points ------------------------------------------------------------------------------
    def note_inputs(self, batch: Any) -> None:
        """From ``prepare_model_inputs``: the micro-batch's sample ids and store step."""
        ids, step = carried_ids(batch)
        # The tokens are checked row by row where the model takes them (the first stage's embedding, on the
        # device): nothing of the micro-batch is read back here.
        self._local.current = _MicroBatchInput(step, ids)
        self._step = step
        self.noted += 1

    def arm(self, config: Any, vp_stage: int | None, local_cp_size: int | None, model: Any) -> None:
        """From ``set_router_replay_data``: the chunk about to run this micro-batch gets its rows at its forward."""
        current = getattr(self._local, "current", None)
        if current is None or model is None:
            raise AlignmentError(
                "set_router_replay_data ran without a micro-batch noted by prepare_model_inputs (or without the "
                "model): apply routelog.integrations.verl.install() before the engine is built"
            )
        chunk = _unwrap(model)
        self.armed += 1
        self._armed[id(chunk)] = _Armed(current, config, vp_stage or 0, local_cp_size)
        if id(chunk) not in self._hooked:
            self._hooked[id(chunk)] = chunk.register_forward_pre_hook(self._pre_forward, with_kwargs=True)

    def _pre_forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        armed = self._armed.pop(id(module), None)
        if armed is None:
            return  # a forward without replay (reference model, critic)
        micro = _micro_batch(armed, args, kwargs)
        config = armed.config
        layout = layout_from_config(config, cp=micro.cp, cp_layout=_cp_layout(config))
        rank = rank_from_parallel_state(cp_rank=micro.cp_rank)
        packing = Packing("thd") if micro.cu_seqlens_padded is not None else Packing("bshd")
        step = armed.micro_batch.step
        plan = AlignmentPlan(
            self.spec,
            layout,
            packing,
            rank,
            (micro,),
            self.missing,
            policy_versions=versions_for(self.policy_versions, step),
            other_versions=self.other_versions,
        )
        mb = self._load(step, plan)
        replay = self._replay_for(module, plan, armed.vp_stage)
        replay.install(mb, vp_stage=armed.vp_stage)

    def begin_pass(self, data: Any, config: Any) -> None:
        """From ``forward_backward_batch``'s start: read the pass's records (this stage's layers) in the background,
        so each micro-batch's forward aligns rows already in memory. Whole records: under context or sequence
        parallelism a rank keeps only its share of each, so it reads up to CP x TP times its rows for records longer
        than a chunk (shorter ones cost a chunk either way); ``prefetch=False`` reads just the share at each
        forward instead."""
        self._ahead = None
        if not self.prefetch or config is None:
            return
        try:
            ids, step = carried_ids(data)
        except AlignmentError:  # not routelog's batch (or a broken one: its micro-batches' forwards will say so)
            return
        layout = layout_from_config(config)
        rank = rank_from_parallel_state()
        layers = AlignmentPlan(self.spec, layout, Packing("thd"), rank, ()).moe_layers
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="routelog-verl-prefetch")
        future = self._executor.submit(self._read_ahead, step, list(ids), layers)
        self._ahead = _Ahead(step, frozenset(ids), tuple(layers), future)

    def _read_ahead(self, step: int, ids: list[str], layers: list[int]) -> dict[str, RecordRouting]:
        snapshot = self._snapshot if self._snapshot is not None and self._snapshot.step == step else None
        if snapshot is None:  # kept for the forwards that read on their own: the step's commits are read once
            snapshot = self._snapshot = self.store.step(step)
        return {r.sample_id: r for r in snapshot.read_many(ids, moe_layers=layers)}

    def end_step(self, *, phase: str | None = None) -> StepFidelity:
        """From ``forward_backward_batch``'s end: clear, judge and publish the router diff of this forward pass."""
        self._ahead = None
        counts = StepFidelity()
        for replay in self._replays.values():
            counts = counts.merge(replay.end_step())
        self._armed.clear()
        if self.fidelity_writer is not None and self._step is not None and counts.replayed:
            write_fidelity(self.store, self._step, self.fidelity_writer, counts, phase=phase)
        return counts

    # -- helpers ------------------------------------------------------------------------------------------------
    def _load(self, step: int, plan: AlignmentPlan) -> MicroBatchReplay:
        """The micro-batch's rows for this rank (every model chunk of the rank shares one read)."""
        key = (step, plan)
        ahead = self._ahead
        ids = plan.micro_batches[0].sample_ids
        if (
            key not in self._loaded
            and ahead is not None
            and ahead.step == step
            and ahead.layers == tuple(plan.moe_layers)
            and ahead.sample_ids.issuperset(ids)
        ):
            routings = ahead.routings.result()  # the background read's errors surface here, at the forward
            self._loaded[key] = gather(plan, 0, {sid: routings[sid] for sid in ids})
            self.prefetched += 1
        if key not in self._loaded:
            if self._snapshot is None or self._snapshot.step != step:  # the step's commits and index, read once
                self._snapshot = self.store.step(step)
            loader = ReplayLoader(self.store, step, plan, prefetch=0, snapshot=self._snapshot)
            self._loaded[key] = loader.load(0)
            while len(self._loaded) > self._cache:
                self._loaded.popitem(last=False)
        return self._loaded[key]

    def _replay_for(self, chunk: Any, plan: AlignmentPlan, vp_stage: int) -> MegatronReplay:
        key = (id(chunk), vp_stage)
        if key not in self._replays:
            self._replays[key] = MegatronReplay([chunk], plan, gate=self.gate, vp_stages=[vp_stage])
        return self._replays[key]

    def remove(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        for replay in self._replays.values():
            replay.remove()
        self._replays.clear()


def _unwrap(model: Any) -> Any:
    """The GPTModel under DDP / Float16Module wrappers or a vision-language model (the module whose forward takes
    ``packed_seq_params``)."""
    found = language_model(model)
    return model if found is None else found


def _cp_layout(config: Any) -> Any:
    """veRL's context-parallel layout: contiguous for DeepSeek-V4 hybrid attention, else zigzag."""
    from verl.utils.megatron.router_replay_utils import _context_parallel_layout

    return _context_parallel_layout(config)


def _micro_batch(armed: _Armed, args: tuple[Any, ...], kwargs: dict[str, Any]) -> MicroBatch:
    """The micro-batch as the model is given it: THD boundaries from ``packed_seq_params`` (with dynamic CP, the
    group and this rank's place in it), else the BSHD width of ``input_ids`` / ``attention_mask``."""
    ids = armed.micro_batch.sample_ids
    params = kwargs.get("packed_seq_params")
    if params is not None:
        cu = getattr(params, "cu_seqlens_q_padded", None)
        if cu is None:
            cu = params.cu_seqlens_q
        cp_rank = None
        group = getattr(params, "cp_group", None)
        if armed.local_cp_size is not None and group is not None:
            import torch.distributed as dist

            cp_rank = dist.get_rank(group=group)
        bounds = tuple(int(x) for x in cu.tolist())
        return MicroBatch(ids, cu_seqlens_padded=bounds, cp=armed.local_cp_size, cp_rank=cp_rank)
    dense = kwargs.get("input_ids", args[0] if args else None)
    if dense is None:
        dense = kwargs.get("attention_mask")
    if dense is None or dense.dim() < 2:
        raise AlignmentError(
            "the model chunk was called without packed_seq_params or a [batch, seq] input: cannot align the routes"
        )
    # With context parallelism the model gets each rank's share of the width: the packing splits the whole one.
    cp = armed.local_cp_size or int(getattr(armed.config, "context_parallel_size", 1) or 1)
    return MicroBatch(ids, seq_len=int(dense.shape[1]) * cp)


def install(
    store: Store | str,
    *,
    spec: ModelSpec | None = None,
    missing: MissingPolicy = "router",
    gate: FidelityGate | None = None,
    fidelity_writer: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    policy_versions: PolicyVersions = "step",
    other_versions: OtherVersions = "refuse",
) -> VerlReplay:
    """Patch veRL's Megatron engine in this process to replay from ``store``; returns the :class:`VerlReplay`.

    Rows without a recorded route (each sequence's final token, padding) are left to the router by default, as
    veRL's own replay does (``missing="dummy"`` gives them placeholder experts instead). Routing of another policy
    version than the step's (what :func:`write_batch` records by default) is refused: ``policy_versions`` and
    ``other_versions`` say otherwise (:data:`~routelog.align.plan.PolicyVersions`).

    Call it in every training worker before the engine is built (e.g. at the top of a custom worker's
    ``init_model``). The patched functions are looked up by veRL in ``transformer_impl``'s namespace, which is why
    they are replaced there.
    """
    from verl.workers.engine.megatron import transformer_impl as impl

    replay = VerlReplay(
        store,
        spec=spec,
        missing=missing,
        gate=gate,
        fidelity_writer=fidelity_writer,
        storage_options=storage_options,
        policy_versions=policy_versions,
        other_versions=other_versions,
    )
    engine = impl.MegatronEngineWithLMHead
    prepare = engine.prepare_model_inputs
    forward_backward = impl.MegatronEngine.forward_backward_batch

    def prepare_model_inputs(self: Any, batch: Any) -> dict[str, Any]:
        inputs: dict[str, Any] = prepare(self, batch)
        replay.note_inputs(batch)
        if inputs.get(ROUTES_KEY) is None:  # veRL's R3 path insists on a tensor; the routes come from the store
            inputs[ROUTES_KEY] = _placeholder(batch["input_ids"])
        return inputs

    def set_router_replay_data(
        layers_topk_idx: Any,
        attention_mask: Any,
        tf_config: Any,
        vp_rank: int | None = None,
        replay_mask: Any = None,
        local_cp_size: int | None = None,
        model: Any = None,
    ) -> None:
        del layers_topk_idx, attention_mask, replay_mask  # rows come from the store, aligned at the forward
        replay.arm(tf_config, vp_rank, local_cp_size, model)

    def forward_backward_batch(self: Any, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
        noted, armed = replay.noted, replay.armed
        replay.begin_pass(data, getattr(self, "tf_config", None))
        try:
            result = forward_backward(self, data, loss_function, forward_only)
        finally:
            replay.end_step(phase="logprob" if forward_only else "train")
        if not forward_only and replay.noted > noted and replay.armed == armed:
            mode = getattr(getattr(getattr(self, "engine_config", None), "router_replay", None), "mode", None)
            raise ReplayFidelityError(
                f"a training pass over {replay.noted - noted} micro-batches carrying routelog's sample ids replayed "
                f"none of them: veRL never asked for their routes (router_replay.mode={mode!r}). Set "
                "actor_rollout_ref.actor.router_replay.mode='R3' (R2 replays the trainer's own recording, not the "
                "rollout's), or drop routelog.integrations.verl.install() from the worker"
            )
        return result

    engine.prepare_model_inputs = prepare_model_inputs
    impl.set_router_replay_data = set_router_replay_data
    impl.MegatronEngine.forward_backward_batch = forward_backward_batch
    return replay


def _placeholder(input_ids: Any) -> Any:
    """A one-number-per-token stand-in for the routes veRL's R3 path expects (aligned and then ignored)."""
    import torch

    if getattr(input_ids, "is_nested", False):
        parts = [torch.zeros((int(n), 1, 1), dtype=torch.int16) for n in input_ids.offsets().diff().tolist()]
        return torch.nested.as_nested_tensor(parts, layout=torch.jagged)
    return torch.zeros((*input_ids.shape[:2], 1, 1), dtype=torch.int16)
