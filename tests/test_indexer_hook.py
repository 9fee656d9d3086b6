"""The megatron-core forward-step hook replaying sparse-attention indexer selections beside the routing, through a
real megatron-core GPTModel with MoE layers and DeepSeek Sparse Attention (CPU, gloo, world size 1): each
micro-batch's selections, prefetched with its routing, are what DSAttention's sparse attention receives; the
indexer diff (the indexer's own top-k against the replayed selection) is measured, judged and published beside the
router diff; a hook that has no indexer to replay, or whose indexers never took the selections, refuses."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import routelog
from routelog import ModelSpec, Record, ReplayConfigError
from routelog.align import Packing, ParallelLayout, RankCoords
from routelog.errors import ReplayFidelityError
from routelog.format.spec import IndexerSpec
from routelog.integrations.megatron import ReplayHook
from routelog.store.fidelity import FidelityGate, read_fidelity
from tests.records import random_routing
from tests.test_indexer_replay import (  # noqa: F401  (dsa_env, attention_receives: the fixtures)
    DSA_SPEC,
    K,
    attention_receives,
    canonical_rows,
    dsa_config,
    dsa_env,
    expected_indices,
)

if TYPE_CHECKING:
    from routelog.integrations.megatron import IndexerReplay

pytestmark = pytest.mark.usefixtures("dsa_env")
torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

LENGTHS = {"s0": 12, "s1": 9, "s2": 10}
MICRO_BATCHES = [["s0", "s1"], ["s2"]]
WIDTHS = [12, 10]
"""Each micro-batch's BSHD width: its longest sequence."""
OWN_SPEC = DSA_SPEC.model_copy(update={"indexer": IndexerSpec(index_topk=K, layers=(0, 1, 2, 3))})
"""Every DSA layer computes its own selection: each is compared with its own stored rows."""
HOOK: dict[str, Any] = {"layout": ParallelLayout(), "rank": RankCoords(), "packing": Packing("bshd")}


def moe_dsa_model() -> tuple[Any, Any]:
    """(config, model): a GPTModel whose every layer runs MLA with DSAttention, its MLPs those of ``DSA_SPEC``
    (layer 0 dense, layers 1..3 MoE with 8 experts, top-2, routing replay enabled)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from routelog.testing import dsa_layer_spec

    config = dsa_config(
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_layer_freq=[0, 1, 1, 1],
        moe_enable_routing_replay=True,
        moe_token_dispatcher_type="allgather",
        moe_aux_loss_coeff=0.0,
    )
    dense = dsa_layer_spec()
    experts = get_gpt_layer_local_spec(num_experts=8, multi_latent_attention=True).submodules.mlp
    moe = dataclasses.replace(dense, submodules=dataclasses.replace(dense.submodules, mlp=experts))
    RouterReplay.clear_global_router_replay_instances()
    torch.manual_seed(0)
    model = GPTModel(
        config=config,
        transformer_layer_spec=TransformerBlockSubmodules(layer_specs=[dense, moe, moe, moe]),
        vocab_size=128,
        max_sequence_length=64,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        position_embedding_type="none",
    )
    return config, model


def write_store(records: list[Record], spec: ModelSpec = DSA_SPEC) -> str:
    url = f"memory://indexer-hook/{uuid.uuid4().hex}"
    with routelog.open_writer(url, 0, model_spec=spec) as writer:
        for record in records:
            writer.append(record)
    return url


def random_records(spec: ModelSpec = DSA_SPEC, seed: int = 3) -> list[Record]:
    """Routes and selections drawn at random (never the model's own); each record's last token without a
    selection; written by policy version 0, as the hook replays step 0's."""
    rng = np.random.default_rng(seed)
    indexer = spec.indexer.num_layers if spec.indexer is not None else 0
    return [
        Record(
            sample_id=sid,
            expert_ids=random_routing(rng, n, spec.num_moe_layers, spec.num_experts, spec.topk),
            prompt_len=2,
            response_len=n - 2,
            token_ids=rng.integers(3, 120, n),
            indexer=canonical_rows(rng, n, indexer, K) if indexer else None,
            policy_version=0,
        )
        for sid, n in LENGTHS.items()
    ]


def spy_indexers(model: Any) -> list[tuple[int, np.ndarray]]:
    """(layer_number, the indexer's own top-k ``[b, sq, k]``) of every DSA indexer call, in order: wrapped around
    megatron-core's own ``forward_with_scores``, under the replay's wrapper (install it before the hook)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    calls: list[tuple[int, np.ndarray]] = []

    def spy(number: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward_with_scores(*args: Any, **kwargs: Any) -> Any:
            scores, native = original(*args, **kwargs)
            calls.append((number, native.numpy().copy()))
            return scores, native

        return forward_with_scores

    for attention in [m for m in model.decoder.modules() if isinstance(m, DSAttention)]:
        attention.indexer.forward_with_scores = spy(int(attention.layer_number), attention.indexer.forward_with_scores)
    return calls


def model_inputs(token_ids: list[Any], width: int) -> tuple[Any, Any]:
    """``input_ids`` ``[B, width]`` (right-padded with 0) and ``position_ids`` of one micro-batch."""
    ids = torch.zeros((len(token_ids), width), dtype=torch.long)
    for b, tokens in enumerate(token_ids):
        ids[b, : len(tokens)] = torch.as_tensor(np.asarray(tokens))
    return ids, torch.arange(width)[None].expand(len(token_ids), -1)


def forward_step_of(batches: list[tuple[Any, Any]]) -> Callable[..., Any]:
    """The user's forward step: the schedule's next micro-batch through the whole model (``batches`` in order;
    a new pass over them starts whenever the first micro-batch's turn comes again)."""
    turn = {"m": 0}

    def forward_step(data_iterator: Any, model: Any) -> Any:
        ids, positions = batches[turn["m"] % len(batches)]
        turn["m"] += 1
        return model(ids, positions, attention_mask=None).sum()

    return forward_step


def micro_batch_inputs(records: list[Record]) -> list[tuple[Any, Any]]:
    tokens = {r.sample_id: r.token_ids for r in records}
    return [
        model_inputs([tokens[sid] for sid in batch], width) for batch, width in zip(MICRO_BATCHES, WIDTHS, strict=True)
    ]


SOURCES = [0, 1, 1, 2]
"""The stored indexer layer each decoder layer replays under ``DSA_SPEC`` (layer 2 shares layer 1's)."""


def assert_attends_as_stored(received: list[Any], records: list[Record]) -> None:
    """DSAttention's sparse attention took the stored selections of each micro-batch of a step, layer by layer."""
    by_id = {r.sample_id: r for r in records}
    assert len(received) == 4 * len(MICRO_BATCHES)
    for m, (batch, width) in enumerate(zip(MICRO_BATCHES, WIDTHS, strict=True)):
        for layer, source in enumerate(SOURCES):
            for b, sid in enumerate(batch):
                got = received[4 * m + layer][b].numpy()
                np.testing.assert_array_equal(got, expected_indices(by_id[sid], source, width))


def run_step(hook: ReplayHook, model: Any, records: list[Record], **end: Any) -> Any:
    """One training step through the hook: every micro-batch's forward, then the backward; returns end_step's
    counts."""
    hook.begin_step(0, MICRO_BATCHES)
    wrapped = hook.wrap(forward_step_of(micro_batch_inputs(records)))
    losses = [wrapped(iter(()), model) for _ in MICRO_BATCHES]
    sum(losses).backward()
    return hook.end_step(**end)


def test_each_micro_batchs_selections_reach_attention_and_their_indexer_diff_is_published(
    attention_receives: list[Any],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from routelog import megatron_indexer

    records = random_records()
    url = write_store(records)
    config, model = moe_dsa_model()
    native = spy_indexers(model)
    read_in: list[str] = []
    load_indexer = megatron_indexer.load_indexer

    def reading(*args: Any, **kwargs: Any) -> Any:
        read_in.append(threading.current_thread().name)
        return load_indexer(*args, **kwargs)

    monkeypatch.setattr(megatron_indexer, "load_indexer", reading)
    hook = ReplayHook(url, [model], config=config, fidelity_writer="train-dp0", **HOOK)
    assert hook.indexer_replay is not None
    counts = run_step(hook, model, records, trainer_step=7)
    assert len(read_in) == 2 and all(name.startswith("routelog-prefetch") for name in read_in), read_in

    assert_attends_as_stored(attention_receives, records)

    by_id = {r.sample_id: r for r in records}
    # The indexer diff, by brute force: per replayed row (a recorded selection), whether the indexer's own set of
    # keys (those not past the query) differs from the stored one.
    replayed: dict[int, int] = {}
    differing: dict[int, int] = {}
    for call, (number, own) in enumerate(native):
        for b, sid in enumerate(MICRO_BATCHES[call // 4]):
            stored = np.asarray(by_id[sid].indexer)[:, SOURCES[number - 1]]
            for p, row in enumerate(stored):
                if (row == -1).all():
                    continue
                replayed[number - 1] = replayed.get(number - 1, 0) + 1
                mine = {int(key) for key in own[b, p] if key <= p}
                differing[number - 1] = differing.get(number - 1, 0) + int(mine != {int(k) for k in row if k >= 0})
    assert len(native) == 4 * len(MICRO_BATCHES)
    assert replayed == dict.fromkeys(range(4), sum(LENGTHS.values()) - len(LENGTHS)), "each record's last: no row"
    assert counts.indexer_replayed == replayed and counts.indexer_differing == differing
    assert all(d > 0 for d in differing.values()), "random selections are not the indexer's own"
    assert counts.router_diff() and counts.samples == 3, "the router diff is measured beside it"

    (document,) = read_fidelity(routelog.open_store(url), 0)
    assert document.trainer_step == 7 and document.layers == [1, 2, 3]
    assert document.indexer_layers == [0, 1, 2, 3]
    assert document.indexer_replayed_rows == [replayed[n] for n in range(4)]
    assert document.indexer_differing_rows == [differing[n] for n in range(4)]
    hook.remove()


def test_the_indexer_diff_is_zero_when_the_stored_selections_are_the_models_own() -> None:
    """A rollout whose routes and selections are the model's own (recorded from its native forward): replaying
    them leaves every layer's input unchanged, so each indexer's own top-k is the replayed set on every row, and a
    gate of 0 % passes."""
    from megatron.core.transformer.moe.router import TopKRouter

    config, model = moe_dsa_model()
    rng = np.random.default_rng(5)
    tokens = {sid: rng.integers(3, 120, n) for sid, n in LENGTHS.items()}
    selections = spy_indexers(model)
    routes: list[tuple[int, np.ndarray]] = []
    handles = [
        router.register_forward_hook(
            lambda module, args, out: routes.append((int(module.layer_number), out[1].detach().numpy()))
        )
        for router in model.decoder.modules()
        if isinstance(router, TopKRouter)
    ]
    records = []
    for batch, width in zip(MICRO_BATCHES, WIDTHS, strict=True):
        selections.clear()
        routes.clear()
        with torch.no_grad():
            model(*model_inputs([tokens[sid] for sid in batch], width), attention_mask=None)
        for b, sid in enumerate(batch):
            n = LENGTHS[sid]
            # Each router's routing map [s * B + b, E]: the token's two experts, per MoE layer.
            experts = np.stack([np.nonzero(rows[b :: len(batch)][:n])[1].reshape(n, 2) for _, rows in routes], axis=1)
            own = np.full((n, 4, K), -1, np.int32)
            for j, (_, native) in enumerate(selections):
                for p in range(n):
                    picked = np.sort(native[b, p][native[b, p] <= p])  # the keys it may attend to, canonical
                    own[p, j, : picked.size] = picked
            records.append(
                Record(
                    sample_id=sid,
                    expert_ids=experts,
                    prompt_len=2,
                    response_len=n - 2,
                    token_ids=tokens[sid],
                    indexer=own,
                    policy_version=0,
                )
            )
    for handle in handles:
        handle.remove()
    url = write_store(records, OWN_SPEC)
    gate = FidelityGate(max_router_diff=0.0, max_indexer_diff=0.0)
    hook = ReplayHook(url, [model], spec=OWN_SPEC, config=config, gate=gate, fidelity_writer="own", **HOOK)
    counts = run_step(hook, model, records)
    assert counts.indexer_replayed == dict.fromkeys(range(4), sum(LENGTHS.values()))
    assert counts.indexer_differing == dict.fromkeys(range(4), 0)
    assert counts.differing == dict.fromkeys([1, 2, 3], 0), "the routes are the model's own too"
    (document,) = read_fidelity(routelog.open_store(url), 0)
    assert document.indexer_differing_rows == [0, 0, 0, 0] and document.indexer_layers == [0, 1, 2, 3]
    hook.remove()


def test_an_indexer_diff_over_the_gate_fails_the_step_at_its_last_forward() -> None:
    records = random_records()
    config, model = moe_dsa_model()
    gate = FidelityGate(max_router_diff=None, max_indexer_diff=0.05)
    hook = ReplayHook(write_store(records), [model], config=config, gate=gate, **HOOK)
    hook.begin_step(0, MICRO_BATCHES)
    wrapped = hook.wrap(forward_step_of(micro_batch_inputs(records)))
    wrapped(iter(()), model)
    over = r"indexer replay: the trainer's sparse-attention indexer disagrees with the replayed selections on"
    with pytest.raises(ReplayFidelityError, match=over):
        wrapped(iter(()), model)
    hook.end_step()
    hook.remove()


def test_a_rerun_of_the_step_reads_its_selections_again(attention_receives: list[Any]) -> None:  # noqa: F811
    """Megatron-LM's rerun state machine runs the step's micro-batches twice: the rows the hook dropped after the
    first pass are read again, and both passes attend to the same replayed selections."""
    records = random_records()
    config, model = moe_dsa_model()
    hook = ReplayHook(write_store(records), [model], config=config, **HOOK)
    forward_step = forward_step_of(micro_batch_inputs(records))

    def forward_backward_func(*, forward_step_func: Any, model: Any) -> None:
        sum(forward_step_func(iter(()), model[0]) for _ in MICRO_BATCHES).backward()

    def train_step(
        forward_step_func: Any,
        data_iterator: Any,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        config: Any,
        forward_backward_func: Any,
        iteration: int | None = None,
    ) -> str:
        for _ in range(2):
            forward_backward_func(forward_step_func=forward_step_func, model=model)
        return "ok"

    wrapped = hook.train_step(train_step, micro_batches=lambda iteration: MICRO_BATCHES)
    assert wrapped(forward_step, iter(()), [model], None, None, config, forward_backward_func, iteration=0) == "ok"
    assert_attends_as_stored(attention_receives[:8], records)
    assert_attends_as_stored(attention_receives[8:], records)
    hook.remove()


@pytest.mark.parametrize("indexer", ["auto", "off", "required"])
def test_a_hook_replays_the_indexer_only_where_spec_and_model_have_one(indexer: IndexerReplay) -> None:
    config, model = moe_dsa_model()
    routing_only = write_store(
        random_records(DSA_SPEC.model_copy(update={"indexer": None})), DSA_SPEC.model_copy(update={"indexer": None})
    )
    if indexer == "required":
        with pytest.raises(
            ReplayConfigError,
            match=r"indexer='required', but the model spec 'tiny-dsa' declares "
            r"no indexer: there is no indexer to replay",
        ):
            ReplayHook(routing_only, [model], config=config, indexer=indexer, **HOOK)
        from tests.test_megatron import build_chunks, megatron_config

        no_dsa = build_chunks(megatron_config())
        with pytest.raises(ReplayConfigError, match=r"indexer='required', but the model chunks hold no DSA layers"):
            ReplayHook(write_store(random_records()), no_dsa, indexer=indexer, **HOOK)
        return
    hook = ReplayHook(routing_only, [model], config=config, indexer=indexer, **HOOK)
    assert hook.indexer_replay is None, "nothing to replay from: the model's indexers select their own keys"
    hook.remove()
    hook = ReplayHook(write_store(random_records()), [model], config=config, indexer=indexer, **HOOK)
    assert (hook.indexer_replay is not None) == (indexer == "auto")
    hook.remove()


def test_a_forward_whose_indexers_never_took_the_selections_fails_the_step() -> None:
    records = random_records()
    config, model = moe_dsa_model()
    hook = ReplayHook(write_store(records), [model], config=config, **HOOK)
    ids, positions = micro_batch_inputs(records)[0]
    with pytest.raises(ReplayFidelityError, match=r"layer 1: the DSA indexer ran with no replayed selection"):
        model(ids, positions, attention_mask=None)  # a forward outside the hook's forward step

    inputs = micro_batch_inputs(records)
    turn = {"m": 0}

    def mlp_only(data_iterator: Any, chunk: Any) -> Any:
        """A forward step that embeds the tokens and routes them, but never runs attention."""
        ids, positions = inputs[turn["m"]]
        turn["m"] += 1
        hidden = chunk.embedding(input_ids=ids, position_ids=positions)
        return sum(layer.mlp(hidden)[0].sum() for layer in chunk.decoder.layers)

    hook.begin_step(0, MICRO_BATCHES)
    wrapped = hook.wrap(mlp_only)
    wrapped(iter(()), model)
    inert = r"indexer selections were handed to the DSA layers \[1, 2, 3, 4\] and no forward took them"
    with pytest.raises(ReplayFidelityError, match=inert):
        wrapped(iter(()), model)
    hook.end_step()
    hook.remove()


def test_fidelity_documents_carry_the_indexer_counts_optionally() -> None:
    """An older document (no indexer counts) reads as none; misaligned or impossible counts are refused."""
    import pydantic

    from routelog.format.documents import FidelityRecord, utc_now
    from routelog.store.fidelity import StepFidelity

    common: dict[str, Any] = {"step": 0, "writer_id": "w", "seq": 0, "created_at": utc_now(), "samples": 1}
    routing = {"layers": [1], "replayed_rows": [4], "differing_rows": [1]}
    older = FidelityRecord.model_validate({**common, **routing})
    assert older.indexer_layers == [] and StepFidelity.of(older).indexer_diff() == {}
    both = FidelityRecord(
        **common, **routing, indexer_layers=[0, 1], indexer_replayed_rows=[4, 4], indexer_differing_rows=[0, 3]
    )
    assert StepFidelity.of(both).merge(StepFidelity.of(both)).indexer_diff() == {0: 0.0, 1: 0.75}
    for wrong in (
        {"indexer_replayed_rows": [4], "indexer_differing_rows": [0, 3]},
        {"indexer_replayed_rows": [4, 2], "indexer_differing_rows": [0, 3]},
    ):
        with pytest.raises(pydantic.ValidationError, match="indexer"):
            FidelityRecord(**common, **routing, indexer_layers=[0, 1], **wrong)
