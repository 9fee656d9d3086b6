"""Write the golden fixture stores of this format version under ``tests/fixtures/golden-v<N>/``.

Golden stores are written once per format version and committed; every later routelog must still read them
(``tests/test_golden.py``). Never regenerate an existing version's fixtures: add a new version's instead.

    python tools/make_golden.py [--force | --add NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import routelog
from routelog import ModelSpec, PartOptions, Record, Segment
from routelog.format.limits import FORMAT_VERSION
from routelog.testing import before_first_log_create

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / f"golden-v{FORMAT_VERSION}"


def _routing(rng: np.random.Generator, tokens: int, layers: int, experts: int, k: int) -> np.ndarray:
    return np.argsort(rng.random((tokens, layers, experts)), axis=-1)[..., :k]


def _last_missing(sample_id: str, ids: np.ndarray, prompt_len: int, token_ids: Any, **fields: Any) -> Record:
    """A record of ``ids`` whose final token's routing is missing (never computed), as engines return them."""
    valid = np.ones(len(ids), bool)
    valid[-1] = False
    return Record(
        sample_id=sample_id,
        expert_ids=ids,
        prompt_len=prompt_len,
        response_len=len(ids) - prompt_len,
        valid=valid,
        token_ids=token_ids,
        **fields,
    )


def _expect_sorted(expected: dict[str, np.ndarray], store: str, record: Record) -> None:
    """What a reader must return for ``record`` written with sorted sets: ascending rows, -1 where missing."""
    valid = np.asarray(record.valid)
    ids = np.sort(np.asarray(record.expert_ids), axis=-1).astype(np.int16)
    ids[~valid] = -1
    expected[f"{store}/{record.sample_id}/ids"] = ids
    expected[f"{store}/{record.sample_id}/valid"] = valid


def write_dense_first(root: Path, expected: dict[str, np.ndarray]) -> None:
    """DeepSeek-V3 style (3 dense layers, E=64, K=6), two steps, several parts, missing rows, multi-turn segments."""
    spec = ModelSpec.from_hf_config(
        {
            "model_type": "deepseek_v3",
            "num_hidden_layers": 7,
            "first_k_dense_replace": 3,
            "n_routed_experts": 64,
            "num_experts_per_tok": 6,
            "n_group": 8,
            "topk_group": 4,
            "_name_or_path": "golden/dense-first",
        }
    )
    rng = np.random.default_rng(2026)
    url = str(root / "dense-first")
    options = PartOptions(chunk_rows=32, chunk_layers=3)
    for step in (0, 1):
        with routelog.open_writer(
            url,
            step,
            model_spec=spec,
            writer_id=f"rollout-{step}",
            options=options,
            flush_bytes=3000,
            run_id="golden-dense-first",
            config={"purpose": "golden fixture"},
        ) as writer:
            for i in range(5):
                tokens = 20 + 13 * i
                ids = _routing(rng, tokens, spec.num_moe_layers, spec.num_experts, spec.topk)
                valid = np.ones(tokens, bool)
                valid[-1] = False
                if i == 3:
                    valid[8:11] = False  # a tool observation never prefilled
                record = Record(
                    sample_id=f"step{step}/req-{i}/0",
                    expert_ids=ids,
                    prompt_len=8,
                    response_len=tokens - 8,
                    valid=valid,
                    token_ids=rng.integers(0, 50000, tokens),
                    group_id=f"group-{i // 2}",
                    policy_version=step,
                    engine="vllm",
                    engine_version="0.22.0",
                    segments=[
                        Segment(start=0, end=8, policy_version=step, source="prompt"),
                        Segment(start=8, end=tokens, policy_version=step, source="response"),
                    ],
                    extra={"reward": float(i) / 4},
                )
                writer.append(record)
                _expect_sorted(expected, "dense-first", record)


def write_wide(root: Path, expected: dict[str, np.ndarray]) -> None:
    """Kimi-K2 style width (E=384 > 256: uint16 byte planes), score order kept, one step."""
    spec = ModelSpec(name="golden/wide", num_layers=3, moe_layers=(1, 2), num_experts=384, topk=8)
    rng = np.random.default_rng(384)
    url = str(root / "wide")
    with routelog.open_writer(
        url, 0, model_spec=spec, writer_id="w", options=PartOptions(topk_order="score"), run_id="golden-wide"
    ) as writer:
        for i in range(3):
            tokens = 17 + i
            ids = _routing(rng, tokens, 2, 384, 8)
            writer.append(Record(sample_id=f"wide-{i}", expert_ids=ids, prompt_len=5, response_len=tokens - 5))
            expected[f"wide/wide-{i}/ids"] = ids.astype(np.int16)
            expected[f"wide/wide-{i}/valid"] = np.ones(tokens, bool)


def _skewed_routing(rng: np.random.Generator, tokens: int, layers: int, experts: int, k: int) -> np.ndarray:
    """Sets drawn from skewed per-layer popularity, a third of the tokens repeating the previous token's set."""
    out = np.empty((tokens, layers, k), np.int64)
    for j in range(layers):
        popularity = rng.dirichlet(np.full(experts, 0.3))
        for t in range(tokens):
            repeat = t > 0 and rng.random() < 0.33
            out[t, j] = out[t - 1, j] if repeat else rng.choice(experts, size=k, replace=False, p=popularity)
    return out


def write_grpo_groups(root: Path, expected: dict[str, np.ndarray]) -> None:
    """Format 2: GRPO groups whose prompts are stored once (one sample's prompt routed differently from token 10
    on, so only its first 10 tokens are shared), skewed routing with repeats (ranked layers), E = 96 and E = 384
    (uint16) in two stores, several parts and edge chunks."""
    for experts in (96, 384):
        spec = ModelSpec(
            name=f"golden/grpo-{experts}", num_layers=5, moe_layers=(1, 2, 3, 4), num_experts=experts, topk=4
        )
        rng = np.random.default_rng(experts)
        name = f"grpo-{experts}"
        with routelog.open_writer(
            str(root / name),
            0,
            model_spec=spec,
            writer_id="rollout",
            options=PartOptions(chunk_rows=64, chunk_layers=3),
            flush_bytes=4000,
            run_id=f"golden-{name}",
        ) as writer:
            for group in range(3):
                prompt = rng.integers(0, 50000, 40)
                prompt_routing = _skewed_routing(rng, 40, 4, experts, 4)
                for sample in range(4):
                    tokens = 40 + int(rng.integers(10, 30))
                    ids = _skewed_routing(rng, tokens, 4, experts, 4)
                    ids[:40] = prompt_routing
                    if group == 1 and sample == 2:
                        ids[10:40] = _skewed_routing(rng, 30, 4, experts, 4)  # batch-variant numerics
                    token_ids = np.concatenate([prompt, rng.integers(0, 50000, tokens - 40)])
                    record = _last_missing(f"g{group}/{sample}", ids, 40, token_ids, group_id=f"g{group}")
                    writer.append(record)
                    _expect_sorted(expected, name, record)


def write_shared_weights(root: Path, expected: dict[str, np.ndarray]) -> None:
    """Format 2: routing weights (bf16 from one writer, float32 from the other, and records without any) and
    prompts shared across parts and across writers (spans naming another part)."""
    spec = ModelSpec(name="golden/shared-weights", num_layers=3, moe_layers=(0, 1, 2), num_experts=32, topk=4)
    rng = np.random.default_rng(32)
    name = "shared-weights"
    prompts = [(rng.integers(0, 50000, 30), _routing(rng, 30, 3, 32, 4)) for _ in range(2)]
    gates = [rng.random((30, 3, 4)).astype(np.float32) for _ in range(2)]
    for writer_id, dtype in (("worker-a", "bfloat16"), ("worker-b", "float32")):
        options = PartOptions(chunk_rows=32, chunk_layers=2, weights_dtype=dtype)  # type: ignore[arg-type]
        with routelog.open_writer(
            str(root / name), 0, model_spec=spec, writer_id=writer_id, options=options, run_id=f"golden-{name}"
        ) as writer:
            for group, ((prompt, prompt_routing), gate) in enumerate(zip(prompts, gates, strict=True)):
                for sample in range(3):
                    tokens = 30 + int(rng.integers(5, 20))
                    ids = _routing(rng, tokens, 3, 32, 4)
                    ids[:30] = prompt_routing
                    weights = rng.random((tokens, 3, 4)).astype(np.float32)
                    weights[:30] = gate
                    valid = np.ones(tokens, bool)
                    valid[-1] = False
                    record = Record(
                        sample_id=f"{writer_id}/g{group}/{sample}",
                        expert_ids=ids,
                        prompt_len=30,
                        response_len=tokens - 30,
                        valid=valid,
                        token_ids=np.concatenate([prompt, rng.integers(0, 50000, tokens - 30)]),
                        group_id=f"g{group}",
                        weights=None if sample == 2 else weights,
                    )
                    writer.append(record)
                    writer.flush()  # one part per record: every later sample points into an earlier part
                    _expect_sorted(expected, name, record)
                    stored = np.full(weights.shape, np.nan, np.float32)
                    if record.weights is not None:
                        order = np.argsort(ids, axis=-1)
                        stored = np.take_along_axis(weights, order, -1)
                        if dtype == "bfloat16" and (writer_id, sample) != ("worker-b", 0):
                            stored = _bf16(stored)
                    stored[~valid] = np.nan
                    expected[f"{name}/{record.sample_id}/weights"] = stored


def write_layer_shards(root: Path, expected: dict[str, np.ndarray]) -> None:
    """Format 2 with ``shard_layers``: each array split into shards along its layers (7 MoE layers in shards of 4,
    the last one padded), uint16 IDs (E = 300), float32 weights, and a prompt shared within the part."""
    spec = ModelSpec(name="golden/layer-shards", num_layers=8, moe_layers=tuple(range(1, 8)), num_experts=300, topk=4)
    rng = np.random.default_rng(7)
    name = "layer-shards"
    options = PartOptions(chunk_rows=16, chunk_layers=2, shard_layers=4, weights_dtype="float32")
    prompt, prompt_routing = rng.integers(0, 50000, 20), _routing(rng, 20, 7, 300, 4)
    with routelog.open_writer(
        str(root / name), 0, model_spec=spec, writer_id="w", options=options, run_id=f"golden-{name}"
    ) as writer:
        for sample in range(3):
            tokens = 20 + int(rng.integers(3, 30))
            ids = _routing(rng, tokens, 7, 300, 4)
            ids[:20] = prompt_routing
            weights = rng.random((tokens, 7, 4)).astype(np.float32)
            valid = np.ones(tokens, bool)
            valid[-1] = False
            record = Record(
                sample_id=f"s{sample}",
                expert_ids=ids,
                prompt_len=20,
                response_len=tokens - 20,
                valid=valid,
                token_ids=np.concatenate([prompt, rng.integers(0, 50000, tokens - 20)]),
                weights=weights,
            )
            writer.append(record)
            _expect_sorted(expected, name, record)
            stored = np.take_along_axis(weights, np.argsort(ids, axis=-1), -1)
            stored[~valid] = np.nan
            expected[f"{name}/{record.sample_id}/weights"] = stored


def write_dictionaries(root: Path, expected: dict[str, np.ndarray]) -> None:
    """Chunk payload version 2: routing decided by the token (each token id of a small, skewed vocabulary takes its
    own set per layer, a tenth of the tokens routed afresh), so sets recur out of order and layers keep
    dictionaries; rows of eight uint8 IDs, of six, and uint16 IDs, in three stores."""
    for experts, k in ((64, 8), (64, 6), (300, 8)):
        spec = ModelSpec(
            name=f"golden/dict-{experts}-{k}", num_layers=3, moe_layers=(0, 1, 2), num_experts=experts, topk=k
        )
        rng = np.random.default_rng(experts * 10 + k)
        name = f"dictionaries-{experts}-{k}"
        vocabulary = _routing(rng, 700, 3, experts, k)
        with routelog.open_writer(
            str(root / name),
            0,
            model_spec=spec,
            writer_id="rollout",
            options=PartOptions(chunk_rows=1024, chunk_layers=2),
            run_id=f"golden-{name}",
        ) as writer:
            for sample in range(4):
                tokens = int(rng.integers(600, 900))
                token_ids = np.minimum(rng.zipf(1.2, tokens) - 1, len(vocabulary) - 1)
                ids = vocabulary[token_ids]
                fresh = rng.random(tokens) < 0.1
                ids[fresh] = _routing(rng, int(fresh.sum()), 3, experts, k)
                record = Record(
                    sample_id=f"s{sample}",
                    expert_ids=ids,
                    prompt_len=100,
                    response_len=tokens - 100,
                    valid=np.ones(tokens, bool),
                    token_ids=token_ids,
                )
                writer.append(record)
                _expect_sorted(expected, name, record)


def write_history(root: Path, expected: dict[str, np.ndarray], name: str = "history") -> None:
    """Format 3: a step's log with every kind of entry. Two writers' parts sharing a prompt; a race on one sample
    id (the later copy shadowed); drops by sample, by part and by writer, each followed by the same id written again
    (live: a drop removes only what precedes it); per-token values in parts and an annotation; the seal, a drop
    after it, and the upload of a writer whose commit met the seal (refused: its part is an orphan)."""
    import threading

    spec = ModelSpec(name="golden/history", num_layers=4, moe_layers=(1, 2, 3), num_experts=48, topk=4)
    rng = np.random.default_rng(48)
    url = str(root / name)
    store = routelog.create_store(url, spec, run_id=f"golden-{name}")
    prompt = rng.integers(0, 1000, 24)
    prompt_routing = _routing(rng, 24, 3, 48, 4)

    def record(sample_id: str, response: int, seed: int) -> Record:
        local = np.random.default_rng(seed)
        ids = np.concatenate([prompt_routing, _routing(local, response, 3, 48, 4)])
        valid = np.ones(24 + response, bool)
        valid[-1] = False
        return Record(
            sample_id=sample_id,
            expert_ids=ids,
            prompt_len=24,
            response_len=response,
            valid=valid,
            token_ids=np.concatenate([prompt, local.integers(1000, 2000, response)]),
            token_values={"logprob_infer": -local.random(24 + response).astype(np.float32)},
        )

    live: dict[str, Record] = {}

    def write(writer_id: str, records: list[Record]) -> None:
        with store.writer(0, writer_id, flush_bytes=1 << 30) as writer:
            for r in records:
                writer.append(r)
        live.update({r.sample_id: r for r in records})

    write("alpha", [record("a", 8, 1), record("b", 9, 2), record("c", 7, 3)])
    write("beta", [record("d", 6, 4), record("e", 10, 5)])  # its prompt rows point into alpha's part
    raced = record("r", 5, 6)
    both_built = threading.Barrier(2, timeout=60)
    racers = []
    for writer_id in ("gamma", "delta"):  # both decide to write "r" before either commits: one copy is shadowed
        racer = routelog.open_store(url)
        before_first_log_create(racer.storage, both_built.wait)
        writer = racer.writer(0, writer_id, background=False)
        writer.append(raced)
        racers.append(writer)
    threads = [threading.Thread(target=w.close) for w in racers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    live["r"] = raced
    store.drop(0, sample_ids=["b"], reason="golden: a drop by sample")
    write("alpha", [record("b", 4, 7)])  # written again after its drop, with other tokens: live
    beta = next(c.part for c in store.step(0).commits if c.writer_id == "beta")
    store.drop(0, parts=[beta], reason="golden: a drop by part (alpha's rows stay shared)")
    for sid in ("d", "e"):
        del live[sid]
    write("beta", [record("d", 6, 4)])  # the same record again: live, the dropped part's copy is not
    with store.annotate(0, "trainer") as annotator:
        for sid in ("a", "c"):
            annotator.add(sid, {"logprob_train": np.zeros(live[sid].prompt_len + live[sid].response_len, np.float32)})
    late_store = routelog.open_store(url)
    at_commit, sealed = threading.Event(), threading.Event()
    original_create = late_store.storage.create

    def after_the_seal(key: str, data: bytes) -> bool:
        if "/log/" in key:
            at_commit.set()
            sealed.wait(60)
        return original_create(key, data)

    late_store.storage.create = after_the_seal  # type: ignore[method-assign]
    late = late_store.writer(0, "late", background=False)
    late.append(record("z", 3, 8))
    closing = threading.Thread(target=_close, args=(late,))
    closing.start()
    at_commit.wait(60)  # uploaded before the seal started, it meets the seal at its commit: refused
    store.seal(0)
    sealed.set()
    closing.join()
    store.drop(0, writers=["gamma", "delta"], reason="golden: a drop by writer after the seal")
    del live["r"]
    for r in live.values():
        _expect_sorted(expected, name, r)
        assert r.token_values is not None
        expected[f"{name}/{r.sample_id}/logprob_infer"] = np.asarray(r.token_values["logprob_infer"], np.float32)
        if r.sample_id in ("a", "c"):
            expected[f"{name}/{r.sample_id}/logprob_train"] = np.zeros(r.prompt_len + r.response_len, np.float32)


def write_archived(root: Path, expected: dict[str, np.ndarray]) -> None:
    """Revision 4.2: the ``history`` store's step (every kind of entry, a shadowed copy, a part dropped whole whose
    rows a live record reads, values in parts and an annotation) archived after its seal, then its original parts
    and the seal's consolidated copies reclaimed by gc, and a drop by part after the archive naming an original
    part (its records go; the archive part stays)."""
    name = "archived"
    write_history(root, expected, name)
    store = routelog.open_store(str(root / name))
    store.archive(0)
    store.gc(3600, delete=True, now=store.storage.clock() + 7200)
    dropped = next(c for c in store.step(0).commits if c.writer_id == "beta")
    snapshot = store.step(0)
    gone = [sid for sid in snapshot.sample_ids if snapshot.to_arrow([sid]).column("part")[0].as_py() == dropped.part]
    store.drop(0, parts=[dropped.part], reason="golden: a drop by part after the archive")
    for sid in gone:
        for key in [k for k in expected if k.startswith(f"{name}/{sid}/")]:
            del expected[key]


def write_context(root: Path, expected: dict[str, np.ndarray], prefix: str = "context") -> None:
    """Revision 3.1, the ``ranked_context`` transform: routing decided by the token (a Zipf vocabulary, each id
    with a preferred set per layer) or by the layer below (a few sets, mapped up the layers), two writers whose
    prompts are shared across parts, the first writer's first part dropped whole while the other's records still
    read its rows, records without token ids and rows missing; uint8 and uint16 IDs (E = 64, K = 8; E = 300, K = 6)
    in two stores, several parts, edge chunks (rows and layers) and two shards. Written with chunks of version 1
    (their escapes a format-2 chunk)."""
    for experts, k in ((64, 8), (300, 6)):
        spec = ModelSpec(
            name=f"golden/{prefix}-{experts}-{k}",
            num_layers=6,
            moe_layers=(1, 2, 3, 4, 5),
            num_experts=experts,
            topk=k,
        )
        rng = np.random.default_rng(experts * 7 + k)
        name = f"{prefix}-{experts}-{k}"
        url = str(root / name)
        store = routelog.create_store(url, spec, run_id=f"golden-{name}")
        options = PartOptions(transform="ranked_context", chunk_rows=48, chunk_layers=2, shard_layers=4)
        vocabulary = 40
        follows = [rng.permutation(experts) for _ in spec.moe_layers]  # a layer's set mostly maps the set below
        pool = _routing(rng, 6, 1, experts, k)[:, 0]
        routing = functools.partial(_chained_routing, rng, spec, pool, follows)
        prompts = [np.minimum(rng.zipf(1.3, 30) - 1, vocabulary - 1) for _ in range(3)]
        prompt_routing = [routing(p) for p in prompts]
        live: dict[str, Record] = {}
        for writer_id, group in (("alpha", 0), ("alpha", 1), ("beta", 0), ("beta", 2)):
            with store.writer(0, writer_id, options=options, flush_bytes=5000) as writer:
                for sample in range(3):
                    tokens = 30 + int(rng.integers(20, 60))
                    response = np.minimum(rng.zipf(1.3, tokens - 30) - 1, vocabulary - 1)
                    token_ids = np.concatenate([prompts[group], response])
                    ids = np.concatenate([prompt_routing[group], routing(response)])
                    without = sample == 2 and group == 2  # a record without token ids
                    record = _last_missing(f"{writer_id}/{group}/{sample}", ids, 30, None if without else token_ids)
                    writer.append(record)
                    live[record.sample_id] = record
        snapshot = store.step(0)
        first = next(c for c in snapshot.commits if c.writer_id == "alpha")
        store.drop(0, parts=[first.part], reason="golden: a part dropped whole whose prompt rows beta still reads")
        for sid in store.step(0).index.column("sample_id").to_pylist():
            _expect_sorted(expected, name, live[sid])


def write_context_escapes(root: Path, expected: dict[str, np.ndarray]) -> None:
    """Revision 3.2: :func:`write_context`'s stores again, now with chunks of version 2 (each layer's escaped rows
    range-coded, the commits naming ``context_escapes``)."""
    write_context(root, expected, prefix="escapes")


def write_context_references(root: Path, expected: dict[str, np.ndarray]) -> None:
    """Revision 3.3: :func:`write_context`'s stores again, now with chunks of version 3 (each escaped row range-coded
    against a reference among its candidates, the commits naming ``context_references``) and lists of the sets used
    three times, in the order the rows name them by place."""
    write_context(root, expected, prefix="references")


def write_context_list_references(root: Path, expected: dict[str, np.ndarray]) -> None:
    """Revision 3.4: :func:`write_context`'s stores again, now with chunks of version 4 (an escaped row may take any
    listed set as its reference) and models of version 4 (candidate tables range-coded), the commits naming
    ``context_list_references``; streams end without their trailing zero bytes."""
    write_context(root, expected, prefix="list-references")


def write_split_token_ids(root: Path, expected: dict[str, np.ndarray]) -> None:
    """Revision 3.2 indexes: the token ids stored as byte planes (Parquet ``BYTE_STREAM_SPLIT``), ids of a
    Zipf-distributed 150k vocabulary (three bytes used) and of an id near 2^31; ``ranked_context`` parts, whose
    chunks decode only with the right token ids, two parts and a record without token ids. The token ids read
    back are expected too."""
    from routelog.synth import token_dependent_routing

    spec = ModelSpec(name="golden/split-token-ids", num_layers=4, moe_layers=(1, 2, 3), num_experts=64, topk=8)
    rng = np.random.default_rng(150_000)
    name = "split-token-ids"
    store = routelog.create_store(str(root / name), spec, run_id=f"golden-{name}")
    options = PartOptions(transform="ranked_context", chunk_rows=64, chunk_layers=2)
    with store.writer(0, "alpha", options=options, flush_bytes=6000) as writer:
        for sample in range(6):
            tokens = np.minimum(rng.zipf(1.2, int(rng.integers(40, 90))) - 1, 149_999)
            if sample == 1:
                tokens[3] = 2**31 - 2
            ids = token_dependent_routing(rng, tokens, spec)
            record = _last_missing(f"split/{sample}", ids, 20, None if sample == 4 else tokens)
            writer.append(record)
            _expect_sorted(expected, name, record)
            if record.token_ids is not None:
                expected[f"{name}/{record.sample_id}/tokens"] = np.asarray(record.token_ids, np.int64)


def _chained_routing(
    rng: np.random.Generator, spec: ModelSpec, pool: np.ndarray, follows: list[np.ndarray], token_ids: np.ndarray
) -> np.ndarray:
    """Half the tokens take their id's preferred sets; the others start from one of the ``pool``'s sets in the first
    layer, and in each layer above mostly take the map (``follows``) of their set below."""
    from routelog.synth import token_dependent_routing

    ids = token_dependent_routing(rng, token_ids, spec)
    chained = rng.random(ids.shape[0]) < 0.5
    ids[chained, 0] = pool[rng.integers(0, len(pool), int(chained.sum()))]
    for layer in range(1, ids.shape[1]):
        mapped = chained & (rng.random(ids.shape[0]) < 0.9)
        ids[mapped, layer] = follows[layer][ids[mapped, layer - 1]]
    return ids


def write_committers(root: Path, expected: dict[str, np.ndarray]) -> None:
    """Format 4: commit entries of many commits. Eight writers of one shared committer whose creates are slow (so
    the parts that wait share an entry), GRPO prompts spread over writers (their rows shared across writers through
    the digests' probes), a re-send of a committed record (shadowed), a writer through its own committer between
    two entries, a drop and the seal; two steps."""
    import threading
    import time

    from routelog.store.committer import Committer

    spec = ModelSpec(name="golden/committers", num_layers=3, moe_layers=(1, 2), num_experts=40, topk=4)
    rng = np.random.default_rng(40)
    name = "committers"
    url = str(root / name)
    store = routelog.create_store(url, spec, run_id="golden-committers")
    committer_store = routelog.open_store(url)
    create = committer_store.storage.create

    def slow_create(key: str, data: bytes, **options: bool) -> bool:
        time.sleep(0.2)
        return bool(create(key, data, **options))

    committer_store.storage.create = slow_create  # type: ignore[method-assign]
    committer = Committer(committer_store, committer_id="golden-committer")
    prompts = [(rng.integers(0, 30000, 20), _routing(rng, 20, 2, 40, 4)) for _ in range(3)]

    def record(sample_id: str, prompt: int, seed: int) -> Record:
        local = np.random.default_rng(seed)
        tokens, routing = prompts[prompt]
        response = int(local.integers(5, 15))
        ids = np.concatenate([routing, _routing(local, response, 2, 40, 4)])
        token_ids = np.concatenate([tokens, local.integers(30000, 40000, response)])
        return _last_missing(sample_id, ids, 20, token_ids, group_id=f"p{prompt}")

    live: dict[tuple[int, str], Record] = {}
    for step in (0, 1):
        writers = [
            store.writer(step, f"w{i}", background=False, flush_bytes=1 << 30, committer=committer) for i in range(8)
        ]
        for i, writer in enumerate(writers):
            for k in range(2):
                r = record(f"t{step}-s{i}-{k}", (i + k) % 3, 100 * step + 10 * i + k)
                writer.append(r)
                live[(step, r.sample_id)] = r
        start = threading.Barrier(len(writers), timeout=60)

        def close(writer: routelog.StepWriter, start: threading.Barrier = start) -> None:
            start.wait()
            writer.close()

        threads = [threading.Thread(target=close, args=(w,)) for w in writers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with store.writer(step, "own") as writer:  # its own committer; and a re-send, found present (shadowed)
            writer.append(live[(step, f"t{step}-s3-1")])
            r = record(f"t{step}-own", 1, 1000 + step)
            writer.append(r)
            live[(step, r.sample_id)] = r
    store.drop(1, sample_ids=["t1-s5-0"])
    del live[(1, "t1-s5-0")]
    store.seal(0)
    for r in live.values():
        _expect_sorted(expected, name, r)
        expected[f"{name}/{r.sample_id}/tokens"] = np.asarray(r.token_ids)


def write_indexer(root: Path, expected: dict[str, np.ndarray]) -> None:
    """Revision 4.1: sparse-attention indexer rows (feature ``indexer_positions``). A GLM-5-style spec (a shared
    layer, stored through its source), records of several lengths across keyframes, a missing row, a record
    without indexer rows in the same part, and a second part; one step, sealed."""
    from routelog.format.spec import IndexerSpec

    spec = ModelSpec(
        name="golden/indexer",
        num_layers=4,
        moe_layers=(1, 2, 3),
        num_experts=16,
        topk=2,
        indexer=IndexerSpec(index_topk=12, layers=(0, 1, 3), shared=(2,)),
    )
    rng = np.random.default_rng(41)
    name = "indexer"
    store = routelog.create_store(str(root / name), spec, run_id="golden-indexer")

    def selections(n: int) -> np.ndarray:
        rows = np.full((n, 12), -1, np.int32)
        kept: set[int] = set()
        for p in range(n):
            if p + 1 <= 12:
                kept = set(range(p + 1))
            else:
                kept |= {p}
                while len(kept) > 12:
                    kept.discard(int(rng.choice(sorted(kept))))
            rows[p, : len(kept)] = sorted(kept)
        return rows

    for part, lengths in enumerate(((9, 40, 300), (700,))):
        with store.writer(0, f"w{part}") as writer:
            for i, n in enumerate(lengths):
                ids = _routing(rng, n, 3, 16, 2)
                indexer = np.stack([selections(n) for _ in range(3)], axis=1)
                indexer[-1] = -1  # the last sampled token: never fed
                sid = f"p{part}-r{i}"
                r = _last_missing(sid, ids, 4, rng.integers(0, 1000, n), indexer=indexer)
                writer.append(r)
                _expect_sorted(expected, name, r)
                expected[f"{name}/{sid}/indexer"] = indexer
            if part == 0:
                plain = _last_missing("p0-plain", _routing(rng, 20, 3, 16, 2), 4, rng.integers(0, 1000, 20))
                writer.append(plain)
                _expect_sorted(expected, name, plain)
    store.seal(0)


def _close(writer: routelog.StepWriter) -> None:
    """Close a writer whose commit is refused (its records are not part of the step)."""
    with contextlib.suppress(routelog.StoreError):
        writer.close()


def _bf16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (nearest even), as float32: what a bf16 store gives back."""
    bits = values.view(np.uint32)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


WRITERS: dict[str, Callable[[Path, dict[str, np.ndarray]], None]] = {
    "dense-first": write_dense_first,
    "wide": write_wide,
    "grpo-96,grpo-384": write_grpo_groups,
    "shared-weights": write_shared_weights,
    "layer-shards": write_layer_shards,
    "dictionaries-64-8,dictionaries-64-6,dictionaries-300-8": write_dictionaries,
    "history": write_history,
    "context-64-8,context-300-6": write_context,
    "escapes-64-8,escapes-300-6": write_context_escapes,
    "split-token-ids": write_split_token_ids,
    "references-64-8,references-300-6": write_context_references,
    "list-references-64-8,list-references-300-6": write_context_list_references,
    "committers": write_committers,
    "indexer": write_indexer,
    "archived": write_archived,
}
"""Fixture stores by name, in the order they were added."""
WRITTEN_IN: dict[int, tuple[str, ...]] = {
    3: tuple(name for name in WRITERS if name not in ("committers", "indexer", "archived")),
    4: ("history", "grpo-96,grpo-384", "committers", "indexer", "archived"),
}
"""The stores each format version's fixtures hold: a version whose parts are unchanged writes again only what its
documents change (format 4: the log, its commit entries and digests)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="replace existing fixtures of this version")
    parser.add_argument(
        "--add", metavar="NAME", help="write only this (new) store into the existing fixtures: " + ", ".join(WRITERS)
    )
    args = parser.parse_args()
    expected: dict[str, np.ndarray] = {}
    if args.add:
        if args.add not in WRITERS or any((FIXTURES / name).exists() for name in args.add.split(",")):
            print(f"--add takes the name of a store not written yet: {', '.join(WRITERS)}")
            return 1
        with np.load(FIXTURES / "expected.npz", allow_pickle=False) as existing:
            expected.update(existing)
        WRITERS[args.add](FIXTURES, expected)
    else:
        if FIXTURES.exists():
            if not args.force:
                print(f"{FIXTURES} exists; golden fixtures are never regenerated (use --force only before release)")
                return 1
            shutil.rmtree(FIXTURES)
        FIXTURES.mkdir(parents=True)
        for name in WRITTEN_IN[FORMAT_VERSION]:
            WRITERS[name](FIXTURES, expected)
    np.savez_compressed(FIXTURES / "expected.npz", **expected)  # type: ignore[arg-type]
    print(f"wrote {FIXTURES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
