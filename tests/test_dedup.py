"""Shared prefixes stored once (routelog.format.dedup): GRPO groups and multi-turn sessions, checked never assumed."""

from __future__ import annotations

import threading
import uuid
from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import routelog
from routelog import ModelSpec, PartOptions, Record
from routelog.format import keys
from routelog.format.dedup import CANDIDATES, MIN_SHARED_TOKENS, PrefixIndex
from routelog.format.part import build_part
from routelog.format.record import prepare_record
from routelog.store import peers as peers_module
from routelog.store import writer as writer_module
from routelog.store.peers import StoredPart
from routelog.store.verify import verify_store
from routelog.store.writer import WriterError
from routelog.synth import synthetic_spec
from tests.records import random_routing

SPEC = synthetic_spec(layers=4, experts=32, topk=4)


def _grpo_group(rng: np.random.Generator, group: str, n: int, prompt_len: int) -> list[Record]:
    """``n`` samples of one prompt: the prompt's tokens and routing are identical, each response its own."""
    prompt = rng.integers(0, 1000, prompt_len)
    prompt_routing = random_routing(rng, prompt_len, SPEC.num_moe_layers, SPEC.num_experts, SPEC.topk)
    records = []
    for i in range(n):
        length = int(rng.integers(5, 60))
        valid = np.ones(prompt_len + length, bool)
        valid[-1] = False
        routing = random_routing(rng, prompt_len + length, SPEC.num_moe_layers, SPEC.num_experts, SPEC.topk)
        routing[:prompt_len] = prompt_routing
        records.append(
            Record(
                sample_id=f"{group}/{i}",
                expert_ids=routing,
                prompt_len=prompt_len,
                response_len=length,
                valid=valid,
                token_ids=np.concatenate([prompt, rng.integers(0, 1000, length)]),
                group_id=group,
            )
        )
    return records


def _write(records: list[Record], *, dedup: Literal["step", "part", "off"] = "step") -> tuple[routelog.Store, int]:
    url = f"memory://dedup-tests/{uuid.uuid4().hex}"
    with routelog.open_writer(url, step=0, model_spec=SPEC, options=PartOptions(dedup=dedup)) as writer:
        for record in records:
            writer.append(record)
    store = routelog.open_store(url)
    return store, sum(c.routing.n_rows for c in store.step(0).commits)


def _assert_reads_back(store: routelog.Store, records: list[Record]) -> None:
    snapshot = store.step(0)
    for record, got in zip(records, snapshot.read_many([r.sample_id for r in records]), strict=True):
        np.testing.assert_array_equal(got.valid, record.valid)
        want = np.sort(np.asarray(record.expert_ids), axis=-1)[record.valid]
        np.testing.assert_array_equal(got.expert_ids[record.valid], want)
    assert verify_store(store).ok


def test_a_grpo_group_stores_its_prompt_once() -> None:
    rng = np.random.default_rng(0)
    records = _grpo_group(rng, "g0", 8, prompt_len=40) + _grpo_group(rng, "g1", 8, prompt_len=25)
    store, stored = _write(records)
    _, plain = _write(records, dedup="off")
    assert plain == sum(int(r.valid.sum()) for r in records)
    assert stored == plain - 7 * 40 - 7 * 25  # each prompt once per group
    _assert_reads_back(store, records)
    summary = store.summary()
    assert (summary["routed_rows"], summary["stored_rows"]) == (plain, stored)
    assert summary["dedup_ratio"] == pytest.approx(plain / stored)
    per_routed_row = summary["routing_bytes"] / (plain * SPEC.num_moe_layers)
    assert summary["bytes_per_token_layer"] == pytest.approx(per_routed_row), "per routed (logical) token-layer"
    info = store.step(0).info("g0/3")
    assert info.spans[0].row == store.step(0).info("g0/0").spans[0].row  # points at the first sample's rows


def test_multi_turn_history_is_stored_once() -> None:
    """Turn t + 1 re-sends turn t's tokens; the token turn t sampled last (never fed, no routing there) is fed in
    turn t + 1, so the shared prefix ends just before it."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 1000, 200)
    routing = random_routing(rng, 200, SPEC.num_moe_layers, SPEC.num_experts, SPEC.topk)
    records = []
    for turn, end in enumerate((50, 100, 150, 200)):
        valid = np.ones(end, bool)
        valid[-1] = False
        records.append(
            Record(
                sample_id=f"session/t{turn}",
                expert_ids=routing[:end],
                prompt_len=end - 20,
                response_len=20,
                valid=valid,
                token_ids=tokens[:end],
            )
        )
    store, stored = _write(records)
    assert stored == 199  # every routed token once: rows of turn t extend turn t - 1's
    _assert_reads_back(store, records)


def test_same_tokens_routed_differently_are_not_shared() -> None:
    """Batch-variant numerics: the same prompt can be routed differently; the shared prefix ends at the first
    token whose routing differs, and the rest is stored."""
    rng = np.random.default_rng(2)
    a, b = _grpo_group(rng, "g", 2, prompt_len=60)
    changed = np.asarray(b.expert_ids).copy()
    changed[30, 2] = (changed[30, 2] + 1) % SPEC.num_experts  # layer 2 of token 30: another expert...
    while len(set(changed[30, 2])) < SPEC.topk:  # ...still a set of distinct experts
        changed[30, 2] = (changed[30, 2] + 1) % SPEC.num_experts
    b = Record(**{**b.__dict__, "expert_ids": changed})
    store, stored = _write([a, b])
    assert stored == int(a.valid.sum()) + int(b.valid.sum()) - 30
    _assert_reads_back(store, [a, b])


def test_a_token_computed_in_one_record_and_missing_in_the_other_ends_the_prefix() -> None:
    rng = np.random.default_rng(3)
    a, b = _grpo_group(rng, "g", 2, prompt_len=60)
    b.valid[20:25] = False
    store, stored = _write([a, b])
    assert stored == int(a.valid.sum()) + int(b.valid.sum()) - 20
    _assert_reads_back(store, [a, b])


def _family(seed: int, n: int) -> list[Record]:
    """``n`` records that each keep a random-length start of one sequence (tokens and routing), then go their own
    way; some keep it with a token routed differently or not computed. Four token ids: tails often run on equal."""
    rng = np.random.default_rng(seed)
    base_tokens = rng.integers(0, 4, 80)
    base_routing = random_routing(rng, 80, SPEC.num_moe_layers, SPEC.num_experts, SPEC.topk)
    records = []
    for i in range(n):
        keep = int(rng.integers(8, 81))
        length = keep + int(rng.integers(1, 30))
        routing = random_routing(rng, length, SPEC.num_moe_layers, SPEC.num_experts, SPEC.topk)
        routing[:keep] = base_routing[:keep]
        if rng.random() < 0.4:  # one token of the kept start routed anew (possibly to the same set)
            at = int(rng.integers(0, keep))
            routing[at] = random_routing(rng, 1, SPEC.num_moe_layers, SPEC.num_experts, SPEC.topk)[0]
        valid = rng.random(length) > 0.05
        valid[-1] = False
        tokens = np.concatenate([base_tokens[:keep], rng.integers(0, 4, length - keep)])
        records.append(
            Record(
                sample_id=f"r{i}",
                expert_ids=routing,
                prompt_len=keep,
                response_len=length - keep,
                valid=valid,
                token_ids=tokens,
            )
        )
    return records


def _shareable(a: Record, b: Record) -> int:
    """Tokens from the start equal in both records, computed alike, and (where computed) routed to the same set."""
    assert a.token_ids is not None and b.token_ids is not None
    n = 0
    while n < min(len(a.token_ids), len(b.token_ids)) and a.token_ids[n] == b.token_ids[n] and a.valid[n] == b.valid[n]:
        if a.valid[n] and not np.array_equal(
            np.sort(np.asarray(a.expert_ids)[n], -1), np.sort(np.asarray(b.expert_ids)[n], -1)
        ):
            break
        n += 1
    return n


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 14))
def test_each_record_shares_the_longest_prefix_a_recent_candidate_offers(seed: int, n: int) -> None:
    """Against a token-by-token reference: a record shares the longest start any of the :data:`CANDIDATES` most
    recent earlier records with its first tokens offers (none under :data:`MIN_SHARED_TOKENS`)."""
    records = _family(seed, n)
    want = 0
    for i, record in enumerate(records):
        assert record.token_ids is not None
        probe = list(record.token_ids[:MIN_SHARED_TOKENS])
        candidates = [
            earlier
            for earlier in records[:i]
            if earlier.token_ids is not None
            and len(earlier.token_ids) >= MIN_SHARED_TOKENS
            and list(earlier.token_ids[:MIN_SHARED_TOKENS]) == probe
        ][-CANDIDATES:]
        shared = max((_shareable(record, earlier) for earlier in candidates), default=0)
        if len(record.token_ids) < MIN_SHARED_TOKENS or shared < MIN_SHARED_TOKENS:
            shared = 0
        want += int(record.valid.sum()) - int(record.valid[:shared].sum())
    store, stored = _write(records)
    assert stored == want
    _assert_reads_back(store, records)


def test_records_without_token_ids_or_short_prefixes_are_stored_whole() -> None:
    rng = np.random.default_rng(4)
    short = _grpo_group(rng, "short", 3, prompt_len=10)  # under MIN_SHARED_TOKENS
    anonymous = [Record(**{**r.__dict__, "token_ids": None}) for r in _grpo_group(rng, "anon", 3, prompt_len=40)]
    records = short + anonymous
    store, stored = _write(records)
    assert stored == sum(int(r.valid.sum()) for r in records)
    _assert_reads_back(store, records)


@pytest.mark.parametrize("topk_order", ["sorted", "score"])
def test_shared_rows_survive_drop_of_the_record_that_owns_them(topk_order: str) -> None:
    """Dropping the first sample of a group hides it, but its rows still serve the others (gc keeps a part while
    any of its records lives)."""
    rng = np.random.default_rng(5)
    records = _grpo_group(rng, "g", 4, prompt_len=30)
    url = f"memory://dedup-tests/{uuid.uuid4().hex}"
    spec: ModelSpec = SPEC
    with routelog.open_writer(url, step=0, model_spec=spec, options=PartOptions(topk_order=topk_order)) as writer:
        for record in records:
            writer.append(record)
    store = routelog.open_store(url)
    store.drop(0, sample_ids=["g/0"])
    store.gc(older_than=0, delete=True, force=True)
    snapshot = store.step(0)
    assert "g/0" not in snapshot.sample_ids
    for record, got in zip(records[1:], snapshot.read_many([r.sample_id for r in records[1:]]), strict=True):
        want = np.asarray(record.expert_ids)[record.valid]
        if topk_order == "sorted":
            want = np.sort(want, axis=-1)
        np.testing.assert_array_equal(got.expert_ids[record.valid], want)


def test_a_micro_batch_of_a_group_fetches_the_shared_prompt_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader reads a micro-batch with one read_many: spans of several records over the same rows become one
    ranged read, so a group's micro-batch costs the prompt once plus its responses."""
    rng = np.random.default_rng(6)
    records = _grpo_group(rng, "g", 8, prompt_len=200)
    url = f"memory://dedup-tests/{uuid.uuid4().hex}"
    with routelog.open_writer(url, step=0, model_spec=SPEC, options=PartOptions(chunk_rows=16)) as writer:
        for record in records:
            writer.append(record)
    snapshot = routelog.open_store(url).step(0)
    fetched: list[int] = []
    storage = snapshot.store.storage
    read_ranges = storage.read_ranges

    def counting(ranges: list[tuple[str, int, int]], *into: memoryview) -> list[Any]:
        fetched.extend(stop - start for _, start, stop in ranges)
        return read_ranges(ranges, *into)

    monkeypatch.setattr(storage, "read_ranges", counting)
    snapshot.read_many(["g/0"])
    one = sum(fetched)
    fetched.clear()
    snapshot.read_many([r.sample_id for r in records])
    group = sum(fetched)
    stored = sum(o.size for c in snapshot.commits for o in c.objects if "/c/" in o.key)
    assert group <= stored, "every stored byte at most once"
    assert group < 8 * one / 2, "the shared prompt is not fetched once per sample"


def _write_parts(url: str, records: list[Record], writer_id: str, *, per_part: int) -> None:
    """Commit ``records`` as one writer, ``per_part`` records per part."""
    with routelog.open_writer(url, step=0, model_spec=SPEC, writer_id=writer_id) as writer:
        for i, record in enumerate(records):
            writer.append(record)
            if (i + 1) % per_part == 0:
                writer.flush()


def _stored_rows(url: str) -> int:
    return sum(c.routing.n_rows for c in routelog.open_store(url).step(0).commits)


def test_a_group_split_across_parts_stores_its_prompt_once() -> None:
    """The writer remembers its committed parts: the group's later samples point into the first part."""
    rng = np.random.default_rng(7)
    records = _grpo_group(rng, "g", 8, prompt_len=50)
    url = f"memory://dedup-tests/{uuid.uuid4().hex}"
    _write_parts(url, records, "w0", per_part=3)
    store = routelog.open_store(url)
    assert len(store.step(0).commits) == 3
    assert _stored_rows(url) == sum(int(r.valid.sum()) for r in records) - 7 * 50
    later = store.step(0).info("g/5")
    assert later.spans[0].part is not None and later.spans[0].part.startswith(keys.part_dir(0, "w0."))
    _assert_reads_back(store, records)


def test_writers_share_prefixes_with_each_others_committed_parts() -> None:
    """A group whose samples reached two inference workers: the second writer compares with, and points at, the
    first writer's committed rows (fetched only for records whose first tokens match)."""
    rng = np.random.default_rng(8)
    group = _grpo_group(rng, "g", 8, prompt_len=64)
    other = _grpo_group(rng, "h", 2, prompt_len=64)
    url = f"memory://dedup-tests/{uuid.uuid4().hex}"
    _write_parts(url, group[:4] + other, "worker-a", per_part=6)
    _write_parts(url, group[4:], "worker-b", per_part=4)
    store = routelog.open_store(url)
    b_commit = next(c for c in store.step(0).commits if c.writer_id == "worker-b")
    assert b_commit.routing.n_rows == sum(int(r.valid.sum()) for r in group[4:]) - 4 * 64
    _assert_reads_back(store, group + other)


def test_a_writer_listing_its_peers_parts_stays_within_its_budget() -> None:
    """Peers' records are listed a commit at a time and the index evicts once after: it holds no more than its
    budget once the listing is done, and still shares with the most recent peer part it kept."""
    rng = np.random.default_rng(12)
    groups = [_grpo_group(rng, f"g{g}", 2, prompt_len=64) for g in range(10)]
    url = f"memory://dedup-tests/{uuid.uuid4().hex}"
    budget = 12_000  # a few of worker-a's parts' rows and candidates
    with routelog.open_writer(url, step=0, model_spec=SPEC, writer_id="worker-b") as writer:
        writer._prefixes.budget_bytes = budget
        _write_parts(url, [group[0] for group in groups], "worker-a", per_part=1)
        writer.append(groups[0][0])  # already present: the flush reads the step and lists worker-a's parts only
        writer.flush()
        assert writer.already_present == ["g0/0"] and not writer.commits
        assert 0 < writer._prefixes.nbytes <= budget
        writer.append(groups[-1][1])
        writer.flush()
    b_commit = next(c for c in routelog.open_store(url).step(0).commits if c.writer_id == "worker-b")
    assert b_commit.routing.n_rows == int(groups[-1][1].valid.sum()) - 64, "shares the last group's prompt"
    _assert_reads_back(routelog.open_store(url), [group[0] for group in groups] + [groups[-1][1]])


def test_a_peers_part_is_fetched_a_row_chunk_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Comparisons with a peer's part fetch the row chunks their rows lie in, whole: a later comparison within
    them (another group of the same part, a longer prefix) reads nothing again."""
    rng = np.random.default_rng(13)
    records = [record for g in range(4) for record in _grpo_group(rng, f"g{g}", 1, prompt_len=40)]
    url = f"memory://dedup-tests/{uuid.uuid4().hex}"
    with routelog.open_writer(url, 0, model_spec=SPEC, options=PartOptions(chunk_rows=64)) as writer:
        for record in records:
            writer.append(record)
    store = routelog.open_store(url)
    commit = store.step(0).commits[0]
    key = keys.part_dir(0, commit.part)
    every, _ = StoredPart(store, key, commit).take(np.arange(commit.routing.n_rows))
    fetched: list[tuple[int, int]] = []
    real_fetch = peers_module.fetch_blocks

    def counted(*args: Any, **kwargs: Any) -> Any:
        fetched.append(args[1][0].rows)
        return real_fetch(*args, **kwargs)

    monkeypatch.setattr(peers_module, "fetch_blocks", counted)
    part = StoredPart(store, key, commit)
    for rows, chunks in [((3, 11), [(0, 64)]), ((20, 41), []), ((60, 71), [(0, 128)]), ((5, 6), [])]:
        wanted = np.arange(*rows)
        ids, weights = part.take(wanted)
        assert weights is None and np.array_equal(ids, every[:, wanted])
        assert fetched == chunks, rows
        fetched.clear()
    last = commit.routing.n_rows - 1
    assert part.take(np.array([last]))[0].shape[1] == 1 and fetched == [(last // 64 * 64, last + 1)]


def test_a_writer_does_not_share_with_a_peer_whose_routing_differs() -> None:
    rng = np.random.default_rng(9)
    a, b = _grpo_group(rng, "g", 2, prompt_len=64)
    routing = np.asarray(b.expert_ids).copy()
    routing[40] = random_routing(rng, 1, SPEC.num_moe_layers, SPEC.num_experts, SPEC.topk)[0]
    b = Record(**{**b.__dict__, "expert_ids": routing})
    url = f"memory://dedup-tests/{uuid.uuid4().hex}"
    _write_parts(url, [a], "worker-a", per_part=1)
    _write_parts(url, [b], "worker-b", per_part=1)
    b_commit = next(c for c in routelog.open_store(url).step(0).commits if c.writer_id == "worker-b")
    assert b_commit.routing.n_rows == int(b.valid.sum()) - 40
    _assert_reads_back(routelog.open_store(url), [a, b])


def test_a_dropped_part_that_others_point_at_is_kept_until_nothing_does() -> None:
    rng = np.random.default_rng(10)
    records = _grpo_group(rng, "g", 4, prompt_len=40)
    url = f"memory://dedup-tests/{uuid.uuid4().hex}"
    _write_parts(url, records[:2], "worker-a", per_part=2)
    _write_parts(url, records[2:], "worker-b", per_part=2)
    store = routelog.open_store(url)
    store.drop(0, writers=["worker-a"])
    store.gc(older_than=0, delete=True, force=True)
    snapshot = store.step(0)
    assert snapshot.sample_ids == ["g/2", "g/3"]
    _assert_reads_back(store, records[2:])
    a_part = next(c for c in snapshot.dropped_commits if c.writer_id == "worker-a").part
    assert store.storage.find(keys.part_dir(0, a_part)), "gc kept the rows worker-b's records read"
    store.drop(0, writers=["worker-b"])
    store.gc(older_than=0, delete=True, force=True)
    assert not store.storage.find(keys.part_dir(0, a_part)), "nothing points at it any more: reclaimed"
    assert verify_store(store).ok


def test_the_prefix_index_stays_within_its_budget() -> None:
    """Earlier parts are forgotten oldest first once their rows exceed the budget: memory stays bounded, and a
    group whose first part was forgotten is stored whole again (still correct)."""
    rng = np.random.default_rng(11)
    records = _grpo_group(rng, "g", 7, prompt_len=200)
    index = PrefixIndex(budget_bytes=30_000)
    options = PartOptions()
    for i, record in enumerate(records):
        part = build_part(
            [prepare_record(record, SPEC, 0, "sorted")], SPEC, options, index, keys.part_dir(0, f"w.{i:08d}.00")
        )
        assert part.prefix_part is not None
        index.committed(part.prefix_part)
        assert index.nbytes <= 30_000 + part.routing.n_rows * SPEC.num_moe_layers * SPEC.topk
    assert part.routing.n_rows == int(records[-1].valid.sum()), (
        "the first part (and all that pointed at it) was forgotten"
    )


# -- a writer's pipeline: part k + 1 is built while part k is uploaded and committed --------------------------------
def _pipelined_writer(
    store: routelog.Store, monkeypatch: pytest.MonkeyPatch, parts: int, fail: tuple[str, int] | None
) -> tuple[routelog.StepWriter, list[str]]:
    """A writer whose every record is a part of its own (``parts`` of them), and whose part ``fail[1]`` (0-based)
    fails at its upload or its commit (``fail[0]``) only once the part after it is built (so that one may share its
    rows). Returns the writer and the names of the parts it uploaded."""
    builds, built = [0], threading.Condition()
    real_build = writer_module.build_part

    def counted_build(*args: Any, **kwargs: Any) -> Any:  # the real build, counted
        part = real_build(*args, **kwargs)
        with built:
            builds[0] += 1
            built.notify_all()
        return part

    monkeypatch.setattr(writer_module, "build_part", counted_build)
    storage = store.storage
    uploads: list[str] = []
    real_write_many, real_create = storage.write_many, storage.create

    def wait_for_next_build() -> None:
        with built:  # every part up to the one after this one
            assert built.wait_for(lambda: builds[0] >= min(len(uploads) + 1, parts), timeout=30), "never built"

    def write_many(objects: Any) -> None:
        uploads.append(next(iter(objects)).split("/")[3])
        if fail is not None and fail == ("upload", len(uploads) - 1):
            wait_for_next_build()
            raise OSError(28, "No space left on device (injected)")
        real_write_many(objects)

    def create(key: str, data: bytes, **options: bool) -> bool:
        if fail is not None and fail == ("commit", len(uploads) - 1) and "/log/" in key:
            wait_for_next_build()
            raise OSError(5, "Input/output error (injected)")
        return real_create(key, data, **options)

    monkeypatch.setattr(storage, "write_many", write_many)
    monkeypatch.setattr(storage, "create", create)
    return store.writer(0, "w", flush_bytes=1, flush_seconds=None), uploads


def _check_no_span_leaves_the_step(store: routelog.Store) -> None:
    """Every span of every committed record points at a committed part."""
    snapshot = store.step(0)
    parts = {keys.part_dir(0, c.part) for c in snapshot.commits}
    for sample_id in snapshot.sample_ids:
        for span in snapshot.info(sample_id).spans:
            assert span.part is None or span.part in parts, (sample_id, span.part)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    groups=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    fail=st.none() | st.tuples(st.sampled_from(["upload", "commit"]), st.integers(0, 6)),
)
def test_a_pipelined_part_that_fails_takes_only_the_parts_built_on_it(
    monkeypatch: pytest.MonkeyPatch, seed: int, groups: list[int], fail: tuple[str, int] | None
) -> None:
    """Part k + 1 is built (and may point at part k's rows) while part k is uploaded and committed. When part k's
    upload fails, exactly its records and those of the later parts built on it are reported not committed; when its
    commit fails, so are those of the parts committed in the same log entry (parts ready together commit together);
    everything else is committed and reads back exactly, no committed record points at a part that was not
    committed, and the records reported can be written again."""
    rng = np.random.default_rng(seed)
    records = [r for g, n in enumerate(groups) for r in _grpo_group(rng, f"g{g}", n, prompt_len=40)]
    with monkeypatch.context() as patch:
        store = routelog.create_store(f"memory://dedup-tests/{uuid.uuid4().hex}", SPEC)
        writer, uploads = _pipelined_writer(
            store, patch, len(records), fail if fail is None or fail[1] < len(records) else None
        )
        errors: list[WriterError] = []
        for record in records:
            try:
                writer.append(record)
            except WriterError as exc:  # a failed part, reported at the next call: the writer stays usable
                errors.append(exc)
                writer.append(record)
        try:
            writer.close()
        except WriterError as exc:
            errors.append(exc)
    failing = fail is not None and fail[1] < len(records)
    assert bool(errors) == failing
    reopened = routelog.open_store(store.url)
    committed = set(reopened.step(0).sample_ids) if reopened.steps() else set()
    not_committed = {sid for error in errors for sid in error.sample_ids}
    assert committed | not_committed == {r.sample_id for r in records}
    assert not committed & not_committed
    if failing:
        assert fail is not None and records[fail[1]].sample_id in not_committed
        reported = " ".join(map(str, errors))
        if len(not_committed) > 1 and fail[0] == "upload":  # the later parts built on it say so
            assert f"shares rows with part {keys.part_dir(0, uploads[fail[1]])}" in reported, reported
    if committed:
        _check_no_span_leaves_the_step(reopened)
        _assert_reads_back(reopened, [r for r in records if r.sample_id in committed])
    else:  # every part failed: the store holds no record (a step only if a part was uploaded), and is consistent
        assert not reopened.steps() or not reopened.step(0).sample_ids
        assert verify_store(reopened).ok
    with reopened.writer(0, "again") as again:  # what was reported may be written again
        for record in records:
            if record.sample_id in not_committed:
                again.append(record)
    _assert_reads_back(routelog.open_store(store.url), records)


def test_a_part_is_built_while_the_one_before_it_commits_and_shares_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline overlaps: the second part of a group is built before the first one's upload, and points at it."""
    rng = np.random.default_rng(3)
    records = _grpo_group(rng, "g", 3, prompt_len=60)
    store = routelog.create_store(f"memory://dedup-tests/{uuid.uuid4().hex}", SPEC)
    gate = threading.Event()
    real_build = writer_module.build_part

    def build_then_open(*args: Any, **kwargs: Any) -> Any:
        part = real_build(*args, **kwargs)
        if args[0][0].row.sample_id == "g/1":
            gate.set()
        return part

    real_write_many = store.storage.write_many
    uploads: list[str] = []

    def held_write_many(objects: Any) -> None:
        uploads.append(next(iter(objects)).split("/")[3])
        if len(uploads) == 1:  # the first part's upload waits for the second part's build
            assert gate.wait(timeout=30), "the second part was not built while the first one was in flight"
        real_write_many(objects)

    monkeypatch.setattr(writer_module, "build_part", build_then_open)
    monkeypatch.setattr(store.storage, "write_many", held_write_many)
    with store.writer(0, "w", flush_bytes=1, flush_seconds=None) as writer:
        for record in records:
            writer.append(record)
    snapshot = routelog.open_store(store.url).step(0)
    assert [c.part for c in snapshot.commits] == uploads, "committed in the order they were built"
    assert snapshot.info("g/1").spans[0].part == keys.part_dir(0, uploads[0]), "it points at the first part's rows"
    _assert_reads_back(routelog.open_store(store.url), records)
