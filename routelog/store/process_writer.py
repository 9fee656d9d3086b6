"""A writer whose work runs in its own process, so the inference engine it records does not notice it.

An engine's scheduler is GIL-bound Python: every millisecond a writer's validation, sorting or compression holds the
GIL in the engine's process is a millisecond the scheduler waits. :class:`ProcessWriter` keeps only a copy on the
engine's side: each record's arrays go into a shared-memory segment, and a small JSON header (the record's
metadata and where its arrays lie) goes down a pipe to a child process that runs an ordinary
:class:`~routelog.store.writer.StepWriter`. The child copies the arrays out, frees the segment, validates, encodes,
uploads and commits. Nothing is pickled: the child is a fresh interpreter running :func:`serve`, and every message
is length-prefixed JSON.

A record the child refuses (or a part that fails) is reported at the caller's next ``append``, ``flush`` or
``close`` as a :class:`~routelog.store.writer.WriterError` naming the samples, with the child's message; a flush after
the writer learned that the step is sealed raises :class:`~routelog.errors.StepSealedError`, as an in-process writer's.

A child that dies (killed, crashed, out of memory) is reported at the caller's next call as a
:class:`WriterProcessError` (a ``WriterError``) naming every record appended since the last flush the child
acknowledged: those are not known to be committed. The child's exit status and the last lines it wrote to stderr
are in the message (its stderr is passed through to the engine's as before); a child that fails to start says why
the same way. ``close`` never waits forever (``close_timeout``, then the child is killed), always frees every
shared-memory segment the writer created, and may be called again.

With ``committer`` (a shared committer the engine's process holds: a ``routelog.Committer``, or a client of a Ray
committer actor, ``routelog.ray.connect_committer``), the child commits through it: its lookups and commits come up
the pipe as JSON and the engine's side answers them from a few threads of its own; when that committer does not
answer, the child commits through its own committer, as any writer does.

The child runs at a lower CPU priority (``niceness``, 10 by default): where the engine's host has no idle core, the
scheduler keeps its core and the writer takes what is left; a writer only falls behind, never the engine (its
shared-memory segments bound what waits). ``cpus`` pins the child to those CPUs (Linux), for hosts that keep
cores free beside the engine's: the writer then never runs on the scheduler's core, and compresses on as many
threads as it has CPUs (``encode_threads``; 1 when unpinned).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import resource_tracker, shared_memory
from types import TracebackType
from typing import IO, Any

import numpy as np

from routelog.errors import StepSealedError, StoreError
from routelog.format.record import Record
from routelog.format.spec import ModelSpec
from routelog.format.transport import META, record_from_payload, record_payload
from routelog.store.committer import CommitService, CommitterUnavailableError, JsonClient, JsonCommitter
from routelog.store.storage import check_url
from routelog.store.writer import DEFAULT_FLUSH_SECONDS, WriterError, check_encode_threads, refuse_if_forked

SEGMENT_BYTES = 8 << 20
"""Default size of a shared-memory segment (one 4096-token, 48-layer, top-8 record is 1.5 MB of IDs)."""
_HEADER = struct.Struct("<I")
_CHILD = (  # replies go to a copy of stdout; the child's fd 1 becomes its stderr, so no stray print breaks a reply.
    # Messages are read from an unbuffered copy of stdin: the thread reading it may still wait there when the
    # interpreter exits, which a buffered reader's lock would turn into a fatal error.
    "import os, sys; from routelog.store.process_writer import serve; "
    "replies = os.fdopen(os.dup(1), 'wb'); os.dup2(2, 1); serve(os.fdopen(os.dup(0), 'rb', buffering=0), replies)"
)
DEFAULT_CLOSE_TIMEOUT = 900.0
DEFAULT_ANSWER_TIMEOUT = 900.0
"""Seconds a flush waits for the writer process's answer, and an append for a shared-memory segment it frees (the
process may be uploading a large part to slow storage); past it the process is taken as stopped (SIGSTOP, a host
under memory pressure), killed by its PID, and the call raises naming the records not acknowledged."""
"""Seconds ``close`` waits for the writer process to commit what it holds before killing it."""
_EXIT_WAIT = 30.0
"""Seconds a writer process that answered ``close`` (or lost its input) gets to exit before it is killed."""
_JOIN_WAIT = 5.0
"""Seconds to wait for a reader thread to see the end of its pipe once the writer process is gone."""
_DYING_WAIT = 2.0
"""Seconds a writer process whose pipe broke gets to finish exiting (its status then says why) before it is killed."""
_STDERR_LINES = 12
_RELAY_THREADS = 4
"""Threads of the engine's side answering its writer process's committer calls (a commit waits for its entry)."""
_RELAY_TIMEOUT = 700.0
"""Seconds the writer process waits for the engine's side to answer a committer call before it commits through its
own committer (longer than a shared committer is given: ``routelog.ray.COMMIT_TIMEOUT``)."""


class WriterProcessError(WriterError):
    """The writer process died (killed, crashed, out of memory) or stopped answering and was killed. The records
    named were appended since the last flush it acknowledged: they are not known to be committed. Append them
    again with a new writer; any that did commit are skipped as already present."""

    def __init__(self, message: str, sample_ids: list[str], returncode: int | None) -> None:
        super().__init__(message, sample_ids)
        self.returncode = returncode
        """The process's exit status (negative: the signal that ended it), None if it could not be reaped."""


def _send(stream: IO[bytes], message: Mapping[str, Any]) -> None:
    data = json.dumps(message).encode()
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> dict[str, Any] | None:
    head = _read_exactly(stream, _HEADER.size)
    if head is None:
        return None
    (size,) = _HEADER.unpack(head)
    body = _read_exactly(stream, size)
    if body is None:
        return None
    message: dict[str, Any] = json.loads(body)
    return message


def _read_exactly(stream: IO[bytes], size: int) -> bytes | None:
    """``size`` bytes (an unbuffered stream returns what the pipe holds); None at the end of the stream."""
    pieces: list[bytes] = []
    left = size
    while left:
        piece = stream.read(left)
        if not piece:
            return None
        pieces.append(piece)
        left -= len(piece)
    return b"".join(pieces)


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
        flush_seconds: float | None = DEFAULT_FLUSH_SECONDS,
        storage_options: Mapping[str, Any] | None = None,
        segments: int = 4,
        niceness: int = 10,
        cpus: Collection[int] | None = None,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
        encode_threads: int | None = None,
        committer: CommitService | None = None,
        answer_timeout: float = DEFAULT_ANSWER_TIMEOUT,
    ) -> None:
        if cpus is not None:
            if not hasattr(os, "sched_setaffinity"):
                raise ValueError("cpus: this platform cannot pin a process to CPUs (no os.sched_setaffinity)")
            known = range(os.cpu_count() or 1)
            if not cpus or any(cpu not in known for cpu in cpus):
                raise ValueError(
                    f"cpus={sorted(cpus)}: give one or more of this machine's CPUs, {known.start}..{known.stop - 1}"
                )
        check_url(url)  # before the process starts: the URL is shown in every message and repr of this writer
        if encode_threads is None:  # the writer process's own cores, where it has some
            encode_threads = 1 if cpus is None else len(set(cpus))
        config = {
            "niceness": niceness,
            "encode_threads": check_encode_threads(encode_threads),
            "cpus": None if cpus is None else sorted(int(cpu) for cpu in cpus),
            "url": url,
            "step": step,
            "model_spec": None if model_spec is None else model_spec.model_dump(mode="json"),
            "writer_id": writer_id,
            "flush_bytes": flush_bytes,
            "flush_seconds": flush_seconds,
            "storage_options": dict(storage_options or {}),
            "committer": committer is not None,
        }
        self.step = step
        self._opened_by = os.getpid()
        self.url = url
        self.close_timeout = close_timeout
        self.answer_timeout = answer_timeout
        """Bound on every other wait for the writer process: a flush's answer, a free shared-memory segment."""
        self.appended = 0
        """Records the writer process accepted as new, as of its last flush or close (as ``StepWriter.appended``)."""
        self.already_present: list[str] = []
        """Sample ids the step already held, as of the last flush or close (as ``StepWriter.already_present``)."""
        self._segments: dict[str, shared_memory.SharedMemory] = {}
        self._free: list[str] = []
        self._limit = max(1, segments)
        self._errors: list[tuple[list[str], str, bool]] = []
        """Refusals the child reported: (sample ids, message, whether the step is sealed)."""
        self._replies: list[dict[str, Any]] = []
        self._unacked: list[str] = []
        """Sample ids sent to the child since the last flush (or close) it acknowledged, in order."""
        self._cond = threading.Condition()
        self._sending = threading.Lock()
        """Messages to the child come from the caller's thread and from the committer relay's."""
        self._relay = (
            None
            if committer is None
            else (JsonCommitter(committer), ThreadPoolExecutor(_RELAY_THREADS, thread_name_prefix="routelog-relay"))
        )
        self._eof = False
        self._failure: WriterProcessError | None = None
        self._closed = False
        self._stopped = False
        self._killed = False
        self._reader: threading.Thread | None = None
        self._stderr_tail: deque[str] = deque(maxlen=_STDERR_LINES)
        self._child = subprocess.Popen(
            [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        if self._child.stdin is None or self._child.stdout is None or self._child.stderr is None:  # pragma: no cover
            raise StoreError("the writer process has no pipes")
        self._to_child, self._from_child = self._child.stdin, self._child.stdout
        self._stderr = threading.Thread(
            target=self._read_stderr, args=(self._child.stderr,), name="routelog-process-writer-stderr", daemon=True
        )
        self._stderr.start()
        try:
            try:
                _send(self._to_child, config)
                ready = _receive(self._from_child)
                while ready is not None and ready.get("op") == "commit-call":  # the child's writer asks as it opens
                    self._relay_call(ready)
                    ready = _receive(self._from_child)
            except (OSError, ValueError):  # a broken pipe, or a garbled reply: the child is gone or going
                ready = None
            if ready is None or ready.get("op") != "ready":
                self._stop(grace=_EXIT_WAIT)
                got = "" if ready is None else f" (it answered {ready!r})"
                raise StoreError(
                    f"the writer process for step {step} of {url} did not start: it {self._exit_cause()}{got}"
                    f"{self._stderr_text()}"
                )
        except BaseException:
            self._stop(grace=0.0)
            raise
        self._reader = threading.Thread(target=self._read_replies, name="routelog-process-writer", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        """The writer process's id."""
        return self._child.pid

    def _read_replies(self) -> None:
        try:
            while (message := _receive(self._from_child)) is not None:
                if message["op"] == "commit-call":
                    self._relay_call(message)
                    continue
                with self._cond:
                    if message["op"] == "copied":
                        self._free.append(message["segment"])
                    elif message["op"] == "error":
                        self._errors.append((message["sample_ids"], message["message"], bool(message.get("sealed"))))
                    else:
                        self._replies.append(message)
                    self._cond.notify_all()
        except Exception:  # a pipe closed under us, a garbled reply: the child is gone (the caller's next call says)
            pass
        finally:
            with self._cond:
                self._eof = True
                self._cond.notify_all()

    def _relay_call(self, message: dict[str, Any]) -> None:
        """A lookup or commit of the child, answered from the engine's side by the shared committer (on a thread of
        the relay: a commit may wait for its log entry)."""
        if self._relay is None:  # a child that was given none: refused, it commits through its own
            self._answer({"op": "commit-unavailable", "id": message["id"], "message": "no committer here"})
            return
        committer, threads = self._relay

        def answer() -> None:
            try:
                reply = getattr(committer, message["method"])(str(message["request"]).encode())
            except Exception as exc:  # unanswered: the child commits through its own committer
                self._answer({"op": "commit-unavailable", "id": message["id"], "message": repr(exc)})
                return
            self._answer({"op": "commit-reply", "id": message["id"], "reply": reply.decode()})

        threads.submit(answer)

    def _answer(self, message: Mapping[str, Any]) -> None:
        with contextlib.suppress(OSError, ValueError), self._sending:  # a child that is gone needs no answer
            _send(self._to_child, message)

    def _read_stderr(self, stream: IO[bytes]) -> None:
        """Pass the child's stderr through to ours, keeping its last lines for the error that says why it died."""
        try:
            while line := stream.readline(1 << 16):
                text = line.decode(errors="replace")
                self._stderr_tail.append(text.rstrip())
                try:
                    sys.stderr.write(text)
                    sys.stderr.flush()
                except Exception:  # our own stderr is closed (interpreter shutdown): keep the tail all the same
                    pass
        except (OSError, ValueError):
            pass

    def _gone(self) -> bool:
        """Whether the child has exited or its replies ended (under the lock)."""
        return self._eof or self._child.poll() is not None

    # -- appending ------------------------------------------------------------------------------------------------
    def append(self, record: Record) -> None:
        """Copy the record into shared memory and hand it to the writer process (blocks only while every segment
        is in use); a refusal of an earlier record, or the writer process's death, is raised here."""
        self._check_usable()
        if self._gone():
            raise self._fail("before this append", also=[record.sample_id])
        self._raise_errors()
        payload = record_payload(record)
        meta = payload.pop(META)
        needed = sum(np.asarray(a).nbytes for a in payload.values()) + 64 * len(payload)
        segment = self._segment(needed, record.sample_id)
        try:
            layout = _copy_into(segment, payload)
        except BaseException:  # the segment is not in use after all
            with self._cond:
                if segment.name in self._segments:
                    self._free.append(segment.name)
            raise
        with self._cond:
            self._unacked.append(record.sample_id)
        self._post({"op": "append", "segment": segment.name, "meta": meta, "arrays": layout}, "append")

    def _segment(self, needed: int, sample_id: str) -> shared_memory.SharedMemory:
        replaced: str | None = None
        deadline, waited_out = time.monotonic() + self.answer_timeout, False
        with self._cond:
            while True:
                fitting = [name for name in self._free if self._segments[name].size >= needed]
                if fitting:
                    self._free.remove(fitting[0])
                    return self._segments[fitting[0]]
                if len(self._segments) < self._limit:
                    break
                if self._free:  # too small: replace it with one large enough
                    replaced = self._free.pop()
                    _release(self._segments.pop(replaced))  # the child may keep its mapping until "forget"
                    break
                if self._gone():
                    break
                if time.monotonic() >= deadline:  # the process holds every segment and answers nothing
                    waited_out = True
                    break
                self._cond.wait(timeout=0.5)
        if waited_out:  # failed outside the lock: stopping the process joins the thread that reads its answers
            stuck = f"freed no shared-memory segment within {self.answer_timeout:g} s (answer_timeout)"
            raise self._fail("while this append waited", also=[sample_id], cause=f"{stuck} and was killed")
        if replaced is not None:
            self._post({"op": "forget", "segment": replaced}, "append", also=[sample_id])
        elif len(self._segments) >= self._limit:
            raise self._fail("while this append waited for a free shared-memory segment", also=[sample_id])
        segment = shared_memory.SharedMemory(create=True, size=max(needed, SEGMENT_BYTES))
        with self._cond:
            self._segments[segment.name] = segment
        return segment

    def _check_usable(self) -> None:
        refuse_if_forked(self._opened_by, f"the ProcessWriter of step {self.step}")
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise ValueError(f"the ProcessWriter of step {self.step} is closed")

    def _raise_errors(self, acknowledged: list[str] | None = None) -> None:
        """Raise the refusals the child reported, once; one that names no record (a flush's or close's) names
        ``acknowledged``, the records that flush covered."""
        with self._cond:
            errors, self._errors = self._errors, []
            if not errors:
                return
            samples = [sid for ids, _, _ in errors for sid in (ids or acknowledged or [])]
            reported = Counter(samples)  # reported now: not named again if the child dies later
            kept = []
            for sid in self._unacked:
                if reported[sid]:
                    reported[sid] -= 1
                else:
                    kept.append(sid)
            self._unacked = kept
        message = "; ".join(message for _, message, _ in errors)
        if not samples and all(sealed for _, _, sealed in errors):
            raise StepSealedError(message)  # as an in-process writer's flush after it learned of the seal
        raise WriterError(message, list(dict.fromkeys(samples)))

    def _post(self, message: Mapping[str, Any], doing: str, also: Iterable[str] = ()) -> None:
        try:
            with self._sending:
                _send(self._to_child, message)
        except (OSError, ValueError) as exc:  # a broken pipe: the child is gone
            raise self._fail(f"when {doing!r} was sent to it", also=also) from exc

    def _request(self, op: str, timeout: float, option: str) -> list[str]:
        """Send ``op`` and wait for its answer (at most ``timeout`` seconds, the writer's ``option``, then the child
        is killed); returns the records it acknowledged (every record sent before it)."""
        with self._cond:
            covered = len(self._unacked)
        self._post({"op": op}, op)
        deadline = time.monotonic() + timeout
        exited: float | None = None
        with self._cond:
            while not self._replies:
                if self._eof:
                    break
                now = time.monotonic()
                if self._child.poll() is not None:  # exited: the reader still drains what it wrote before
                    exited = exited or now
                    if now - exited > _JOIN_WAIT:
                        break
                if now >= deadline:
                    break
                self._cond.wait(timeout=0.2)
            if self._replies:
                reply = self._replies.pop(0)
                self.appended = int(reply.get("appended", self.appended))
                self.already_present = list(reply.get("already_present", self.already_present))
                acknowledged, self._unacked = self._unacked[:covered], self._unacked[covered:]
                return acknowledged
        if self._child.poll() is None and time.monotonic() >= deadline:
            raise self._fail("", cause=f"did not answer {op!r} within {timeout:g} s ({option}) and was killed")
        raise self._fail(f"before answering {op!r}")

    def flush(self) -> None:
        """Commit everything appended so far and wait for it: at most ``answer_timeout`` seconds, then the writer
        process is killed and :class:`WriterProcessError` names the records it did not acknowledge (re-send them)."""
        self._check_usable()
        acknowledged = self._request("flush", self.answer_timeout, "answer_timeout")
        self._raise_errors(acknowledged)

    def close(self) -> None:
        """Commit what is buffered, stop the writer process and free the shared memory.

        Waits at most ``close_timeout`` seconds for the commit, then kills the writer process and raises
        :class:`WriterProcessError` naming what was not acknowledged. A death already reported by an earlier call
        is not raised again; calling ``close`` again does nothing."""
        refuse_if_forked(self._opened_by, f"the ProcessWriter of step {self.step}")
        if self._closed:
            return
        self._closed = True
        if self._failure is not None:
            return  # reported when it happened; everything is freed
        try:
            acknowledged = self._request("close", self.close_timeout, "close_timeout")
        finally:
            self._stop(grace=_EXIT_WAIT)
        self._raise_errors(acknowledged)

    # -- the end of the writer process ----------------------------------------------------------------------
    def _stop(self, grace: float) -> None:
        """End the writer process (it exits on its own within ``grace`` seconds, or is killed), its pipes and
        threads, and free every shared-memory segment this writer created. Idempotent; every wait is bounded."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(OSError, ValueError):
            self._to_child.close()  # end of input: a live child closes its writer and exits
        try:
            self._child.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self._killed = True
            self._child.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):  # stuck in the kernel: SIGKILL lands later
                self._child.wait(timeout=_EXIT_WAIT)
        for thread, stream in ((self._reader, self._from_child), (self._stderr, self._child.stderr)):
            if thread is not None:
                thread.join(timeout=_JOIN_WAIT)
            if stream is not None and (thread is None or not thread.is_alive()):  # else a grandchild holds the pipe
                stream.close()
        with self._cond:
            segments = list(self._segments.values())
            self._segments.clear()
            self._free.clear()
        for segment in segments:
            _release(segment)
        if self._relay is not None:
            self._relay[1].shutdown(wait=False, cancel_futures=True)

    def _exit_cause(self) -> str:
        code = self._child.poll()
        if code is None:
            return "is still running"
        if self._killed:
            return "did not exit and was killed"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            oom = " (also the out-of-memory killer's signal)" if -code == signal.SIGKILL else ""
            return f"was killed by {name}{oom}"
        return f"exited with code {code}"

    def _stderr_text(self) -> str:
        lines = list(self._stderr_tail)
        return "; its last lines on stderr:\n    " + "\n    ".join(lines) if lines else "; it wrote nothing to stderr"

    def _fail(self, when: str, *, also: Iterable[str] = (), cause: str | None = None) -> WriterProcessError:
        """Stop everything (killing the child unless it is exiting already) and return the error the caller gets
        from now on, naming the records not known to be committed."""
        if self._failure is not None:
            return self._failure
        self._stop(grace=0.0 if cause is not None else _DYING_WAIT)
        with self._cond:
            errors, self._errors = self._errors, []
            samples = list(dict.fromkeys([*self._unacked, *also, *(sid for ids, _, _ in errors for sid in ids)]))
            self._unacked = []
        what = " ".join(part for part in (cause or self._exit_cause(), when) if part)
        if samples:
            shown = ", ".join(repr(sid) for sid in samples[:5]) + (", ..." if len(samples) > 5 else "")
            lost = (
                f"{len(samples)} records appended since the last flush it acknowledged are not known to be committed: "
                f"{shown}. Append them again with a new writer (any that did commit are skipped as already present)"
            )
        else:
            lost = "every record appended was acknowledged as committed"
        reported = "".join(f"; before that it reported: {message}" for _, message, _ in errors)
        self._failure = WriterProcessError(
            f"the writer process of step {self.step} (pid {self._child.pid}) {what}; {lost}{reported}"
            f"{self._stderr_text()}",
            samples,
            self._child.returncode,
        )
        return self._failure

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("failed" if self._failure is not None else "open")
        return (
            f"ProcessWriter(step {self.step} of {self.url!r}, pid {self._child.pid}, {state}: "
            f"{self.appended} appended, {len(self.already_present)} already present, "
            f"{len(self._unacked)} not yet acknowledged)"
        )

    def __enter__(self) -> ProcessWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _copy_into(segment: shared_memory.SharedMemory, payload: Mapping[str, Any]) -> dict[str, Any]:
    """Copy the arrays into the segment, 64-byte aligned; returns where each lies (no view of it outlives this)."""
    layout: dict[str, Any] = {}
    offset = 0
    for name, array in payload.items():
        data = np.ascontiguousarray(array)
        view = np.ndarray(data.shape, data.dtype, buffer=segment.buf, offset=offset)
        view[...] = data
        layout[name] = {"offset": offset, "dtype": data.dtype.str, "shape": list(data.shape)}
        offset += -(-data.nbytes // 64) * 64
    return layout


def _release(segment: shared_memory.SharedMemory) -> None:
    """Unmap and unlink a segment this process created (a child's mapping of it stays valid until it lets go)."""
    with contextlib.suppress(BufferError):  # a view of it is still referenced: unlink it all the same
        segment.close()
    with contextlib.suppress(FileNotFoundError):
        segment.unlink()


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


def counters(writer: Any) -> dict[str, Any]:
    """What a flush or close reply tells the engine's side about the step writer's records."""
    return {"appended": writer.appended, "already_present": list(writer.already_present)}


class _ParentCommitter:
    """The writer process's end of the committer relay: calls go up the pipe, their answers come back down it
    (routed here by the thread that reads the pipe)."""

    def __init__(self, send: Callable[[Mapping[str, Any]], None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[int, list[Any]] = {}

    def call(self, method: str, writer_id: str, payload: bytes) -> bytes:
        answered = threading.Event()
        with self._lock:
            number = self._next
            self._next += 1
            self._waiting[number] = [answered, None]
        try:
            self._send({"op": "commit-call", "id": number, "method": method, "request": payload.decode()})
            if not answered.wait(_RELAY_TIMEOUT):
                raise CommitterUnavailableError(f"the engine's side did not answer within {_RELAY_TIMEOUT:g} s")
        finally:
            with self._lock:
                slot = self._waiting.pop(number)
        message = slot[1]
        if message is None or message["op"] != "commit-reply":
            raise CommitterUnavailableError(str(None if message is None else message.get("message")))
        return str(message["reply"]).encode()

    def answer(self, message: Mapping[str, Any]) -> None:
        with self._lock:
            slot = self._waiting.get(int(message["id"]))
            if slot is not None:
                slot[1] = message
                slot[0].set()

    def end(self) -> None:
        """The pipe ended: no answer will come (the calls waiting raise, and the writer commits on its own)."""
        with self._lock:
            for slot in self._waiting.values():
                slot[0].set()


def _pump(incoming: IO[bytes], inbox: queue.Queue[dict[str, Any] | None], relay: _ParentCommitter) -> None:
    """Read the pipe from the engine: committer answers to the calls waiting for them, the rest to ``inbox``."""
    try:
        while (message := _receive(incoming)) is not None:
            if message["op"] in ("commit-reply", "commit-unavailable"):
                relay.answer(message)
            else:
                inbox.put(message)
    finally:
        relay.end()
        inbox.put(None)


def serve(incoming: IO[bytes], outgoing: IO[bytes]) -> None:
    """The writer process: a StepWriter fed by messages on ``incoming``; replies on ``outgoing``.

    A refusal is reported as an ``error`` message naming its samples (none: every record the flush or close
    covered). Anything else that goes wrong ends the process with a traceback on stderr, which the engine's side
    reports with the records it had not seen acknowledged."""
    import routelog
    from routelog.errors import RoutelogError

    sending = threading.Lock()

    def send(message: Mapping[str, Any]) -> None:
        with sending:  # replies, and the committer calls of the writer's threads
            _send(outgoing, message)

    def report(exc: RoutelogError, also: str | None = None) -> None:
        samples = list(exc.sample_ids) if isinstance(exc, WriterError) else []
        if also is not None and also not in samples:
            samples.append(also)
        sealed = isinstance(exc, StepSealedError)
        send({"op": "error", "sample_ids": [str(s) for s in samples], "message": str(exc), "sealed": sealed})

    config = _receive(incoming)
    if config is None:
        return
    if config.get("niceness") and hasattr(os, "nice"):  # POSIX: yield the CPU to the engine under contention
        os.nice(int(config["niceness"]))
    if config.get("cpus") is not None:  # keep the writer off the engine's cores (it inherited the engine's mask)
        os.sched_setaffinity(0, config["cpus"])
    relay = _ParentCommitter(send)
    inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
    threading.Thread(target=_pump, args=(incoming, inbox, relay), name="routelog-pipe", daemon=True).start()
    spec = None if config["model_spec"] is None else ModelSpec.model_validate(config["model_spec"])
    writer = routelog.open_writer(
        config["url"],
        config["step"],
        model_spec=spec,
        writer_id=config["writer_id"],
        flush_bytes=config["flush_bytes"],
        flush_seconds=config.get("flush_seconds", DEFAULT_FLUSH_SECONDS),
        storage_options=config["storage_options"] or None,
        encode_threads=int(config.get("encode_threads", 1)),
        committer=JsonClient(relay.call) if config.get("committer") else None,
    )
    send({"op": "ready"})
    attached: dict[str, shared_memory.SharedMemory] = {}
    while True:
        received = inbox.get()
        message = received or {}
        op = "close" if received is None else message["op"]
        current: str | None = None  # the record an append carries: not taken if the append raises
        try:
            if op == "append":
                current = str(json.loads(message["meta"])["sample_id"])
                name = message["segment"]
                if name not in attached:
                    attached[name] = shared_memory.SharedMemory(name=name)
                    resource_tracker.unregister(f"/{name}", "shared_memory")  # the engine owns it
                try:
                    record = _record_from(message, attached[name])
                finally:  # the segment is free again, also when the record is refused
                    send({"op": "copied", "segment": name})
                try:
                    writer.append(record)
                except WriterError as exc:  # an earlier part's failure, raised before this record was taken
                    report(exc)
                    writer.append(record)
            elif op == "forget":
                segment = attached.pop(message["segment"], None)
                if segment is not None:
                    segment.close()
            elif op == "flush":
                writer.flush()
                send({"op": "flushed", **counters(writer)})
            elif op == "close":
                writer.close()
                if received is not None:
                    send({"op": "closed", **counters(writer)})
                return
        except RoutelogError as exc:  # reported to the engine's next call, naming the samples
            report(exc, current)
            if op in ("flush", "close"):
                send({"op": "flushed" if op == "flush" else "closed", **counters(writer)})
                if op == "close":
                    return
