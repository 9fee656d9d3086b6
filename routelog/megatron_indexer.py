"""Replaying sparse-attention indexer selections into megatron-core 0.16.1's DeepSeek Sparse Attention.

megatron-core 0.16.1 has no indexer replay: ``DSAttention.forward`` asks its ``DSAIndexer.forward_with_scores`` for
``(index_scores, topk_indices)``, where ``topk_indices = index_scores.topk(min(index_topk, sq))`` is int64
``[b, sq, topk]`` batch-first, its positions the key positions of each batch row (the whole CP-local sequence: the
indexer all-gathers its inputs under sequence parallelism), and hands the indices to ``unfused_dsa_fn`` (which
scatters them into the attention mask) and to the indexer loss. :class:`MegatronIndexerReplay` wraps
``forward_with_scores`` on each DSA layer's indexer instance (found by walking each chunk's decoder: MTP layers are
never touched) so that it returns the scores it computed and the replayed indices of the micro-batch installed, in
that convention. A ``-1`` slot (a query with fewer keys than ``index_topk`` before it, or a row without a recorded
selection under ``missing="dummy"``) becomes the query's own position, which the scatter makes harmless; with
``missing="router"`` such a row takes the indexer's own top-k instead.

It fails closed, as :class:`~routelog.megatron.MegatronReplay` does for routers:

- every replayed row is checked a valid top-k for its query before it is installed (a key past the query or of
  another sequence, a duplicate, a wrong count: refused naming the layer, the sample and the position);
- a DSA indexer that runs with no selection installed (outside :meth:`MegatronIndexerReplay.forward`, or a
  recomputation with nothing left to pop) raises, naming the layer; so does a shape other than the replay's;
- the tokens the first stage's embedding takes are compared row by row with the tokens the rows were recorded
  for, and :meth:`~MegatronIndexerReplay.check` (before the optimizer step) raises when they differ, when a check
  could not run, or when a layer was handed selections that no forward took (an inert replay).

With ``measure=True`` (or a ``gate``) each layer also counts the replayed rows whose indexer's own top-k set (it
computes its scores anyway) differs from the replayed selection: the indexer diff, the counterpart of the router
diff, returned by :meth:`~MegatronIndexerReplay.check` and :meth:`~MegatronIndexerReplay.end_step` and judged by the
gate's ``max_indexer_diff``. :class:`IndexerReplayLoader` reads each micro-batch's rows beside its routing, in the
routing loader's background thread.

>>> replay = MegatronIndexerReplay(model_chunks, plan, config=model_config)                  # doctest: +SKIP
>>> for m in range(len(plan.micro_batches)):                                                # doctest: +SKIP
...     with replay.forward(load_indexer(snapshot, plan, m)):
...         loss = forward_step(...)
>>> replay.end_step()                                                                        # doctest: +SKIP

megatron-core 0.16.1's DSA takes no packed sequences and no context parallelism (``transformer_config.py``
asserts ``context_parallel_size == 1``); the alignment handles both (:mod:`routelog.align.indexer`) for trainers
whose DSA does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.align.indexer import (
    MISSING,
    IndexerQueryRows,
    MicroBatchIndexer,
    RecordIndexer,
    check_indexer_rows,
    gather_indexer,
    indexer_of,
    local_indexers,
    stored_indexer_layers,
)
from routelog.align.plan import AlignmentPlan, MicroBatchReplay
from routelog.errors import AlignmentError, ReplayConfigError, ReplayFidelityError
from routelog.format.spec import ModelSpec
from routelog.loader import ReplayLoader
from routelog.megatron import _STRICT, TokenCheck, language_model
from routelog.store.fidelity import FidelityGate, StepFidelity
from routelog.store.reader import StepSnapshot


def load_indexer(
    snapshot: StepSnapshot, plan: AlignmentPlan, m: int, *, sequence_parallel: IndexerQueryRows = "gathered"
) -> MicroBatchIndexer:
    """Micro-batch ``m``'s indexer rows for the plan's rank, reading only the stored layers its stage replays."""
    layers = stored_indexer_layers(plan)
    records = {
        sid: RecordIndexer(snapshot.info(sid), snapshot.read_indexer(sid, layers=layers), tuple(layers))
        for sid in plan.micro_batches[m].sample_ids
    }
    return gather_indexer(plan, m, records, sequence_parallel=sequence_parallel)


class IndexerReplayLoader(ReplayLoader):
    """A :class:`~routelog.loader.ReplayLoader` that also reads each micro-batch's indexer rows
    (:func:`load_indexer`) in its :meth:`load`, so they are prefetched in the same background thread and as far
    ahead as the routing; :meth:`take_indexer` hands them over once (the loader then holds none of them)."""

    def __init__(self, *args: Any, sequence_parallel: IndexerQueryRows = "gathered", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sequence_parallel: IndexerQueryRows = sequence_parallel
        self._indexer: dict[int, MicroBatchIndexer] = {}

    def load(self, m: int) -> MicroBatchReplay:
        replay = super().load(m)
        # Set before the routing is returned: whoever holds micro-batch m's routing finds its indexer rows here.
        self._indexer[m] = load_indexer(self.snapshot, self.plan, m, sequence_parallel=self.sequence_parallel)
        return replay

    def take_indexer(self, m: int) -> MicroBatchIndexer:
        """Micro-batch ``m``'s indexer rows: the prefetched ones, or read now when they were taken already (a rerun
        of the step from its first micro-batch)."""
        rows = self._indexer.pop(m, None)
        if rows is None:
            rows = load_indexer(self.snapshot, self.plan, m, sequence_parallel=self.sequence_parallel)
        return rows

    def close(self) -> None:
        super().close()
        self._indexer.clear()


@dataclass(frozen=True)
class ChunkIndexer:
    """A ``DSAttention`` found in a model chunk's decoder, and its ``DSAIndexer``."""

    vp_stage: int
    layer_number: int
    attention: Any
    indexer: Any


def find_dsa_indexers(model_chunks: Sequence[Any], vp_stages: Sequence[int] | None = None) -> list[ChunkIndexer]:
    """Every ``DSAttention`` under each chunk's decoder, in forward order (MTP layers excluded)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    found = []
    stages = range(len(model_chunks)) if vp_stages is None else vp_stages
    for vp_stage, chunk in zip(stages, model_chunks, strict=True):
        model = language_model(chunk)
        if model is None:
            raise ReplayConfigError(f"{type(chunk).__name__} has no decoder (expected a megatron-core GPTModel chunk)")
        attentions = [m for m in model.decoder.modules() if isinstance(m, DSAttention)]
        for attention in sorted(attentions, key=lambda a: int(a.layer_number)):
            found.append(ChunkIndexer(vp_stage, int(attention.layer_number), attention, attention.indexer))
    return found


def check_dsa_config(config: Any, spec: ModelSpec) -> None:
    """Refuse a model config whose DSA the spec's indexer rows cannot replay into."""
    declared = indexer_of(spec)
    problems = []
    if getattr(config, "experimental_attention_variant", None) != "dsa":
        problems.append("experimental_attention_variant is not 'dsa': the model has no sparse-attention indexer")
    topk = getattr(config, "dsa_indexer_topk", declared.index_topk)
    if topk != declared.index_topk:
        problems.append(f"dsa_indexer_topk={topk}, the recorded rows select {declared.index_topk} keys")
    if getattr(config, "context_parallel_size", 1) != 1:
        problems.append("megatron-core 0.16.1's DSA has no context parallelism (context_parallel_size must be 1)")
    if problems:
        raise ReplayConfigError("indexer replay cannot run with this configuration: " + "; ".join(problems))


def megatron_targets(mb: MicroBatchIndexer, stored: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """``mb.rows[stored]`` in megatron-core's convention: int64 ``[b, sq, min(index_topk, sq)]`` batch-first (the
    rows are sequence-major, ``s * b + batch``), each -1 slot the query's own position; and ``[b, sq]``, the rows
    that replay a recorded selection."""
    rows = mb.rows[stored]
    n_rows, k = rows.shape
    batch = mb.batch_size
    if n_rows % batch:
        raise AlignmentError(f"micro-batch {mb.index}: {n_rows} rows do not split into {batch} batch rows")
    seqlen = n_rows // batch
    own = (np.arange(n_rows) // batch)[:, None]  # with one CP rank and every TP rank's rows: the key axis
    filled = np.where(rows == MISSING, own, rows)[:, : min(k, seqlen)]  # canonical rows: nothing past sq cut off
    target = np.ascontiguousarray(filled.reshape(seqlen, batch, -1).transpose(1, 0, 2), dtype=np.int64)
    mask = np.ascontiguousarray(mb.mask[stored].reshape(seqlen, batch).T)
    return target, mask


def selection_differs(index_scores: Any, native: Any, replayed: Any) -> Any:
    """``[b, sq]``: whether the indexer's own top-k (``native``) selects another set of keys than ``replayed``
    (megatron's convention: a slot past the query's keys holds the query's own position). The indexer's slots past
    the query's keys are masked keys (score -inf), read as the query's own position too, so a query with fewer keys
    than ``index_topk`` agrees whenever both attend to all of them."""
    import torch

    own = torch.arange(native.shape[1], device=native.device).view(1, -1, 1)
    chosen = torch.where(torch.isfinite(index_scores.gather(-1, native)), native, own)
    return (chosen.sort(dim=-1).values != replayed.sort(dim=-1).values).any(dim=-1)


@dataclass(frozen=True)
class _Installed:
    """One micro-batch's selections for a DSA layer, on the host or the device."""

    target: Any
    """int64 ``[b, sq, topk]`` in megatron-core's convention."""
    own_choice: Any
    """``[b, sq]`` rows taking the indexer's own choice (``missing="router"``), or None."""
    replayed: Any
    """``[b, sq]`` rows replaying a recorded selection, where the indexer diff is measured; else None."""


@dataclass
class _LayerReplay:
    """One DSA layer's replayed selections: the forward's, and a FIFO activation recomputation pops (in the
    backward, micro-batches come in the order of their forwards), as megatron-core's ``RouterReplay`` keeps them."""

    forward: _Installed | None = None
    """The selections of the forward running now."""
    recompute: list[_Installed] = field(default_factory=list)
    handed: int = 0
    taken: int = 0
    tally: Any = None
    """On the indexer's device, the step's forwards' (replayed rows, of those the rows whose own top-k set
    differs): added to without reading the device."""


class MegatronIndexerReplay:
    """Hands one rank's indexer rows to megatron-core 0.16.1's DSA layers, micro-batch by micro-batch, and proves
    the replay did what it should before the optimizer step (:meth:`check`); see the module's documentation."""

    def __init__(
        self,
        model_chunks: Sequence[Any],
        plan: AlignmentPlan,
        *,
        config: Any = None,
        vp_stages: Sequence[int] | None = None,
        check_tokens: TokenCheck = "rows",
        measure: bool = False,
        gate: FidelityGate | None = None,
    ) -> None:
        """``measure`` (implied by a ``gate``): count the indexer diff. ``gate`` judges it (``max_indexer_diff``)
        and the tokens fed (``on_token_mismatch``); without one, tokens fed that are not the recorded ones raise."""
        if config is not None:
            check_dsa_config(config, plan.spec)
        if check_tokens not in ("rows", "off"):
            raise ValueError(f"check_tokens must be 'rows' or 'off', got {check_tokens!r}")
        if plan.layout.cp != 1:
            raise ReplayConfigError(
                f"the plan has CP = {plan.layout.cp}: megatron-core 0.16.1's DSA has no context parallelism"
            )
        self.plan = plan
        self.check_tokens = check_tokens
        self.gate = gate
        self.measure = measure or gate is not None
        self.layers = find_dsa_indexers(model_chunks, vp_stages)
        found = [(i.vp_stage, i.layer_number) for i in self.layers]
        expected = [
            (i.vp_stage, i.layer_number)
            for i in local_indexers(plan.layout, plan.spec, plan.rank.pp)
            if vp_stages is None or i.vp_stage in vp_stages
        ]
        if found != expected:
            raise AlignmentError(
                f"the model's DSA layers (vp_stage, layer_number) {found} differ from the plan's indexer layers "
                f"{expected}: the pipeline layout or the model spec's indexer does not match the model"
            )
        self._state = {i.layer_number: _LayerReplay() for i in self.layers}
        self._in_forward: set[int] = set()
        """Layer numbers whose chunk runs a :meth:`forward` now."""
        self._wrapped: dict[int, tuple[Any, bool, Any]] = {}
        """Per layer number: (the indexer's own ``forward_with_scores``, whether the instance had its own, ours)."""
        for layer in self.layers:
            original = layer.indexer.forward_with_scores
            replaying = self._replaying(layer, original)
            self._wrapped[layer.layer_number] = (original, "forward_with_scores" in vars(layer.indexer), replaying)
            # On the instance: other models' indexers (a reference model) keep megatron-core's own.
            layer.indexer.forward_with_scores = replaying
        self._handles: list[Any] = []
        self._embedded: set[int] = set()
        stages = range(len(model_chunks)) if vp_stages is None else vp_stages
        for vp_stage, chunk in zip(stages, model_chunks, strict=True):
            model = language_model(chunk)
            embedding = getattr(model, "embedding", None) if getattr(model, "pre_process", True) else None
            if embedding is not None and check_tokens == "rows":
                self._embedded.add(vp_stage)
                self._handles.append(embedding.register_forward_pre_hook(self._token_hook(vp_stage), with_kwargs=True))
        self._reset_step()

    def _reset_step(self) -> None:
        for state in self._state.values():
            state.forward, state.handed, state.taken, state.tally = None, 0, 0, None
            state.recompute.clear()
        self._owed: dict[int, MicroBatchIndexer] = {}
        self._fed: list[tuple[MicroBatchIndexer, Any, Any]] = []
        self._unchecked: list[str] = []
        self._judged = False
        self._judged_at: dict[int, int] = {}
        """Per layer number, the forwards taken when the step was judged."""
        self._read: StepFidelity | None = None
        """The counts the judgement read."""

    def _replaying(self, layer: ChunkIndexer, original: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        state = self._state[layer.layer_number]

        def forward_with_scores(x: Any, qr: Any, mask: Any = None, packed_seq_params: Any = None) -> Any:
            index_scores, native = original(x, qr, mask, packed_seq_params)
            installed = state.forward if layer.layer_number in self._in_forward else None
            forward = installed is not None
            if installed is not None:
                state.taken += 1
            elif layer.layer_number not in self._in_forward and state.recompute:
                installed = state.recompute.pop(0)
            else:
                raise ReplayFidelityError(
                    f"layer {layer.layer_number}: the DSA indexer ran with no replayed selection installed; run each "
                    "forward inside MegatronIndexerReplay.forward(micro_batch) (a recomputation in the backward "
                    "takes the selections installed, oldest first, and there are none left)"
                )
            if tuple(installed.target.shape) != tuple(native.shape):
                raise AlignmentError(
                    f"layer {layer.layer_number}: the indexer selects {tuple(native.shape)} [b, sq, topk], the replay "
                    f"holds {tuple(installed.target.shape)}; the packing or the micro-batch differs from the plan"
                )
            indices = installed.target.to(native.device)
            if forward and installed.replayed is not None:  # counted once per micro-batch: not in recomputation
                with torch.no_grad():
                    replayed = installed.replayed.to(native.device)
                    differs = selection_differs(index_scores, native, indices)
                    counts = torch.stack([replayed.sum(), (replayed & differs).sum()])
                state.tally = counts if state.tally is None else state.tally + counts
            if installed.own_choice is not None:
                indices = torch.where(installed.own_choice.to(native.device)[..., None], native, indices)
            return index_scores, indices

        return forward_with_scores

    def _token_hook(self, vp_stage: int) -> Any:
        import torch

        def fed(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            mb = self._owed.pop(vp_stage, None)  # the forward's first embedding call (MTP embeds again)
            if mb is None or input_ids is None:
                return
            rows = input_ids.transpose(0, 1).reshape(-1)  # [b, s] -> the indexer's rows s * b + batch
            if int(rows.shape[0]) != mb.tokens.shape[0]:
                raise AlignmentError(
                    f"micro-batch {mb.index}: the model is fed {int(rows.shape[0])} token rows, the indexer rows are "
                    f"{mb.tokens.shape[0]}; the packing or the micro-batch differs from the plan"
                )
            stored = torch.from_numpy(mb.tokens).to(rows.device, non_blocking=True)
            self._fed.append((mb, rows, ((stored >= 0) & (rows != stored)).sum()))  # read once, at check()

        return fed

    @contextmanager
    def forward(
        self,
        mb: MicroBatchIndexer,
        *,
        vp_stage: int | None = None,
        device: Any = None,
        fed_rows: npt.ArrayLike | None = None,
    ) -> Iterator[None]:
        """Replay ``mb`` in the forward run inside the block (one model chunk, or all with ``vp_stage=None``); the
        same selections serve the recomputation of its backward. ``fed_rows``: the token id at each of ``mb``'s
        rows from the data the trainer is about to feed, checked now instead of at the embedding."""
        layers = {i.layer_number for i in self.layers if vp_stage is None or i.vp_stage == vp_stage}
        self.install(mb, vp_stage=vp_stage, device=device, fed_rows=fed_rows)
        self._in_forward |= layers
        try:
            yield
        finally:
            self._in_forward -= layers
            for number in layers:
                self._state[number].forward = None

    def install(
        self,
        mb: MicroBatchIndexer,
        *,
        vp_stage: int | None = None,
        device: Any = None,
        fed_rows: npt.ArrayLike | None = None,
    ) -> None:
        """Check ``mb``'s rows and hand them to the DSA layers of one model chunk (all with ``vp_stage=None``);
        :meth:`forward` calls it."""
        import torch

        layout = self.plan.layout
        if mb.query_rows == "split" and layout.sp and layout.tp > 1:
            raise AlignmentError(
                f"micro-batch {mb.index} holds each TP rank's sequence-parallel share of the indexer rows; "
                "megatron-core's DSAIndexer all-gathers the sequence first: align with sequence_parallel='gathered'"
            )
        if self.check_tokens == "rows" and mb.unverified:
            raise ReplayFidelityError(
                f"micro-batch {mb.index}: samples {list(mb.unverified[:5])} were stored without token ids, so nothing "
                "proves their indexer rows belong to the tokens fed; store token ids (Record.token_ids), or replay "
                "them unchecked with check_tokens='off'"
            )
        if fed_rows is not None and self.check_tokens == "rows":
            why = _token_mismatch(mb, np.asarray(fed_rows, np.int64))
            if why is not None:
                (self.gate or _STRICT).token_mismatch(why)
        chosen = [layer for layer in self.layers if vp_stage is None or layer.vp_stage == vp_stage]
        prepared: dict[int, _Installed] = {}
        for layer in chosen:  # every row checked before any layer is handed one: a refusal installs nothing
            stored = mb.stored_of(layer.layer_number)
            if stored not in prepared:  # a shared layer replays its source's rows: checked and moved once
                check_indexer_rows(mb, stored, layer.layer_number)
                target, replayed = megatron_targets(mb, stored)
                tensors = [
                    torch.from_numpy(target),
                    torch.from_numpy(~replayed) if self.plan.missing == "router" else None,
                    torch.from_numpy(replayed) if self.measure else None,
                ]
                if device is not None:
                    tensors = [None if t is None else t.to(device) for t in tensors]
                prepared[stored] = _Installed(*tensors)
        for stage in self._embedded if fed_rows is None else ():
            if vp_stage is None or vp_stage == stage:
                missed = self._owed.get(stage)
                if missed is not None:
                    self._unchecked.append(f"micro-batch {missed.index} on virtual stage {stage}")
                self._owed[stage] = mb
        for layer in chosen:
            state = self._state[layer.layer_number]
            state.forward = prepared[mb.stored_of(layer.layer_number)]
            state.recompute.append(state.forward)
            state.handed += 1

    def _counts(self) -> StepFidelity:
        """The step's indexer diff so far, per global layer index (empty unless measured): one read of the device."""
        counts = StepFidelity()
        tallies = {n: state.tally for n, state in self._state.items() if state.tally is not None}
        if tallies:
            import torch

            values = torch.stack([t.to("cpu", non_blocking=True) for t in tallies.values()]).tolist()
            for number, (replayed, differing) in zip(tallies, values, strict=True):
                counts.add_indexer(number - 1, int(replayed), int(differing))
        return counts

    def check(self) -> StepFidelity:
        """Judge the step so far, before the optimizer step: raises
        :class:`~routelog.store.fidelity.ReplayFidelityError` when a row was fed another token than its selection
        was recorded for, a token check could not run, a DSA layer was handed selections no forward took, or the
        ``gate`` finds the indexer diff too high. Returns the step's indexer diff so far."""
        self._judged = True
        self._judged_at = {number: state.taken for number, state in self._state.items()}
        self._read = counts = self._counts()
        # An inert replay first: it also leaves the tokens unchecked, and is the cause to name.
        inert = [number for number, state in sorted(self._state.items()) if state.handed and not state.taken]
        if inert:
            raise ReplayFidelityError(
                f"indexer selections were handed to the DSA layers {inert} and no forward took them: the replay is "
                "inert (run the model's forward inside MegatronIndexerReplay.forward)"
            )
        unchecked = self._unchecked + [
            f"micro-batch {mb.index} on virtual stage {stage}" for stage, mb in sorted(self._owed.items())
        ]
        if unchecked:
            raise ReplayFidelityError(
                f"the tokens fed could not be checked for {', '.join(unchecked[:3])}: the chunk's embedding never "
                "ran between the indexer rows' installation and the next one, or turn the check off by name with "
                "check_tokens='off'"
            )
        if self._fed:
            import torch

            if int(torch.stack([d.reshape(()) for _, _, d in self._fed]).sum()):  # the one device read
                for mb, rows, _ in self._fed:
                    why = _token_mismatch(mb, rows.cpu().numpy().astype(np.int64))
                    if why is not None:
                        (self.gate or _STRICT).token_mismatch(why)
                        break
        if self.gate is not None:
            self.gate.check(counts, "indexer replay")
        return counts

    def end_step(self) -> StepFidelity:
        """Judge the step (unless :meth:`check` did) and clear every selection, after the optimizer step; returns
        the step's indexer diff (per global layer index; empty unless measured)."""
        try:
            if not self._judged:
                return self.check()
            if self._read is not None and self._judged_at == {n: s.taken for n, s in self._state.items()}:
                return self._read  # no forward since the judgement: its read is the step's
            return self._counts()
        finally:
            self._reset_step()

    def remove(self) -> None:
        """Give every indexer megatron-core's own ``forward_with_scores`` back and remove the hooks."""
        for layer in self.layers:
            original, had_own, replaying = self._wrapped.pop(layer.layer_number, (None, False, None))
            if replaying is None or vars(layer.indexer).get("forward_with_scores") is not replaying:
                continue  # removed already, or wrapped again since by someone else: theirs to undo
            if had_own:
                layer.indexer.forward_with_scores = original
            else:
                del layer.indexer.forward_with_scores  # the class's method again
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _token_mismatch(mb: MicroBatchIndexer, fed: npt.NDArray[np.int64]) -> str | None:
    """Why ``mb``'s rows do not belong to the tokens ``fed`` at its rows, naming the first row that differs."""
    if fed.shape != mb.tokens.shape:
        return (
            f"micro-batch {mb.index}: the model is fed {fed.shape[0]} rows, the indexer rows are {mb.tokens.shape[0]}"
        )
    known = mb.tokens >= 0
    wrong = np.flatnonzero(known & (fed != mb.tokens))
    if not wrong.size:
        return None
    row = int(wrong[0])
    sample, position = mb.sample_at(row)
    return (
        f"micro-batch {mb.index}: row {row} feeds token {int(fed[row])} where sample {sample!r} had token "
        f"{int(mb.tokens[row])} at position {position} ({wrong.size} of {int(known.sum())} rows differ); the "
        "micro-batch order or content differs from the rollout, so the indexer selections belong to other tokens"
    )
