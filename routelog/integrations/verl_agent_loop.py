"""veRL 0.9 rollout side with no driver code: each agent-loop worker writes the routing of its own trajectories.

Both of veRL's trainers get their rollouts from agent-loop workers (``verl.experimental.agent_loop``): the legacy
trainer collects them into a ``DataProto`` on the driver, the V1 trainer (``trainer.use_v1``, the default) puts
each trajectory into TransferQueue, where no ``DataProto`` ever exists on the driver. The one place both pass
through is the worker's ``_agent_loop_postprocess(output, validate, **kwargs)`` (the legacy worker's, and the V1
worker's override), which turns an ``AgentLoopOutput`` into what the trainer receives. :func:`install` wraps it in
both classes: before veRL's own postprocessing, every training trajectory's routing (``output.routed_experts``, the
engine's rows from the first prompt token) is written to the store's step (the trajectory's global step) as a
record, and the output carries the record's id and step in ``extra_fields`` instead of the dense tensor. veRL moves
``extra_fields`` to the trainer on both paths (legacy: ``non_tensor_batch`` columns; V1: the TransferQueue field),
and :class:`~routelog.integrations.verl.VerlReplay` reads them there. Validation trajectories are left alone.

Writes are group-committed: one writer per process and step flushes every :data:`FLUSH_SECONDS`, and each
trajectory's postprocessing waits (without blocking the worker's event loop) until the part holding its record is
committed, so the trainer never receives an id whose routing is not readable yet.

The routelog plugin (:mod:`routelog.integrations.verl_plugin`) installs this in every process that imports veRL's
agent loop when ``ROUTELOG_URL`` is set: nothing to add to the driver or the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import threading
import types
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np

from routelog.engines.verl import records_from_batch
from routelog.errors import DuplicateSampleError, StoreNotFoundError, WriteInterruptedError
from routelog.format.documents import CommitRecord
from routelog.format.record import Record, token_hash
from routelog.format.spec import ModelSpec
from routelog.integrations.verl import SAMPLE_ID_KEY, STEP_KEY
from routelog.store.store import Store, create_store, open_store
from routelog.store.writer import StepWriter

MAX_ATTEMPTS = 64
"""Regenerations of one trajectory id in one step before its writer gives up."""
FLUSH_SECONDS = 0.2
"""How long a record waits for others of its process and step before its part is written (group commit)."""
COMMIT_TIMEOUT = 120.0
"""How long a trajectory waits for its part's commit before the writer is asked why."""
AGENT_LOOP_MODULE = "verl.experimental.agent_loop.agent_loop"
V1_AGENT_LOOP_MODULE = "verl.trainer.ppo.v1.agent_loop_tq"
_PATCHED = "_routelog_agent_loop"

_trajectory: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "routelog_verl_trajectory", default=None
)
"""The trajectory (global step, sample index, rollout index, validation) of the agent loop this task runs."""


@dataclass(frozen=True)
class Trajectory:
    step: int
    sample_id: str


def trajectory_of(trajectory: Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> Trajectory:
    """Where a postprocessed output belongs: its global step and an id unique in the step (``<uid>/<session>``;
    the dataset index and rollout number when veRL sets no uid)."""
    trajectory = trajectory or {}
    step = kwargs.get("global_steps", trajectory.get("step"))
    if step is None:
        raise WriteInterruptedError(
            "a veRL agent loop finished without a global step (neither its trajectory nor its inputs carry one), so "
            "its routing has no store step: routelog supports veRL 0.9.1's agent-loop workers"
        )
    first = kwargs.get("uid", trajectory.get("sample_index"))
    second = kwargs.get("session_id", trajectory.get("rollout_n", 0))
    return Trajectory(int(_scalar(step)), f"{_scalar(first)}/{_scalar(second)}")


def _scalar(value: Any) -> Any:
    item = getattr(value, "item", None)
    return item() if callable(item) and getattr(value, "ndim", 0) == 0 else value


class AgentLoopRecorder:
    """One process's writers (one per step), group-committed; :meth:`write` waits for its record's commit."""

    def __init__(self, store: Store, *, writer_prefix: str = "agent-loop") -> None:
        self.store = store
        self.writer_prefix = writer_prefix
        self._lock = threading.Lock()
        self._writers: dict[int, StepWriter] = {}
        self._waiting: dict[tuple[int, str], list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = {}
        self._written: dict[tuple[int, str], str] = {}
        """(step, sample id) -> token hash of each record this process appended."""

    def _writer(self, step: int) -> tuple[StepWriter, list[StepWriter]]:
        """The step's writer (opened on first use) and the writers of earlier steps, now done, for the caller to
        close once it has released the lock (their commits call back into it)."""
        done: list[StepWriter] = []
        writer = self._writers.get(step)
        if writer is None:
            for older in [s for s in self._writers if s < step]:  # a later step began: the earlier ones are done
                done.append(self._writers.pop(older))
                self._written = {key: value for key, value in self._written.items() if key[0] >= step}
            writer = self._writers[step] = self.store.writer(
                step,
                f"{self.writer_prefix}-{uuid.uuid4().hex[:12]}",
                flush_seconds=FLUSH_SECONDS,
                on_commit=functools.partial(self._committed, step),
            )
        return writer, done

    def _committed(self, step: int, commit: CommitRecord, ids: list[str]) -> None:
        del commit
        with self._lock:
            waiters = [w for sid in ids for w in self._waiting.pop((step, sid), [])]
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future)

    async def write(self, record: Record, step: int) -> str:
        """Append ``record`` to ``step`` and return its sample id once it is committed (or was already there).

        A trajectory postprocessed again with the same tokens (a retried task) finds its record; one generated again
        under the same id with other tokens gets the next attempt's id (``<id>#1``, ``#2``...): the id travels with
        the trajectory, so the trainer reads the attempt it trains on. The append runs off the event loop: a writer
        whose uploads are behind blocks its caller, never the worker's other trajectories."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        writer, sid = await loop.run_in_executor(None, self._append, record, step, loop, future)
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout=COMMIT_TIMEOUT)
        except TimeoutError:
            await loop.run_in_executor(None, writer.flush)  # raises the part's failure, if one failed
            if not future.done():
                raise WriteInterruptedError(
                    f"sample {sid!r} of step {step}: its part was not committed within {COMMIT_TIMEOUT:.0f} s and "
                    "its writer reports no failure; the store may be unreachable"
                ) from None
        return sid

    def _append(
        self, record: Record, step: int, loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]
    ) -> tuple[StepWriter, str]:
        tokens = token_hash(np.asarray(record.token_ids))
        with self._lock:
            writer, done = self._writer(step)
        for older in done:
            older.close()
        return self._append_to(writer, record, tokens, step, loop, future)

    def _append_to(
        self,
        writer: StepWriter,
        record: Record,
        tokens: str,
        step: int,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[None],
    ) -> tuple[StepWriter, str]:
        """Claim the first attempt id free for these tokens and append under it. The lock is never held across the
        append: a full writer blocks there until a part commits, and its commit calls back into the lock."""
        base = record.sample_id
        for attempt in range(MAX_ATTEMPTS):
            sid = base if attempt == 0 else f"{base}#{attempt}"
            key = (step, sid)
            with self._lock:
                claimed = self._written.get(key)
                if claimed is not None and claimed != tokens:
                    continue  # an earlier attempt of this trajectory, with other tokens
                if claimed == tokens:  # this process wrote it: committed, or its waiters are queued already
                    if key in self._waiting:
                        self._waiting[key].append((loop, future))
                    else:
                        loop.call_soon_threadsafe(_resolve, future)
                    return writer, sid
                self._written[key] = tokens
                self._waiting.setdefault(key, []).append((loop, future))
            try:
                writer.append(replace(record, sample_id=sid))
            except BaseException as exc:
                with self._lock:
                    self._written.pop(key, None)
                    self._waiting.pop(key, None)
                if isinstance(exc, DuplicateSampleError):
                    continue  # another process's attempt, with other tokens
                raise
            if sid in writer.already_present:  # another process wrote these very tokens: nothing to commit
                with self._lock:
                    waiters = self._waiting.pop(key, [])
                for waiting_loop, waiting in waiters:
                    waiting_loop.call_soon_threadsafe(_resolve, waiting)
            return writer, sid
        raise DuplicateSampleError(
            base, "sample_id", f"{MAX_ATTEMPTS} attempts of it in step {step} hold other tokens", "stop regenerating it"
        )

    def close(self) -> None:
        with self._lock:
            writers, self._writers = list(self._writers.values()), {}
        for writer in writers:
            writer.close()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def routed_rows(routed_experts: Any) -> np.ndarray[Any, Any]:
    """An ``AgentLoopOutput.routed_experts`` (array, tensor or nested lists) as an array."""
    numpy = getattr(routed_experts, "numpy", None)
    if callable(numpy):
        return np.asarray(routed_experts.detach().cpu().numpy())
    return np.asarray(routed_experts)


def record_of(output: Any, sample_id: str, spec: ModelSpec, step: int) -> Record:
    """The routing of one ``AgentLoopOutput`` as a record: rows from the first prompt token, as veRL lays them
    out in its batch (rows the engine did not return, and all-zero rows, are missing)."""
    prompt = np.asarray(output.prompt_ids, dtype=np.int64)
    response = np.asarray(output.response_ids, dtype=np.int64)
    tokens = np.concatenate([prompt, response])
    rows = routed_rows(output.routed_experts)
    n = tokens.shape[0]
    aligned = np.zeros((n, *rows.shape[1:]), dtype=rows.dtype)  # veRL's own alignment (AgentLoopOutput.as_dict)
    aligned[: min(n, rows.shape[0])] = rows[:n]
    extra = {k: output.extra_fields[k] for k in ("min_global_steps", "max_global_steps") if k in output.extra_fields}
    (record,) = records_from_batch(
        aligned[None],
        np.ones((1, n), dtype=bool),
        prompt.shape[0],
        spec,
        input_ids=tokens[None],
        sample_ids=[sample_id],
        policy_version=step,
        batch_name="agent loop",
    )
    if extra:
        record.extra = {k: v for k, v in extra.items() if v is None or isinstance(v, int | float | str)}
    return record


class AgentLoopRouting:
    """What :func:`install` puts in front of veRL's ``_agent_loop_postprocess``."""

    def __init__(self, store: Store | str, *, storage_options: Mapping[str, Any] | None = None) -> None:
        self._store = store
        self._storage_options = storage_options
        self._recorder: AgentLoopRecorder | None = None
        self.written = 0
        """Trajectories whose routing this process wrote."""

    def __reduce__(self) -> tuple[Any, ...]:
        """Travels (with Ray's actor class) as its store's URL: each process opens its own writers."""
        url = self._store.url if isinstance(self._store, Store) else self._store
        return (AgentLoopRouting, (url,), {"_storage_options": self._storage_options})

    def recorder(self, worker: Any) -> AgentLoopRecorder:
        if self._recorder is None:
            self._recorder = AgentLoopRecorder(self._open(worker))
        return self._recorder

    def _open(self, worker: Any) -> Store:
        if isinstance(self._store, Store):
            return self._store
        try:
            return open_store(self._store, storage_options=self._storage_options)
        except StoreNotFoundError:
            return create_store(self._store, _spec_of(worker), storage_options=self._storage_options)

    async def before_postprocess(self, worker: Any, output: Any, validate: bool, kwargs: Mapping[str, Any]) -> None:
        """Write the routing of ``output`` (one ``AgentLoopOutput`` or a list) and carry ids instead."""
        if validate:
            return
        outputs = output if isinstance(output, list) else [output]
        routed = [o for o in outputs if getattr(o, "routed_experts", None) is not None]
        if not routed:
            return
        where = trajectory_of(_trajectory.get(), kwargs)
        recorder = self.recorder(worker)
        spec = recorder.store.model_spec
        for i, one in enumerate(outputs):
            if getattr(one, "routed_experts", None) is None:
                continue
            sid = where.sample_id if len(outputs) == 1 else f"{where.sample_id}/{i}"
            sid = await recorder.write(record_of(one, sid, spec, where.step), where.step)
            one.routed_experts = None
            one.extra_fields[SAMPLE_ID_KEY] = sid
            one.extra_fields[STEP_KEY] = where.step
            self.written += 1


def _spec_of(worker: Any) -> ModelSpec:
    """The model spec from the HF ``config.json`` of the worker's model (``actor_rollout_ref.model.path``)."""
    from pathlib import Path

    path = Path(str(worker.config.actor_rollout_ref.model.path)) / "config.json"
    return ModelSpec.from_hf_config(json.loads(path.read_text()))


def install(store: Store | str, *, storage_options: Mapping[str, Any] | None = None) -> AgentLoopRouting:
    """Wrap veRL's agent-loop workers (legacy and V1, whichever are importable) in this process; returns the
    routing writer."""
    import importlib

    routing = AgentLoopRouting(store, storage_options=storage_options)
    patch_module(importlib.import_module(AGENT_LOOP_MODULE), routing)
    with contextlib.suppress(ImportError):  # TransferQueue not installed: no V1 trainer in this process either
        patch_module(importlib.import_module(V1_AGENT_LOOP_MODULE), routing)
    return routing


def patch_module(module: Any, routing: AgentLoopRouting) -> None:
    """Wrap the workers a veRL agent-loop module defines: ``_run_agent_loop`` (which knows the trajectory's step)
    and ``_agent_loop_postprocess``, in the legacy ``AgentLoopWorker`` and the V1 ``AgentLoopWorkerTQ``.

    ``AgentLoopWorkerTQ`` is a Ray actor class from its definition: Ray's class for it holds its own copies of the
    methods (tracing wrappers made at decoration), and those copies are what an actor process runs. They are
    wrapped too, and travel with the class to the actor (the routing writer with them, unopened: each process
    opens its own)."""
    for name in ("AgentLoopWorker", "AgentLoopWorkerTQ"):
        for cls in _classes(getattr(module, name, None)):
            if "_run_agent_loop" in vars(cls):
                _wrap_run(cls)
            if "_agent_loop_postprocess" in vars(cls):
                _wrap_postprocess(cls, routing)


def _classes(worker: Any) -> list[type]:
    """The classes whose own methods a worker runs: a plain class, or a Ray actor class's class and its bases."""
    if worker is None:
        return []
    metadata = getattr(worker, "__ray_metadata__", None)
    cls = metadata.modified_class if metadata is not None else worker
    return [c for c in cls.__mro__ if c is not object]


def _wrap_run(cls: Any) -> None:
    if not getattr(vars(cls)["_run_agent_loop"], _PATCHED, False):
        cls._run_agent_loop = _RunAgentLoop(vars(cls)["_run_agent_loop"])


def _wrap_postprocess(cls: Any, routing: AgentLoopRouting) -> None:
    if not getattr(vars(cls)["_agent_loop_postprocess"], _PATCHED, False):
        cls._agent_loop_postprocess = _Postprocess(vars(cls)["_agent_loop_postprocess"], routing)


class _Method:
    """A wrapped worker method. An object of a module-level class, not a closure: Ray pickles its class for an
    actor by value, and a closure would take this module's globals (the context variable) with it."""

    _routelog_agent_loop = True  # the mark :data:`_PATCHED` names: a class is wrapped once

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        self.__name__ = getattr(original, "__name__", type(self).__name__)
        self.__doc__ = original.__doc__

    def __get__(self, worker: Any, owner: Any = None) -> Any:
        return self if worker is None else types.MethodType(cast(Callable[..., Any], self), worker)


class _RunAgentLoop(_Method):
    """``_run_agent_loop``: the trajectory (its global step) is noted for the postprocessing it runs."""

    async def __call__(self, worker: Any, sampling_params: Any, trajectory: Any, *args: Any, **kwargs: Any) -> Any:
        token = _trajectory.set(trajectory)
        try:
            return await self.original(worker, sampling_params, trajectory, *args, **kwargs)
        finally:
            _trajectory.reset(token)


class _Postprocess(_Method):
    """``_agent_loop_postprocess``: the routing is written, and ids carried, before veRL's own postprocessing."""

    def __init__(self, original: Callable[..., Any], routing: AgentLoopRouting) -> None:
        super().__init__(original)
        self.routing = routing

    async def __call__(self, worker: Any, output: Any, validate: Any, **kwargs: Any) -> Any:
        await self.routing.before_postprocess(worker, output, bool(validate), kwargs)
        return await self.original(worker, output, validate, **kwargs)
