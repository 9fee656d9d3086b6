"""The sparse-attention indexer's selections (DeepSeek Sparse Attention): the model spec declares them, records
carry them, parts store them (``indexer.bin``, feature ``indexer_positions``), readers read a record's layers and
token range, and a real HF DeepSeek-V3.2-style model records them in bf16 generation and replays them in an fp32
training forward, failing closed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import routelog
from routelog import ModelSpec, Record
from routelog.errors import (
    CorruptDataError,
    FormatVersionError,
    InvalidRecordError,
    ReplayConfigError,
    ValuesNotFoundError,
)
from routelog.format import keys
from routelog.format.documents import SUPPORTED_FEATURES, parse_log_document
from routelog.format.spec import IndexerSpec

SPEC = ModelSpec(
    name="dsa", num_layers=3, moe_layers=(1, 2), num_experts=8, topk=2, indexer=IndexerSpec(index_topk=8, layers=(0, 2))
)


def _rows(rng: np.random.Generator, n: int, k: int, swaps: int = 1) -> np.ndarray:
    """Canonical rows of one layer: each query keeps its predecessor's set but ``swaps`` positions (one of them
    the query itself, when there is room)."""
    out = np.full((n, k), -1, np.int32)
    kept: set[int] = set()
    for p in range(n):
        if p + 1 <= k:
            kept = set(range(p + 1))
        else:
            kept = kept | {p}
            while len(kept) > k:
                kept.discard(int(rng.choice(sorted(kept - {p}))))
            for _ in range(swaps - 1):
                out_ = int(rng.choice(sorted(kept)))
                pool = sorted(set(range(p + 1)) - kept)
                if pool:
                    kept = (kept - {out_}) | {int(rng.choice(pool))}
        out[p, : len(kept)] = sorted(kept)
    return out


def _record(rng: np.random.Generator, sid: str, n: int) -> Record:
    ids = np.argsort(rng.random((n, 2, 8)), axis=-1)[..., :2]
    indexer = np.stack([_rows(rng, n, 8, swaps=2) for _ in range(2)], axis=1)
    indexer[-1] = -1  # the last sampled token is never fed: no selection
    return Record(sample_id=sid, expert_ids=ids, prompt_len=4, response_len=n - 4, indexer=indexer)


def test_indexer_rows_round_trip_by_layer_and_token_range(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    records = [_record(rng, f"s{i}", 40 + 7 * i) for i in range(4)]
    plain = Record(sample_id="plain", expert_ids=records[0].expert_ids, prompt_len=4, response_len=36)
    store = routelog.create_store(str(tmp_path / "run"), SPEC)
    with store.writer(0, "w") as writer:
        for record in [*records, plain]:
            writer.append(record)
    snapshot = routelog.open_store(str(tmp_path / "run")).step(0)
    for record in records:
        assert np.array_equal(snapshot.read_indexer(record.sample_id), record.indexer)
        assert np.array_equal(
            snapshot.read_indexer(record.sample_id, layers=[1], tokens=(9, 31)),
            np.asarray(record.indexer)[9:31, [1]],
        )
    with pytest.raises(ValuesNotFoundError, match="holds no indexer rows of it"):
        snapshot.read_indexer("plain")
    commit = snapshot.commits[0]
    assert commit.features == ["indexer_positions"] and commit.indexer is not None
    assert commit.indexer.n_records == 4 and commit.indexer.num_layers == 2
    assert store.verify().ok


def test_a_reader_without_the_feature_refuses_the_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = routelog.create_store(str(tmp_path / "run"), SPEC)
    with store.writer(0, "w") as writer:
        writer.append(_record(np.random.default_rng(1), "s0", 20))
    monkeypatch.setattr(routelog.format.documents, "SUPPORTED_FEATURES", SUPPORTED_FEATURES - {"indexer_positions"})
    key = f"{keys.log_dir(0)}/{keys.log_name(0)}"
    with pytest.raises(FormatVersionError, match="indexer_positions"):
        parse_log_document(store.storage.read(key), key)


@pytest.mark.parametrize(
    ("forge", "message"),
    [
        (lambda r: r.__setitem__((12, 0, 3), 13), "past the query's own position 12"),
        (lambda r: r.__setitem__((12, 0, 3), r[12, 0, 2]), "selected twice"),
        (lambda r: r.__setitem__((12, 0, 7), -1), "holds 7 positions, not min"),
        (lambda r: r.__setitem__((3, 1, 4), 3), "more than min"),
        (lambda r: r.__setitem__((12, 1, 0), 11), "not ascending"),
    ],
    ids=["beyond its row", "duplicate", "too few", "too many", "unsorted"],
)
def test_a_record_with_an_invalid_selection_is_refused_naming_sample_layer_and_position(
    tmp_path: Path, forge: Any, message: str
) -> None:
    record = _record(np.random.default_rng(2), "bad", 20)
    forge(record.indexer)
    store = routelog.create_store(str(tmp_path / "run"), SPEC)
    with store.writer(0, "w") as writer, pytest.raises(InvalidRecordError, match=message) as raised:
        writer.append(record)
    assert raised.value.sample_id == "bad" and "indexer" in raised.value.field
    assert "layer" in raised.value.field


def test_a_forged_indexer_object_is_corrupt_data_not_wrong_positions(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    store = routelog.create_store(url, SPEC)
    record = _record(np.random.default_rng(3), "s0", 30)
    with store.writer(0, "w") as writer:
        writer.append(record)
    commit = store.step(0).commits[0]
    path = tmp_path / "run" / keys.part_dir(0, commit.part) / "indexer.bin"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # a bit of the last block
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match="crc32c"):
        routelog.open_store(url).step(0).read_indexer("s0")
    assert not routelog.open_store(url).verify().ok


def test_the_spec_derives_computing_and_shared_layers_from_hf_configs() -> None:
    base = {"num_hidden_layers": 6, "n_routed_experts": 8, "num_experts_per_tok": 2, "index_topk": 2048}
    v32 = ModelSpec.from_hf_config({"model_type": "deepseek_v32", **base})
    assert v32.indexer == IndexerSpec(index_topk=2048, layers=(0, 1, 2, 3, 4, 5))
    glm = ModelSpec.from_hf_config({"model_type": "glm_moe_dsa", "index_topk_freq": 2, **base})
    assert glm.indexer is not None and (glm.indexer.layers, glm.indexer.shared) == ((0, 1, 3, 5), (2, 4))
    assert [glm.indexer.source_of(layer) for layer in range(6)] == [0, 1, 1, 2, 2, 3]
    pattern = ModelSpec.from_hf_config({"model_type": "glm_moe_dsa", "index_topk_pattern": "FFSFSS", **base})
    assert pattern.indexer is not None and pattern.indexer.shared == (2, 4, 5)
    with pytest.raises(routelog.ModelSpecError, match="index_topk"):
        ModelSpec.from_hf_config({"model_type": "deepseek_v32", **base, "index_topk": 1 << 20})
    run = json.loads(v32.model_dump_json())
    assert ModelSpec.model_validate(run) == v32


# -- a real HF DeepSeek-V3.2-style model ------------------------------------------------------------------------
HF_CONFIG = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "n_group": 2,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "qk_nope_head_dim": 16,
    "index_topk": 8,
    "index_head_dim": 32,
    "index_n_heads": 4,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}


def test_a_hf_dsa_model_records_in_bf16_and_replays_in_fp32_exactly(tmp_path: Path) -> None:
    """bf16 generation records routers and indexers; an fp32 training forward's own indexers pick other
    positions; with replay every indexer installs exactly the stored selection (read back from the store), and the
    replay refuses another batch's tokens and never leaves the block inert."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from routelog.engines import hf, hf_indexer

    torch.manual_seed(0)
    config = transformers.DeepseekV32Config(**HF_CONFIG)
    model = transformers.DeepseekV32ForCausalLM(config).eval()
    spec = ModelSpec.from_hf_config({"model_type": "deepseek_v32", **HF_CONFIG})
    assert spec.indexer is not None
    prompts = torch.randint(3, 128, (2, 20))
    mask = torch.ones_like(prompts)
    mask[1, :5] = 0  # left padding
    generator = model.to(torch.bfloat16)
    with hf.RoutingRecorder(generator, spec) as routing, hf_indexer.IndexerRecorder(generator, spec) as indexer:
        out = generator.generate(
            prompts, attention_mask=mask, max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=2
        )
    records = indexer.attach(routing.records(prompts, mask, out, sample_ids=["a", "b"]), mask)
    store = routelog.create_store(str(tmp_path / "run"), spec)
    with store.writer(0, "w") as writer:
        for record in records:
            writer.append(record)
    snapshot = routelog.open_store(str(tmp_path / "run")).step(0)
    stored = [
        Record(
            sample_id=r.sample_id,
            expert_ids=r.expert_ids,
            prompt_len=r.prompt_len,
            response_len=r.response_len,
            token_ids=r.token_ids,
            indexer=snapshot.read_indexer(r.sample_id),
        )
        for r in records
    ]
    assert all(np.array_equal(s.indexer, r.indexer) for s, r in zip(stored, records, strict=True))

    trainer = model.to(torch.float32)
    full_mask = torch.cat([mask, torch.ones(2, out.shape[1] - prompts.shape[1], dtype=mask.dtype)], dim=1)

    def own_selections() -> dict[int, Any]:
        with hf_indexer.IndexerRecorder(trainer, spec) as recorder, torch.no_grad():
            trainer(out, attention_mask=full_mask)
        return {layer: calls[0] for layer, calls in recorder.calls.items()}

    wanted = hf_indexer.replay_rows(stored, full_mask, spec)
    native = own_selections()
    differ = sum(int((np.sort(native[layer], -1) != np.sort(wanted[layer], -1)).any(-1).sum()) for layer in wanted)
    with hf_indexer.replay(trainer, spec, wanted, out, stored):
        captured: dict[int, Any] = {}
        hooks = [
            module.register_forward_hook(lambda m, a, o, layer=layer: captured.setdefault(layer, o.clone()))
            for layer, module in hf_indexer.find_indexers(trainer, spec).items()
        ]
        try:
            with torch.no_grad():
                trainer(out, attention_mask=full_mask)
        finally:
            for hook in hooks:
                hook.remove()
    # Hooks run in the order they were registered: these see what the replay's hook returned.
    assert set(captured) == set(spec.indexer.layers)
    for layer in spec.indexer.layers:
        assert np.array_equal(captured[layer].numpy(), wanted[layer]), f"layer {layer} did not attend as recorded"
    print(f"queries whose fp32 selection differs from the bf16 recording without replay: {differ}")

    with (
        pytest.raises(ReplayConfigError, match="does not hold the tokens"),
        hf_indexer.replay(trainer, spec, wanted, out.flip(0), stored),
    ):
        pass
    with pytest.raises(ReplayConfigError, match="never ran"), hf_indexer.replay(trainer, spec, wanted, out, stored):
        pass
