"""megatron-core R2 recordings: ``RouterReplay.get_recorded_data()`` back to records.

In ``RECORD`` mode every router keeps the ``[T_local, K]`` indices of its last forward, in Megatron's row order for
that rank: packed, CP- and SP-split, one tensor per router in router order. Given the layout that produced them
(an :class:`~routelog.align.plan.AlignmentPlan` per rank) the rows are mapped back to (sample, token position,
layer) with the same pure alignment the loader uses, and the shards of all ranks are merged. Padding rows are
dropped; every MoE layer of every token must be covered by some rank, or the token stays missing.

Multi-token-prediction routers (built after the decoder on the last pipeline stage, and numbered from 1 again by
some megatron-core versions) are never mixed into the decoder's layers: their recordings, passed apart as
``mtp_recordings``, become the record's ``mtp`` stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from routelog.align.plan import AlignmentPlan
from routelog.align.positions import PAD
from routelog.errors import IngestError
from routelog.format.record import Record, StreamRows
from routelog.format.spec import MTP_STREAM

ENGINE = "megatron-core"


@dataclass(frozen=True)
class RecordedShard:
    """What one rank recorded for one micro-batch: one ``[T_local, K]`` tensor per router of ``plan.routers``."""

    plan: AlignmentPlan
    micro_batch: int
    recordings: Sequence[npt.ArrayLike]
    mtp_recordings: Sequence[npt.ArrayLike] = ()
    """One ``[T_local, K]`` tensor per MTP router of this rank, in MTP-layer order (last pipeline stage only)."""


def records_from_recordings(
    shards: Iterable[RecordedShard],
    lengths: Mapping[str, tuple[int, int]],
    *,
    token_ids: Mapping[str, npt.ArrayLike] | None = None,
    policy_version: int | None = None,
) -> list[Record]:
    """Records from every rank's recordings; ``lengths`` maps each sample id to ``(prompt_len, response_len)``."""
    shards = list(shards)
    if not shards:
        raise IngestError("no recordings given")
    spec = shards[0].plan.spec
    mtp = spec.stream(MTP_STREAM)
    ids = {sid: np.zeros((p + r, spec.num_moe_layers, spec.topk), np.int64) for sid, (p, r) in lengths.items()}
    seen = {sid: np.zeros((p + r, spec.num_moe_layers), bool) for sid, (p, r) in lengths.items()}
    mtp_layers = mtp.num_layers if mtp is not None else 0
    mtp_ids = {sid: np.zeros((p + r, max(mtp_layers, 1), spec.topk), np.int64) for sid, (p, r) in lengths.items()}
    mtp_seen = {sid: np.zeros((p + r, max(mtp_layers, 1)), bool) for sid, (p, r) in lengths.items()}
    any_mtp = False
    for shard in shards:
        plan, m = shard.plan, shard.micro_batch
        batch = plan.micro_batches[m]
        unknown = [sid for sid in batch.sample_ids if sid not in lengths]
        if unknown:
            raise IngestError(f"micro-batch {m}: no lengths for samples {unknown[:5]}")
        positions = plan.positions(m, [sum(lengths[sid]) for sid in batch.sample_ids])
        routers = plan.routers
        if len(shard.recordings) != len(routers):
            raise IngestError(
                f"rank {plan.rank} micro-batch {m}: {len(shard.recordings)} recordings for {len(routers)} routers"
            )
        if shard.mtp_recordings and len(shard.mtp_recordings) != mtp_layers:
            raise IngestError(
                f"rank {plan.rank} micro-batch {m}: {len(shard.mtp_recordings)} MTP recordings, the model spec "
                f"declares an mtp stream of {mtp_layers} layers (ModelSpec.with_mtp_stream())"
            )
        real = np.flatnonzero(positions[:, 0] != PAD)
        samples = [plan.sample_ids[i] for i in positions[real, 0]]
        tokens = positions[real, 1]
        targets = [
            (f"layer {r.layer_number}", rows, ids, seen, r.moe_index)
            for r, rows in zip(routers, shard.recordings, strict=True)
        ]
        targets += [(f"MTP layer {j}", rows, mtp_ids, mtp_seen, j) for j, rows in enumerate(shard.mtp_recordings)]
        any_mtp = any_mtp or bool(shard.mtp_recordings)
        for what, recorded, out, covered, axis in targets:
            rows = np.asarray(recorded)
            if rows.shape != (positions.shape[0], spec.topk):
                raise IngestError(
                    f"rank {plan.rank} micro-batch {m} {what}: recorded {rows.shape}, the layout gives "
                    f"[{positions.shape[0]}, {spec.topk}]"
                )
            for sid in set(samples):
                pick = np.fromiter((s == sid for s in samples), bool, len(samples))
                out[sid][tokens[pick], axis] = rows[real[pick]]
                covered[sid][tokens[pick], axis] = True
    records = []
    for sid, (prompt_len, response_len) in lengths.items():
        streams = None
        if any_mtp:
            streams = {MTP_STREAM: StreamRows(mtp_ids[sid], _fully_covered(sid, mtp_seen[sid], "MTP layers"))}
        records.append(
            Record(
                sample_id=sid,
                expert_ids=ids[sid],
                prompt_len=prompt_len,
                response_len=response_len,
                valid=_fully_covered(sid, seen[sid], "MoE layers"),
                token_ids=None if token_ids is None else token_ids[sid],
                policy_version=policy_version,
                engine=ENGINE,
                streams=streams,
            )
        )
    return records


def _fully_covered(sid: str, covered: npt.NDArray[np.bool_], what: str) -> npt.NDArray[np.bool_]:
    """Tokens recorded in every layer; a token recorded in some layers only means a stage's recordings are missing."""
    partial = covered.any(axis=1) & ~covered.all(axis=1)
    if partial.any():
        raise IngestError(
            f"sample {sid!r}: token {int(np.argmax(partial))} was recorded for some {what} only; "
            "pass the recordings of every pipeline stage"
        )
    return np.asarray(covered.all(axis=1), dtype=bool)
