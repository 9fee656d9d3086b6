"""HF transformers' DSA indexers (``deepseek_v32``, ``glm_moe_dsa``): record their selections during ``generate``,
replay them in a later forward.

Each computing layer's ``self_attn.indexer`` (transformers 5.23: ``DeepseekV32Indexer``, ``GlmMoeDsaIndexer``)
returns int ``[B, S, min(index_topk, T)]``: for each of the ``S`` queries fed, the ``T``-long key axis of its padded
batch row (the KV cache included) columns it attends to. Left padding takes key columns, and a query with fewer
than ``index_topk`` keys before it gets its valid keys and then arbitrary other columns (the attention mask removes
them). A forward hook sees the prefill call, then one call per decode step (the last sampled token is never fed).
Recorded rows are turned into routelog's canonical rows: positions in the sequence (the pad width subtracted), the
ones at or before the query only, ascending, -1 padded (:mod:`routelog.format.positions`).

Replay returns, from the same hook, the stored selection mapped back onto the key axis the module attends over; a
``-1`` slot (a query with fewer keys than ``index_topk``) is filled with the query's own column, which the
attention's scatter into its mask makes harmless. Replay fails closed: the forward's tokens must be the records'
token by token, every replayed row is checked canonical before it is installed, and leaving the block without
every indexer having replayed raises.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.engines.hf import ForwardHooks
from routelog.errors import InvalidRecordError, ReplayConfigError
from routelog.format.positions import check_position_rows
from routelog.format.record import Record
from routelog.format.spec import IndexerSpec, ModelSpec


def indexer_spec(spec: ModelSpec) -> IndexerSpec:
    if spec.indexer is None:
        raise ReplayConfigError(f"model {spec.name!r} declares no sparse-attention indexer (ModelSpec.indexer)")
    return spec.indexer


def find_indexers(model: Any, spec: ModelSpec) -> dict[int, Any]:
    """``{decoder layer: its indexer module}`` for every computing layer of ``spec.indexer``."""
    declared = indexer_spec(spec)
    layers = model.model.layers
    found = {}
    for layer in declared.layers:
        module = getattr(getattr(layers[layer], "self_attn", None), "indexer", None)
        if module is None:
            raise ReplayConfigError(f"decoder layer {layer} has no self_attn.indexer; the spec says it computes one")
        found[layer] = module
    return found


class IndexerRecorder(ForwardHooks):
    """Context manager recording every indexer call of a HF DSA model; :meth:`attach` adds the rows to records.

    >>> with RoutingRecorder(model, spec) as routing, IndexerRecorder(model, spec) as indexer:      # doctest: +SKIP
    ...     out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)
    >>> records = indexer.attach(routing.records(input_ids, mask, out, sample_ids=[...]), mask)    # doctest: +SKIP
    """

    def __init__(self, model: Any, spec: ModelSpec) -> None:
        self.spec = spec
        self.indexers = find_indexers(model, spec)
        super().__init__(self.indexers)
        self.calls: dict[int, list[npt.NDArray[np.int64]]] = {layer: [] for layer in self.indexers}

    def _hook(self, layer: int) -> Any:
        def record(module: Any, inputs: Any, output: Any) -> None:
            self.calls[layer].append(output.detach().to("cpu").numpy().astype(np.int64, copy=True))

        return record

    def attach(self, records: Sequence[Record], attention_mask: Any) -> list[Record]:
        """``records`` (one per batch row of the recorded ``generate``, as :class:`RoutingRecorder` made them) with
        their indexer rows set: ``[n_tokens, indexer layers, index_topk]`` canonical, -1 rows for tokens never fed."""
        declared = indexer_spec(self.spec)
        mask = np.asarray(attention_mask.detach().cpu() if hasattr(attention_mask, "detach") else attention_mask)
        mask = mask.astype(bool)
        batch, width = mask.shape
        calls = [self.calls[layer] for layer in declared.layers]
        if len(records) != batch or any(len(c) != len(calls[0]) or not c for c in calls):
            raise ReplayConfigError(
                f"recorded {[len(c) for c in calls]} indexer calls per layer for {len(records)} records of a batch of "
                f"{batch}: record one generate call at a time with the KV cache on"
            )
        out = []
        for b, record in enumerate(records):
            pad = width - int(mask[b].sum())
            rows = np.full((record.n_tokens, declared.num_layers, declared.index_topk), -1, np.int32)
            for j, layer_calls in enumerate(calls):
                fed = [_widened(call[b], declared.index_topk) for call in layer_calls]  # [S, k] KV-axis columns
                queries = np.concatenate(fed, axis=0)[pad:]  # query at position p is row p (prompt, then decode)
                for p in range(min(record.n_tokens, queries.shape[0])):
                    picked = queries[p] - pad
                    chosen = np.unique(picked[(picked >= 0) & (picked <= p)])[: declared.index_topk]
                    rows[p, j, : chosen.shape[0]] = chosen
            out.append(_with_indexer(record, rows))
        return out


def _widened(call: npt.NDArray[np.int64], k: int) -> npt.NDArray[np.int64]:
    """One call's ``[S, min(k, T)]`` columns as ``[S, k]``, -1 filling the columns a short key axis lacks."""
    out = np.full((call.shape[0], k), -1, np.int64)
    out[:, : call.shape[1]] = call
    return out


def _with_indexer(record: Record, rows: npt.NDArray[np.int32]) -> Record:
    return replace(record, indexer=rows)


def replay_rows(records: Sequence[Record], attention_mask: Any, spec: ModelSpec) -> dict[int, npt.NDArray[np.int64]]:
    """``{decoder layer: [B, T, min(index_topk, T)] int64}``: the records' indexer rows on the key axis of a
    full-sequence forward of the left-padded batch (``attention_mask`` ``[B, T]``), ready for :func:`replay`.
    Every row is checked canonical first (a position past its query, a duplicate, a wrong count is refused naming
    the sample, layer and position); a missing row or a padding query attends to its own column."""
    declared = indexer_spec(spec)
    mask = np.asarray(attention_mask.detach().cpu() if hasattr(attention_mask, "detach") else attention_mask)
    mask = mask.astype(bool)
    batch, width = mask.shape
    k = min(declared.index_topk, width)
    own = np.broadcast_to(np.arange(width)[:, None], (width, k))
    out = {layer: np.array(np.broadcast_to(own, (batch, width, k))) for layer in declared.layers}
    for b, record in enumerate(records):
        if record.indexer is None:
            raise ReplayConfigError(f"sample {record.sample_id!r} carries no indexer rows to replay")
        rows = np.asarray(record.indexer)
        pad = width - record.n_tokens
        if pad < 0 or int(mask[b].sum()) != record.n_tokens or mask[b, :pad].any():
            raise ReplayConfigError(
                f"sample {record.sample_id!r} has {record.n_tokens} tokens; batch row {b} holds "
                f"{int(mask[b].sum())} (left-padded to {width}): the batch is not these records"
            )
        for j, layer in enumerate(declared.layers):
            try:
                check_position_rows(rows[:, j, :], 0)
            except InvalidRecordError as exc:
                raise InvalidRecordError(record.sample_id, f"indexer (layer {layer})", exc.problem, exc.fix) from None
            kv = np.where(rows[:, j, :k] >= 0, rows[:, j, :k] + pad, -1)
            kv = np.where(kv >= 0, kv, (np.arange(record.n_tokens) + pad)[:, None])  # -1: the query's own column
            out[layer][b, pad:] = kv
    return out


@contextmanager
def replay(
    model: Any, spec: ModelSpec, rows: Mapping[int, Any], input_ids: Any, records: Sequence[Record]
) -> Iterator[None]:
    """Force every computing indexer to select ``rows[layer]`` (from :func:`replay_rows`) in the full-sequence
    forwards inside the block, after checking that ``input_ids`` (``[B, T]``, left-padded) holds each record's
    tokens row by row. Raises on leaving the block when an indexer never replayed (an inert replay)."""
    import torch

    indexers = find_indexers(model, spec)
    ids = np.asarray(input_ids.detach().cpu() if hasattr(input_ids, "detach") else input_ids)
    for b, record in enumerate(records):
        tokens = np.asarray(record.token_ids) if record.token_ids is not None else None
        if tokens is None or not np.array_equal(ids[b, ids.shape[1] - tokens.shape[0] :], tokens):
            raise ReplayConfigError(
                f"batch row {b} does not hold the tokens of sample {record.sample_id!r}: its indexer rows would "
                "select keys of other tokens"
            )
    fired = dict.fromkeys(indexers, 0)
    handles = []

    def hook_for(layer: int) -> Any:
        target = torch.as_tensor(rows[layer], dtype=torch.long)

        def rewrite(module: Any, inputs: Any, output: Any) -> Any:
            if tuple(output.shape) != tuple(target.shape):
                raise ReplayConfigError(
                    f"layer {layer}: the indexer selects {tuple(output.shape)}, the replay holds {tuple(target.shape)}"
                    " (replay a full-sequence forward of the recorded batch, no KV cache)"
                )
            fired[layer] += 1
            return target.to(device=output.device, dtype=output.dtype)

        return rewrite

    try:
        for layer, module in indexers.items():
            handles.append(module.register_forward_hook(hook_for(layer)))
        yield
    finally:
        for handle in handles:
            handle.remove()
    idle = sorted(layer for layer, n in fired.items() if n == 0)
    if idle:
        raise ReplayConfigError(f"the indexers of layers {idle} never ran inside the replay block: nothing replayed")
