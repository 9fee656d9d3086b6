"""gc deletes only what it can prove unreferenced, and never a part a live writer is about to commit."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

import routelog
from routelog.errors import GcRefusedError, StoreError
from routelog.format import keys
from routelog.store.gc import MIN_GRACE, collect_garbage
from routelog.store.writer import MAX_COMMIT_DELAY
from tests.attacks.kit import (
    SPEC,
    assert_same,
    build_store,
    commit_keys,
    make_records,
    read_commit,
    read_everything,
    write_commit,
)


def _orphan(store: routelog.Store) -> str:
    key = f"{keys.part_dir(0, 'dead.00000009.0123456789ab')}/index.parquet"
    store.storage.write(key, b"a dead writer's upload")
    return key


@pytest.mark.parametrize("seed", range(6))
def test_a_flipped_byte_in_the_seal_never_makes_gc_delete_committed_data(tmp_path: Path, seed: int) -> None:
    url = f"file://{tmp_path}/store"
    expected = build_store(url)
    store = routelog.open_store(url)
    orphan = _orphan(store)
    original = store.storage.read(keys.seal_key(0))
    damaged = bytearray(original)
    position = random.Random(seed).randrange(len(damaged))
    damaged[position] ^= 1 << random.Random(seed + 100).randrange(8)
    store.storage.write(keys.seal_key(0), bytes(damaged))
    try:
        report = collect_garbage(routelog.open_store(url), 0, delete=True, force=True)
    except GcRefusedError as exc:
        refusal = str(exc)
        assert "damaged" in refusal
        assert store.storage.read(orphan)  # refused: nothing at all was deleted
    else:
        assert set(report.orphans) == {orphan}, "only the dead writer's upload was garbage"
    store.storage.write(keys.seal_key(0), original)
    assert_same(read_everything(url), expected)


def test_a_sealed_step_keeps_the_part_of_a_lost_commit_file(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    expected = build_store(url)
    store = routelog.open_store(url)
    lost = commit_keys(store.storage)[0]
    store.storage.delete([lost])
    report = collect_garbage(store, 0, delete=True, force=True)
    assert report.orphans == {}
    assert_same(read_everything(url), expected)  # the seal's consolidated copy still has the lost commit


def test_a_damaged_part_name_in_a_commit_makes_gc_refuse(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    expected = build_store(url, sealed=False)
    store = routelog.open_store(url)
    key = commit_keys(store.storage)[0]
    original = store.storage.read(key)
    doc = read_commit(store.storage, key)
    doc["part"] = doc["part"][:-1] + ("0" if doc["part"][-1] != "0" else "1")  # still a valid name: another dir
    write_commit(store.storage, key, doc)
    with pytest.raises(GcRefusedError, match="missing"):
        collect_garbage(store, 0, delete=True, force=True)
    store.storage.write(key, original)
    assert_same(read_everything(url), expected)


def test_grace_periods_shorter_than_a_commit_can_take_are_refused(memory_url: str) -> None:
    build_store(memory_url, sealed=False)
    store = routelog.open_store(memory_url)
    assert MIN_GRACE > MAX_COMMIT_DELAY
    with pytest.raises(GcRefusedError, match="force"):
        collect_garbage(store, MAX_COMMIT_DELAY)
    assert collect_garbage(store, MIN_GRACE).orphans == {}


def test_a_writer_never_commits_later_than_its_limit_after_reading_the_step(memory_url: str) -> None:
    """The writer's half of the grace contract: a part is committed within ``max_commit_delay`` of the writer's read
    of the step (whose parts its shared prefixes point at), or not at all; gc's minimum grace is far longer."""
    store = routelog.create_store(memory_url, SPEC)
    with store.writer(0, "w", background=False) as writer:
        writer.append(make_records(SPEC, 1, seed=1)[0])
    original = store.storage.write_many

    def slow(objects: dict[str, bytes]) -> None:
        time.sleep(0.3)
        original(objects)

    store.storage.write_many = slow  # type: ignore[method-assign]
    late = store.writer(0, "v", background=False, max_commit_delay=0.2)
    late.append(make_records(SPEC, 1, seed=2, prefix="v/")[0])
    with pytest.raises(StoreError, match="could not be committed within"):
        late.flush()
    assert routelog.open_store(memory_url).step(0).sample_ids == ["s0"]
