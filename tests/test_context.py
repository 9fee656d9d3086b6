"""The ranked_context chunk codec (routelog.format.context): models, chunks, their compiled and Python passes, forged
and stores written with ``transform="ranked_context"`` read back exactly."""

from __future__ import annotations

import dataclasses
import math
import shutil
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import routelog
from routelog import ModelSpec, PartOptions, Record
from routelog.errors import CorruptDataError, FormatVersionError
from routelog.format import context, context_python, keys, ranked
from routelog.format.codec import storage_dtype
from routelog.store import blocks
from routelog.store.summary import store_summary
from routelog.store.verify import verify_store
from routelog.synth import random_topk, token_dependent_routing, zipf_token_ids

COMPILED = context._COMPILED is not None
needs_compiled = pytest.mark.skipif(not COMPILED, reason="the compiled set-context passes were not built")


def _part(
    rng: np.random.Generator, layers: int, rows: int, experts: int, k: int, vocab: int, share: float = 0.6
) -> tuple[np.ndarray, np.ndarray]:
    """Layer-major sorted rows ``[layers, rows, k]`` of token-dependent routing, and the rows' token ids (a tenth
    without one: -1)."""
    spec = ModelSpec(name="t", num_layers=layers, moe_layers=tuple(range(layers)), num_experts=experts, topk=k)
    tokens = zipf_token_ids(rng, rows, vocab).astype(np.int64)
    ids = np.sort(token_dependent_routing(rng, tokens, spec, preferred_share=share), axis=-1)
    tokens[rng.random(rows) < 0.1] = -1
    return np.ascontiguousarray(ids.transpose(1, 0, 2)).astype(storage_dtype(experts)), tokens


def _coded(
    rows: np.ndarray, tokens: np.ndarray, chunk_rows: int, experts: int, version: int | None = None
) -> tuple[list[Any], list[bytes]]:
    """A layer chunk planned and its chunks' bytes (of ``version``, by default the writer's choice)."""
    plan = context.plan_layers(rows, tokens, chunk_rows)
    n = rows.shape[1]
    chunks = [
        b"".join(context.chunk_pieces(plan, c, rows[:, r0 : r0 + chunk_rows], experts, version=version))
        for c, r0 in enumerate(range(0, n, chunk_rows))
    ]
    return plan.models, chunks


CHUNK_VERSIONS = [
    context.CHUNK_VERSION,
    context.CHUNK_VERSION_CODED_ESCAPES,
    context.CHUNK_VERSION_REFERENCED,
    context.CHUNK_VERSION_LIST_REFERENCES,
]
CODED_FEATURES = ["ranked_context", "context_escapes", "context_references", "context_list_references"]
"""What a commit of ``ranked_context`` parts names where the escape coders take its experts (revision 3.4)."""


# -- models --------------------------------------------------------------------------------------------------------
def test_a_layer_model_lists_the_sets_used_often_most_used_first_and_each_tokens_and_set_belows() -> None:
    rng = np.random.default_rng(1)
    rows, tokens = _part(rng, 2, 3000, 32, 4, 40)
    below_model, below_index = context.build_layer(rows[0], tokens, None, 0)
    model, index = context.build_layer(rows[1], tokens, below_index, below_model.n_sets)
    items = [r.tobytes() for r in rows[1]]
    uses = Counter(items)
    listed = [s.tobytes() for s in model.sets]
    often = context.LIST_MIN_USES
    assert sorted(listed) == sorted(s for s, n in uses.items() if n >= often)
    assert [uses[s] for s in listed] == sorted((uses[s] for s in listed), reverse=True)
    np.testing.assert_array_equal(index, [listed.index(s) if uses[s] >= often else -1 for s in items])
    pairs = Counter((int(t), int(i)) for t, i in zip(tokens, index, strict=True) if t >= 0 and i >= 0)
    for i, token in enumerate(model.token_keys.tolist()):
        candidates = model.token_candidates[model.token_offsets[i] : model.token_offsets[i + 1]].tolist()
        counts = [pairs[(token, c)] for c in candidates]
        assert 1 <= len(candidates) <= context.MAX_TOKEN_CANDIDATES
        twice = context.CANDIDATE_MIN_USES
        assert min(counts) >= twice and counts == sorted(counts, reverse=True)
        assert len(candidates) == context.MAX_TOKEN_CANDIDATES or sum(
            1 for (t, _), n in pairs.items() if t == token and n >= twice
        ) == len(candidates)
    assert sorted(model.token_keys.tolist()) == sorted(
        {t for (t, _), n in pairs.items() if n >= context.CANDIDATE_MIN_USES}
    )
    below_pairs = Counter((int(b), int(i)) for b, i in zip(below_index, index, strict=True) if b >= 0 and i >= 0)
    assert model.below_offsets.size == below_model.n_sets + 1
    for b in range(below_model.n_sets):
        candidates = model.below_candidates[model.below_offsets[b] : model.below_offsets[b + 1]].tolist()
        assert all(below_pairs[(b, c)] >= context.CANDIDATE_MIN_USES for c in candidates)
        assert len(candidates) <= context.MAX_BELOW_CANDIDATES


def test_uniform_routing_lists_nothing_and_costs_no_more_than_format_2() -> None:
    rng = np.random.default_rng(2)
    rows = random_topk(rng, 4 * 2048, 128, 8).reshape(4, 2048, 8).astype(np.uint8)
    tokens = rng.integers(0, 150_000, 2048)
    models, chunks = _coded(rows, tokens, 2048, 128)
    assert all(m.n_sets == 0 for m in models)
    assert len(chunks[0]) == len(ranked.encode(rows, 128)) + 5 + 4 * 4  # version 1: the head, the streams empty
    bound = 4 * 2048 * math.log2(math.comb(128, 8)) / 8
    for version in CHUNK_VERSIONS[1:]:  # smaller, and ten times slower: not the default
        _, coded = _coded(rows, tokens, 2048, 128, version=version)
        head = np.frombuffer(coded[0][1 : 1 + 8 * 4], "<u4")
        assert coded[0][0] == version and not head[:4].any(), "no decision coded"
        assert len(coded[0]) < len(chunks[0]) and len(coded[0]) < 1.05 * bound, (len(coded[0]), len(chunks[0]))


MODEL_VERSIONS = [
    context.MODEL_VERSION,
    context.MODEL_VERSION_CODED_LISTS,
    context.MODEL_VERSION_REFERENCED_LISTS,
    context.MODEL_VERSION_CODED_TABLES,
]


@pytest.mark.parametrize("version", MODEL_VERSIONS)
def test_a_model_stores_and_reads_back_every_table(version: int) -> None:
    """Models of every version: 4 (lists against references, tables range-coded: what routelog writes), 3, 2 and 1
    (revision 3.3's, 3.2's and 3.1's stores)."""
    rng = np.random.default_rng(3)
    rows, tokens = _part(rng, 5, 2000, 300, 6, 50)
    models = []
    indexes: list[np.ndarray] = []
    for j in range(5):
        below = indexes[-1] if j % 4 else None
        model, index = context.build_layer(rows[j], tokens, below, models[-1].n_sets if j % 4 else 0)
        models.append(model)
        indexes.append(index)
    blob = context.encode_model(models, 300, version=version)
    head = context.model_header_nbytes(5)
    _, ends = context.read_model_head(blob[:head], 5, len(blob), 300)
    assert context.read_model_head(blob[:head], 5, len(blob), 300).version == version
    for j, (start, end) in enumerate(zip(np.r_[head, ends[:-1]], ends, strict=True)):
        back = context.decode_section(
            blob[start:end], j, 2000, 6, np.dtype(np.uint16), 300, models[j - 1].n_sets if j % 4 else None, version
        )
        for field in ("sets", "token_keys", "token_offsets", "token_candidates", "below_offsets", "below_candidates"):
            np.testing.assert_array_equal(getattr(back, field), getattr(models[j], field), err_msg=field)


# -- chunks ----------------------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    layers=st.integers(1, 5),
    rows=st.integers(1, 700),
    shape=st.sampled_from([(16, 4), (64, 8), (300, 8), (128, 1)]),
    vocab=st.sampled_from([3, 40, 5000]),
    share=st.sampled_from([0.0, 0.6, 1.0]),
    chunk_rows=st.sampled_from([64, 256, 1000]),
    version=st.sampled_from([None, *CHUNK_VERSIONS]),
)
def test_chunks_decode_to_their_rows_whole_and_by_window(
    seed: int,
    layers: int,
    rows: int,
    shape: tuple[int, int],
    vocab: int,
    share: float,
    chunk_rows: int,
    version: int | None,
) -> None:
    """Chunks of every version: 3 (escapes range-coded against references, what routelog writes), 2 (revision 3.2's
    stores: range-coded alone) and 1 (revision 3.1's stores)."""
    experts, k = shape
    rng = np.random.default_rng(seed)
    ids, tokens = _part(rng, layers, rows, experts, k, vocab, share)
    models, chunks = _coded(ids, tokens, chunk_rows, experts, version)
    dtype = storage_dtype(experts)
    for c, r0 in enumerate(range(0, rows, chunk_rows)):
        n = min(chunk_rows, rows - r0)
        shape3 = (layers, n, k)
        got = context.decode_chunk(chunks[c], shape3, dtype, experts, tokens[r0 : r0 + n], models)
        np.testing.assert_array_equal(got, ids[:, r0 : r0 + n])
        l0, l1 = sorted(rng.integers(0, layers + 1, 2))
        w0, w1 = sorted(rng.integers(0, n + 1, 2))
        window = context.decode_chunk(
            chunks[c], shape3, dtype, experts, tokens[r0 : r0 + n], models, window=((l0, l1), (w0, w1))
        )
        np.testing.assert_array_equal(window, ids[l0:l1, r0 + w0 : r0 + w1])


@needs_compiled
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 400), vocab=st.sampled_from([5, 60]))
def test_the_python_passes_write_and_read_what_the_compiled_ones_do(seed: int, rows: int, vocab: int) -> None:
    rng = np.random.default_rng(seed)
    ids, tokens = _part(rng, 3, rows, 32, 4, vocab)
    models, _ = _coded(ids, tokens, 128, 32)
    indexes: list[np.ndarray] = []
    for j, model in enumerate(models):
        _, index = context.build_layer(ids[j], tokens, indexes[-1] if j else None, models[j - 1].n_sets if j else 0)
        indexes.append(index)
        below = indexes[j - 1] if j else np.zeros(0, np.int32)
        compiled = context._encode_layer(index, model, tokens, below)
        python = context_python.encode_layer(index, model.python_tables(), tokens, below)
        assert compiled == python
        decoded = np.empty(rows, np.int32)
        assert context_python.decode_layer(compiled, model.python_tables(), tokens, below, decoded) == (0, -1)
        np.testing.assert_array_equal(decoded, index)
    noise = rng.integers(0, 256, 64, dtype=np.uint8).tobytes()  # forged streams: both read the same, or fail alike
    for model in models:
        python_index = np.empty(rows, np.int32)
        compiled_index = np.empty(rows, np.int32)
        python = context_python.decode_layer(noise, model.python_tables(), tokens, np.zeros(0, np.int32), python_index)
        compiled = context._decode_layer(
            np.frombuffer(noise, np.uint8), model, tokens, np.zeros(0, np.int32), compiled_index
        )
        assert python == compiled
        stop = rows if python[0] == 0 else python[1]
        np.testing.assert_array_equal(python_index[:stop], compiled_index[:stop])


@needs_compiled
def test_the_compiled_passes_constants_are_the_python_ones() -> None:
    """Both paths write the same bytes only with the same contexts and limits: every constant the C module exports
    equals the Python passes' of that name."""
    names = [n for n in dir(context._COMPILED) if n.isupper()]
    assert len(names) >= 15
    for name in names:
        python = getattr(context_python, name) if hasattr(context_python, name) else getattr(context, name)
        assert getattr(context._COMPILED, name) == python, name


def test_distinct_numbers_items_in_order_of_first_appearance_on_both_paths() -> None:
    rng = np.random.default_rng(5)
    items = rng.integers(0, 6, (500, 3)).astype(np.uint8)
    ids, first = context._distinct(items)
    expected: dict[bytes, int] = {}
    for row in items:
        expected.setdefault(row.tobytes(), len(expected))
    np.testing.assert_array_equal(ids, [expected[r.tobytes()] for r in items])
    np.testing.assert_array_equal(items[first], [np.frombuffer(b, np.uint8) for b in expected])
    py_ids, py_first = context_python.distinct(items.view(np.dtype((np.void, 3))).reshape(-1))
    np.testing.assert_array_equal(py_ids, ids)
    np.testing.assert_array_equal(py_first, first)


@needs_compiled
def test_candidate_hits_are_alike_on_both_paths_and_refuse_keys_past_their_offsets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plan's question, which rows' sets are among their key's candidates, asked of the compiled pass and of
    numpy's (escapes and rows without a key included); forged offsets or keys are a ValueError, not a read past
    the arrays."""
    rng = np.random.default_rng(11)
    keys_, sets, n = 50, 30, 2000
    counts = rng.integers(0, 9, keys_)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
    candidates = rng.integers(0, sets, int(offsets[-1])).astype(np.uint32)
    at = rng.integers(-1, keys_, n).astype(np.int64)
    index = rng.integers(-1, sets, n).astype(np.int32)
    compiled = context._candidate_hits(at, offsets, candidates, index)
    monkeypatch.setattr(context, "_COMPILED", None)
    numpy_hits = context._candidate_hits(at, offsets, candidates, index)
    monkeypatch.undo()
    np.testing.assert_array_equal(compiled, numpy_hits)
    assert 0 < compiled.sum() < n
    hit = np.zeros(n, np.uint8)
    for forged_at, forged_offsets in ((np.full(n, keys_, np.int64), offsets), (at, offsets[::-1].copy())):
        with pytest.raises(ValueError, match="candidate_hits"):
            context._COMPILED.candidate_hits(forged_at, forged_offsets, candidates, index, hit)
    too_far = offsets.copy()
    too_far[-1] += 1
    with pytest.raises(ValueError, match="candidate_hits"):
        context._COMPILED.candidate_hits(at, too_far, candidates, index, hit)


@needs_compiled
def test_placed_rows_take_their_listed_set_or_the_next_escape_and_forged_ones_are_refused() -> None:
    sets = np.array([[1, 2], [3, 4], [5, 6]], np.uint8)
    escapes = np.array([[7, 8], [9, 10]], np.uint8)
    index = np.array([2, -1, 0, -1, 2], np.int32)
    out = np.zeros((5, 2), np.uint8)
    context._COMPILED.place_rows(index, sets.reshape(-1), escapes.reshape(-1), out.reshape(-1), 2)
    np.testing.assert_array_equal(out, [[5, 6], [7, 8], [1, 2], [9, 10], [5, 6]])
    for forged_index, forged_escapes, forged_out in (
        (np.array([3, -1, 0, -1, 2], np.int32), escapes, out),  # past the list
        (np.array([2, -2, 0, -1, 2], np.int32), escapes, out),  # no index
        (index, escapes[:1], out),  # an escape short
        (np.array([2, -1, 0, 1, 2], np.int32), escapes, out),  # an escape left over
        (index, escapes, out[:4]),  # out of another size
        (index, escapes, out.astype(np.uint16)),  # or dtype
    ):
        with pytest.raises(ValueError, match="place_rows"):
            context._COMPILED.place_rows(
                forged_index, sets.reshape(-1), forged_escapes.reshape(-1), forged_out.reshape(-1), 2
            )


@needs_compiled
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(0, 300),
    shape=st.sampled_from([(8, 8), (9, 8), (16, 1), (64, 8), (128, 8), (300, 6), (1024, 4), (64, 40)]),
    skew=st.sampled_from([0.05, 0.3, 100.0]),
)
def test_escapes_are_coded_alike_on_both_paths_and_any_stream_decodes_to_sets(
    seed: int, rows: int, shape: tuple[int, int], skew: float
) -> None:
    experts, k = shape
    rng = np.random.default_rng(seed)
    popularity = np.maximum(rng.dirichlet(np.full(experts, skew)), 1e-12)  # every expert possible
    ids = np.sort(random_topk(rng, rows, experts, k, popularity / popularity.sum()), axis=-1)
    ids = ids.astype(storage_dtype(experts))
    order = rng.permutation(experts).astype(np.uint16)
    compiled = context._encode_escapes(ids, order, experts)
    assert compiled == context_python.encode_escapes(ids, order.tolist(), experts)
    for stream in (compiled, rng.integers(0, 256, 40, dtype=np.uint8).tobytes()):  # the stream, then noise
        python = np.empty_like(ids)
        context_python.decode_escapes(stream, python, order.tolist(), experts)
        got = np.empty_like(ids)
        context._decode_escapes(np.frombuffer(stream, np.uint8), got, order, experts)
        np.testing.assert_array_equal(got, python)
        assert (got < experts).all() and (np.diff(got.astype(np.int64), axis=-1) > 0).all(), "sorted distinct sets"
        if stream is compiled:
            np.testing.assert_array_equal(got, ids)


def _swap_one_expert(rng: np.random.Generator, ids: np.ndarray, experts: int, share: float) -> np.ndarray:
    """``ids`` ``[L, N, K]`` with one expert of a ``share`` of the rows swapped for one outside the row (sorted again):
    what most escapes of the corpora are, a usual set with an expert changed."""
    out = ids.copy()
    for j in range(out.shape[0]):
        for r in np.flatnonzero(rng.random(out.shape[1]) < share):
            outside = np.setdiff1d(np.arange(experts), out[j, r])
            out[j, r, rng.integers(0, out.shape[2])] = rng.choice(outside)
            out[j, r].sort()
    return out


def test_coded_escapes_take_fewer_bytes_than_format_2_ones_and_references_fewer_still() -> None:
    """Escaped rows are sets the part uses once: no repeat for format 2's zstd to find, while the range coder
    learns which experts the layer takes (the list's order) within each chunk layer. Where escapes are a usual set
    with an expert changed (as on the corpora) references code them in fewer bits, and where no candidate names that
    set (here: no token ids, the first layer) a listed reference does (version 4); where they are drawn afresh (the
    rest of token-dependent routing) the bits that say so cost next to nothing."""
    rng = np.random.default_rng(21)
    ids, tokens = _part(rng, 4, 4000, 128, 8, 150_000)
    sizes = {version: sum(map(len, _coded(ids, tokens, 2000, 128, version)[1])) for version in CHUNK_VERSIONS}
    assert sizes[2] < 0.95 * sizes[1], sizes
    assert sizes[3] < 1.005 * sizes[2], sizes
    assert sizes[4] < 1.005 * sizes[3], sizes
    ids, tokens = _part(rng, 4, 4000, 128, 8, 300)  # a vocabulary whose tokens recur: candidates to refer to
    near = _swap_one_expert(rng, ids, 128, 0.3)
    near_sizes = {version: sum(map(len, _coded(near, tokens, 2000, 128, version)[1])) for version in CHUNK_VERSIONS}
    assert near_sizes[3] < 0.9 * near_sizes[2], near_sizes
    assert near_sizes[4] < 1.005 * near_sizes[3], near_sizes  # the candidates reference them: the list adds little
    no_tokens = np.full_like(tokens, -1)  # no candidates in the first layer: only the list to refer to
    first = near[:1]
    alone = {version: sum(map(len, _coded(first, no_tokens, 2000, 128, version)[1])) for version in CHUNK_VERSIONS}
    assert alone[4] < 0.98 * alone[3], alone


@pytest.mark.parametrize("version", CHUNK_VERSIONS[1:])
def test_a_coded_chunk_past_the_escape_coders_experts_is_refused(version: int) -> None:
    rng = np.random.default_rng(22)
    ids, tokens = _part(rng, 1, 200, 64, 4, 30)
    models, chunks = _coded(ids, tokens, 200, 64, version)
    with pytest.raises(context.ContextFormatError, match=f"version-{version} chunk of 2000 experts"):
        context.decode_chunk(chunks[0], (1, 200, 4), np.dtype(np.uint16), 2000, tokens, models)


def _escaped(
    plan: context.LayerChunkPlan, ids: np.ndarray, tokens: np.ndarray, j: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layer ``j``'s escaped rows of a plan, their token ids and their rows' sets in the layer below's list."""
    escaped = plan.index[j] < 0
    below = plan.index[j - 1][escaped] if j else np.zeros(0, np.int32)
    return np.ascontiguousarray(ids[j][escaped]), np.ascontiguousarray(tokens[escaped]), np.ascontiguousarray(below)


@needs_compiled
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(1, 500),
    shape=st.sampled_from([(9, 8), (12, 6), (16, 1), (64, 8), (300, 6), (1024, 4), (64, 40)]),
    vocab=st.sampled_from([3, 40, 5000]),
    lists=st.booleans(),
)
def test_referenced_escapes_are_coded_alike_on_both_paths_and_any_stream_decodes_to_sets(
    seed: int, rows: int, shape: tuple[int, int], vocab: int, lists: bool
) -> None:
    """Version 3's and 4's (``lists``) escapes, compiled and in Python: the same bytes, the rows back, and any
    stream (noise) read alike by both, as sorted distinct sets or (version 4) refused where it names a listed
    reference past the list, whatever reference each row takes (few experts: every reference dropped to its last
    expert outside it)."""
    experts, k = shape
    rng = np.random.default_rng(seed)
    ids, tokens = _part(rng, 3, rows, experts, k, vocab, share=0.8)
    plan = context.plan_layers(ids, tokens, rows)
    for j, model in enumerate(plan.models):
        escaped, escaped_tokens, below = _escaped(plan, ids, tokens, j)
        order = model.escape_order(experts)
        compiled = context._encode_referenced(escaped, order, experts, model, escaped_tokens, below, lists)
        tables = model.python_tables()
        python = context_python.encode_referenced(
            escaped, order.tolist(), experts, model.sets, tables, escaped_tokens, below, lists
        )
        assert compiled == python
        for stream in (compiled, rng.integers(0, 256, 40, dtype=np.uint8).tobytes()):
            got = np.empty_like(escaped)
            python_got = np.empty_like(escaped)
            failure = ""
            try:
                context._decode_referenced(
                    np.frombuffer(stream, np.uint8), got, order, experts, model, escaped_tokens, below, lists
                )
            except ValueError as exc:
                failure = str(exc)
            if failure:
                assert lists and stream is not compiled and "reference outside the list" in failure
                with pytest.raises(ValueError, match="reference outside the list"):
                    context_python.decode_referenced(
                        stream, python_got, order.tolist(), experts, model.sets, tables, escaped_tokens, below, lists
                    )
                continue
            context_python.decode_referenced(
                stream, python_got, order.tolist(), experts, model.sets, tables, escaped_tokens, below, lists
            )
            np.testing.assert_array_equal(got, python_got)
            assert (got < experts).all() and (np.diff(got.astype(np.int64), axis=-1) > 0).all(), "sorted sets"
            if stream is compiled:
                np.testing.assert_array_equal(got, escaped)


@needs_compiled
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    sets=st.integers(0, 900),
    shape=st.sampled_from([(9, 8), (12, 6), (16, 1), (64, 8), (300, 6), (1024, 4), (64, 40)]),
    near=st.sampled_from([0.0, 0.7, 1.0]),
)
def test_lists_are_coded_alike_on_both_paths_and_any_stream_decodes_to_sets_or_stops(
    seed: int, sets: int, shape: tuple[int, int], near: float
) -> None:
    """Version 3's lists, compiled and in Python: the same bytes, the sets back (a share ``near`` of them an earlier
    set with an expert changed, some further back than the window the writer searches), and any stream (noise)
    read alike by both: sorted distinct sets, up to a set whose reference lies before the list's start."""
    experts, k = shape
    rng = np.random.default_rng(seed)
    rows = random_topk(rng, sets, experts, k).astype(storage_dtype(experts))
    for i in np.flatnonzero(rng.random(sets) < near)[1:]:
        row = rows[rng.integers(0, i)].copy()
        outside = np.setdiff1d(np.arange(experts), row)
        if outside.size:
            row[rng.integers(0, k)] = rng.choice(outside)
        rows[i] = row
    rows = np.sort(rows, axis=-1)
    order = np.arange(experts, dtype=np.uint16)
    compiled = context._encode_list(rows, experts)
    assert compiled == context_python.encode_list(rows, order.tolist(), experts)
    for stream in (compiled, rng.integers(0, 256, 40, dtype=np.uint8).tobytes()):
        got = np.zeros_like(rows)
        stopped = context._decode_list(np.frombuffer(stream, np.uint8), got, experts)
        python = np.zeros_like(rows)
        assert context_python.decode_list(stream, python, order.tolist(), experts)[1] == stopped
        np.testing.assert_array_equal(got, python)
        read = got[: stopped if stopped >= 0 else sets]
        assert (read < experts).all() and (np.diff(read.astype(np.int64), axis=-1) > 0).all(), "sorted sets"
        if stream is compiled:
            assert stopped == -1
            np.testing.assert_array_equal(got, rows)


@needs_compiled
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    layers=st.integers(1, 4),
    rows=st.integers(1, 600),
    vocab=st.sampled_from([3, 40, 150_000]),
)
def test_tables_are_coded_alike_on_both_paths_and_any_stream_reads_alike(
    seed: int, layers: int, rows: int, vocab: int
) -> None:
    """Model version 4's candidate tables, compiled and in Python: the same bytes, the tables back, and any stream
    (noise, or the honest one cut short) read alike by both: the same status, the same tables where it is OK."""
    rng = np.random.default_rng(seed)
    ids, tokens = _part(rng, layers, rows, 64, 8, vocab, share=0.8)
    plan = context.plan_layers(ids, tokens, rows)
    for j, model in enumerate(plan.models):
        below_sets = model.below_offsets.size - 1 if j else -1
        compiled = context._encode_tables(model)
        lists = [t.tolist() for t in (*_fields(model).values(),)][1:]
        assert compiled == context_python.encode_tables(*lists, model.n_sets, max(below_sets, 0))
        n_below = int(np.count_nonzero(np.diff(model.below_offsets.astype(np.int64))))
        for stream in (compiled, compiled[: len(compiled) // 2], rng.integers(0, 256, 30, dtype=np.uint8).tobytes()):
            python = context_python.decode_tables(stream, model.token_keys.size, model.n_sets, below_sets, n_below)
            try:
                read = context._decode_tables(
                    np.frombuffer(stream, np.uint8),
                    model.sets,
                    model.token_keys.size,
                    n_below,
                    None if below_sets < 0 else below_sets,
                    "layer",
                )
            except context.ContextFormatError:
                assert python[0] != context_python.OK
                continue
            assert python[0] == context_python.OK
            for got, want in zip(list(_fields(read).values())[1:], python[1:], strict=True):
                np.testing.assert_array_equal(got, np.asarray(want, got.dtype))
            if stream is compiled:
                for name, value in _fields(model).items():
                    np.testing.assert_array_equal(getattr(read, name), value, err_msg=name)


def test_a_list_of_near_sets_is_smaller_against_references_and_one_referring_before_its_start_is_corrupt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Listed sets an expert away from an earlier one (as 69 % of the DeepSeek-V3-style corpus' are) cost far fewer
    bits against it than alone; a list whose first set names a reference (before the list's start) stops both paths
    there, and its model is refused with the typed error."""
    rng = np.random.default_rng(25)
    rows = random_topk(rng, 2000, 64, 8).astype(np.uint8)
    for i in range(1, 2000, 2):
        rows[i] = rows[i - 1]
        rows[i, 0] = next(e for e in rng.permutation(64) if e not in rows[i])
    rows = np.sort(rows, axis=-1)
    order = np.arange(64, dtype=np.uint16)
    assert len(context._encode_list(rows, 64)) < 0.8 * len(context._encode_escapes(rows, order, 64))
    coder = context_python._Encoder()
    state = context_python._Referenced(rows, order.tolist(), 64)
    context_python._code(coder, state.referenced, 0, 1)  # the first set takes a reference...
    context_python._code(coder, state.gap_bucket, 0, 0)  # ... one set back
    forged = coder.finish()
    got = np.zeros_like(rows)
    assert context._decode_list(np.frombuffer(forged, np.uint8), got, 64) == 0
    assert context_python.decode_list(forged, got, order.tolist(), 64) == (1, 0)
    model, _ = context.build_layer(np.concatenate([rows, rows, rows]), np.full(6000, -1), None, 0)
    monkeypatch.setattr(context, "_encode_list", lambda sets, experts: forged)
    section = context.encode_model([model], 64)[context.model_header_nbytes(1) :]
    with pytest.raises(context.ContextFormatError, match="set 0 refers to a set before the list's start"):
        context.decode_section(section, 0, 6000, 8, np.dtype(np.uint8), 64, None, 3)


def test_referenced_escapes_refuse_a_reference_outside_the_list_or_a_forged_set_on_both_paths() -> None:
    """A model whose candidates name sets past its list (the reader checks them when it reads a model; these
    passes check again, as they index the list with them): a ValueError from both paths, a typed error from the
    chunk."""
    rng = np.random.default_rng(23)
    ids, tokens = _part(rng, 1, 600, 64, 8, 20, share=0.9)
    plan = context.plan_layers(ids, tokens, 600)
    model = plan.models[0]
    escaped, escaped_tokens, below = _escaped(plan, ids, tokens, 0)
    assert model.token_candidates.size and escaped.shape[0]
    cut = dataclasses.replace(model, sets=model.sets[: int(model.token_candidates.max())])
    order = model.escape_order(64)
    stream = context._encode_referenced(escaped, order, 64, model, escaped_tokens, below, True)
    with pytest.raises(ValueError, match="reference outside the list"):
        context._encode_referenced(escaped, order, 64, cut, escaped_tokens, below, True)
    with pytest.raises(ValueError, match="reference outside the list"):
        context_python.encode_referenced(
            escaped, order.tolist(), 64, cut.sets, cut.python_tables(), escaped_tokens, below, True
        )
    with pytest.raises(ValueError, match="reference outside the list"):
        context._decode_referenced(
            np.frombuffer(stream, np.uint8), escaped.copy(), order, 64, cut, escaped_tokens, below, True
        )
    _, chunks = _coded(ids, tokens, 600, 64, context.CHUNK_VERSION_LIST_REFERENCES)
    with pytest.raises(context.ContextFormatError, match="reference outside the list"):
        context.decode_chunk(chunks[0], (1, 600, 8), np.dtype(np.uint8), 64, tokens, [cut])
    doubled = model.sets.copy()  # every listed set naming an ID twice: refused where a row reads one
    doubled[:, 1] = doubled[:, 0]
    forged = dataclasses.replace(model, sets=doubled)
    with pytest.raises(ValueError, match="names an ID past the experts or twice"):
        context._decode_referenced(
            np.frombuffer(stream, np.uint8), escaped.copy(), order, 64, forged, escaped_tokens, below, True
        )
    with pytest.raises(ValueError, match="names an ID past the experts or twice"):
        context_python.decode_referenced(
            stream, escaped.copy(), order.tolist(), 64, doubled, forged.python_tables(), escaped_tokens, below, True
        )
    with pytest.raises(context.ContextFormatError, match="names an ID past the experts or twice"):
        context.decode_chunk(chunks[0], (1, 600, 8), np.dtype(np.uint8), 64, tokens, [forged])


def test_a_listed_reference_past_the_list_is_refused_on_both_paths() -> None:
    """Version 4: a row (no candidates) whose stream names a listed reference one past the list: a ValueError from
    both paths, and the same stream read as version 3 (no listed references) decodes to a set."""
    rng = np.random.default_rng(26)
    sets = np.sort(random_topk(rng, 5, 64, 8), axis=-1).astype(np.uint8)
    model, _ = context.build_layer(np.concatenate([sets] * 3), np.full(15, -1), None, 0)
    assert model.n_sets == 5
    order = model.escape_order(64)
    coder = context_python._Encoder()
    state = context_python._Referenced(model.sets, order.tolist(), 64)
    context_python._code(coder, state.list_referenced, 0, 1)  # a row without candidates takes a listed set...
    state._gamma(coder, model.n_sets + 1)  # ... the one past the list
    forged = coder.finish()
    tokens, below = np.full(1, -1), np.zeros(0, np.int32)
    out = np.zeros((1, 8), np.uint8)
    with pytest.raises(ValueError, match="reference outside the list"):
        context._decode_referenced(np.frombuffer(forged, np.uint8), out, order, 64, model, tokens, below, True)
    with pytest.raises(ValueError, match="reference outside the list"):
        context_python.decode_referenced(
            forged, out, order.tolist(), 64, model.sets, model.python_tables(), tokens, below, True
        )
    context._decode_referenced(np.frombuffer(forged, np.uint8), out, order, 64, model, tokens, below, False)
    assert (np.diff(out.astype(np.int64), axis=-1) > 0).all()


def test_the_list_puts_the_sets_rows_name_by_their_place_first_and_codes_the_same_rows() -> None:
    """by_list_coding only renumbers the list: every row, token candidate and set-below candidate names the same
    set as before; the sets the rows reach by their place in the list (no candidate of theirs names it) come first,
    most such rows first, and the rest keep their order."""
    rng = np.random.default_rng(24)
    rows, tokens = _part(rng, 2, 4000, 64, 8, 300, share=0.7)
    below_model, below_index = context.build_layer(rows[0], tokens, None, 0)
    model, index = context.build_layer(rows[1], tokens, below_index, below_model.n_sets)
    moved, moved_index = context.by_list_coding(model, index, tokens, below_index)
    listed = index >= 0
    np.testing.assert_array_equal(moved_index < 0, ~listed)
    np.testing.assert_array_equal(moved.sets[moved_index[listed]], model.sets[index[listed]])
    np.testing.assert_array_equal(moved.sets[moved.token_candidates], model.sets[model.token_candidates])
    np.testing.assert_array_equal(moved.sets[moved.below_candidates], model.sets[model.below_candidates])
    tables = model.python_tables()
    by_place = Counter()
    for i, token, under in zip(index.tolist(), tokens.tolist(), below_index.tolist(), strict=True):
        found_below, found_token = tables.candidates(token, under)
        if i >= 0 and i not in found_below and i not in found_token:
            by_place[model.sets[i].tobytes()] += 1
    counts = [by_place[s.tobytes()] for s in moved.sets]
    assert counts == sorted(counts, reverse=True) and counts[0] > 0
    rest = [s.tobytes() for s in moved.sets if not by_place[s.tobytes()]]
    assert rest == [s.tobytes() for s in model.sets if not by_place[s.tobytes()]], "the rest keep their order"


# -- forged bytes ----------------------------------------------------------------------------------------------------
def _one_layer_model() -> tuple[context.LayerModel, np.ndarray, np.ndarray, bytes]:
    rng = np.random.default_rng(7)
    rows, tokens = _part(rng, 1, 1500, 64, 8, 30)
    model, _ = context.build_layer(rows[0], tokens, None, 0)
    return model, rows, tokens, context.encode_model([model], 64)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_forged_chunks_decode_to_sets_or_fail_with_the_typed_error(data: st.DataObject) -> None:
    model, rows, tokens, _ = _one_layer_model()
    _, chunks = _coded(
        rows[:, :300], tokens[:300], 300, 64, data.draw(st.sampled_from(CHUNK_VERSIONS), label="version")
    )
    chunk = bytearray(chunks[0])
    for _ in range(data.draw(st.integers(1, 6))):
        at = data.draw(st.integers(0, len(chunk) - 1))
        chunk[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        chunk = chunk[: data.draw(st.integers(0, len(chunk)))]
    try:
        got = context.decode_chunk(bytes(chunk), (1, 300, 8), np.dtype(np.uint8), 64, tokens[:300], [model])
    except context.ContextFormatError:
        return
    assert ((got < 64).all()) and (np.diff(got.astype(np.int64), axis=-1) > 0).all(), "every row a sorted set"


@pytest.mark.parametrize(
    "forge",
    [
        lambda s: s[:-1] + bytes([s[-1] ^ 1]),  # checksum
        lambda s: s[:10],
        lambda s: _resealed((2**31).to_bytes(4, "little") + s[4:-4]),  # more sets than rows
        lambda s: _resealed(s[:4] + (10**6).to_bytes(4, "little") + s[8:-4]),  # more token keys than rows
        lambda s: _resealed(s[:8] + (1).to_bytes(4, "little") + s[12:-4]),  # below keys without a layer below
        lambda s: _resealed(s[:-8] + s[-7:-4]),  # the integers end early
    ],
)
@pytest.mark.parametrize("version", MODEL_VERSIONS)
def test_forged_model_sections_are_refused_with_the_typed_error(forge: Any, version: int) -> None:
    model, _, _, _ = _one_layer_model()
    blob = context.encode_model([model], 64, version=version)
    section = blob[context.model_header_nbytes(1) :]
    context.decode_section(section, 0, 1500, 8, np.dtype(np.uint8), 64, None, version)  # unforged: read
    with pytest.raises(context.ContextFormatError):
        context.decode_section(forge(section), 0, 1500, 8, np.dtype(np.uint8), 64, None, version)


def _resealed(body: bytes) -> bytes:
    import google_crc32c

    return body + google_crc32c.value(body).to_bytes(4, "little")


def test_forged_tables_inside_the_integers_are_refused() -> None:
    """Models of versions 1 to 3: candidates past the list, keys out of order and counts over the limit, in a valid
    frame: checked values. Version 4's writers refuse such tables (their streams are forged below)."""
    model, *_ = _one_layer_model()
    version = context.MODEL_VERSION_REFERENCED_LISTS
    for field, value in [("token_candidates", model.n_sets), ("token_keys", -5)]:
        forged = getattr(model, field).copy()
        forged[-1] = value if field != "token_keys" else forged[0] - 1
        bad = context.LayerModel(**{**_fields(model), field: forged})
        section = context.encode_model([bad], 64, version=version)[context.model_header_nbytes(1) :]
        with pytest.raises(context.ContextFormatError, match=r"limits|order"):
            context.decode_section(section, 0, 1500, 8, np.dtype(np.uint8), 64, None, version)
        with pytest.raises(ValueError, match="past their limits"):
            context.encode_model([bad], 64)


def _tables_stream(keys: list[int], counts: list[int], candidates: list[int], below: list[int]) -> bytes:
    """A version-4 table stream of what it is given, unchecked (the Python pass codes any values; the candidates may
    name any place): the keys, each key's count and candidates (``candidates`` in order), then each set below's
    count (``below``; their candidates all 0)."""
    offsets = [0, *np.cumsum(counts, dtype=np.int64).tolist()]
    below_offsets = [0, *np.cumsum(below, dtype=np.int64).tolist()]
    return context_python.encode_tables(keys, offsets, candidates, below_offsets, [0] * sum(below), 2**40, len(below))


@pytest.mark.parametrize("kernels", ["compiled", "numpy"])
def test_forged_version_4_tables_are_refused_with_the_typed_error(
    kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Model version 4: a stream naming a candidate past the list, a key past the largest token id, or other sets
    below with candidates than the section's head says (the stream's count in the head, the stream another): the
    typed error, on both paths; the honest stream reads back."""
    if kernels == "numpy":
        monkeypatch.setattr(context, "_COMPILED", None)
    elif context._COMPILED is None:
        pytest.skip("the compiled passes were not built")
    model, *_ = _one_layer_model()
    encode_tables = context._encode_tables
    keys = model.token_keys.tolist()
    counts = np.diff(model.token_offsets.astype(np.int64)).tolist()
    candidates = model.token_candidates.tolist()
    cases = {
        "": _tables_stream(keys, counts, candidates, []),
        "candidate": _tables_stream(keys, counts, [*candidates[:-1], model.n_sets], []),
        "key": _tables_stream([*keys[:-1], context.MAX_TOKEN + 1], counts, candidates, []),
    }
    for problem, stream in cases.items():
        monkeypatch.setattr(context, "_encode_tables", lambda _model, stream=stream: stream)
        section = context.encode_model([model], 64)[context.model_header_nbytes(1) :]
        version = context.MODEL_VERSION_CODED_TABLES
        if not problem:
            read = context.decode_section(section, 0, 1500, 8, np.dtype(np.uint8), 64, None, version)
            assert _fields(read).keys() == _fields(model).keys()
            for name, value in _fields(model).items():
                np.testing.assert_array_equal(getattr(read, name), value)
            continue
        with pytest.raises(context.ContextFormatError, match="past its limit"):
            context.decode_section(section, 0, 1500, 8, np.dtype(np.uint8), 64, None, version)
    below = [1, 0, 2]  # a layer below of three sets, two with candidates; the head says 2
    stream = _tables_stream([], [], [], below)
    empty = context.LayerModel(
        model.sets,
        np.zeros(0, np.int64),
        np.zeros(1, np.uint32),
        np.zeros(0, np.uint32),
        np.array([0, 1, 1, 3], np.uint32),
        np.zeros(3, np.uint32),
    )
    assert encode_tables(empty) == stream
    monkeypatch.setattr(context, "_encode_tables", encode_tables)
    section = context.encode_model([empty], 64)[context.model_header_nbytes(1) :]
    read = context.decode_section(section, 0, 1500, 8, np.dtype(np.uint8), 64, 3, context.MODEL_VERSION_CODED_TABLES)
    np.testing.assert_array_equal(read.below_offsets, [0, 1, 1, 3])
    monkeypatch.setattr(context, "_encode_tables", lambda _model: _tables_stream([], [], [], [1, 0, 0]))
    section = context.encode_model([empty], 64)[context.model_header_nbytes(1) :]
    with pytest.raises(context.ContextFormatError, match="disagree on the sets below"):
        context.decode_section(section, 0, 1500, 8, np.dtype(np.uint8), 64, 3, context.MODEL_VERSION_CODED_TABLES)


def _fields(model: context.LayerModel) -> dict[str, Any]:
    names = ("sets", "token_keys", "token_offsets", "token_candidates", "below_offsets", "below_candidates")
    return {name: getattr(model, name) for name in names}


def test_a_forged_model_head_is_refused() -> None:
    _, _, _, blob = _one_layer_model()
    head = context.model_header_nbytes(1)
    for forged, size in [(b"XXXX" + blob[4:head], len(blob)), (blob[:head], len(blob) + 1), (blob[: head - 1], 0)]:
        with pytest.raises(context.ContextFormatError):
            context.read_model_head(forged, 1, size, 64)
    assert context.read_model_head(blob[:head], 1, len(blob), 64).version == context.MODEL_VERSION_CODED_TABLES
    with pytest.raises(context.ContextFormatError, match="version-4 set model of 2000 experts"):
        context.read_model_head(blob[:head], 1, len(blob), 2000)


# -- stores ----------------------------------------------------------------------------------------------------------
def _records(rng: np.random.Generator, spec: ModelSpec, n: int, tokens: int, vocab: int) -> list[Record]:
    """Token-dependent records; GRPO-style pairs sharing a prompt (shared rows), one without token ids."""
    out = []
    prompt = zipf_token_ids(rng, tokens // 2, vocab)
    prompt_routing = token_dependent_routing(rng, prompt, spec)
    for i in range(n):
        response = zipf_token_ids(rng, tokens - prompt.size, vocab)
        ids = np.concatenate([prompt_routing, token_dependent_routing(rng, response, spec)])
        token_ids = None if i == 3 else np.concatenate([prompt, response])
        out.append(
            Record(
                sample_id=f"s{i}",
                expert_ids=ids,
                prompt_len=prompt.size,
                response_len=tokens - prompt.size,
                token_ids=token_ids,
            )
        )
    return out


def _expect(store: routelog.Store, records: list[Record], step: int = 0) -> None:
    snapshot = store.step(step)
    got = {g.sample_id: g for g in snapshot.read_many([r.sample_id for r in records])}
    for record in records:
        valid = np.asarray(got[record.sample_id].valid)
        np.testing.assert_array_equal(
            np.asarray(got[record.sample_id].expert_ids)[valid], np.sort(record.expert_ids, axis=-1)[valid]
        )


def test_a_context_store_reads_back_exactly_and_is_smaller(store_url: str) -> None:
    spec = ModelSpec(name="t", num_layers=7, moe_layers=(1, 2, 3, 4, 5, 6), num_experts=64, topk=8)
    rng = np.random.default_rng(11)
    records = _records(rng, spec, 12, 600, 80)
    sizes = {}
    for transform in ("ranked_gaps", "ranked_context"):
        url = f"{store_url}-{transform}"
        options = PartOptions(transform=transform, chunk_rows=512, chunk_layers=4)
        with routelog.open_writer(url, 0, model_spec=spec, options=options, flush_bytes=150_000) as writer:
            for record in records:
                writer.append(record)
        store = routelog.open_store(url)
        snapshot = store.step(0)
        assert len(snapshot.commits) >= 2, "several parts"
        assert {tuple(c.features) for c in snapshot.commits} == (
            {tuple(CODED_FEATURES)} if transform == "ranked_context" else {()}
        )
        _expect(store, records)
        fresh = routelog.open_store(url).step(0)  # layers inside their chunks, whose models begin below them
        for got, record in zip(fresh.read_many(["s1", "s2"], moe_layers=[2, 3, 5]), records[1:3], strict=True):
            valid = np.asarray(got.valid)
            np.testing.assert_array_equal(
                np.asarray(got.expert_ids)[valid], np.sort(record.expert_ids, axis=-1)[:, [2, 3, 5]][valid]
            )
        sizes[transform] = snapshot.routing_bytes
        assert verify_store(store).ok
        assert store_summary(store)["codecs"] == {transform: len(snapshot.commits)}
    assert sizes["ranked_context"] < 0.9 * sizes["ranked_gaps"], sizes  # parts of a few records: little to learn


def test_a_snapshot_keeps_models_within_its_budget_and_reads_alike(
    monkeypatch: pytest.MonkeyPatch, memory_url: str
) -> None:
    spec = ModelSpec(name="t", num_layers=4, moe_layers=(0, 1, 2, 3), num_experts=32, topk=4)
    records = _records(np.random.default_rng(16), spec, 6, 300, 30)
    options = PartOptions(transform="ranked_context", chunk_rows=64)
    with routelog.open_writer(memory_url, 0, model_spec=spec, options=options, flush_bytes=20_000) as writer:
        for record in records:
            writer.append(record)
    monkeypatch.setattr(blocks, "MODEL_CACHE_BYTES", 1)
    snapshot = routelog.open_store(memory_url).step(0)
    assert len(snapshot.commits) > 1
    for _ in range(2):  # the second read fetches the models again
        _expect(routelog.open_store(memory_url), records)
        for record in records:
            got = snapshot.read(record.sample_id, moe_layers=[1, 3])
            valid = np.asarray(got.valid)
            np.testing.assert_array_equal(
                np.asarray(got.expert_ids)[valid], np.sort(record.expert_ids, axis=-1)[:, [1, 3]][valid]
            )
    assert len(snapshot._index_cache._models) == 1, "the budget keeps the last model only"


def test_rows_shared_from_a_part_dropped_whole_still_decode(tmp_path: Path) -> None:
    """Writer b's records share prompt rows with writer a's part; a's part is dropped whole: b's records read
    them, and the dropped part's rows decode with the token ids its own index holds."""
    spec = ModelSpec(name="t", num_layers=4, moe_layers=(0, 1, 2, 3), num_experts=32, topk=4)
    rng = np.random.default_rng(12)
    records = _records(rng, spec, 6, 400, 30)
    url = str(tmp_path / "store")
    options = PartOptions(transform="ranked_context", chunk_rows=128)
    for writer_id, batch in (("a", records[:2]), ("b", records[2:])):
        with routelog.open_writer(url, 0, model_spec=spec, writer_id=writer_id, options=options) as writer:
            for record in batch:
                writer.append(record)
    store = routelog.open_store(url)
    first = next(c.part for c in store.step(0).commits if c.writer_id == "a")
    assert any(s.part for s in store.step(0).info("s2").spans), "b's records point into a's part"
    store.drop(0, parts=[first], reason="test")
    snapshot = store.step(0)
    assert len(snapshot.dropped_commits) == 1
    _expect(store, [r for r in records[2:] if r.sample_id != "s3"] + [records[3]])


def test_a_reader_without_the_feature_refuses_context_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    import routelog.format.documents

    spec = ModelSpec(name="t", num_layers=2, moe_layers=(0, 1), num_experts=16, topk=2)
    url = f"memory://context/{uuid.uuid4().hex}"
    rng = np.random.default_rng(13)
    with routelog.open_writer(url, 0, model_spec=spec, options=PartOptions(transform="ranked_context")) as writer:
        for record in _records(rng, spec, 2, 50, 10):
            writer.append(record)
    monkeypatch.setattr(routelog.format.documents, "SUPPORTED_FEATURES", frozenset())
    with pytest.raises(FormatVersionError, match="ranked_context"):
        routelog.open_store(url).step(0)


@pytest.mark.parametrize(
    ("supported", "missing"),
    [
        ({"ranked_context"}, "context_escapes"),
        ({"ranked_context", "context_escapes"}, "context_references"),
        ({"ranked_context", "context_escapes", "context_references"}, "context_list_references"),
    ],
    ids=["revision 3.1", "revision 3.2", "revision 3.3"],
)
def test_a_reader_without_coded_escapes_refuses_their_parts_and_many_experts_keep_version_1(
    monkeypatch: pytest.MonkeyPatch, supported: set[str], missing: str
) -> None:
    """A reader of revision 3.1 (``ranked_context`` without ``context_escapes``), 3.2 (without
    ``context_references``) or 3.3 (without ``context_list_references``) refuses the parts routelog writes now with
    the typed error naming what it lacks; a model
    of more experts than the escape coders take still writes version-1 chunks, which both read."""
    import routelog.format.documents

    urls = {}
    for experts in (16, 2000):
        spec = ModelSpec(name="t", num_layers=2, moe_layers=(0, 1), num_experts=experts, topk=2)
        urls[experts] = f"memory://context/{uuid.uuid4().hex}"
        records = _records(np.random.default_rng(14), spec, 3, 60, 10)
        options = PartOptions(transform="ranked_context")
        with routelog.open_writer(urls[experts], 0, model_spec=spec, options=options) as writer:
            for record in records:
                writer.append(record)
        _expect(routelog.open_store(urls[experts]), records)
    assert routelog.open_store(urls[16]).step(0).commits[0].features == CODED_FEATURES
    assert routelog.open_store(urls[2000]).step(0).commits[0].features == ["ranked_context"]
    monkeypatch.setattr(routelog.format.documents, "SUPPORTED_FEATURES", frozenset(supported))
    with pytest.raises(FormatVersionError, match=missing):
        routelog.open_store(urls[16]).step(0)
    assert routelog.open_store(urls[2000]).step(0).read_many(["s0"])


def test_zarr_opens_a_context_array_and_says_to_read_it_with_routelog(tmp_path: Path) -> None:
    spec = ModelSpec(name="t", num_layers=2, moe_layers=(0, 1), num_experts=16, topk=2)
    url = str(tmp_path / "store")
    rng = np.random.default_rng(14)
    with routelog.open_writer(url, 0, model_spec=spec, options=PartOptions(transform="ranked_context")) as writer:
        for record in _records(rng, spec, 2, 50, 10):
            writer.append(record)
    store = routelog.open_store(url)
    part = store.step(0).commits[0].part
    array = zarr.open_array(store.storage.zarr_store(f"{keys.part_dir(0, part)}/routing"), mode="r")
    assert array.shape[0] == 2 and array.shape[2] == 2
    with pytest.raises(NotImplementedError, match="read the part with routelog"):
        array[:]


def test_a_damaged_model_is_corrupt_data_naming_the_object(tmp_path: Path) -> None:
    spec = ModelSpec(name="t", num_layers=2, moe_layers=(0, 1), num_experts=16, topk=2)
    url = str(tmp_path / "store")
    rng = np.random.default_rng(15)
    records = _records(rng, spec, 4, 80, 10)
    with routelog.open_writer(url, 0, model_spec=spec, options=PartOptions(transform="ranked_context")) as writer:
        for record in records:
            writer.append(record)
    model = next((tmp_path / "store").rglob("routing/model"))
    data = bytearray(model.read_bytes())
    data[-3] ^= 0xFF
    model.write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match="routing/model"):
        routelog.open_store(url).step(0).read_many(["s0"])
    shutil.rmtree(tmp_path / "store")


def test_streams_and_weights_beside_context_coded_routing_and_score_order_left_alone(memory_url: str) -> None:
    """Extra streams keep format 2 and routing weights their own array; with the engine's score order kept there are
    no sets to model (the transform is ``none``): those commits name no feature."""
    from routelog import StreamRows, StreamSpec

    spec = ModelSpec(
        name="t",
        num_layers=4,
        moe_layers=(1, 2, 3),
        num_experts=32,
        topk=4,
        streams=(StreamSpec(name="indexer", num_layers=1, universe=32, topk=4),),
    )
    rng = np.random.default_rng(17)
    records = []
    for record in _records(rng, spec, 5, 120, 20):
        n = record.expert_ids.shape[0]
        extra = StreamRows(np.sort(random_topk(rng, n, 32, 4), axis=-1).reshape(n, 1, 4))
        weights = rng.random(record.expert_ids.shape).astype(np.float32)
        records.append(Record(**{**record.__dict__, "streams": {"indexer": extra}, "weights": weights}))
    for order, transform in (("sorted", "ranked_context"), ("score", "none")):
        url = f"{memory_url}-{order}"
        options = PartOptions(transform="ranked_context", topk_order=order)
        with routelog.open_writer(url, 0, model_spec=spec, options=options) as writer:
            for record in records:
                writer.append(record)
        snapshot = routelog.open_store(url).step(0)
        commit = snapshot.commits[0]
        assert commit.routing.transform == transform
        assert commit.streams["indexer"].transform == ("ranked_gaps" if order == "sorted" else "none")
        assert commit.features == (CODED_FEATURES if transform == "ranked_context" else [])
        got = {g.sample_id: g for g in snapshot.read_many(snapshot.sample_ids, weights=True)}
        stream = {g.sample_id: g for g in snapshot.read_many(snapshot.sample_ids, stream="indexer")}
        for record in records:
            routing = got[record.sample_id]
            valid = np.asarray(routing.valid)
            expected = np.asarray(record.expert_ids)
            if order == "sorted":
                expected = np.sort(expected, axis=-1)
            np.testing.assert_array_equal(np.asarray(routing.expert_ids)[valid], expected[valid])
            assert routing.weights is not None and record.weights is not None
            given = np.asarray(record.weights)
            if order == "sorted":  # each weight moves with its expert
                given = np.take_along_axis(given, np.argsort(np.asarray(record.expert_ids), axis=-1), axis=-1)
            np.testing.assert_allclose(routing.weights.transpose(1, 0, 2)[valid], given[valid], rtol=1e-2)
            assert record.streams is not None
            np.testing.assert_array_equal(
                np.asarray(stream[record.sample_id].expert_ids), np.asarray(record.streams["indexer"].expert_ids)
            )
