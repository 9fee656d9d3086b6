"""Names read from stored documents never leave the store: every one is validated when the document is parsed.

A forged ``part`` of ``../../victim-store/...`` used to make readers return another store's records (with verify
clean), and a seal key ``../../outside-secret.json`` was followed. Each case below forges one stored name, with
checksums recomputed so that only the name is wrong, and requires a typed error from readers, a problem from
verify, and a gc that deletes nothing, inside or outside the store.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import routelog
from routelog.errors import CorruptDataError, GcRefusedError, RoutelogError, UnsafeKeyError
from routelog.format import keys
from routelog.store.gc import collect_garbage
from routelog.store.storage import Storage
from routelog.store.verify import verify_store
from tests.attacks.kit import SPEC, build_store, commit_keys, entry_keys, read_commit, read_everything, write_commit

ESCAPE = "../../../../victim-store/steps/0000000000/parts/alpha.00000000.aaaaaaaaaaaa"


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _edit_json(storage: Storage, key: str, edit: Callable[[Any], None]) -> None:
    doc = json.loads(storage.read(key))
    edit(doc)
    storage.write(key, json.dumps(doc).encode())


def _first_commit(storage: Storage) -> str:
    return commit_keys(storage)[0]


def _forge_span_part(storage: Storage) -> None:
    """Rewrite a part's index so a span points outside the store, and its commit's SHA-256 to match."""
    key = _first_commit(storage)
    commit = read_commit(storage, key)
    index_key = f"{keys.part_dir(0, commit['part'])}/{keys.INDEX}"
    table = pq.read_table(io.BytesIO(storage.read(index_key)))
    rows = table.to_pylist()
    rows[0]["spans"][0]["part"] = ESCAPE
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), sink)
    data = sink.getvalue()
    storage.write(index_key, data)
    for obj in commit["objects"]:
        if obj["key"] == keys.INDEX:
            obj.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    write_commit(storage, key, commit)


def _forge_commit(field: str) -> Callable[[Storage], None]:
    def forge(storage: Storage) -> None:
        def edit(doc: Any) -> None:
            if field == "part":
                doc["part"] = ESCAPE
            elif field == "routing.path":
                doc["routing"]["path"] = "../../../../victim-store"
            elif field == "objects.key":
                doc["objects"][0]["key"] = "../../../../victim-store/routelog.json"
            elif field == "values.key":
                doc["values"]["key"] = "../../../../victim-store/routelog.json"

        key = _first_commit(storage)
        commit = read_commit(storage, key)
        edit(commit)
        write_commit(storage, key, commit)

    return forge


def _forge_seal_key(storage: Storage) -> None:
    _edit_json(
        storage,
        keys.seal_key(0),
        lambda doc: doc["consolidated"]["commits"].update(key="../../../outside-secret.json"),
    )


def _forge_seal_commit_name(storage: Storage) -> None:
    _edit_json(storage, keys.seal_key(0), lambda doc: doc["commits"].__setitem__(0, "../../../x.00000000.json"))


def _forge_annotation_part(storage: Storage) -> None:
    _edit_json(storage, entry_keys(storage, "routelog.annotation")[0], lambda doc: doc.update(part=ESCAPE))


FORGERIES: dict[str, Callable[[Storage], None]] = {
    "commit part": _forge_commit("part"),
    "routing path": _forge_commit("routing.path"),
    "object key": _forge_commit("objects.key"),
    "values key": _forge_commit("values.key"),
    "span part": _forge_span_part,
    "seal consolidated key": _forge_seal_key,
    "seal commit name": _forge_seal_commit_name,
    "annotation part": _forge_annotation_part,
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_forged_names_are_refused_and_gc_deletes_nothing(tmp_path: Path, forgery: str) -> None:
    victim = tmp_path / "victim-store"
    build_store(f"file://{victim}", seed=7)
    attacked_root = tmp_path / "runs" / "a" / "b" / "attacked"
    url = f"file://{attacked_root}"
    build_store(url, sealed=forgery.startswith("seal"), seed=1)
    (tmp_path / "outside-secret.json").write_text('{"secret": true}')
    store = routelog.open_store(url)  # unsealed: reads go through the commits (sealed for the seal forgeries)
    victim_before = _tree(victim)
    FORGERIES[forgery](store.storage)
    with pytest.raises(RoutelogError) as info:
        read_everything(url)
    assert isinstance(info.value, (CorruptDataError, UnsafeKeyError)), info.value
    assert not verify_store(routelog.open_store(url)).ok
    attacked_before = _tree(attacked_root)
    try:
        report = collect_garbage(routelog.open_store(url), 0, delete=True, force=True)
    except GcRefusedError as exc:  # a damaged document: gc deletes nothing
        refusal = str(exc)
        assert "damaged" in refusal
    else:  # gc does not read indexes, so a forged span is not its concern: but there is no garbage to delete
        assert report.orphans == {}
    assert _tree(attacked_root) == attacked_before
    assert _tree(victim) == victim_before
    assert (tmp_path / "outside-secret.json").exists()


def test_storage_refuses_keys_that_leave_the_root(tmp_path: Path) -> None:
    storage = Storage.open(f"file://{tmp_path}/store")
    for key in ("../x", "a/../../x", "/etc/passwd", "a//b", "a/./b", "a\\b", "steps/\x00"):
        with pytest.raises(UnsafeKeyError):
            storage.read(key)
        with pytest.raises(UnsafeKeyError):
            storage.delete([key])
    with pytest.raises(UnsafeKeyError):
        routelog.create_store(f"file://{tmp_path}/s", SPEC).writer(0, "../escape")


def test_gc_with_an_unreadable_document_deletes_no_orphan(tmp_path: Path) -> None:
    """Even a genuine orphan stays while any document is damaged: gc cannot prove what is unreferenced."""
    url = f"file://{tmp_path}/store"
    build_store(url, sealed=False)
    store = routelog.open_store(url)
    orphan = f"{keys.part_dir(0, 'dead.00000000.0123456789ab')}/index.parquet"
    store.storage.write(orphan, b"orphaned bytes")
    store.storage.write(_first_commit(store.storage), b"{not json")
    dry = collect_garbage(store, 0, force=True)
    assert dry.damaged and not dry.deleted
    with pytest.raises(GcRefusedError, match="damaged"):
        collect_garbage(store, 0, delete=True, force=True)
    assert store.storage.read(orphan) == b"orphaned bytes"


def test_a_copied_store_reads_the_same(tmp_path: Path) -> None:
    """Names are relative: a store moved elsewhere (or copied to S3) reads identically."""
    build_store(f"file://{tmp_path}/one")
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    first, second = read_everything(f"file://{tmp_path}/one"), read_everything(f"file://{tmp_path}/two")
    assert sorted(first) == sorted(second)
