"""Wrong data is never returned silently: damaged bytes raise a typed error naming the object, and verify agrees.

The byte-flip fuzzing at the end visits every object kind of a store (documents, indexes, shards, values,
annotations, consolidated seal objects): after each flip, either reading everything returns exactly what was
written, or it raises a typed routelog error and verify reports a problem; a store verify calls sound always reads.
"""

from __future__ import annotations

import hashlib
import json
import random
import uuid
from pathlib import Path

import numpy as np
import pytest

import routelog
from routelog import keys
from routelog.errors import CorruptDataError, RoutelogError
from routelog.part import shard_layout
from routelog.shard import EMPTY, _crc
from routelog.storage import Storage
from routelog.values import LOGPROB_INFER, LOGPROB_TRAIN
from routelog.verify import verify_store
from tests.attacks.kit import Expected, assert_same, build_store, read_everything


def _commits(storage: Storage) -> list[tuple[str, dict]]:  # type: ignore[type-arg]
    return [
        (keys.commit_key(0, n), json.loads(storage.read(keys.commit_key(0, n))))
        for n in storage.list(keys.commits_dir(0))
    ]


def test_a_chunk_marked_never_written_is_corruption_not_expert_zero(memory_url: str) -> None:
    """An index entry saying "never written" (crc and SHA recomputed, as a buggy writer would leave them) used to
    decode as experts 0..K-1 with verify clean."""
    build_store(memory_url, sealed=False)
    store = routelog.open_store(memory_url)
    key, commit = _commits(store.storage)[0]
    info = routelog.format.RoutingArrayInfo.model_validate(commit["routing"])
    shard_key = f"{keys.part_dir(0, commit['part'])}/{info.path}/{shard_layout(info).shard_key()}"
    shard = bytearray(store.storage.read(shard_key))
    n = shard_layout(info).index_nbytes
    index = np.frombuffer(bytes(shard[: n - 4]), dtype="<u8").copy()
    index[:2] = EMPTY
    shard[: n - 4] = index.tobytes()
    shard[n - 4 : n] = _crc(bytes(shard[: n - 4]))
    store.storage.write(shard_key, bytes(shard))
    for obj in commit["objects"]:
        if obj["key"].startswith(f"{info.path}/c/"):
            obj.update(size=len(shard), sha256=hashlib.sha256(shard).hexdigest())
    store.storage.write(key, json.dumps(commit).encode())
    with pytest.raises(CorruptDataError, match="never written"):
        read_everything(memory_url)
    assert not verify_store(routelog.open_store(memory_url)).ok


@pytest.mark.parametrize("which", ["part values", "annotation values"])
def test_flipped_bytes_in_values_never_return_wrong_logprobs(memory_url: str, which: str) -> None:
    expected = build_store(memory_url, sealed=False)
    storage = routelog.open_store(memory_url).storage
    if which == "part values":
        key = f"{keys.part_dir(0, _commits(storage)[0][1]['part'])}/values.parquet"
    else:
        directory = keys.annotations_dir(0)
        part = next(n for n in storage.list(directory) if not n.endswith(".json"))
        key = f"{directory}/{part}/values.parquet"
    original = storage.read(key)
    rng = random.Random(which)
    for _ in range(25):
        damaged = bytearray(original)
        damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
        storage.write(key, bytes(damaged))
        with pytest.raises(CorruptDataError, match="SHA-256"):
            read_everything(memory_url)
        assert not verify_store(routelog.open_store(memory_url)).ok
    storage.write(key, original)
    assert_same(read_everything(memory_url), expected)


def test_a_renamed_or_dropped_values_declaration_is_damage(memory_url: str) -> None:
    build_store(memory_url, sealed=False)
    storage = routelog.open_store(memory_url).storage
    key, commit = next((k, c) for k, c in _commits(storage) if c.get("values"))
    original = storage.read(key)
    commit["values"]["columns"][0]["name"] = "logprob_inferred"
    storage.write(key, json.dumps(commit).encode())
    with pytest.raises(CorruptDataError, match="declares"):
        read_everything(memory_url)
    assert not verify_store(routelog.open_store(memory_url)).ok
    dropped = json.loads(original)
    dropped.pop("values")  # the object is still listed: an undeclared values object is refused at parse time
    storage.write(key, json.dumps(dropped).encode())
    with pytest.raises(CorruptDataError, match="no values columns are declared"):
        read_everything(memory_url)
    assert not verify_store(routelog.open_store(memory_url)).ok
    dropped["objects"] = [o for o in dropped["objects"] if o["key"] != "values.parquet"]
    storage.write(key, json.dumps(dropped).encode())
    # With both the declaration and the listing gone the commit no longer vouches for the object: readers (who
    # never list part directories) read the records without the column, and verify reports the unlisted object.
    report = verify_store(routelog.open_store(memory_url))
    assert any("does not list" in p for p in report.problems), report.problems


def _all_objects(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _flip_and_check(url: str, path: Path, position: int, bit: int, expected: Expected) -> str:
    original = path.read_bytes()
    damaged = bytearray(original)
    damaged[position] ^= 1 << bit
    path.write_bytes(bytes(damaged))
    try:
        try:
            got = read_everything(url)
            read_error: RoutelogError | None = None
        except RoutelogError as exc:
            got, read_error = None, exc
        try:
            sound = verify_store(routelog.open_store(url)).ok
        except RoutelogError:  # the run document itself is damaged: `routelog verify` exits with the error
            sound = False
    finally:
        path.write_bytes(original)
    where = f"{path.name} byte {position} bit {bit}"
    if read_error is None:
        assert got is not None
        assert_same(got, expected)  # never wrong data: the flip was harmless (e.g. a timestamp digit)
        return "harmless" if sound else "flagged by verify only"
    assert not sound, f"{where}: reading fails ({read_error}) but verify calls the store sound"
    return "refused"


@pytest.mark.parametrize("sealed", [False, True], ids=["unsealed", "sealed"])
def test_byte_flips_in_every_object_kind(tmp_path: Path, sealed: bool) -> None:
    """Seeded fuzzing: a few flips in every object of a store holding every object kind. Raw exceptions (anything
    but a routelog error) fail the test by propagating."""
    root = tmp_path / uuid.uuid4().hex
    url = f"file://{root}"
    expected = build_store(url, sealed=sealed)
    rng = random.Random(11 if sealed else 12)
    outcomes: dict[str, int] = {}
    kinds: set[str] = set()
    for path in _all_objects(root):
        kinds.add(path.name if path.parent.name != "0" else "shard")
        for _ in range(4):
            outcome = _flip_and_check(url, path, rng.randrange(path.stat().st_size), rng.randrange(8), expected)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert {"routelog.json", "index.parquet", "zarr.json", "values.parquet", "shard"} <= kinds
    assert outcomes.get("refused", 0) > len(_all_objects(root)), outcomes
    assert_same(read_everything(url), expected)


def test_reading_needs_no_values_object_unless_asked(memory_url: str) -> None:
    """The values objects are checked when read, and only when read: routing reads do not fetch them."""
    build_store(memory_url, sealed=False)
    storage = routelog.open_store(memory_url).storage
    for key in [k for k in storage.find("steps") if k.endswith("values.parquet")]:
        storage.write(key, b"garbage")
    snapshot = routelog.open_store(memory_url).step(0)
    assert len(snapshot.read_many(snapshot.sample_ids)) == len(snapshot)
    with pytest.raises(CorruptDataError):
        snapshot.token_values(snapshot.sample_ids, [LOGPROB_INFER, LOGPROB_TRAIN])
