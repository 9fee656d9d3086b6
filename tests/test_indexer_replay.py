"""Sparse-attention indexer rows on a trainer's ranks and in megatron-core 0.16.1's DSA (CPU, gloo, world size 1):
rows placed as routing rows are, key positions rebased onto the packed stream (THD) and kept global under CP, each
pipeline stage given its layers (a shared layer its source's); replayed selections are exactly what DSAttention's
sparse attention receives, and every way the replay could be wrong or inert is refused."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import routelog
from routelog import AlignmentError, ModelSpec, Record, ReplayConfigError
from routelog.align import AlignmentPlan, MicroBatch, Packing, ParallelLayout, RankCoords, gather
from routelog.align.indexer import (
    MicroBatchIndexer,
    RecordIndexer,
    gather_indexer,
    local_indexers,
    stored_indexer_layers,
)
from routelog.errors import InvalidRecordError, ReplayFidelityError, StaleRoutingError
from routelog.format.spec import IndexerSpec
from routelog.store.reader import StepSnapshot
from tests.records import random_routing


def canonical_rows(rng: np.random.Generator, n: int, layers: int, k: int) -> np.ndarray:
    """``[n, layers, k]`` canonical rows, each query's selection drawn at random (never the indexer's own); the
    last token's row missing, as an engine that never fed it records it."""
    rows = np.full((n, layers, k), -1, np.int32)
    for p in range(n - 1):
        for j in range(layers):
            picked = np.sort(rng.choice(p + 1, min(k, p + 1), replace=False))
            rows[p, j, : picked.size] = picked
    return rows


def write_store(
    spec: ModelSpec, lengths: dict[str, int], seed: int, versions: dict[str, int] | None = None
) -> tuple[StepSnapshot, dict[str, Record]]:
    rng = np.random.default_rng(seed)
    assert spec.indexer is not None
    url = f"memory://indexer-replay/{uuid.uuid4().hex}"
    records = {}
    with routelog.open_writer(url, 0, model_spec=spec) as writer:
        for sid, n in lengths.items():
            record = Record(
                sample_id=sid,
                expert_ids=random_routing(rng, n, spec.num_moe_layers, spec.num_experts, spec.topk),
                prompt_len=2,
                response_len=n - 2,
                token_ids=rng.integers(3, 120, n),
                indexer=canonical_rows(rng, n, spec.indexer.num_layers, spec.indexer.index_topk),
                policy_version=(versions or {}).get(sid),
            )
            writer.append(record)
            records[sid] = record
    return routelog.open_store(url).step(0), records


def read_indexer(snapshot: StepSnapshot, plan: AlignmentPlan) -> dict[str, RecordIndexer]:
    layers = stored_indexer_layers(plan)
    return {
        sid: RecordIndexer(snapshot.info(sid), snapshot.read_indexer(sid, layers=layers), tuple(layers))
        for sid in plan.sample_ids
    }


def rebased(row: np.ndarray, offset: int) -> np.ndarray:
    """miles' ``torch.where(r != -1, r + offset, r)``."""
    return np.where(row != -1, row + offset, row)


# -- alignment -----------------------------------------------------------------------------------------------------
ALIGN_SPEC = ModelSpec(
    name="dsa-8",
    num_layers=8,
    moe_layers=tuple(range(1, 8)),
    num_experts=8,
    topk=2,
    indexer=IndexerSpec(index_topk=4, layers=(0, 1, 2, 5), shared=(3, 4, 6, 7)),
)
LENGTHS = {"a": 7, "b": 11, "c": 5}


def test_thd_packing_adds_each_sequences_packed_start_to_its_positions_only() -> None:
    snapshot, records = write_store(ALIGN_SPEC, LENGTHS, seed=1)
    cu = (0, 8, 20, 28)  # the trainer's cu_seqlens_padded: every sequence padded
    plan = AlignmentPlan(ALIGN_SPEC, ParallelLayout(), Packing("thd"), RankCoords(), (MicroBatch(("a", "b", "c"), cu),))
    mb = gather_indexer(plan, 0, read_indexer(snapshot, plan))
    assert mb.rows.shape == (4, 28, 4) and mb.rows.dtype == np.int32 and mb.batch_size == 1
    for i, (sid, n) in enumerate(LENGTHS.items()):
        stored = records[sid].indexer
        assert isinstance(stored, np.ndarray)
        for j in range(4):
            got = mb.rows[j, cu[i] : cu[i] + n]
            np.testing.assert_array_equal(got, rebased(stored[:, j], cu[i]))
            assert (got[stored[:, j] == -1] == -1).all()  # -1 is never shifted
            np.testing.assert_array_equal(mb.mask[j, cu[i] : cu[i] + n], (stored[:, j] != -1).any(axis=1))
        pad = slice(cu[i] + n, cu[i + 1])
        assert (mb.rows[:, pad] == -1).all() and not mb.mask[:, pad].any()
    # The key of the second sequence's query at position 5 lies in the packed stream at 8 + its own positions.
    assert mb.rows[0, 8 + 5].tolist() == (records["b"].indexer[5, 0] + 8).tolist()  # type: ignore[index]
    bshd = AlignmentPlan(ALIGN_SPEC, ParallelLayout(), Packing("bshd"), RankCoords(), (MicroBatch(("a", "b", "c")),))
    rows = gather_indexer(bshd, 0, read_indexer(snapshot, bshd))
    assert rows.batch_size == 3  # rows s * 3 + b; a batch row per sequence keeps its own positions
    np.testing.assert_array_equal(rows.rows[1, 5 * 3 + 1], records["b"].indexer[5, 1])  # type: ignore[index]


@pytest.mark.parametrize("packing", ["verl", "slime", "nemo"])
def test_cp_zigzag_splits_rows_like_routing_and_keeps_global_key_positions(packing: str) -> None:
    snapshot, records = write_store(ALIGN_SPEC, LENGTHS, seed=2)
    layout = ParallelLayout(tp=2, cp=2, sequence_parallel=True)
    batch = (MicroBatch(("a", "b", "c")),)
    routings = {r.sample_id: r for r in snapshot.read_many(list(LENGTHS))}
    seen: dict[tuple[str, int], int] = {}
    for cp_rank in range(2):
        gathered = []
        for tp_rank in range(2):
            plan = AlignmentPlan(ALIGN_SPEC, layout, Packing(packing), RankCoords(tp=tp_rank, cp=cp_rank), batch)  # type: ignore[arg-type]
            routing = gather(plan, 0, {sid: routings[sid] for sid in LENGTHS})
            split = gather_indexer(plan, 0, read_indexer(snapshot, plan), sequence_parallel="split")
            np.testing.assert_array_equal(split.positions, routing.positions)  # the very rows routing gets
            np.testing.assert_array_equal(split.tokens, routing.tokens)
            gathered.append(routing.positions)
            whole = gather_indexer(plan, 0, read_indexer(snapshot, plan))
        # The indexer all-gathers the SP shards: every TP rank holds the rows of both TP ranks' routing.
        np.testing.assert_array_equal(whole.positions, np.concatenate(gathered))
        cu = plan.packed(0, list(LENGTHS.values())).cu_seqlens_padded
        for row, (sample, position) in enumerate(whole.positions.tolist()):
            if sample < 0:
                assert (whole.rows[:, row] == -1).all()
                continue
            sid = "abc"[sample]
            seen[sid, position] = seen.get((sid, position), 0) + 1
            for j in range(4):  # global packed key positions, not the CP rank's local ones
                expected = rebased(records[sid].indexer[position, j], cu[sample])  # type: ignore[index]
                np.testing.assert_array_equal(whole.rows[j, row], expected)
    assert seen == {(sid, p): 1 for sid, n in LENGTHS.items() for p in range(n)}  # each query on one CP rank


def test_a_pipeline_stage_gets_its_layers_and_a_shared_layer_its_sources_rows() -> None:
    snapshot, records = write_store(ALIGN_SPEC, LENGTHS, seed=3)
    layout = ParallelLayout(pp=2)  # stage 0: layers 0..3, stage 1: layers 4..7
    batch = (MicroBatch(("a", "b", "c")),)
    plans = [AlignmentPlan(ALIGN_SPEC, layout, Packing("verl"), RankCoords(pp=p), batch) for p in range(2)]
    stage1 = local_indexers(layout, ALIGN_SPEC, 1)
    assert [(i.layer, i.stored_index, i.shared) for i in stage1] == [
        (4, 2, True),
        (5, 3, False),
        (6, 3, True),
        (7, 3, True),
    ]
    # Stage 1 reads layer 2's rows (computed on stage 0) for its shared layer 4, and its own layer 5's.
    assert stored_indexer_layers(plans[0]) == [0, 1, 2] and stored_indexer_layers(plans[1]) == [2, 3]
    mb = gather_indexer(plans[1], 0, read_indexer(snapshot, plans[1]))
    assert mb.rows.shape[0] == 2 and [i.layer_number for i in mb.layers] == [5, 6, 7, 8]
    b_at = int(np.flatnonzero((mb.positions == [1, 6]).all(axis=1))[0])
    offset = int(mb.key_offsets[b_at])
    for layer_number, source in [(5, 2), (6, 3), (7, 3), (8, 3)]:
        expected = rebased(records["b"].indexer[6, source], offset)  # type: ignore[index]
        np.testing.assert_array_equal(mb.rows[mb.stored_of(layer_number), b_at], expected)
    every_layer = {sid: RecordIndexer(snapshot.info(sid), snapshot.read_indexer(sid), (0, 1, 2, 3)) for sid in LENGTHS}
    with pytest.raises(AlignmentError, match=r"read with indexer layers \[0, 1, 2, 3\], the plan needs \[2, 3\]"):
        gather_indexer(plans[1], 0, every_layer)


def test_stale_policy_versions_are_refused_or_left_missing() -> None:
    snapshot, _ = write_store(ALIGN_SPEC, {"a": 7, "b": 9}, seed=4, versions={"a": 5, "b": 4})
    batch = (MicroBatch(("a", "b")),)
    plan = AlignmentPlan(
        ALIGN_SPEC, ParallelLayout(), Packing("verl"), RankCoords(), batch, policy_versions=frozenset({5})
    )
    with pytest.raises(StaleRoutingError, match=r"sample 'b': tokens 0\.\.9 were routed by policy version 4"):
        gather_indexer(plan, 0, read_indexer(snapshot, plan))
    lenient = AlignmentPlan(
        ALIGN_SPEC,
        ParallelLayout(),
        Packing("verl"),
        RankCoords(),
        batch,
        policy_versions=frozenset({5}),
        other_versions="missing",
    )
    mb = gather_indexer(lenient, 0, read_indexer(snapshot, lenient))
    of_b = mb.positions[:, 0] == 1
    assert (mb.rows[:, of_b] == -1).all() and not mb.mask[:, of_b].any()
    assert mb.mask[:, mb.positions[:, 0] == 0].any()


# -- megatron-core 0.16.1 DSA --------------------------------------------------------------------------------------
K = 4
DSA_SPEC = ModelSpec(
    name="tiny-dsa",
    num_layers=4,
    moe_layers=(1, 2, 3),
    num_experts=8,
    topk=2,
    indexer=IndexerSpec(index_topk=K, layers=(0, 1, 3), shared=(2,)),
)
DSA_LENGTHS = {"s0": 12, "s1": 9}


@pytest.fixture(scope="module")
def dsa_env() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from routelog.testing import dsa_on_cpu

    dsa_on_cpu()


def dsa_config(**overrides: Any) -> Any:
    import torch
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    fields: dict[str, Any] = {
        "num_layers": 4,
        "hidden_size": 64,
        "ffn_hidden_size": 64,
        "num_attention_heads": 4,
        "multi_latent_attention": True,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_head_dim": 16,
        "qk_pos_emb_head_dim": 16,
        "v_head_dim": 16,
        "rope_type": "rope",
        "experimental_attention_variant": "dsa",
        "dsa_indexer_n_heads": 4,
        "dsa_indexer_head_dim": 32,
        "dsa_indexer_topk": K,
        "dsa_indexer_loss_coeff": 0.0,
        "use_cpu_initialization": True,
        "params_dtype": torch.float32,
        "add_bias_linear": False,
        "hidden_dropout": 0.0,  # two forwards of one batch see the same hidden states
        "attention_dropout": 0.0,
    }
    fields.update(overrides)
    return MLATransformerConfig(**fields)


def dsa_model(config: Any) -> Any:
    """A real megatron-core GPTModel whose every layer runs MLA with DSAttention and its DSAIndexer."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from routelog.testing import dsa_layer_spec

    torch.manual_seed(0)
    return GPTModel(
        config=config,
        transformer_layer_spec=dsa_layer_spec(),
        vocab_size=128,
        max_sequence_length=64,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        position_embedding_type="none",
    )


@pytest.fixture
def attention_receives(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The ``topk_indices`` every ``unfused_dsa_fn`` call (DSAttention's sparse attention) receives, in order."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    seen: list[Any] = []
    original = dsa.unfused_dsa_fn

    def spy(query: Any, key: Any, value: Any, topk_indices: Any, softmax_scale: float) -> Any:
        seen.append(topk_indices.clone())
        return original(query, key, value, topk_indices, softmax_scale)

    monkeypatch.setattr(dsa, "unfused_dsa_fn", spy)
    return seen


def dsa_plan(**options: Any) -> AlignmentPlan:
    return AlignmentPlan(
        DSA_SPEC, ParallelLayout(), Packing("bshd"), RankCoords(), (MicroBatch(tuple(DSA_LENGTHS)),), **options
    )


def batch_of(records: dict[str, Record], width: int = 12) -> tuple[Any, Any]:
    """``input_ids`` [B, S] (right-padded with 0) and ``position_ids`` of the micro-batch."""
    import torch

    ids = torch.zeros((len(records), width), dtype=torch.long)
    for b, record in enumerate(records.values()):
        assert record.token_ids is not None
        ids[b, : record.n_tokens] = torch.as_tensor(np.asarray(record.token_ids)[:width])
    return ids, torch.arange(width)[None].expand(len(records), -1)


def expected_indices(record: Record, source: int, width: int) -> np.ndarray:
    """``[S, min(K, S)]``: the record's stored row per query, its -1 slots (and a padding query's) the query."""
    stored = np.asarray(record.indexer)[:, source]
    out = np.broadcast_to(np.arange(width)[:, None], (width, min(K, width))).copy()
    out[: record.n_tokens] = np.where(stored == -1, np.arange(record.n_tokens)[:, None], stored)[:, : min(K, width)]
    return out


@pytest.fixture
def dsa_setup(dsa_env: None) -> tuple[StepSnapshot, dict[str, Record]]:
    return write_store(DSA_SPEC, DSA_LENGTHS, seed=7)


def test_attention_receives_exactly_the_replayed_selections(
    dsa_setup: tuple[StepSnapshot, dict[str, Record]], attention_receives: list[Any]
) -> None:
    from routelog.megatron_indexer import MegatronIndexerReplay, load_indexer

    snapshot, records = dsa_setup
    config = dsa_config()
    model = dsa_model(config)
    ids, positions = batch_of(records)
    model(ids, positions, attention_mask=None)
    native = [t.numpy() for t in attention_receives]
    attention_receives.clear()

    plan = dsa_plan()
    replay = MegatronIndexerReplay([model], plan, config=config)
    mb = load_indexer(snapshot, plan, 0)
    with replay.forward(mb):
        model(ids, positions, attention_mask=None)
    got = [t.numpy() for t in attention_receives]
    assert [g.shape for g in got] == [(2, 12, K)] * 4 and all(g.dtype == np.int64 for g in got)
    for layer, source in enumerate([0, 1, 1, 2]):  # decoder layer 2 is shared: it replays layer 1's rows
        for b, record in enumerate(records.values()):
            np.testing.assert_array_equal(got[layer][b], expected_indices(record, source, 12))
    assert any((g != n).any() for g, n in zip(got, native, strict=True))  # the replay changed what attention used
    replay.end_step()

    # Training: the forward (and the indexer loss) take the replayed indices, and a recomputation in the backward,
    # outside the forward block, pops the same ones.
    model.train()
    attention_receives.clear()
    with replay.forward(mb):
        model(ids, positions, attention_mask=None).sum().backward()
    model(ids, positions, attention_mask=None)  # as activation recomputation runs the layers again
    first, again = attention_receives[:4], attention_receives[4:]
    assert len(again) == 4 and all((a == b).all() for a, b in zip(first, again, strict=True))
    replay.end_step()
    replay.remove()
    attention_receives.clear()
    model(ids, positions, attention_mask=None)  # removed: megatron-core's own selection, no replay needed
    assert len(attention_receives) == 4


def test_missing_rows_take_the_indexers_own_choice_with_the_router_policy(
    dsa_setup: tuple[StepSnapshot, dict[str, Record]], attention_receives: list[Any]
) -> None:
    from routelog.megatron_indexer import MegatronIndexerReplay, load_indexer

    snapshot, records = dsa_setup
    model = dsa_model(dsa_config())
    ids, positions = batch_of(records)
    model(ids, positions, attention_mask=None)
    native = [t.numpy() for t in attention_receives]
    attention_receives.clear()
    plan = dsa_plan(missing="router")
    replay = MegatronIndexerReplay([model], plan)
    with replay.forward(load_indexer(snapshot, plan, 0)):
        model(ids, positions, attention_mask=None)
    got = [t.numpy() for t in attention_receives]
    # Layer 0 sees the same hidden states in both passes: there the rows without a recorded selection (each
    # record's last token, s1's padding) are the indexer's own, the others replayed.
    for b, record in enumerate(records.values()):
        last = record.n_tokens - 1
        np.testing.assert_array_equal(got[0][b, last:], native[0][b, last:])
        np.testing.assert_array_equal(got[0][b, :last], expected_indices(record, 0, 12)[:last])
    replay.end_step()


@pytest.fixture
def installed(dsa_setup: tuple[StepSnapshot, dict[str, Record]]) -> Iterator[tuple[Any, Any, MicroBatchIndexer]]:
    """(model, its installer, the micro-batch's rows) for the records of ``dsa_setup``."""
    from routelog.megatron_indexer import MegatronIndexerReplay, load_indexer

    snapshot, _ = dsa_setup
    config = dsa_config()
    model = dsa_model(config)
    plan = dsa_plan()
    replay = MegatronIndexerReplay([model], plan, config=config)
    yield model, replay, load_indexer(snapshot, plan, 0)
    replay.remove()


def test_an_indexer_running_without_replay_data_is_refused(
    dsa_setup: tuple[StepSnapshot, dict[str, Record]], installed: tuple[Any, Any, MicroBatchIndexer]
) -> None:
    model, replay, mb = installed
    ids, positions = batch_of(dsa_setup[1])
    with pytest.raises(ReplayFidelityError, match=r"layer 1: the DSA indexer ran with no replayed selection installed"):
        model(ids, positions, attention_mask=None)
    with replay.forward(mb):
        model(ids, positions, attention_mask=None)
    model(ids, positions, attention_mask=None)  # a recomputation takes the selections installed
    with pytest.raises(ReplayFidelityError, match=r"layer 1: .* and there are none left"):
        model(ids, positions, attention_mask=None)


INVALID_ROWS = {
    "duplicate": ((1, 0), r"position 0 is selected twice \(columns 0 and 1\)"),
    "past the query": ((3, 9), r"position 9 at column 3 is past the query's own position 6"),
    "too few": ((3, -1), r"it holds 3 positions, not min\(k, p \+ 1\) = 4"),
    "unsorted": ((0, 3), r"its positions are not ascending \(3 at column 0, then 2\)"),
    "negative": ((0, -5), r"it selects key -5, and key positions are >= 0 with only -1 padding"),
}


@pytest.mark.parametrize("edit", INVALID_ROWS.values(), ids=INVALID_ROWS.keys())
def test_a_replayed_row_that_is_not_a_valid_topk_is_refused(
    installed: tuple[Any, Any, MicroBatchIndexer], edit: tuple[tuple[int, int], str]
) -> None:
    _, replay, mb = installed
    (column, value), problem = edit
    row = mb.rows[1, 6 * 2]  # stored layer 1 (layer_number 2, and the shared 3); s0's query at 6 is row 6 * B + 0
    row[:] = [0, 2, 4, 6]
    row[column] = value
    with pytest.raises(InvalidRecordError) as refused:
        replay.install(mb)
    message = str(refused.value)
    assert "sample 's0', field 'indexer (layer 2)'" in message, message
    assert "the replayed selection of the query at position 6 (local row 12) is not a valid top-4: " in message
    assert re.search(problem, message), message


def test_a_padding_row_or_another_sequences_key_is_refused(
    dsa_setup: tuple[StepSnapshot, dict[str, Record]], installed: tuple[Any, Any, MicroBatchIndexer]
) -> None:
    from routelog.megatron_indexer import MegatronIndexerReplay, load_indexer

    _, replay, mb = installed
    mb.rows[0, 11 * 2 + 1, :2] = [0, 1]  # s1 has 9 tokens: row 11 * B + 1 is padding
    with pytest.raises(AlignmentError, match=r"layer 1: local row 23 is padding .*, yet its replayed row selects"):
        replay.install(mb)
    # Packed as one [1, T] batch row (THD): s1's keys start at 12, so a key below 12 in its rows is s0's.
    thd = AlignmentPlan(
        DSA_SPEC, ParallelLayout(), Packing("thd"), RankCoords(), (MicroBatch(tuple(DSA_LENGTHS), (0, 12, 21)),)
    )
    packed = load_indexer(dsa_setup[0], thd, 0)
    assert packed.batch_size == 1 and packed.rows[0, 12 + 4].min() >= 12
    packed.rows[0, 12 + 4, 0] = 11
    thd_replay = MegatronIndexerReplay([dsa_model(dsa_config())], thd)
    another = (
        r"sample 's1', field 'indexer \(layer 1\)': the replayed selection of the query at position 4 \(local row "
        r"16\) is not a valid top-4: it selects key 11, before its sequence's first key 12 in the packed stream"
    )
    with pytest.raises(InvalidRecordError, match=another):
        thd_replay.install(packed)
    thd_replay.remove()


def test_selections_no_forward_took_fail_the_step(installed: tuple[Any, Any, MicroBatchIndexer]) -> None:
    _, replay, mb = installed
    with replay.forward(mb):
        pass  # the trainer's forward never reached the DSA layers
    with pytest.raises(ReplayFidelityError, match=r"handed to the DSA layers \[1, 2, 3, 4\] and no forward took them"):
        replay.end_step()


def test_other_tokens_fed_fail_the_step(
    dsa_setup: tuple[StepSnapshot, dict[str, Record]], installed: tuple[Any, Any, MicroBatchIndexer]
) -> None:
    model, replay, mb = installed
    ids, positions = batch_of(dsa_setup[1])
    ids[1, 3] += 1  # s1's token at position 3: local row 3 * B + 1
    with replay.forward(mb):
        model(ids, positions, attention_mask=None)
    other = r"row 7 feeds token \d+ where sample 's1' had token \d+ at position 3"
    with pytest.raises(ReplayFidelityError, match=other):
        replay.end_step()
    with pytest.raises(ReplayFidelityError, match=other):  # or at install, from the data the trainer holds
        replay.install(mb, fed_rows=ids.transpose(0, 1).reshape(-1).numpy())


def test_a_batch_of_another_shape_is_refused(dsa_setup: tuple[StepSnapshot, dict[str, Record]]) -> None:
    from routelog.megatron_indexer import MegatronIndexerReplay, load_indexer

    model = dsa_model(dsa_config())
    plan = dsa_plan()
    mb = load_indexer(dsa_setup[0], plan, 0)
    ids, positions = batch_of(dsa_setup[1], width=10)
    replay = MegatronIndexerReplay([model], plan)
    fed_rows = r"micro-batch 0: the model is fed 20 token rows, the indexer rows are 24"
    with pytest.raises(AlignmentError, match=fed_rows), replay.forward(mb):
        model(ids, positions, attention_mask=None)
    replay.remove()
    unchecked = MegatronIndexerReplay([model], plan, check_tokens="off")
    shape = r"layer 1: the indexer selects \(2, 10, 4\) \[b, sq, topk\], the replay holds \(2, 12, 4\)"
    with pytest.raises(AlignmentError, match=shape), unchecked.forward(mb):
        model(ids, positions, attention_mask=None)
    unchecked.remove()


def test_a_model_or_config_that_is_not_the_specs_is_refused(dsa_env: None) -> None:
    from routelog.megatron_indexer import MegatronIndexerReplay, check_dsa_config

    plan = dsa_plan()
    other_layers = r"DSA layers \(vp_stage, layer_number\) \[\(0, 1\), \(0, 2\), \(0, 3\)\] differ"
    with pytest.raises(AlignmentError, match=other_layers):
        MegatronIndexerReplay([dsa_model(dsa_config(num_layers=3))], plan)
    with pytest.raises(ReplayConfigError, match=r"dsa_indexer_topk=8, the recorded rows select 4 keys"):
        check_dsa_config(dsa_config(dsa_indexer_topk=8), DSA_SPEC)
    with pytest.raises(ReplayConfigError, match=r"megatron-core 0.16.1's DSA has no context parallelism"):
        MegatronIndexerReplay([], AlignmentPlan(DSA_SPEC, ParallelLayout(cp=2), Packing("bshd"), RankCoords(), ()))
