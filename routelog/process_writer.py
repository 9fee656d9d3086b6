"""A writer whose work runs in its own process, so the inference engine it records does not notice it.

An engine's scheduler is GIL-bound Python: every millisecond a writer's validation, sorting or compression holds the
GIL in the engine's process is a millisecond the scheduler waits. :class:`ProcessWriter` keeps only a copy on the
engine's side: each record's arrays go into a shared-memory segment, and a small JSON header (the record's
metadata and where its arrays lie) goes down a pipe to a child process that runs an ordinary
:class:`~routelog.writer.StepWriter`. The child copies the arrays out, frees the segment, validates, encodes,
uploads and commits. Nothing is pickled: the child is a fresh interpreter running :func:`serve`, and every message
is length-prefixed JSON.

A record the child refuses (or a part that fails) is reported at the caller's next ``append``, ``flush`` or
``close`` as a :class:`~routelog.writer.WriterError` naming the samples, with the child's message.

The child runs at a lower CPU priority (``niceness``, 10 by default): where the engine's host has no idle core, the
scheduler keeps its core and the writer takes what is left; a writer only falls behind, never the engine (its
shared-memory segments bound what waits). ``cpus`` pins the child to those CPUs (Linux), for hosts that keep
cores free beside the engine's: the writer then never runs on the scheduler's core.

Before it reports ready, the child loads the codec kernels its routing takes, or compiles them where numba's cache
is empty (``warm_up``, on by default; :func:`routelog.ranked.warm_up`). The constructor pays that: about 0.5 s, or
about a minute on a fresh 2-core machine. Otherwise the child pays it on its first records and part, while the engine's
appends wait on full segments (measured on a fresh cache: one append blocked for 12 s).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Collection, Mapping
from multiprocessing import resource_tracker, shared_memory
from types import TracebackType
from typing import IO, Any

import numpy as np

from routelog.errors import StoreError
from routelog.record import Record
from routelog.spec import ModelSpec
from routelog.transport import META, record_from_payload, record_payload
from routelog.writer import WriterError

SEGMENT_BYTES = 8 << 20
"""Default size of a shared-memory segment (one 4096-token, 48-layer, top-8 record is 1.5 MB of IDs)."""
_HEADER = struct.Struct("<I")
_CHILD = "import sys; from routelog.process_writer import serve; serve(sys.stdin.buffer, sys.stdout.buffer)"


def _send(stream: IO[bytes], message: Mapping[str, Any]) -> None:
    data = json.dumps(message).encode()
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> dict[str, Any] | None:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    message: dict[str, Any] = json.loads(stream.read(size))
    return message


class ProcessWriter:
    """Appends records to one step through a writer process (see the module docs); a context manager."""

    def __init__(
        self,
        url: str,
        step: int,
        *,
        model_spec: ModelSpec | None = None,
        writer_id: str | None = None,
        flush_bytes: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        segments: int = 4,
        niceness: int = 10,
        cpus: Collection[int] | None = None,
        warm_up: bool = True,
    ) -> None:
        if cpus is not None:
            if not hasattr(os, "sched_setaffinity"):
                raise ValueError("cpus: this platform cannot pin a process to CPUs (no os.sched_setaffinity)")
            known = range(os.cpu_count() or 1)
            if not cpus or any(cpu not in known for cpu in cpus):
                raise ValueError(
                    f"cpus={sorted(cpus)}: give one or more of this machine's CPUs, {known.start}..{known.stop - 1}"
                )
        config = {
            "niceness": niceness,
            "cpus": None if cpus is None else sorted(int(cpu) for cpu in cpus),
            "url": url,
            "step": step,
            "model_spec": None if model_spec is None else model_spec.model_dump(mode="json"),
            "writer_id": writer_id,
            "flush_bytes": flush_bytes,
            "storage_options": dict(storage_options or {}),
            "warm_up": warm_up,
        }
        self._child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if self._child.stdin is None or self._child.stdout is None:  # pragma: no cover - Popen was given both pipes
            raise StoreError("the writer process has no pipes")
        self._to_child, self._from_child = self._child.stdin, self._child.stdout
        _send(self._to_child, config)
        ready = _receive(self._from_child)
        if ready is None or ready.get("op") != "ready":
            raise StoreError(f"the writer process did not start: {ready}")
        self.warm_up_seconds: dict[str, float] = ready.get("warm_up", {})
        """The codec kernel path the child loaded (or compiled) before it was ready, and its seconds."""
        self._segments: dict[str, shared_memory.SharedMemory] = {}
        self._free: list[str] = []
        self._limit = max(1, segments)
        self._errors: list[tuple[list[str], str]] = []
        self._replies: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read_replies, name="routelog-process-writer", daemon=True)
        self._reader.start()
        self._closed = False

    def _read_replies(self) -> None:
        while True:
            message = _receive(self._from_child)
            with self._cond:
                if message is None:
                    self._replies.append({"op": "exited"})
                elif message["op"] == "copied":
                    self._free.append(message["segment"])
                elif message["op"] == "error":
                    self._errors.append((message["sample_ids"], message["message"]))
                else:
                    self._replies.append(message)
                self._cond.notify_all()
            if message is None:
                return

    # -- appending ------------------------------------------------------------------------------------------------
    def append(self, record: Record) -> None:
        """Copy the record into shared memory and hand it to the writer process (blocks only while every segment
        is in use); a refusal of an earlier record is raised here."""
        self._raise_errors()
        payload = record_payload(record)
        meta = payload.pop(META)
        needed = sum(np.asarray(a).nbytes for a in payload.values()) + 64 * len(payload)
        segment = self._segment(needed)
        layout: dict[str, Any] = {}
        offset = 0
        for name, array in payload.items():
            data = np.ascontiguousarray(array)
            view = np.ndarray(data.shape, data.dtype, buffer=segment.buf, offset=offset)
            view[...] = data
            layout[name] = {"offset": offset, "dtype": data.dtype.str, "shape": list(data.shape)}
            offset += -(-data.nbytes // 64) * 64
        _send(self._to_child, {"op": "append", "segment": segment.name, "meta": meta, "arrays": layout})

    def _segment(self, needed: int) -> shared_memory.SharedMemory:
        with self._cond:
            while True:
                fitting = [name for name in self._free if self._segments[name].size >= needed]
                if fitting:
                    self._free.remove(fitting[0])
                    return self._segments[fitting[0]]
                if len(self._segments) < self._limit:
                    break
                if self._free:  # too small: replace it with one large enough
                    name = self._free.pop()
                    _send(self._to_child, {"op": "forget", "segment": name})
                    self._segments.pop(name).unlink()
                    break
                self._cond.wait(timeout=1.0)
                if not self._reader.is_alive():
                    raise StoreError("the writer process exited")
        segment = shared_memory.SharedMemory(create=True, size=max(needed, SEGMENT_BYTES))
        self._segments[segment.name] = segment
        return segment

    def _raise_errors(self) -> None:
        with self._cond:
            errors, self._errors = self._errors, []
        if errors:
            samples = [sid for ids, _ in errors for sid in ids]
            raise WriterError("; ".join(message for _, message in errors), samples)

    def _request(self, op: str) -> dict[str, Any]:
        _send(self._to_child, {"op": op})
        with self._cond:
            while not self._replies:
                self._cond.wait(timeout=1.0)
            reply = self._replies.pop(0)
        if reply["op"] == "exited":
            raise StoreError(f"the writer process exited before answering {op!r}")
        return reply

    def flush(self) -> None:
        """Commit everything appended so far and wait for it."""
        self._request("flush")
        self._raise_errors()

    def close(self) -> None:
        """Commit what is buffered, stop the writer process and free the shared memory."""
        if self._closed:
            return
        self._closed = True
        try:
            self._request("close")
        finally:
            self._to_child.close()
            self._child.wait(timeout=600)
            self._reader.join(timeout=10)
            self._from_child.close()
            for segment in self._segments.values():
                segment.close()
                segment.unlink()
            self._segments.clear()
        self._raise_errors()

    def __enter__(self) -> ProcessWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# -- the writer process ---------------------------------------------------------------------------------------
def _record_from(message: dict[str, Any], segment: shared_memory.SharedMemory) -> Record:
    """The record a message describes, its arrays copied out of the segment (which is reused afterwards)."""
    payload: dict[str, Any] = {
        name: np.ndarray(
            tuple(spec["shape"]), np.dtype(spec["dtype"]), buffer=segment.buf, offset=spec["offset"]
        ).copy()
        for name, spec in message["arrays"].items()
    }
    payload[META] = message["meta"]
    return record_from_payload(payload)


def serve(incoming: IO[bytes], outgoing: IO[bytes]) -> None:
    """The writer process: a StepWriter fed by messages on ``incoming``; replies on ``outgoing``."""
    import routelog
    from routelog.errors import RoutelogError

    config = _receive(incoming)
    if config is None:
        return
    if config.get("niceness") and hasattr(os, "nice"):  # POSIX: yield the CPU to the engine under contention
        os.nice(int(config["niceness"]))
    if config.get("cpus") is not None:  # keep the writer off the engine's cores (it inherited the engine's mask)
        os.sched_setaffinity(0, config["cpus"])
    spec = None if config["model_spec"] is None else ModelSpec.model_validate(config["model_spec"])
    writer = routelog.open_writer(
        config["url"],
        config["step"],
        model_spec=spec,
        writer_id=config["writer_id"],
        flush_bytes=config["flush_bytes"],
        storage_options=config["storage_options"] or None,
    )
    warmed = {}
    if config.get("warm_up"):  # before the first record, not while the engine's segments fill up
        from routelog.ranked import kernel_path, warm_up

        spec = writer.store.model_spec
        warmed = warm_up([kernel_path(spec.num_experts, spec.topk)])
    _send(outgoing, {"op": "ready", "warm_up": warmed})
    attached: dict[str, shared_memory.SharedMemory] = {}
    while True:
        received = _receive(incoming)
        message = received or {}
        op = "close" if received is None else message["op"]
        try:
            if op == "append":
                name = message["segment"]
                if name not in attached:
                    attached[name] = shared_memory.SharedMemory(name=name)
                    resource_tracker.unregister(f"/{name}", "shared_memory")  # the engine owns it
                record = _record_from(message, attached[name])
                _send(outgoing, {"op": "copied", "segment": name})
                writer.append(record)
            elif op == "forget":
                segment = attached.pop(message["segment"], None)
                if segment is not None:
                    segment.close()
            elif op == "flush":
                writer.flush()
                _send(outgoing, {"op": "flushed"})
            elif op == "close":
                writer.close()
                if received is not None:
                    _send(outgoing, {"op": "closed"})
                return
        except RoutelogError as exc:  # reported to the engine's next call, naming the samples
            samples = getattr(exc, "sample_ids", None) or [getattr(exc, "sample_id", None) or "?"]
            _send(outgoing, {"op": "error", "sample_ids": [str(s) for s in samples], "message": str(exc)})
            if op in ("flush", "close"):
                _send(outgoing, {"op": "flushed" if op == "flush" else "closed"})
                if op == "close":
                    return
