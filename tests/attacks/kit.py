"""Helpers of the attack corpus: a small store with every kind of object, and a full read of it.

Every attack case changes stored bytes (or hands routelog hostile input) and then asserts one of two things: a
typed routelog error that names what is wrong, or exactly the data that was written. ``read_everything`` is the
whole read surface a user has (open, list, read every record, every per-token column), so "the read succeeded"
means "nothing wrong reached a user".
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

import routelog
from routelog import ModelSpec, Record
from routelog.format import keys
from routelog.format.values import LOGPROB_INFER, LOGPROB_TRAIN
from routelog.store.storage import Storage
from routelog.synth import synthetic_spec
from tests.records import sample_records

SPEC = synthetic_spec(layers=6, experts=32, topk=4)


@dataclass(frozen=True)
class Expected:
    """What was written: ``{sample_id: (expert_ids sorted [T, L, K] with -1 rows, valid, {column: values})}``."""

    records: dict[str, tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]]


def make_records(spec: ModelSpec, n: int, seed: int, prefix: str = "") -> list[Record]:
    return sample_records(spec, n, seed, prefix, tokens=(4, 40), logprobs=True, policy_version=3)


def build_store(url: str, *, sealed: bool = True, seed: int = 0) -> Expected:
    """Two writers, several parts, per-token values, an annotation, and (by default) a seal with consolidated
    objects: one store holding every object kind the format has."""
    store = routelog.create_store(url, SPEC, config={"purpose": "attack corpus"})
    expected: dict[str, tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]] = {}
    train: dict[str, dict[str, np.ndarray]] = {}
    for writer_id, prefix in (("alpha", "a/"), ("beta", "b/")):
        records = make_records(SPEC, 5, seed + len(prefix) + ord(prefix[0]), prefix)
        with store.writer(0, writer_id, flush_bytes=600) as writer:
            for record in records:
                writer.append(record)
        for record in records:
            ids = np.sort(np.asarray(record.expert_ids), axis=-1).astype(np.int16)
            assert record.valid is not None and record.token_values is not None
            valid = np.asarray(record.valid)
            ids[~valid] = -1
            values = {LOGPROB_INFER: np.asarray(record.token_values[LOGPROB_INFER], np.float32)}
            train[record.sample_id] = {LOGPROB_TRAIN: values[LOGPROB_INFER] - 0.01}
            values[LOGPROB_TRAIN] = train[record.sample_id][LOGPROB_TRAIN]
            expected[record.sample_id] = (ids, valid, values)
    with store.annotate(0, "trainer") as annotator:
        for sid, columns in train.items():
            annotator.add(sid, columns)
    if sealed:
        store.seal(0)
    return Expected(expected)


def entry_keys(storage: Storage, kind: str, step: int = 0) -> list[str]:
    """Keys of a step's log entries of one kind (``routelog.commit``, ``routelog.annotation``, ...), in log order."""
    found = []
    for name in storage.list(keys.log_dir(step)):
        key = f"{keys.log_dir(step)}/{name}"
        if json.loads(storage.read(key)).get("kind") == kind:
            found.append(key)
    return found


def commit_keys(storage: Storage, step: int = 0) -> list[str]:
    return entry_keys(storage, "routelog.commit", step)


class CommitDoc(dict):  # type: ignore[type-arg]
    """A commit to edit, as a dict; ``entry`` is the whole log entry it is the first commit of (format 4), or
    None when the commit is the entry itself (format 3)."""

    entry: dict | None = None  # type: ignore[type-arg]


def read_commit(storage: Storage, key: str) -> CommitDoc:
    """The first commit of the log entry at ``key``, editable in place (:func:`write_commit` writes it back)."""
    entry = json.loads(storage.read(key))
    if "commits" not in entry:
        return CommitDoc(entry)
    commit = CommitDoc(entry["commits"][0])
    commit.entry = entry
    entry["commits"][0] = commit
    return commit


def write_commit(storage: Storage, key: str, commit: dict) -> None:  # type: ignore[type-arg]
    """Write back the entry an edited commit belongs to."""
    entry = getattr(commit, "entry", None)
    storage.write(key, json.dumps(commit if entry is None else entry).encode())


def read_everything(url: str) -> dict[str, tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]]:
    """Every record and every per-token column through the public read API (raises on any problem)."""
    store = routelog.open_store(url)
    out = {}
    for step in store.steps():
        snapshot = store.step(step)
        infos = list(snapshot.infos())
        columns = snapshot.value_columns()
        values = snapshot.token_values(snapshot.sample_ids, columns)
        for routing in snapshot.read_many([i.sample_id for i in infos]):
            out[routing.sample_id] = (routing.expert_ids, routing.valid, values[routing.sample_id])
    return out


def assert_same(got: dict[str, tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]], expected: Expected) -> None:
    assert sorted(got) == sorted(expected.records)
    for sid, (ids, valid, values) in expected.records.items():
        got_ids, got_valid, got_values = got[sid]
        np.testing.assert_array_equal(got_ids, ids, err_msg=sid)
        np.testing.assert_array_equal(got_valid, valid, err_msg=sid)
        assert sorted(got_values) == sorted(values), sid
        for name, column in values.items():
            np.testing.assert_array_equal(got_values[name], column, err_msg=f"{sid} {name}")
