"""Ray: writers as actors (or inside existing rollout workers), and Ray Data reads of many stores.

Nothing crosses Ray as a custom Python object: a record travels as numpy arrays plus a JSON string of metadata,
and the datasets hold plain columns, so a reader needs routelog only to decode, never to unpickle.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cache, partial
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from routelog.format.documents import INDEX_SCHEMA
from routelog.format.keys import check_writer_id
from routelog.format.part import PartOptions
from routelog.format.spec import ModelSpec
from routelog.format.transport import record_from_payload
from routelog.ray_session import ray_session
from routelog.store.store import Store, create_store, open_store

if TYPE_CHECKING:
    from routelog.store.committer import JsonClient


def ray_writer_id(prefix: str = "ray") -> str:
    """A writer id for writers inside rollout workers: ``<prefix>-<16 hex digits>``, the same for every call in one
    Ray actor (or one task), different between actors and between tasks.

    The digits hash the whole actor id (or task id): a task id ends with its job's part, shared by every task of
    the job, so no slice of it tells concurrent tasks apart. One actor that runs methods concurrently
    (``max_concurrency`` > 1) gets one id for all of them: give each of its concurrent writers its own ``prefix``.
    """
    import ray

    context = ray.get_runtime_context()
    ident = context.get_actor_id() or context.get_task_id() or context.get_worker_id()
    digest = hashlib.blake2b(str(ident).encode(), digest_size=8).hexdigest()
    return check_writer_id(f"{prefix}-{digest}")


# -- a committer shared by the writers of a cluster -------------------------------------------------------------------
COMMIT_TIMEOUT = 660.0
"""Seconds a writer waits for the committer actor's answer to a commit: longer than any part may wait for its commit
(:data:`~routelog.store.writer.MAX_COMMIT_DELAY`); past it the writer commits through its own committer."""
LOOKUP_TIMEOUT = 60.0
_STARTED: dict[str, list[Any]] = {}
"""The committer actors this process started, by name: held so that they live as long as the process."""


def committer_name(url: str) -> str:
    """The name of a store's committer actor: ``routelog-committer-<hash of the URL>``."""
    return f"routelog-committer-{hashlib.blake2b(url.rstrip('/').encode(), digest_size=8).hexdigest()}"


class CommitterActor:
    """A :class:`~routelog.store.committer.Committer` of one store in a Ray actor: the writers of a cluster commit
    through it (:func:`start_committer`). Requests and replies cross as JSON bytes, never pickled objects."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, shards: int = 1) -> None:
        from routelog.store.committer import Committer, JsonCommitter

        self._committer = JsonCommitter(Committer(open_store(url, storage_options=storage_options)))
        self._shards = shards
        self._calls = {"lookup": 0, "commit": 0}

    def lookup(self, request: bytes) -> bytes:
        self._calls["lookup"] += 1
        return self._committer.lookup(request)

    def commit(self, request: bytes) -> bytes:
        self._calls["commit"] += 1
        return self._committer.commit(request)

    def shards(self) -> int:
        """How many committer actors share the store's writers (this one is the first)."""
        return self._shards

    def usage(self) -> str:
        """JSON: the calls answered and the CPU seconds the actor's process spent (what one committer can take)."""
        import time

        return json.dumps({**self._calls, "cpu_s": time.process_time()})


def _shard_names(name: str, shards: int) -> list[str]:
    return [name, *(f"{name}-{i}" for i in range(1, shards))]


def _ray_client(actors: Sequence[Any], name: str) -> JsonClient:
    """A writer's handle on the committer actors ``actors`` (each writer always reaches the same one): a call that
    gets no answer (the actor's process died, or the call timed out) raises
    :class:`~routelog.store.committer.CommitterUnavailableError`, and the writer commits through its own committer."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from routelog.store.committer import CommitterUnavailableError, JsonClient

    def call(method: str, writer_id: str, payload: bytes) -> bytes:
        shard = int.from_bytes(hashlib.blake2b(writer_id.encode(), digest_size=4).digest(), "little") % len(actors)
        timeout = COMMIT_TIMEOUT if method == "commit" else LOOKUP_TIMEOUT
        try:
            return bytes(ray.get(getattr(actors[shard], method).remote(payload), timeout=timeout))
        except (RayActorError, GetTimeoutError) as exc:
            raise CommitterUnavailableError(f"the committer actor {name!r} ({shard}) did not answer: {exc}") from exc

    return JsonClient(call)


def start_committer(
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    name: str | None = None,
    shards: int = 1,
    max_concurrency: int = 256,
    max_restarts: int = -1,
    num_cpus: float = 0.5,
) -> JsonClient:
    """Start the committer actor of the store at ``url`` (or find the one running under ``name``, by default
    :func:`committer_name`): every writer given it commits through it, many parts per log entry, instead of
    contending for the step's log (:func:`connect_committer` finds it from another actor). ``shards`` > 1 starts
    that many actors and sends each writer to one of them (one takes about 2,000 calls a second: two a part). It
    lives as long as the process that started it (or until :func:`stop_committer`); Ray restarts it if its process
    dies (a new one reads the log again); meanwhile writers commit through their own committers."""
    ray = ray_session()

    name = name or committer_name(url)
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    actors = _STARTED.get(name) or [
        ray.remote(CommitterActor)
        .options(
            name=shard,
            get_if_exists=True,
            max_concurrency=max_concurrency,
            max_restarts=max_restarts,
            num_cpus=num_cpus,
        )
        .remote(url, dict(storage_options or {}), shards)
        for shard in _shard_names(name, shards)
    ]
    _STARTED[name] = actors  # owned by this process for as long as it runs (an actor nobody holds is ended)
    return _ray_client(actors, name)


def stop_committer(url: str, *, name: str | None = None) -> None:
    """End the committer actors this process started for ``url`` (writers then commit through their own)."""
    import ray

    for actor in _STARTED.pop(name or committer_name(url), []):
        ray.kill(actor, no_restart=True)


def connect_committer(url: str, *, name: str | None = None) -> JsonClient:
    """The committer actors started for the store at ``url`` (under ``name``, by default :func:`committer_name`), as
    a writer's ``committer``."""
    import ray

    name = name or committer_name(url)
    first = ray.get_actor(name)
    count: Any = ray.get(first.shards.remote())
    shards = int(count)
    return _ray_client([first, *(ray.get_actor(n) for n in _shard_names(name, shards)[1:])], name)


class RoutingWriter:
    """A writer for one step, meant to run as a Ray actor (see :func:`remote_writer`). With ``committer`` (the name
    of a committer actor, :func:`start_committer`) it commits through that actor."""

    def __init__(
        self,
        url: str,
        step: int,
        writer_id: str,
        model_spec_json: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        flush_bytes: int | None = None,
        topk_order: str = "sorted",
        encode_threads: int = 1,
        committer: str | None = None,
    ) -> None:
        store = (
            create_store(url, ModelSpec.model_validate_json(model_spec_json), storage_options=storage_options)
            if model_spec_json
            else open_store(url, storage_options=storage_options)
        )
        options = PartOptions(topk_order="score" if topk_order == "score" else "sorted")
        self._writer = store.writer(
            step,
            writer_id,
            options=options,
            flush_bytes=flush_bytes,
            encode_threads=encode_threads,
            committer=None if committer is None else connect_committer(url, name=committer),
        )

    def append(self, payload: Mapping[str, Any]) -> None:
        self._writer.append(record_from_payload(payload))

    def append_many(self, payloads: Sequence[Mapping[str, Any]]) -> int:
        for payload in payloads:
            self.append(payload)
        return len(payloads)

    def flush(self) -> int:
        return len(self._writer.flush())

    def close(self) -> list[str]:
        """Commit the rest; returns the part names this writer committed."""
        return [c.part for c in self._writer.close()]


def remote_writer(
    url: str,
    step: int,
    writer_id: str,
    *,
    model_spec: ModelSpec | None = None,
    storage_options: Mapping[str, Any] | None = None,
    num_cpus: float = 0.5,
    **kwargs: Any,
) -> Any:
    """Start a :class:`RoutingWriter` actor; feed it :func:`routelog.format.transport.record_payload` dicts.
    ``kwargs`` are the actor's (``flush_bytes``, ``topk_order``, ``encode_threads``: reserve ``num_cpus`` for
    them; ``committer``: the name of a committer actor to commit through, :func:`start_committer`)."""
    ray = ray_session()

    actor = ray.remote(num_cpus=num_cpus)(RoutingWriter)
    spec_json = None if model_spec is None else model_spec.model_dump_json()
    return actor.remote(url, step, writer_id, spec_json, dict(storage_options or {}), **kwargs)


@cache
def _store(url: str, options_json: str) -> Store:
    return open_store(url, storage_options=json.loads(options_json))


def _index_rows(tasks: pa.Table) -> pa.Table:
    """The index of each task's store (and step), after ``url``, ``options`` and ``step`` columns: built as Arrow
    tables so nullable integers stay integers (row dicts would turn a None into NaN)."""
    tables = []
    for task in tasks.to_pylist():
        store = _store(task["url"], task["options"])
        for step in store.steps() if task["step"] is None else [task["step"]]:
            index = _plain_columns(store.step(step).to_arrow().drop_columns(["step"]))
            n = index.num_rows
            where = [pa.repeat(pa.scalar(task["url"]), n), pa.repeat(pa.scalar(task["options"]), n)]
            columns = [*where, pa.repeat(pa.scalar(step, pa.int64()), n), *index.columns]
            tables.append(pa.Table.from_arrays(columns, names=["url", "options", "step", *index.column_names]))
    if not tables:  # stores with no steps: an empty block of the same schema
        index = INDEX_SCHEMA.remove(INDEX_SCHEMA.get_field_index("step")).append(pa.field("part", pa.string()))
        schema = pa.schema([("url", pa.string()), ("options", pa.string()), ("step", pa.int64()), *index])
        return _plain_columns(pa.Table.from_batches([], schema=schema))
    return pa.concat_tables(tables)


def _plain_columns(index: pa.Table) -> pa.Table:
    """Each column that is a list of structs (``spans``, ``segments``: Ray would convert them to Python objects and
    pickle them) as one list column per field, ``<column>_<field>``: plain Arrow lists, the same values in order."""
    table = index
    for name in [f.name for f in index.schema if pa.types.is_list(f.type) and pa.types.is_struct(f.type.value_type)]:
        position = table.column_names.index(name)
        lists = table.column(name).combine_chunks()
        table = table.remove_column(position)
        fields = lists.type.value_type
        offsets = pc.subtract(lists.offsets, lists.offsets[0])
        values = lists.flatten()
        for k in range(fields.num_fields):
            column = pa.ListArray.from_arrays(offsets, values.field(k))
            table = table.add_column(position + k, f"{name}_{fields.field(k).name}", column)
    return table


def read_index(
    urls: Iterable[str], *, steps: Sequence[int] | None = None, storage_options: Mapping[str, Any] | None = None
) -> Any:
    """A Ray dataset with one row per record of the stores (all steps, or ``steps``): the url, the step and the
    index columns (:meth:`routelog.StepSnapshot.to_arrow`; its lists of structs, ``spans`` and ``segments``, as
    plain list columns ``spans_<field>`` and ``segments_<field>``, which Ray never pickles), no routing."""
    ray = ray_session()

    options = json.dumps(dict(storage_options or {}))
    tasks = [{"url": u, "step": s, "options": options} for u in urls for s in (steps if steps is not None else [None])]
    return ray.data.from_items(tasks).map_batches(_index_rows, batch_size=1, batch_format="pyarrow")


def _fetch_routing(batch: pa.Table, moe_layers: list[int] | None) -> pa.Table:
    from ray.data.extensions import ArrowTensorArray

    n = batch.num_rows
    keys = list(zip(*(batch.column(c).to_pylist() for c in ("url", "options", "step", "sample_id")), strict=True))
    by_step: dict[tuple[str, str, int], list[str]] = {}
    for url, options, step, sid in keys:
        by_step.setdefault((url, options, step), []).append(sid)
    fetched = {}
    for (url, options, step), sids in by_step.items():
        snapshot = _store(url, options).step(step)
        for routing in snapshot.read_many(sids, moe_layers=moe_layers):
            fetched[(url, step, routing.sample_id)] = routing
    # Ragged tensors as Ray's Arrow tensor extension (an object array, so Ray does not first try to stack them).
    ids, valid = np.empty(n, dtype=object), np.empty(n, dtype=object)
    for i, (url, _, step, sid) in enumerate(keys):
        routing = fetched[(url, step, sid)]
        ids[i], valid[i] = routing.expert_ids, routing.valid
    table = batch.append_column("expert_ids", ArrowTensorArray.from_numpy(ids))
    return table.append_column("valid", ArrowTensorArray.from_numpy(valid))


def read_routing(
    urls: Iterable[str],
    *,
    steps: Sequence[int] | None = None,
    moe_layers: Sequence[int] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    batch_size: int = 16,
) -> Any:
    """The index of :func:`read_index`, then every record's routing fetched in parallel: adds ``expert_ids``
    (``[n_tokens, layers, K]`` int16, -1 on missing rows) and ``valid``."""
    return read_index(urls, steps=steps, storage_options=storage_options).map_batches(
        partial(_fetch_routing, moe_layers=None if moe_layers is None else list(moe_layers)),
        batch_size=batch_size,
        batch_format="pyarrow",
    )
