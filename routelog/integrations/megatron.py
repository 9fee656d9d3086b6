"""Replay for users who drive megatron-core's schedules themselves: wrap the forward-step function.

megatron-core calls ``forward_step_func(data_iterator, model)`` once per micro-batch and model chunk; with virtual
pipeline stages the chunks interleave, but each chunk sees the micro-batches in order. :class:`ReplayHook` keeps a
cursor per chunk, installs that micro-batch's routes (loaded in the background, only this rank's records and
layers) around the call. At the step's last forward it judges the step (tokens fed row by row, routes taken, the
router diff a :class:`~routelog.store.fidelity.FidelityGate` checks), so a bad step raises before its backward and the
optimizer step; at the end of the step it clears the routes and publishes the router diff to the store::

    hook = ReplayHook(url, model_chunks, spec=spec, layout=layout, rank=rank, packing=Packing("megatron"),
                      config=model_config, gate=FidelityGate(max_router_diff=0.2), fidelity_writer="train-r3")
    for iteration in range(iterations):
        hook.begin_step(step_of(iteration), micro_batches)        # this rank's micro-batches: lists of sample ids
        forward_backward_func(forward_step_func=hook.wrap(forward_step), data_iterator=..., model=model_chunks, ...)
        optimizer.step()
        hook.end_step(trainer_step=iteration)

With Megatron-LM's own training loop, one line wires all of it into ``train_step``
(:meth:`ReplayHook.train_step`)::

    training.train_step = hook.train_step(training.train_step, micro_batches=lambda iteration: my_micro_batches)

A model with DeepSeek Sparse Attention also gets its indexer selections replayed (``indexer="auto"``: when the model
spec declares an indexer and the chunks hold DSA layers; ``"required"`` refuses to run without both, ``"off"`` never
replays them): each micro-batch's rows are read beside its routing, in the loader's background thread, installed
around the same forward (:class:`~routelog.megatron_indexer.MegatronIndexerReplay`), judged with the routing, and
their indexer diff is returned and published beside the router diff.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from routelog.align import AlignmentPlan, MicroBatch, Packing, ParallelLayout, RankCoords
from routelog.align.indexer import MicroBatchIndexer
from routelog.align.layout import CpLayout
from routelog.align.plan import MicroBatchReplay, MissingPolicy, OtherVersions, PolicyVersions, versions_for
from routelog.errors import AlignmentError, ReplayConfigError, RoutelogError
from routelog.format.spec import ModelSpec
from routelog.format.values import LOGPROB_TRAIN
from routelog.loader import ReplayLoader
from routelog.megatron import MegatronReplay, TokenCheck
from routelog.megatron_indexer import IndexerReplayLoader, MegatronIndexerReplay, find_dsa_indexers
from routelog.store.fidelity import FidelityGate, StepFidelity, write_fidelity
from routelog.store.store import Store, open_store

TokensOf = Callable[[MicroBatchReplay], Sequence[npt.ArrayLike]]
IndexerReplay = Literal["auto", "off", "required"]
"""Whether the hook replays sparse-attention indexer selections: ``auto`` when the model spec declares an indexer
and the model chunks hold DSA layers, ``required`` refuses to run without both, ``off`` never."""


class ReplayHook:
    """One rank's replay across training steps: plan, loader and installer, rebuilt per step from its
    micro-batches; a measured router diff per step."""

    def __init__(
        self,
        store: Store | str,
        model_chunks: Sequence[Any],
        *,
        spec: ModelSpec | None = None,
        layout: ParallelLayout,
        rank: RankCoords,
        packing: Packing,
        config: Any = None,
        missing: MissingPolicy = "dummy",
        gate: FidelityGate | None = None,
        fidelity_writer: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        prefetch: int = 2,
        check_tokens: TokenCheck = "rows",
        policy_versions: PolicyVersions = "step",
        other_versions: OtherVersions = "refuse",
        indexer: IndexerReplay = "auto",
    ) -> None:
        self.store = store if isinstance(store, Store) else open_store(store, storage_options=storage_options)
        self.spec = spec or self.store.model_spec
        self.layout, self.rank, self.packing, self.missing = layout, rank, packing, missing
        self.policy_versions, self.other_versions = policy_versions, other_versions
        versions_for(policy_versions, 0)  # a bad rule fails here, not at the first step
        self.model_chunks = list(model_chunks)
        self.fidelity_writer = fidelity_writer
        self.prefetch = prefetch
        replays_indexer = self._replays_indexer(indexer)  # refused before anything is installed on the model
        if gate is None and fidelity_writer is not None:
            gate = _MEASURE_ONLY  # measure the router diff to publish it, judge nothing
        self.replay = MegatronReplay(
            self.model_chunks, self._plan((), 0), config=config, gate=gate, check_tokens=check_tokens
        )
        self.indexer_replay: MegatronIndexerReplay | None = None
        if replays_indexer:
            try:
                self.indexer_replay = MegatronIndexerReplay(
                    self.model_chunks, self._plan((), 0), config=config, gate=gate, check_tokens=check_tokens
                )
            except BaseException:
                self.replay.remove()
                raise
        self._indexer_rows: dict[int, tuple[MicroBatchIndexer, int]] = {}
        """Micro-batch -> (its indexer rows, the model chunks yet to install them): dropped once all have."""
        self.step: int | None = None
        self._logprobs: dict[str, npt.NDArray[Any]] = {}
        self._loader: ReplayLoader | None = None
        self._loaded: list[MicroBatchReplay] = []
        self._iterator: Any = None
        self._cursor: dict[int, int] = {}
        self._micro_batches = self._forwards = 0

    def _replays_indexer(self, indexer: IndexerReplay) -> bool:
        if indexer not in ("auto", "off", "required"):
            raise ValueError(f"indexer must be 'auto', 'off' or 'required', got {indexer!r}")
        if indexer == "off" or (indexer == "auto" and self.spec.indexer is None):
            return False  # a model without an indexer in its spec is not walked (nor DSA imported)
        try:
            in_model = bool(find_dsa_indexers(self.model_chunks))
        except ImportError:  # a megatron-core without DeepSeek Sparse Attention
            in_model = False
        if indexer == "auto":
            return in_model
        missing = [] if self.spec.indexer is not None else [f"the model spec {self.spec.name!r} declares no indexer"]
        if not in_model:
            missing.append("the model chunks hold no DSA layers (megatron-core's DSAttention)")
        if missing:
            raise ReplayConfigError(f"indexer='required', but {' and '.join(missing)}: there is no indexer to replay")
        return True

    def _plan(self, micro_batches: Sequence[MicroBatch], step: int) -> AlignmentPlan:
        return AlignmentPlan(
            self.spec,
            self.layout,
            self.packing,
            self.rank,
            tuple(micro_batches),
            self.missing,
            policy_versions=versions_for(self.policy_versions, step),
            other_versions=self.other_versions,
        )

    def begin_step(self, step: int, micro_batches: Sequence[Sequence[str] | MicroBatch]) -> None:
        """Start loading ``step``'s routing for this rank's micro-batches (in the order the schedule runs them)."""
        if self.step is not None:
            raise AlignmentError(f"step {self.step} was begun and not ended: call end_step() after the optimizer step")
        batches = [b if isinstance(b, MicroBatch) else MicroBatch(tuple(b)) for b in micro_batches]
        self.step = step
        loader = ReplayLoader if self.indexer_replay is None else IndexerReplayLoader
        self._loader = loader(self.store, step, self._plan(batches, step), prefetch=self.prefetch)
        self._iterator = iter(self._loader)
        self._loaded = []
        self._indexer_rows = {}
        self._cursor = {}
        self._micro_batches, self._forwards = len(batches), 0

    def micro_batch(self, m: int) -> MicroBatchReplay:
        """Micro-batch ``m`` of the step, loaded in order (earlier ones are kept until the step ends)."""
        if self._iterator is None:
            raise AlignmentError("no step begun: call begin_step(step, micro_batches) before the forward passes")
        while len(self._loaded) <= m:
            try:
                self._loaded.append(next(self._iterator))
            except StopIteration:
                raise AlignmentError(
                    f"step {self.step}: the schedule ran micro-batch {m}, but begin_step was given "
                    f"{len(self._loaded)} micro-batches"
                ) from None
        return self._loaded[m]

    def wrap(self, forward_step: Callable[..., Any], *, tokens_of: TokensOf | None = None) -> Callable[..., Any]:
        """``forward_step`` with the current micro-batch's routes installed around it; the tokens fed are checked
        row by row at the first stage's embedding. ``tokens_of(mb)`` (optional) also returns the token ids the
        micro-batch feeds, per sample in ``mb.sample_ids`` order, to have their hashes checked."""

        def forward_step_with_replay(data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
            chunk = self._chunk_of(model)
            m = self._cursor.get(chunk, 0)
            self._cursor[chunk] = m + 1
            mb = self.micro_batch(m)
            tokens = tokens_of(mb) if tokens_of is not None else None
            with self.replay.forward(mb, vp_stage=chunk, tokens=tokens), self._indexer_forward(m, chunk):
                out = forward_step(data_iterator, model, *args, **kwargs)
            self._forwards += 1
            if self._forwards == self._micro_batches * len(self.model_chunks):
                # The step's last forward: judged before its backward and the optimizer step.
                self.replay.check()
                if self.indexer_replay is not None:
                    self.indexer_replay.check()
            return out

        return forward_step_with_replay

    def _indexer_forward(self, m: int, chunk: int) -> contextlib.AbstractContextManager[None]:
        """Micro-batch ``m``'s indexer selections installed on ``chunk``'s DSA layers around its forward; its rows
        are held only until every chunk has installed them (a rerun reads them again)."""
        if self.indexer_replay is None:
            return contextlib.nullcontext()
        held = self._indexer_rows.get(m)
        if held is None:
            if not isinstance(self._loader, IndexerReplayLoader):
                raise AlignmentError("no step begun: call begin_step(step, micro_batches) before the forward passes")
            held = (self._loader.take_indexer(m), len(self.model_chunks))
        rows, pending = held
        if pending > 1:
            self._indexer_rows[m] = (rows, pending - 1)
        else:
            self._indexer_rows.pop(m, None)
        return self.indexer_replay.forward(rows, vp_stage=chunk)

    def train_step(
        self,
        train_step: Callable[..., Any],
        micro_batches: Callable[[int | None], Sequence[Sequence[str] | MicroBatch]],
        *,
        store_step: Callable[[int | None], int] | None = None,
    ) -> Callable[..., Any]:
        """Megatron-LM's ``train_step`` (``megatron.training.training.train_step``) with this rank's routes replayed:
        ``train_step = hook.train_step(train_step, micro_batches=...)`` before Megatron's training loop calls it.

        ``micro_batches(iteration)`` names this rank's micro-batches of the iteration in the order the schedule runs
        them (lists of sample ids); the store step is the iteration unless ``store_step(iteration)`` says otherwise.
        Each call begins the step, wraps the ``forward_step_func`` Megatron hands its ``forward_backward_func``
        (again at each rerun of Megatron's rerun state machine, from the first micro-batch), and ends the step after
        the optimizer (the step is judged at its last forward, before the backward and the optimizer step). A step
        that raised is cleared without publishing; its own error is the one raised."""

        def train_step_with_replay(
            forward_step_func: Any,
            data_iterator: Any,
            model: Any,
            optimizer: Any,
            opt_param_scheduler: Any,
            config: Any,
            forward_backward_func: Callable[..., Any],
            *args: Any,
            iteration: int | None = None,
            **kwargs: Any,
        ) -> Any:
            step = store_step(iteration) if store_step is not None else iteration
            if step is None:
                raise AlignmentError("train_step was called without iteration=: pass store_step= to name the step")
            self.begin_step(step, micro_batches(iteration))

            def forward_backward(*fb_args: Any, **fb_kwargs: Any) -> Any:
                self._rewind()  # a rerun replays the step's micro-batches from the first
                if "forward_step_func" in fb_kwargs:
                    fb_kwargs["forward_step_func"] = self.wrap(fb_kwargs["forward_step_func"])
                else:
                    fb_args = (self.wrap(fb_args[0]), *fb_args[1:])
                return forward_backward_func(*fb_args, **fb_kwargs)

            try:
                result = train_step(
                    forward_step_func,
                    data_iterator,
                    model,
                    optimizer,
                    opt_param_scheduler,
                    config,
                    forward_backward,
                    *args,
                    iteration=iteration,
                    **kwargs,
                )
            except BaseException:
                with contextlib.suppress(RoutelogError):
                    self._abandon_step()
                raise
            self.end_step(trainer_step=iteration)
            return result

        return train_step_with_replay

    def _rewind(self) -> None:
        self._cursor = {}
        self._indexer_rows = {}
        self._forwards = 0

    def _abandon_step(self) -> None:
        """Clear a step that failed: routes, selections and loader, nothing published."""
        if self._loader is not None:
            self._loader.close()
        self.step, self._loader, self._iterator, self._loaded, self._logprobs = None, None, None, [], {}
        self._indexer_rows = {}
        try:
            self.replay.end_step()
        finally:
            if self.indexer_replay is not None:
                self.indexer_replay.end_step()

    def _chunk_of(self, model: Any) -> int:
        for i, chunk in enumerate(self.model_chunks):
            if chunk is model:
                return i
        if len(self.model_chunks) == 1:
            return 0
        raise AlignmentError("forward_step was called with a model that is not one of the hook's model chunks")

    def record_logprobs(self, sample_id: str, logprobs: npt.ArrayLike) -> None:
        """The trainer's per-token log-probs of a record of this step (``[n_tokens]``, NaN where none, e.g. the
        prompt): published at :meth:`end_step` as the ``logprob_train`` column, which ``routelog mismatch`` compares
        with the engine's ``logprob_infer``."""
        self._logprobs[sample_id] = np.asarray(logprobs, dtype=np.float32)

    def end_step(self, *, trainer_step: int | None = None, phase: str | None = None) -> StepFidelity:
        """Clear the routes (and indexer selections) after the optimizer step, check and publish the step's router
        diff and indexer diff (and the log-probs recorded for it); returns their counts."""
        if self._loader is not None:
            self._loader.close()
        step, self.step, self._loader, self._iterator, self._loaded = self.step, None, None, None, []
        logprobs, self._logprobs, self._indexer_rows = self._logprobs, {}, {}
        try:
            counts = self.replay.end_step()
        except BaseException:
            if self.indexer_replay is not None:
                with contextlib.suppress(RoutelogError):  # cleared; the routing's failure is the one raised
                    self.indexer_replay.end_step()
            raise
        if self.indexer_replay is not None:
            counts = counts.merge(self.indexer_replay.end_step())
        writer = self.fidelity_writer
        if writer is not None and step is not None and (counts.replayed or counts.indexer_replayed):
            write_fidelity(self.store, step, writer, counts, trainer_step=trainer_step, phase=phase)
        if logprobs and step is not None:
            with self.store.annotate(step, writer or "trainer") as annotator:
                for sid, values in logprobs.items():
                    annotator.add(sid, {LOGPROB_TRAIN: values})
        return counts

    def remove(self) -> None:
        """Undo every hook and wrapper installed on the model."""
        self.replay.remove()
        if self.indexer_replay is not None:
            self.indexer_replay.remove()


def layout_from_config(config: Any, *, cp: int | None = None, cp_layout: CpLayout = "zigzag") -> ParallelLayout:
    """The parallel layout a megatron-core ``TransformerConfig`` describes (``cp``: a trainer's per-micro-batch
    context-parallel size, e.g. veRL's dynamic CP). With ``pipeline_model_parallel_layout`` the model is built from
    that explicit layout, not from the uniform or uneven split: each (pipeline rank, virtual stage)'s decoder
    layers are read from it."""
    layout = ParallelLayout(
        tp=int(getattr(config, "tensor_model_parallel_size", 1) or 1),
        cp=int(cp or getattr(config, "context_parallel_size", 1) or 1),
        pp=int(getattr(config, "pipeline_model_parallel_size", 1) or 1),
        vpp=int(getattr(config, "virtual_pipeline_model_parallel_size", None) or 1),
        cp_layout=cp_layout,
        sequence_parallel=bool(getattr(config, "sequence_parallel", False)),
        first_stage_layers=getattr(config, "num_layers_in_first_pipeline_stage", None),
        last_stage_layers=getattr(config, "num_layers_in_last_pipeline_stage", None),
        account_for_embedding=bool(getattr(config, "account_for_embedding_in_pipeline_split", False)),
        account_for_loss=bool(getattr(config, "account_for_loss_in_pipeline_split", False)),
    )
    custom = getattr(config, "pipeline_model_parallel_layout", None)
    if custom is None:
        return layout
    from megatron.core.transformer.enums import LayerType

    rows = custom.layout  # [pp_rank][vp_stage] -> the LayerTypes of that model chunk
    stages = [[range(0)] * len(row) for row in rows]
    first = 0
    for v in range(len(rows[0])):  # decoder layer ids run virtual stage by virtual stage, pipeline rank by rank
        for p, row in enumerate(rows):
            count = sum(1 for kind in row[v] if kind == LayerType.decoder)
            stages[p][v] = range(first, first + count)
            first += count
    return replace(layout, stage_layers=tuple(tuple(tuple(chunk) for chunk in row) for row in stages))


def rank_from_parallel_state(*, cp_rank: int | None = None) -> RankCoords:
    """This process's TP, CP and PP ranks from megatron-core's ``parallel_state``."""
    from megatron.core import parallel_state

    return RankCoords(
        tp=parallel_state.get_tensor_model_parallel_rank(),
        cp=parallel_state.get_context_parallel_rank() if cp_rank is None else cp_rank,
        pp=parallel_state.get_pipeline_model_parallel_rank(),
    )


_MEASURE_ONLY = FidelityGate(max_router_diff=None, on_token_mismatch="raise")
"""Measures without judging: a hook without a gate still refuses routing recorded for other tokens."""
