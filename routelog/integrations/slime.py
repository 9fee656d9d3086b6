"""slime (THUDM/slime) Rollout Routing Replay through a routelog store: slime places the rows, each rank reads its own.

**Why.** slime's R3 ships every sample's routing, ``Sample.rollout_routed_experts`` (``[len(tokens) - 1,
num_layers, K]`` int32 from SGLang, all layers), inside each DP rank's ``rollout_data``; every TP x CP x PP rank of
the DP group fetches that whole payload, then pads, CP-slices and SP-slices it and keeps its stage's layers in
``MegatronTrainRayActor.fill_routing_replay`` (slime #2384: host memory grows with DP-local tokens x all layers on
every rank, and runs hosts out of memory on long responses). Here the rollout side writes the routing to a store
once and sends nothing of it to training. Each training rank hands slime's own ``RoutingReplay`` instances, per
router and micro-batch, a lazy reference (slime's lazy-resource API, :mod:`routelog.integrations.slime_source`):
when a router pops it, slime's own ``prepare_routed_experts_for_routing_replay`` decides where the micro-batch's
rows land on the rank (final tokens, zigzag or all-gather CP, the pad multiple, the SP slice: slime pads and
slices), and routelog reads only those rows of the micro-batch's records, only its pipeline stage's layers, a few
micro-batches ahead. The tensor is the one slime's code would have recorded (int32 per router and micro-batch,
padding rows included; only a token SGLang never routed differs: slime would replay its zeros, routelog gives it
distinct placeholder experts), so slime's stage machine (``ROUTING_REPLAY_STAGE``, the forward and backward
cursors) runs unchanged, and ``RoutingReplay.clear_all`` releases it. ``tests/test_integration_slime.py`` compares
every rank's tensors with those slime's real code (commit 624b824a) recorded on the same rollout.

**Sample ids.** A record's id is ``f"{rollout_id}/{position}"``: its position in the rollout's flattened sample
list, which is what slime itself ships to each DP rank as ``rollout_data["partition"]`` (and how its debug dumps
number samples). So nothing is added to slime's data: ``Sample.index`` is not unique in agentic rollouts (the
samples a trajectory emits share it), the position is. Before any router runs, each record's tokens are compared,
position by position, with the tokens the trainer feeds.

**Wiring** (slime at 624b824a; both hooks are slime's own arguments)::

    # rollout side: slime's rollout, its routing written to the store and stripped from the samples
    export ROUTELOG_URL=s3://bucket/run-42          # in the Ray job's runtime env (env_vars)
    --rollout-function-path routelog.integrations.slime.generate_rollout
    #   (a custom rollout function: ROUTELOG_SLIME_ROLLOUT_FUNCTION=my_pkg.rollout.generate)

    # training side: every training actor swaps in routelog's fill_routing_replay
    --custom-megatron-init-path routelog.integrations.slime.install
    --use-rollout-routing-replay                    # still needed: SGLang returns routes, slime's replay stages run
    #   (slime with RoutingReplay's lazy-resource API: a74ae3a0 on, 624b824a tested)

From Python: :func:`write_samples` / :func:`strip_routing` (or :func:`wrap_rollout_function`) on the rollout side;
:func:`install` / :func:`patch` with a :class:`SlimeReplay` on the training side, whose :meth:`SlimeReplay.record`
is the whole training-side logic (with ``prepare=``, usable without slime).

slime, megatron-core and torch are imported only inside the functions that need them.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from routelog import environment
from routelog.align import AlignmentPlan, LocalRouter, MicroBatch, Packing, ParallelLayout, RankCoords
from routelog.align.plan import OtherVersions, PolicyVersions, replayable_rows, versions_for
from routelog.engines.slime import record_from_sample
from routelog.errors import AlignmentError, IngestError, ModelSpecError, RecordNotFoundError, ReplayConfigError
from routelog.format.part import PartOptions
from routelog.format.record import token_hash
from routelog.format.spec import ModelSpec
from routelog.integrations.slime_source import (
    Prepare,
    PreparedMicroBatch,
    RolloutSource,
    SlimeGeometry,
    StoreRows,
    check_pad_routes,
)
from routelog.integrations.transfer import host_sequences
from routelog.loader import ReplayLoader
from routelog.store.fidelity import FidelityGate, ReplayFidelityError, StepFidelity, write_fidelity
from routelog.store.reader import StepSnapshot
from routelog.store.store import Store, create_store, open_store

URL_ENV = environment.URL.name
"""Environment variable naming the store for :func:`generate_rollout` and :func:`install`."""
ROLLOUT_FUNCTION_ENV = environment.SLIME_ROLLOUT_FUNCTION.name
"""Environment variable naming the rollout function :func:`generate_rollout` wraps (``module.function``)."""
DEFAULT_ROLLOUT_FUNCTION = "slime.rollout.sglang_rollout.generate_rollout"
SAMPLE_ID_KEY = "routelog_sample_id"
"""Where :func:`strip_routing` leaves a sample's id in a ``Sample.metadata`` dict (slime's debug dumps show it)."""
DEFAULT_WRITER_ID = "slime-rollout"
_ACTOR_CLASS = "slime.backends.megatron_utils.actor.MegatronTrainRayActor"
_STEP_ATTRIBUTE = "_routelog_rollout_id"
_PATCHED = "__routelog_slime__"
logger = logging.getLogger(__name__)


# -- rollout side ------------------------------------------------------------------------------------------------
def sample_id(rollout_id: int, position: int) -> str:
    """The record id of the sample at ``position`` of rollout ``rollout_id``'s flattened sample list."""
    return f"{rollout_id}/{position}"


def spec_from_args(args: Any, *, name: str | None = None) -> ModelSpec:
    """The model spec slime's (Megatron) arguments describe: ``num_layers``, ``num_experts``, ``moe_router_topk``,
    ``moe_layer_freq`` and the router options (``mtp_num_layers`` for MTP models)."""
    return ModelSpec.from_megatron(
        num_layers=int(args.num_layers),
        num_moe_experts=int(args.num_experts),
        moe_router_topk=int(args.moe_router_topk),
        moe_layer_freq=getattr(args, "moe_layer_freq", None) or 1,
        moe_router_score_function=getattr(args, "moe_router_score_function", None) or "softmax",
        moe_router_pre_softmax=bool(getattr(args, "moe_router_pre_softmax", False)),
        moe_router_num_groups=getattr(args, "moe_router_num_groups", None),
        moe_router_group_topk=getattr(args, "moe_router_group_topk", None),
        moe_router_enable_expert_bias=bool(getattr(args, "moe_router_enable_expert_bias", False)),
        moe_router_topk_scaling_factor=getattr(args, "moe_router_topk_scaling_factor", None),
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
        name=name or os.path.basename(str(getattr(args, "hf_checkpoint", None) or "slime").rstrip("/")) or "slime",
    )


def flatten_samples(samples: Sequence[Any]) -> list[Any]:
    """A rollout's samples in the order slime trains them: nested lists flattened as ``RolloutManager`` does."""
    flat: list[Any] = list(samples)
    while flat and isinstance(flat[0], list):
        flat = list(itertools.chain.from_iterable(flat))
    return flat


def write_samples(
    store: Store | str,
    rollout_id: int,
    samples: Sequence[Any],
    *,
    spec: ModelSpec | None = None,
    writer_id: str = DEFAULT_WRITER_ID,
    policy_version: int | None = None,
    options: PartOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
    on_conflict: Literal["drop", "error"] = "drop",
) -> list[str]:
    """Write the routing of a rollout's samples (slime ``Sample``-like objects, flat or nested as a rollout function
    returns them) to step ``rollout_id``; returns their ids, in flattened order. Waits for the commit, so the
    training side can read them as soon as this returns.

    Each sample needs ``tokens``, ``response_length`` and ``rollout_routed_experts`` (``[len(tokens) - 1,
    num_layers, K]``: a tensor, an array or nested lists); ``group_index`` becomes the record's group. Parts keep
    SGLang's top-k order (``topk_order="score"``) unless ``options`` say otherwise, so replay hands the routers the
    exact rows slime would. ``spec`` creates the store when it does not exist (:func:`spec_from_args`).

    A rollout regenerated after a restart reuses its ids with other tokens: ``on_conflict="drop"`` first drops
    the parts of the earlier attempt that hold such stale records (a drop document, nothing rewritten; their
    records still current are written again), ``"error"`` refuses them.
    """
    flat = flatten_samples(samples)
    if isinstance(store, Store):
        target = store
    elif spec is not None:
        target = create_store(store, spec, storage_options=storage_options)
    else:
        target = open_store(store, storage_options=storage_options)
    model = target.model_spec
    ids = [sample_id(rollout_id, position) for position in range(len(flat))]
    version = rollout_id if policy_version is None else policy_version
    records = (_record(sample, sid, model, version) for sample, sid in zip(flat, ids, strict=True))
    if on_conflict == "drop" and rollout_id in target.steps():
        _drop_stale(target, rollout_id, flat, ids)
    with target.writer(
        rollout_id, writer_id, options=options or PartOptions(topk_order="score"), on_duplicate="skip"
    ) as writer:
        for record in records:
            writer.append(record)
    return ids


def _tokens(sample: Any, where: str) -> npt.NDArray[np.int64]:
    tokens = getattr(sample, "tokens", None)
    if tokens is None:
        raise IngestError(f"{where}: the sample has no tokens")
    return np.asarray(_numpy(tokens), dtype=np.int64).reshape(-1)


def _record(sample: Any, sid: str, spec: ModelSpec, policy_version: int | None) -> Any:
    where = f"sample {sid!r} (Sample.index {getattr(sample, 'index', None)})"
    routes = getattr(sample, "rollout_routed_experts", None)
    if routes is None:
        raise IngestError(
            f"{where}: rollout_routed_experts is None. SGLang returns routing only when slime runs with "
            "--use-rollout-routing-replay (return_routed_experts); a sample built outside SGLang needs its routes too"
        )
    group = getattr(sample, "group_index", None)
    return record_from_sample(
        _numpy(routes),
        _tokens(sample, where),
        int(getattr(sample, "response_length", 0)),
        spec,
        sample_id=sid,
        group_id=None if group is None else f"{sid.split('/', 1)[0]}/g{group}",
        policy_version=policy_version,
    )


def _drop_stale(store: Store, rollout_id: int, samples: Sequence[Any], ids: Sequence[str]) -> None:
    """Drop the records of an earlier attempt at this rollout whose tokens differ: the drop removes those committed
    before it, and the regenerated records written after it are live (``schemas/FORMAT.md`` section 3)."""
    snapshot = store.step(rollout_id)
    present = [(sample, sid) for sample, sid in zip(samples, ids, strict=True) if sid in snapshot]
    if not present:
        return
    index = snapshot.to_arrow([sid for _, sid in present])
    stale = [
        sid
        for (sample, sid), n, digest in zip(
            present, index.column("n_tokens").to_pylist(), index.column("token_hash").to_pylist(), strict=True
        )
        if (n, digest) != ((tokens := _tokens(sample, f"sample {sid!r}")).shape[0], token_hash(tokens))
    ]
    if stale:
        store.drop(rollout_id, sample_ids=stale, reason=f"slime regenerated rollout {rollout_id}")


def strip_routing(data: Sequence[Any] | MutableMapping[str, Any], sample_ids: Sequence[str] | None = None) -> int:
    """Drop the routing payload so it never travels to training; returns how many payloads were dropped.

    ``data`` is a rollout's samples (``rollout_routed_experts`` set to None; with ``sample_ids``, each id is left in
    ``Sample.metadata[SAMPLE_ID_KEY]`` where metadata is a dict) or slime's ``train_data`` / ``rollout_data`` dict
    (its ``rollout_routed_experts`` key removed)."""
    if isinstance(data, MutableMapping):
        payload = data.pop("rollout_routed_experts", None)
        return 0 if payload is None else len(payload)
    flat = flatten_samples(data)
    if sample_ids is not None and len(sample_ids) != len(flat):
        raise AlignmentError(f"{len(sample_ids)} sample ids for {len(flat)} samples")
    dropped = 0
    for position, sample in enumerate(flat):
        if getattr(sample, "rollout_routed_experts", None) is not None:
            sample.rollout_routed_experts = None
            dropped += 1
        metadata = getattr(sample, "metadata", None)
        if sample_ids is not None and isinstance(metadata, dict):
            metadata[SAMPLE_ID_KEY] = sample_ids[position]
    return dropped


RolloutFunction = Callable[..., Any]


def wrap_rollout_function(
    fn: RolloutFunction,
    store: Store | str,
    *,
    spec: ModelSpec | None = None,
    writer_id: str = DEFAULT_WRITER_ID,
    storage_options: Mapping[str, Any] | None = None,
    options: PartOptions | None = None,
) -> RolloutFunction:
    """A slime rollout function (``generate_rollout(args, rollout_id, data_source, evaluation=False)``) that runs
    ``fn``, writes the training samples' routing to step ``rollout_id`` and strips it from them. Evaluation
    rollouts pass through untouched. ``spec`` defaults to :func:`spec_from_args`."""

    def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
        output = fn(args, rollout_id, data_source, evaluation=evaluation)
        if evaluation:
            return output
        samples: Any = getattr(output, "samples", output)  # RolloutFnTrainOutput, or a legacy list of samples
        ids = write_samples(
            store,
            rollout_id,
            samples,
            spec=spec or spec_from_args(args),
            writer_id=writer_id,
            storage_options=storage_options,
            options=options,
        )
        strip_routing(samples, ids)
        return output

    return generate_rollout


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """``--rollout-function-path routelog.integrations.slime.generate_rollout``: slime's SGLang rollout (or the
    function ``$ROUTELOG_SLIME_ROLLOUT_FUNCTION`` names) with its routing written to the store at ``$ROUTELOG_URL``
    and stripped from the samples."""
    inner = _load_function(environment.slime_rollout_function() or DEFAULT_ROLLOUT_FUNCTION)
    return wrap_rollout_function(inner, _url_from_env(args))(args, rollout_id, data_source, evaluation=evaluation)


def _load_function(path: str) -> Any:
    """The function at ``path``, a dotted path :func:`routelog.environment.slime_rollout_function` checked."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ReplayConfigError(f"cannot load the rollout function {path!r}: {exc}") from exc


def _url_from_env(args: Any = None) -> str:
    url = getattr(args, "routelog_url", None) or environment.store_url()
    if not url:
        raise ReplayConfigError(
            f"no routelog store: set {URL_ENV} in the Ray job's runtime environment (env_vars), or call "
            "install(url=...) / wrap_rollout_function(fn, url) from your own hook"
        )
    return str(url)


# -- training side -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FillReport:
    """What one :meth:`SlimeReplay.record` call put into slime's ``RoutingReplay`` instances: one
    :class:`~routelog.integrations.slime_source.LayerRef` per router and micro-batch."""

    rollout_id: int
    micro_batches: int
    routers: int
    samples: int


def layout_from_args(args: Any, model_chunks: Sequence[Any] | None = None) -> ParallelLayout:
    """The parallel layout of slime's (Megatron) arguments. With the actor's model chunks, each (pipeline rank,
    virtual stage)'s layers are megatron-core's own ``get_transformer_layer_offset`` / ``get_num_layers_to_build``
    on the chunks' config, as slime's ``fill_routing_replay`` walks them."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    vpp = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
    common: dict[str, Any] = {
        "tp": tp,
        "cp": int(getattr(args, "context_parallel_size", 1) or 1),
        "pp": pp,
        "vpp": vpp,
        "sequence_parallel": bool(getattr(args, "sequence_parallel", tp > 1)),
    }
    if model_chunks:
        config = _chunk_config(model_chunks[0])
        return ParallelLayout(
            **common,
            stage_layers=tuple(
                tuple(tuple(_megatron_chunk_layers(config, v, p)) for v in range(vpp if pp > 1 else 1))
                for p in range(pp)
            ),
        )
    return ParallelLayout(
        **common,
        first_stage_layers=getattr(args, "decoder_first_pipeline_num_layers", None),
        last_stage_layers=getattr(args, "decoder_last_pipeline_num_layers", None),
        account_for_embedding=bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
        account_for_loss=bool(getattr(args, "account_for_loss_in_pipeline_split", False)),
    )


def rank_from_megatron() -> RankCoords:
    """This process's TP, CP and PP ranks from megatron-core's ``parallel_state`` (slime's ``mpu``)."""
    from megatron.core import parallel_state

    return RankCoords(
        tp=parallel_state.get_tensor_model_parallel_rank(),
        cp=parallel_state.get_context_parallel_rank(),
        pp=parallel_state.get_pipeline_model_parallel_rank(),
    )


def _chunk_config(chunk: Any) -> Any:
    """The ``TransformerConfig`` of a model chunk (slime reads ``model.module.config``), through wrappers."""
    current = chunk
    for _ in range(8):
        if current is None:
            break
        module = getattr(current, "module", None)
        if module is not None and getattr(module, "config", None) is not None:
            return module.config
        if getattr(current, "config", None) is not None:
            return current.config
        current = module
    raise ReplayConfigError(f"{type(chunk).__name__} has no megatron config (expected slime's model chunks)")


def _megatron_chunk_layers(config: Any, vp_stage: int, pp_rank: int) -> range:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = int(get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank))
    return range(offset, offset + int(get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)))


def _slime_is_moe(config: Any, layer: int) -> bool:
    """slime's own dense-layer test in ``fill_routing_replay`` (``moe_layer_freq`` int or list)."""
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return layer % freq == 0
    return bool(freq[layer])


class SlimeReplay:
    """One training process's replay from a store into slime's ``RoutingReplay`` instances.

    ``layout`` and ``rank`` default to slime's arguments and megatron-core's ``parallel_state``; ``spec`` to the
    store's; ``prepare`` to slime's own ``prepare_routed_experts_for_routing_replay`` (where rows land on a rank is
    always slime's decision; :func:`routelog.testing.slime_prepare` stands in where slime is not installed).
    ``check_tokens`` compares, row by row, the tokens each record's routing was recorded for with the tokens slime
    feeds (``rollout_data["tokens"]``, one host copy per sample and rollout): a micro-batch whose samples were
    reordered or changed fails before training, naming the sample, position and both tokens. Without ``tokens`` in
    the train data, or for records stored without token ids, it refuses; ``check_tokens=False`` turns it off, by
    name. ``prefetch`` micro-batches are read ahead of the one a router pops.

    Routing that was recorded into slime's ``RoutingReplay`` and that no router popped by the rollout's first
    optimizer step fails the step (:class:`~routelog.store.fidelity.ReplayFidelityError`: slime's replay is inert). With
    a ``gate`` or a ``fidelity_writer``, :func:`patch` also wraps slime's replaying ``compute_topk``: in each replay
    stage's first pop of a micro-batch the router's own top-k is computed too (one extra top-k per router and
    micro-batch, no host synchronisation), and the rows whose own set differs from the replayed one are counted
    (the R3 paper's router diff, on the trainer's weights). Before each optimizer step inside ``train_actor``
    (slime's ``optimizer.step()``, wrapped for the rollout) and after it, the counts so far are judged by the gate
    (:class:`~routelog.store.fidelity.ReplayFidelityError` when a layer exceeds it); after it they are published as the
    rank's fidelity document ``<fidelity_writer>-r<global rank>`` of the step (``routelog mismatch`` shows them)."""

    def __init__(
        self,
        store: Store | str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        spec: ModelSpec | None = None,
        layout: ParallelLayout | None = None,
        rank: RankCoords | None = None,
        prefetch: int = 2,
        check_tokens: bool = True,
        gate: FidelityGate | None = None,
        fidelity_writer: str | None = None,
        policy_versions: PolicyVersions = "step",
        other_versions: OtherVersions = "refuse",
        prepare: Prepare | None = None,
    ) -> None:
        self._store = store
        self.policy_versions = policy_versions
        self.other_versions = other_versions
        versions_for(policy_versions, 0)  # a bad rule fails here, not at the first rollout
        self.storage_options = storage_options
        self.spec = spec
        self.layout = layout
        self.rank = rank
        self.prefetch = prefetch
        self.check_tokens = check_tokens
        self.gate = gate
        self.fidelity_writer = fidelity_writer
        self.prepare = prepare
        self.last_report: FillReport | None = None
        """What the last :meth:`record` call recorded."""
        self.source: RolloutSource | None = None
        """The rollout being trained: slime's lazy resource its routers pop."""
        self.meter: FidelityMeter | None = None
        """The router diff of the rollout being trained (measured only with a gate or a fidelity writer)."""
        self._padding_checked: set[tuple[SlimeGeometry, RankCoords]] = set()

    @property
    def measures(self) -> bool:
        """Whether the router diff is measured."""
        return self.gate is not None or self.fidelity_writer is not None

    @property
    def store(self) -> Store:
        """The store, opened on first use (in the process that replays)."""
        if not isinstance(self._store, Store):
            self._store = open_store(self._store, storage_options=self.storage_options)
        return self._store

    def micro_batches(
        self, rollout_id: int, rollout_data: Mapping[str, Any], num_microbatches: Sequence[int] | None = None
    ) -> list[MicroBatch]:
        """This DP rank's micro-batches in the order slime runs them (``micro_batch_indices``, the first
        ``sum(num_microbatches)``), each a list of record ids from ``rollout_data["partition"]``."""
        for key in ("partition", "micro_batch_indices"):
            if key not in rollout_data:
                raise AlignmentError(
                    f"rollout_data has no {key!r}: routelog reads each sample's position from slime's "
                    "'partition' and the schedule from 'micro_batch_indices' (slime 624b824a ships both)"
                )
        partition = [int(p) for p in rollout_data["partition"]]
        schedule = [list(mb) for mb in rollout_data["micro_batch_indices"]]
        count = len(schedule) if num_microbatches is None else sum(int(n) for n in num_microbatches)
        if count > len(schedule):
            raise AlignmentError(
                f"rollout {rollout_id}: num_microbatches sums to {count}, micro_batch_indices holds {len(schedule)}"
            )
        batches = []
        for m, local in enumerate(schedule[:count]):
            if not local or any(not 0 <= j < len(partition) for j in local):
                raise AlignmentError(
                    f"rollout {rollout_id}: micro-batch {m} holds local indices {local}, outside this DP rank's "
                    f"{len(partition)} samples"
                )
            batches.append(MicroBatch(tuple(sample_id(rollout_id, partition[j]) for j in local)))
        return batches

    def plan(
        self,
        rollout_id: int,
        args: Any,
        rollout_data: Mapping[str, Any],
        *,
        num_microbatches: Sequence[int] | None = None,
        model_chunks: Sequence[Any] | None = None,
    ) -> AlignmentPlan:
        """This rank's plan: its micro-batches, its routers (the layout and rank), the policy versions it replays.
        Its packing (``--allgather-cp`` picks ``slime-allgather``, ``--data-pad-size-multiplier`` the pad) is
        routelog's model of slime's for offline use (``routelog align``); at run time slime places the rows."""
        spec = self.spec or self.store.model_spec
        _check_args(spec, args)
        layout = self.layout or layout_from_args(args, model_chunks)
        packing = Packing(
            "slime-allgather" if getattr(args, "allgather_cp", False) else "slime",
            slime_pad_multiplier=int(getattr(args, "data_pad_size_multiplier", 128) or 128),
        )
        return AlignmentPlan(
            spec,
            layout,
            packing,
            self.rank or rank_from_megatron(),
            tuple(self.micro_batches(rollout_id, rollout_data, num_microbatches)),
            policy_versions=versions_for(self.policy_versions, rollout_id),
            other_versions=self.other_versions,
        )

    def record(
        self,
        rollout_id: int,
        args: Any,
        rollout_data: Mapping[str, Any],
        replays: Sequence[Any],
        *,
        num_microbatches: Sequence[int] | None = None,
        model_chunks: Sequence[Any] | None = None,
    ) -> FillReport:
        """Record into ``replays`` (slime's ``RoutingReplay.all_routing_replays``: one per local MoE router in build
        order), for each of this rank's micro-batches of rollout ``rollout_id``, one
        :class:`~routelog.integrations.slime_source.LayerRef` per router; slime's ``pop_forward`` / ``pop_backward``
        turn it into the int32 ``[T_local, K]`` tensor slime's own ``fill_routing_replay`` would have recorded,
        reading the rank's rows of the micro-batch's records (its stage's layers) from the store then.

        Checked here, before any router runs: the router walk, slime's padding, every record present, the tokens
        fed are the tokens recorded (row by row), and no stale routing. The rollout's resource is
        :attr:`source`."""
        plan = self.plan(rollout_id, args, rollout_data, num_microbatches=num_microbatches, model_chunks=model_chunks)
        routers = plan.routers
        if model_chunks:
            _check_routers(plan, model_chunks)
        if len(replays) != len(routers):
            raise ReplayConfigError(
                f"slime has {len(replays)} RoutingReplay instances on this rank, the model's pipeline stage has "
                f"{len(routers)} MoE routers (layers {[r.layer for r in routers]}). MTP layers' routers register "
                "too (slime #1556): R3 with MTP needs slime's skip_replay fix (f8879db2)"
            )
        prepare = self.prepare or _slime_prepare()
        spec = plan.spec
        geometry = SlimeGeometry.from_args(
            args, num_layers=spec.num_layers, num_experts=spec.num_experts, topk=spec.topk
        )
        if (geometry, plan.rank) not in self._padding_checked:
            check_pad_routes(prepare, geometry)
            self._padding_checked.add((geometry, plan.rank))
        loader = ReplayLoader(self.store, rollout_id, plan, prefetch=0)
        snapshot, fed = self._check_samples(plan, rollout_id, rollout_data, _snapshot(loader))
        # The rows each record may replay (policy versions, rows the engine routed): index metadata, no routing read.
        replayable = {r.sample_id: replayable_rows(r, plan) for r in snapshot.read_many(plan.sample_ids, moe_layers=[])}
        meter = FidelityMeter(routers, replays, samples=len(plan.sample_ids)) if self.measures else None
        source = RolloutSource(
            StoreRows(snapshot, plan, fed, replayable, prepare, geometry),
            len(plan.micro_batches),
            len(routers),
            prefetch=self.prefetch,
            on_build=None if meter is None else meter.add_micro_batch,
        )
        for m in range(len(plan.micro_batches)):
            for target, ref in zip(replays, source.refs(m), strict=True):
                target.record(ref)
        self.close()
        self.source, self.meter = source, meter
        source.start()
        self.last_report = FillReport(
            rollout_id=rollout_id,
            micro_batches=len(plan.micro_batches),
            routers=len(routers),
            samples=len(plan.sample_ids),
        )
        logger.info(
            "routelog: rollout %d, rank %s: %d micro-batches x %d routers to replay from %s (%d samples)",
            rollout_id,
            plan.rank,
            len(plan.micro_batches),
            len(routers),
            self.store.url,
            len(plan.sample_ids),
        )
        return self.last_report

    def close(self) -> None:
        """Release the rollout's routing (slime's ``RoutingReplay.clear_all`` does it too; idempotent)."""
        if self.source is not None:
            self.source.close()

    def _check_samples(
        self,
        plan: AlignmentPlan,
        rollout_id: int,
        rollout_data: Mapping[str, Any],
        snapshot: StepSnapshot | None,
    ) -> tuple[StepSnapshot, dict[str, Any]]:
        """Every record present, with the tokens the trainer feeds (row by row, unless ``check_tokens`` is off);
        returns the step and the fed tokens by id (host tensors)."""
        import torch

        absent = [sid for sid in plan.sample_ids if snapshot is None or sid not in snapshot]
        if snapshot is None or absent:
            raise AlignmentError(
                f"rollout {rollout_id}: no routing for samples {absent[:5]} (of {len(absent)}) in {self.store.url}. "
                "Write it on the rollout side: --rollout-function-path routelog.integrations.slime.generate_rollout "
                "(or write_samples(...) in your rollout function), to the same store URL"
            )
        fed = rollout_data.get("tokens")
        if fed is None:
            raise ReplayFidelityError(
                f"rollout {rollout_id}: rollout_data has no 'tokens', so neither slime nor routelog can place the "
                "routing or prove it belongs to the tokens the trainer feeds; keep slime's 'tokens' key in the "
                "train data"
            )
        local = {sample_id(rollout_id, int(p)): j for j, p in enumerate(rollout_data["partition"])}
        host = host_sequences([fed[local[sid]] for sid in plan.sample_ids])
        tokens: dict[str, Any] = {}
        for sid, ids in zip(plan.sample_ids, host, strict=True):
            info = snapshot.info(sid)
            if ids.shape[0] != info.n_tokens:
                raise AlignmentError(
                    f"sample {sid!r}: the trainer feeds {ids.shape[0]} tokens, its routing was recorded for "
                    f"{info.n_tokens}. The rollout's samples were reordered or changed after the rollout function "
                    "returned (a custom --custom-convert-samples-to-train-data-path must keep their order and tokens)"
                )
            if self.check_tokens:
                _check_sample_tokens(sid, info.token_ids, ids)
            tokens[sid] = torch.from_numpy(ids)
        return snapshot, tokens

    def fill_routing_replay(
        self, actor: Any, data_iterator: Sequence[Any], num_microbatches: Sequence[int], rollout_data: Any
    ) -> FillReport:
        """The body of the patched ``MegatronTrainRayActor.fill_routing_replay``: :meth:`record` into slime's
        ``RoutingReplay.all_routing_replays``, the rollout's resource registered with
        ``RoutingReplay.register_lazy_resource`` (slime's ``clear_all`` closes it)."""
        rollout_id = getattr(actor, _STEP_ATTRIBUTE, None)
        if rollout_id is None:
            raise ReplayConfigError(
                "routelog's fill_routing_replay ran outside train_actor(rollout_id, ...): install it with "
                "routelog.integrations.slime.install() / patch(), which also record the rollout id"
            )
        routing_replay = importlib.import_module("slime.utils.routing_replay").RoutingReplay
        register = getattr(routing_replay, "register_lazy_resource", None)
        if register is None:
            raise ReplayConfigError(
                "slime's RoutingReplay has no register_lazy_resource (its lazy-resource API, slime a74ae3a0 on): "
                "routelog hands slime's routers the routing when they pop it; use slime at 624b824a or later"
            )
        for iterator in data_iterator:
            iterator.reset()
        report = self.record(
            int(rollout_id),
            actor.args,
            rollout_data,
            routing_replay.all_routing_replays,
            num_microbatches=num_microbatches,
            model_chunks=getattr(actor, "model", None),
        )
        if self.source is not None:
            register(self.source)
        strip_routing(rollout_data)  # as slime deletes its payload after filling (none travels with routelog)
        for iterator in data_iterator:
            iterator.reset()
        return report

    def judge(self, rollout_id: int) -> StepFidelity | None:
        """Before each optimizer step of rollout ``rollout_id``: fail if the routes recorded were never popped by
        a router, or if the router diff measured so far exceeds the gate; the counts so far (None when not
        measuring). One read of the device."""
        _refuse_inert(self.source, rollout_id)
        if self.meter is None:
            return None
        counts = self.meter.counts()
        self._check_gate(counts, rollout_id)
        return counts

    def end_rollout(self, rollout_id: int) -> StepFidelity | None:
        """After training on rollout ``rollout_id``: release its routing and judge it as :meth:`judge` does, having
        published the router diff (with a gate or a fidelity writer; None otherwise)."""
        source, self.source = self.source, None
        meter, self.meter = self.meter, None
        if source is not None:
            source.close()
        _refuse_inert(source, rollout_id)
        if meter is None:
            return None
        counts = meter.counts()
        if self.fidelity_writer is not None and counts.replayed:
            write_fidelity(
                self.store,
                rollout_id,
                f"{self.fidelity_writer}-r{_global_rank()}",
                counts,
                trainer_step=rollout_id,
                phase="slime",
            )
        self._check_gate(counts, rollout_id)
        return counts

    def _check_gate(self, counts: StepFidelity, rollout_id: int) -> None:
        if self.gate is not None:
            self.gate.check(counts, f"rollout {rollout_id}, rank {_global_rank()}")


def _refuse_inert(source: RolloutSource | None, rollout_id: int) -> None:
    """Raise unless the routes recorded into slime's ``RoutingReplay`` (if any) were popped by a router."""
    if source is not None and source.micro_batches and source.routers and not source.materialized:
        raise ReplayFidelityError(
            f"rollout {rollout_id}: routes of {source.micro_batches} micro-batches were recorded into slime's "
            "RoutingReplay and no router popped them: replay is inert (slime's replay stages never ran its "
            "compute_topk: ENABLE_ROUTING_REPLAY unset, the model built without moe_enable_routing_replay, or "
            "slime's routing API changed)"
        )


def _check_sample_tokens(sid: str, stored: Sequence[int] | None, fed: npt.NDArray[np.int64]) -> None:
    """The routing of ``sid`` was recorded for exactly the tokens ``fed``, position by position."""
    if stored is None:
        raise ReplayFidelityError(
            f"sample {sid!r} was stored without token ids, so nothing proves its routing belongs to the tokens fed; "
            "store token ids (write_samples does), or turn the check off by name: install(..., check_tokens=False)"
        )
    recorded = np.asarray(stored, dtype=np.int64)
    wrong = np.flatnonzero(recorded != fed)
    if wrong.size:
        position = int(wrong[0])
        raise ReplayFidelityError(
            f"sample {sid!r}: position {position} feeds token {int(fed[position])} where the rollout had token "
            f"{int(recorded[position])} ({wrong.size} of {fed.size} positions differ); the rollout's samples were "
            "reordered or changed after the rollout function returned, so the routing belongs to other tokens"
        )


class FidelityMeter:
    """Counts, per local router, the replayed rows whose router would have chosen another top-k set.

    :meth:`observe` runs inside slime's replaying ``compute_topk``; the micro-batch is the replay object's cursor
    of the stage (slime pops micro-batch ``m`` as its ``m``-th forward of the stage), so padding rows and tokens
    without a recorded route are left out, and each (router, micro-batch) is counted once per rollout, in whichever
    stage pops it first (slime skips its log-prob pass when it can reuse the training pass's). Counts stay on the
    device until :meth:`counts`."""

    def __init__(self, routers: Sequence[LocalRouter], replays: Sequence[Any], *, samples: int) -> None:
        self.layers = [r.layer for r in routers]
        self.index = {id(replay): j for j, replay in enumerate(replays)}
        self.masks: dict[int, npt.NDArray[np.bool_]] = {}
        self.samples = samples
        self.replayed = [0] * len(routers)
        self.differing: list[Any] = [0] * len(routers)
        self.observed = 0
        """(router, micro-batch) pairs measured."""
        self._seen: set[tuple[int, int]] = set()
        self._device_masks: dict[tuple[int, str], Any] = {}

    def add_micro_batch(self, m: int, prepared: PreparedMicroBatch) -> None:
        """Micro-batch ``m`` was built: its rows that replay a recorded route."""
        self.masks[m] = prepared.mask

    def observe(self, replay: Any, stage: str, replayed: Any, own: Any) -> None:
        """``replayed`` and ``own`` are ``[T_local, K]`` expert ids of one router's forward in ``stage``."""
        j = self.index.get(id(replay))
        m = int(getattr(replay, f"{stage}_index", 0)) - 1
        mask = self.masks.get(m)
        if j is None or mask is None or (j, m) in self._seen or own.shape != replayed.shape:
            return
        self._seen.add((j, m))
        self.observed += 1
        import torch

        key = (m, str(own.device))
        on_device = self._device_masks.get(key)
        if on_device is None:
            on_device = self._device_masks[key] = torch.from_numpy(mask).to(own.device)
        same = torch.sort(own.long(), dim=-1).values == torch.sort(replayed.long(), dim=-1).values
        self.differing[j] = self.differing[j] + ((~same.all(dim=-1)) & on_device).sum()
        self.replayed[j] += int(mask.sum())

    def counts(self) -> StepFidelity:
        """The rank's counts per global layer (one host synchronisation for all routers)."""
        out = StepFidelity(samples=self.samples)
        on_device = [d for d in self.differing if not isinstance(d, int)]
        read = iter(_read_all(on_device))
        for layer, rows, differing in zip(self.layers, self.replayed, self.differing, strict=True):
            value = differing if isinstance(differing, int) else next(read)
            if rows:
                out.add(layer, rows, value)
        return out


def _read_all(tensors: Sequence[Any]) -> list[int]:
    """Scalar device tensors as ints, in one transfer."""
    if not tensors:
        return []
    import torch

    values: list[int] = torch.stack([t.reshape(()) for t in tensors]).tolist()
    return values


def _global_rank() -> int:
    try:
        import torch.distributed as dist

        return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0
    except ImportError:  # pragma: no cover - torch is there whenever slime is
        return 0


_REPLAY_STAGES = {"replay_forward": "forward", "replay_backward": "backward"}
"""slime's ``ROUTING_REPLAY_STAGE`` values that pop recorded routes, and the cursor each advances."""


def measuring_compute_topk(factory: Callable[[Any], Any], meter_of: Callable[[], FidelityMeter | None]) -> Any:
    """slime's ``get_routing_replay_compute_topk`` with the router diff measured: the returned factory wraps
    megatron's ``compute_topk`` as slime's does, and in the replay stages also runs the router's own top-k on the
    same scores and hands both to the current :class:`FidelityMeter`."""

    def get_routing_replay_compute_topk(old_compute_topk: Any) -> Any:
        replaying = factory(old_compute_topk)

        def compute_topk(scores: Any, topk: int, num_groups: Any = None, group_topk: Any = None) -> Any:
            probs, top_indices = replaying(scores, topk, num_groups=num_groups, group_topk=group_topk)
            meter = meter_of()
            stage = _REPLAY_STAGES.get(os.environ.get("ROUTING_REPLAY_STAGE", ""))
            if meter is not None and stage is not None:
                import torch

                replay = getattr(importlib.import_module("slime.utils.routing_replay"), "ROUTING_REPLAY", None)
                with torch.no_grad():
                    _, own = old_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                meter.observe(replay, stage, top_indices, own)
            return probs, top_indices

        return compute_topk

    return get_routing_replay_compute_topk


def _slime_prepare() -> Prepare:
    """slime's own ``prepare_routed_experts_for_routing_replay``."""
    try:
        module = importlib.import_module("slime.backends.megatron_utils.cp_utils")
    except ImportError as exc:
        raise ReplayConfigError(
            f"slime's slime.backends.megatron_utils.cp_utils does not import here ({exc}): routelog lets slime place "
            "the routing rows (prepare_routed_experts_for_routing_replay); run in slime's training actor, or pass "
            "prepare= (routelog.testing.slime_prepare stands in for tests)"
        ) from None
    prepare = getattr(module, "prepare_routed_experts_for_routing_replay", None)
    if prepare is None:
        raise ReplayConfigError(
            "slime's cp_utils has no prepare_routed_experts_for_routing_replay (slime's API changed since "
            "624b824a): routelog lets slime place the routing rows; use slime at 624b824a, or pass prepare="
        )
    return prepare  # type: ignore[no-any-return]


def _snapshot(loader: ReplayLoader) -> StepSnapshot | None:
    """The loader's step, or None when the store holds no such step."""
    try:
        return loader.snapshot
    except RecordNotFoundError:
        return None


def _check_args(spec: ModelSpec, args: Any) -> None:
    expected = {
        "num_layers": spec.num_layers,
        "num_experts": spec.num_experts,
        "moe_router_topk": spec.topk,
    }
    wrong = {
        name: (getattr(args, name), value)
        for name, value in expected.items()
        if getattr(args, name, None) is not None and int(getattr(args, name)) != value
    }
    if wrong:
        raise ModelSpecError(
            "slime's arguments do not describe the model the routing was recorded for: "
            + ", ".join(f"{name}={got} (store: {want})" for name, (got, want) in wrong.items())
        )


def _check_routers(plan: AlignmentPlan, model_chunks: Sequence[Any]) -> None:
    """The plan's routers are slime's walk: per model chunk, megatron-core's layers, dense ones skipped by slime's
    ``moe_layer_freq`` rule."""
    slime = [
        (v, layer)
        for v, chunk in enumerate(model_chunks)
        for layer in _megatron_chunk_layers(_chunk_config(chunk), v, plan.rank.pp)
        if _slime_is_moe(_chunk_config(chunk), layer)
    ]
    ours = [(r.vp_stage, r.layer) for r in plan.routers]
    if slime != ours:
        raise AlignmentError(
            f"slime's router walk on this rank is (virtual stage, layer) {slime}, the routing's model spec and "
            f"layout give {ours}: the store's MoE layers {list(plan.spec.moe_layers)} or the parallel layout differ "
            "from the model's (pass spec= or layout= to SlimeReplay)"
        )


def _numpy(value: Any) -> Any:
    """A torch tensor (any device) as a NumPy array; anything else unchanged."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        return value.detach().cpu().numpy()
    return value


# -- installing into slime ---------------------------------------------------------------------------------------
def patch(actor_class: Any, replay: SlimeReplay) -> Callable[[], None]:
    """Swap ``actor_class.fill_routing_replay`` for routelog's and wrap ``train_actor`` to note the rollout id
    (the store step) and, after it, end the rollout (:meth:`SlimeReplay.end_rollout`); when ``replay`` measures
    the router diff, also wrap ``slime.utils.routing_replay.get_routing_replay_compute_topk``. Returns a function
    that restores all of it. Patching again replaces the replay (measuring is decided by the first).

    Both are looked up on the instance when slime calls them (``self.train_actor(...)`` from ``train``,
    ``self.fill_routing_replay(...)`` from ``train_actor``), so actors that already exist take the patch; Ray
    binds the methods it dispatches itself (``train``) when the actor is created, which is why ``train`` is left
    alone."""
    current = actor_class.__dict__.get(_PATCHED)
    if current is not None:
        current["replay"] = replay
        return current["undo"]  # type: ignore[no-any-return]
    original_fill = actor_class.__dict__.get("fill_routing_replay")
    original_train_actor = actor_class.train_actor
    state: dict[str, Any] = {"replay": replay}

    def fill_routing_replay(self: Any, data_iterator: Any, num_microbatches: Any, rollout_data: Any) -> None:
        state["replay"].fill_routing_replay(self, data_iterator, num_microbatches, rollout_data)

    def train_actor(self: Any, rollout_id: int, rollout_data: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(getattr(self, "args", None), "use_rollout_routing_replay", True):
            raise ReplayConfigError(
                f"rollout {rollout_id}: routelog's replay is installed but slime's --use-rollout-routing-replay is "
                "off, so slime would train on its own routing and never ask for the rollout's; turn it on, or drop "
                "routelog's --custom-megatron-init-path"
            )
        setattr(self, _STEP_ATTRIBUTE, rollout_id)
        restore = _judge_before_steps(getattr(self, "optimizer", None), lambda: state["replay"].judge(rollout_id))
        try:
            result = original_train_actor(self, rollout_id, rollout_data, *args, **kwargs)
        except BaseException:
            state["replay"].close()
            raise
        finally:
            restore()
            setattr(self, _STEP_ATTRIBUTE, None)
        state["replay"].end_rollout(rollout_id)
        return result

    routing_replay = importlib.import_module("slime.utils.routing_replay") if replay.measures else None
    original_factory = getattr(routing_replay, "get_routing_replay_compute_topk", None)
    if routing_replay is not None and original_factory is None:
        raise ReplayConfigError(
            "slime.utils.routing_replay has no get_routing_replay_compute_topk (slime's API changed since "
            "624b824a), so the router diff a gate or a fidelity writer asks for cannot be measured; use slime at "
            "624b824a, or install without gate= and fidelity_writer="
        )
    if routing_replay is not None and original_factory is not None:
        # megatron's patched topk_routing_with_score_function imports this factory at every call
        measuring = measuring_compute_topk(original_factory, lambda: state["replay"].meter)
        setattr(routing_replay, "get_routing_replay_compute_topk", measuring)  # noqa: B010

    def undo() -> None:
        if original_fill is None:
            delattr(actor_class, "fill_routing_replay")
        else:
            actor_class.fill_routing_replay = original_fill
        actor_class.train_actor = original_train_actor
        if routing_replay is not None and original_factory is not None:
            setattr(routing_replay, "get_routing_replay_compute_topk", original_factory)  # noqa: B010
        delattr(actor_class, _PATCHED)

    fill_routing_replay.__doc__ = SlimeReplay.fill_routing_replay.__doc__
    actor_class.fill_routing_replay = fill_routing_replay
    actor_class.train_actor = train_actor
    state["undo"] = undo
    setattr(actor_class, _PATCHED, state)
    return undo


def _judge_before_steps(optimizer: Any, judge: Callable[[], Any]) -> Callable[[], None]:
    """While a rollout trains, each ``optimizer.step()`` (slime's ``train_one_step``) first runs ``judge``: a step
    whose replay failed raises before it updates any weight. Returns the undo."""
    step = getattr(optimizer, "step", None)
    if step is None:
        return lambda: None
    shadowed = "step" in vars(optimizer)

    def judged_step(*args: Any, **kwargs: Any) -> Any:
        judge()
        return step(*args, **kwargs)

    optimizer.step = judged_step

    def undo() -> None:
        if shadowed:
            optimizer.step = step
        else:
            del optimizer.step

    return undo


def install(
    args: Any = None,
    *,
    url: str | None = None,
    actor_class: Any = None,
    **options: Any,
) -> SlimeReplay:
    """``--custom-megatron-init-path routelog.integrations.slime.install``: patch slime's
    ``MegatronTrainRayActor`` in this training process to replay from the store at ``url`` (default
    ``$ROUTELOG_URL``). ``options`` are :class:`SlimeReplay`'s (``storage_options``, ``layout``, ``rank``,
    ``prefetch``, ``check_tokens``, ``spec``). With an init hook of your own, call ``install(args, url=...)``
    from it."""
    environment.slime_rollout_function()  # the runtime env reaches the rollout too: a bad value stops start-up
    replay = SlimeReplay(url or _url_from_env(args), **options)
    if actor_class is None:
        module, _, name = _ACTOR_CLASS.rpartition(".")
        actor_class = getattr(importlib.import_module(module), name)
    patch(actor_class, replay)
    return replay


__all__ = [
    "DEFAULT_ROLLOUT_FUNCTION",
    "ROLLOUT_FUNCTION_ENV",
    "SAMPLE_ID_KEY",
    "URL_ENV",
    "FidelityMeter",
    "FillReport",
    "SlimeReplay",
    "flatten_samples",
    "generate_rollout",
    "install",
    "layout_from_args",
    "patch",
    "rank_from_megatron",
    "sample_id",
    "spec_from_args",
    "strip_routing",
    "wrap_rollout_function",
    "write_samples",
]
