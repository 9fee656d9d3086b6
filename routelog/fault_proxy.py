"""A fault-injecting HTTP proxy between an S3 client and an S3 endpoint, for protocol tests and soak runs.

The client talks to :attr:`FaultProxy.endpoint` (path-style requests, ``http://127.0.0.1:PORT/bucket/key``); the
proxy forwards each request to the upstream endpoint (a moto server in the tests) and relays the response, unless
a fault applies to it::

    with FaultProxy(upstream="http://127.0.0.1:5000") as proxy:
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": proxy.endpoint}, skip_instance_cache=True)
        proxy.inject(Fault("lost_response", method="PUT", key=r"/log/", header="If-None-Match", times=1))
        proxy.set_random(seed=7, rates={"lost_response": 0.05, "error_before": 0.05})
        ...
        proxy.counts  # {"requests": ..., "forwarded": ..., "lost_response": ..., ...}
        proxy.clear()

Faults (:data:`FaultKind`):

``lost_response``
    The request reaches upstream (the storage applies it), then the client connection closes without a response:
    the client sees a disconnect and retries a request that already took effect. A retried conditional create
    (``If-None-Match: *``) then gets 412 for the object the client itself wrote.
``error_before``
    An S3 error response (503 ``SlowDown`` by default, or 500 ``InternalError``) without forwarding: not applied.
``reset_before``
    The connection closes without forwarding (and without reading the request body): not applied.
``delay``
    The request waits ``Fault.delay`` seconds (at most :data:`MAX_DELAY`), then is forwarded normally.

``latency`` (a setting, not a fault) makes every forwarded request wait that long, like an object store's round trip,
and ``observer`` sees every request as it arrives (benchmarks count requests by kind with it).

A dropped connection closes with FIN (aiohttp: ``ServerDisconnectedError``, botocore: ``ConnectionClosedError``),
or with RST when ``Fault(rst=True)`` (aiohttp: ``ClientOSError``, botocore: ``EndpointConnectionError``); the two
reach different retry rules in s3fs.

The proxy speaks HTTP/1.1 with keep-alive on both sides, ``Content-Length`` and chunked bodies both ways, answers
``Expect: 100-continue`` itself, and listens on 127.0.0.1 only. Only plain ``http`` upstreams are supported.
Random faults are reproducible from the seed when requests arrive in a reproducible order (one client at a time).
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import random
import re
import socket
import socketserver
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from types import TracebackType
from typing import Any, Literal, cast, get_args
from urllib.parse import urlsplit
from xml.sax.saxutils import escape

logger = logging.getLogger(__name__)

FaultKind = Literal["lost_response", "error_before", "reset_before", "delay"]
FAULT_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)

MAX_DELAY = 30.0
"""Longest ``delay`` fault, in seconds."""
MAX_BODY = 1 << 30
"""Largest request or response body the proxy handles (1 GiB; S3 parts are far smaller in tests)."""
MAX_REQUESTS_PER_CONNECTION = 100_000
"""Requests served on one client connection before the proxy closes it (the client reconnects)."""
_CHUNK = 1 << 16
_MAX_CHUNKS = 1 << 20
_MAX_TRAILER_LINES = 100
_DRAIN_LIMIT = 8 << 20
"""A lost response's body is read (keeping the upstream connection) up to this size, else the connection closes."""
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
        "content-length",  # the proxy frames every body itself
    }
)
_S3_ERRORS = {
    400: ("BadRequest", "The fault proxy could not parse the request."),
    413: ("EntityTooLarge", "The body is larger than the fault proxy handles."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    502: ("BadGateway", "The fault proxy could not reach the upstream endpoint."),
    503: ("SlowDown", "Please reduce your request rate."),
}


@dataclass(frozen=True)
class Fault:
    """A fault for the next ``times`` requests that match (``None``: every matching request until cleared).

    A request matches when its method equals ``method`` (any method when ``None``), the regular expression ``key``
    is found in its request target (path and query, e.g. ``/bucket/runs/a/log/0001.json?x-id=PutObject``), and it
    carries the header ``header`` (any value), each where given.
    """

    kind: FaultKind
    method: str | None = None
    key: str | None = None
    header: str | None = None
    times: int | None = 1
    status: int = 503
    """``error_before``: the status answered (503 ``SlowDown``, 500 ``InternalError``, others a generic error)."""
    delay: float = 0.2
    """``delay``: seconds waited before forwarding."""
    rst: bool = False
    """``lost_response`` and ``reset_before``: close with a TCP reset instead of a clean close."""
    _pattern: re.Pattern[str] | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {self.kind!r}: one of {', '.join(FAULT_KINDS)}")
        if self.times is not None and self.times < 1:
            raise ValueError(f"times must be at least 1 (or None for every matching request), not {self.times}")
        if not 0 <= self.delay <= MAX_DELAY:
            raise ValueError(f"delay must be within [0, {MAX_DELAY}] seconds, not {self.delay}")
        if not 400 <= self.status <= 599:
            raise ValueError(f"status must be an HTTP error status (400-599), not {self.status}")
        if self.method is not None:
            object.__setattr__(self, "method", self.method.upper())
        if self.key is not None:
            object.__setattr__(self, "_pattern", re.compile(self.key))

    def matches(self, method: str, target: str, headers: Iterable[str]) -> bool:
        """Whether a request (``headers``: its header names, lower case) matches this fault."""
        if self.method is not None and method.upper() != self.method:
            return False
        if self._pattern is not None and self._pattern.search(target) is None:
            return False
        return self.header is None or self.header.lower() in headers


@dataclass(frozen=True)
class FaultEvent:
    """One injected fault, for test diagnostics."""

    method: str
    path: str
    kind: FaultKind
    at: float
    """``time.time()`` when the fault was chosen."""


@dataclass
class _Armed:
    fault: Fault
    remaining: int | None


class _BadRequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class FaultProxy:
    """An HTTP proxy on ``127.0.0.1`` (a free port) in front of ``upstream``, injecting :class:`Fault` s.

    It serves from construction until :meth:`close` (or the end of a ``with`` block); each client connection
    runs in its own thread. ``upstream_timeout`` bounds each wait on the upstream endpoint, ``idle_timeout`` each
    wait for a client's next request; ``log_size`` bounds :attr:`events`.
    """

    def __init__(
        self,
        upstream: str,
        *,
        upstream_timeout: float = 60.0,
        idle_timeout: float = 30.0,
        log_size: int = 1000,
        latency: float = 0.0,
        observer: Callable[[str, str, frozenset[str]], None] | None = None,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/") or parts.query:
            raise ValueError(f"upstream must be a plain http://host:port endpoint, not {upstream!r}")
        self.upstream = upstream.rstrip("/")
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port or 80
        self.upstream_timeout = upstream_timeout
        self.idle_timeout = idle_timeout
        if not 0 <= latency <= MAX_DELAY:
            raise ValueError(f"latency must be within [0, {MAX_DELAY}] seconds, not {latency}")
        self.latency = latency
        """Seconds every request waits before it is forwarded (an object store's round trip), faults or not."""
        self.observer = observer
        """Called with each request's method, target and header names (lower case) as it arrives: benchmarks count
        requests by kind with it."""
        self._lock = threading.Lock()
        self._faults: list[_Armed] = []
        self._random: list[tuple[Fault, float]] = []
        self._rng = random.Random(0)
        self._counts = self._zero_counts()
        self._events: deque[FaultEvent] = deque(maxlen=log_size)
        self._active: dict[socket.socket, threading.Thread] = {}
        self._closing = threading.Event()
        self._server = _Server(self)
        port: int = self._server.socket.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        """The URL clients use as their S3 ``endpoint_url``."""
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fault-proxy", daemon=True
        )
        self._thread.start()

    # -- control -----------------------------------------------------------------------------------------------
    def inject(self, fault: Fault) -> None:
        """Arm ``fault``; counted faults fire in the order injected, before any random fault."""
        with self._lock:
            self._faults.append(_Armed(fault, fault.times))

    def set_random(
        self,
        seed: int,
        rates: Mapping[FaultKind, float],
        *,
        method: str | None = None,
        key: str | None = None,
        header: str | None = None,
        status: int = 503,
        delay: float = 0.2,
        rst: bool = False,
    ) -> None:
        """Inject faults at random into matching requests (see :class:`Fault` for the matching and the options):
        each request draws once from ``random.Random(seed)`` and gets at most one fault, ``kind`` with probability
        ``rates[kind]``. Replaces earlier random rates."""
        total = 0.0
        faults: list[tuple[Fault, float]] = []
        for kind, rate in rates.items():
            if not 0 <= rate <= 1:
                raise ValueError(f"rate of {kind} must be within [0, 1], not {rate}")
            total += rate
            fault = Fault(kind, method=method, key=key, header=header, times=None, status=status, delay=delay, rst=rst)
            faults.append((fault, rate))
        if total > 1 + 1e-9:
            raise ValueError(f"fault rates add up to {total}, more than 1")
        with self._lock:
            self._rng = random.Random(seed)
            self._random = faults

    def clear(self) -> None:
        """Remove every fault and random rate; reset :attr:`counts` and :attr:`events`."""
        with self._lock:
            self._faults.clear()
            self._random = []
            self._counts = self._zero_counts()
            self._events.clear()

    @property
    def counts(self) -> dict[str, int]:
        """``requests`` received, ``forwarded`` (answered by upstream), ``upstream_error`` (answered 502),
        ``expect_continue`` (``Expect: 100-continue`` requests), and how many times each fault fired."""
        with self._lock:
            return dict(self._counts)

    @property
    def events(self) -> list[FaultEvent]:
        """The latest injected faults, oldest first (at most ``log_size``)."""
        with self._lock:
            return list(self._events)

    @property
    def pending(self) -> int:
        """Counted faults still to fire (those with ``times=None`` not included)."""
        with self._lock:
            return sum(armed.remaining or 0 for armed in self._faults)

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving, drop open client connections, and wait (at most ``timeout`` seconds) for their threads."""
        if self._closing.is_set():
            return
        self._closing.set()
        deadline = time.monotonic() + timeout
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            active = list(self._active.items())
        for sock, _ in active:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for _, thread in active:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- used by the request handlers -------------------------------------------------------------------------
    @staticmethod
    def _zero_counts() -> dict[str, int]:
        return dict.fromkeys(("requests", "forwarded", "upstream_error", "expect_continue", *FAULT_KINDS), 0)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _choose(self, method: str, target: str, headers: frozenset[str]) -> Fault | None:
        """The fault for this request, if any (counted and logged)."""
        if self.observer is not None:
            self.observer(method, target, headers)
        with self._lock:
            self._counts["requests"] += 1
            chosen: Fault | None = None
            for armed in self._faults:
                if armed.fault.matches(method, target, headers):
                    chosen = armed.fault
                    if armed.remaining is not None:
                        armed.remaining -= 1
                    break
            self._faults = [armed for armed in self._faults if armed.remaining != 0]
            if chosen is None and self._random and self._random[0][0].matches(method, target, headers):
                draw = self._rng.random()
                for fault, rate in self._random:
                    if draw < rate:
                        chosen = fault
                        break
                    draw -= rate
            if chosen is not None:
                self._counts[chosen.kind] += 1
                self._events.append(FaultEvent(method, target, chosen.kind, time.time()))
            return chosen

    def _register(self, sock: socket.socket) -> None:
        with self._lock:
            self._active[sock] = threading.current_thread()

    def _unregister(self, sock: socket.socket) -> None:
        with self._lock:
            self._active.pop(sock, None)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    block_on_close = False  # FaultProxy.close waits for the handler threads, boundedly
    allow_reuse_address = False
    request_queue_size = 128

    def __init__(self, owner: FaultProxy) -> None:
        self.owner = owner
        super().__init__(("127.0.0.1", 0), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("fault proxy: connection from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # a response's head and body go out in separate writes: no delayed-ACK stalls
    _upstream: http.client.HTTPConnection | None = None

    @property
    def _owner(self) -> FaultProxy:
        return cast(_Server, self.server).owner

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self._owner.idle_timeout)
        self._owner._register(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self._close_upstream()
            self._owner._unregister(self.connection)

    def handle(self) -> None:
        owner = self._owner
        self.close_connection = True
        for _ in range(MAX_REQUESTS_PER_CONNECTION):
            self.handle_one_request()
            if self.close_connection or owner._closing.is_set():
                break

    def handle_expect_100(self) -> bool:
        return True  # answered in _proxy, once the fault (which may refuse the body) is known

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("fault proxy: " + format, *args)

    def do_GET(self) -> None:  # http.server dispatches on do_<METHOD>
        self._proxy()

    def do_HEAD(self) -> None:
        self._proxy()

    def do_PUT(self) -> None:
        self._proxy()

    def do_POST(self) -> None:
        self._proxy()

    def do_DELETE(self) -> None:
        self._proxy()

    # -- one request ----------------------------------------------------------------------------------------
    def _proxy(self) -> None:
        owner = self._owner
        method, target = self.command, self.path
        names = frozenset(name.lower() for name in self.headers)
        expect = self.headers.get("Expect", "").lower() == "100-continue"
        if expect:
            owner._count("expect_continue")
        fault = owner._choose(method, target, names)
        try:
            if fault is not None and fault.kind == "reset_before":
                self._abort(fault.rst)
                return
            if fault is not None and fault.kind == "error_before":
                if expect:  # the client holds the body back for a final status: answer it and close
                    self.close_connection = True
                else:
                    self._read_body()
                self._send_error(fault.status)
                return
            if fault is not None and fault.kind == "delay":
                owner._closing.wait(fault.delay)
            if owner.latency:
                owner._closing.wait(owner.latency)
            if expect:
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = self._read_body()
            try:
                response = self._forward(method, target, body)
            except (OSError, http.client.HTTPException) as exc:
                logger.debug("fault proxy: upstream %s failed: %r", owner.upstream, exc)
                self._close_upstream()
                owner._count("upstream_error")
                self._send_error(502)
                return
            owner._count("forwarded")
            if fault is not None and fault.kind == "lost_response":
                self._drain(response)
                self._abort(fault.rst)
                return
            self._relay(response)
        except _BadRequestError as exc:
            self.close_connection = True
            self._send_error(exc.status, str(exc))
        except (OSError, http.client.HTTPException, ValueError) as exc:
            # The client went away, or upstream failed mid-response: the state of both connections is unknown.
            logger.debug("fault proxy: %s %s failed: %r", method, target, exc)
            self._close_upstream()
            self._abort(rst=False)

    def _read_body(self) -> bytes | None:
        """The request body (de-chunked); ``None`` when the request has none."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked()
        length = self.headers.get("Content-Length")
        if length is None:
            return None
        try:
            size = int(length)
        except ValueError:
            raise _BadRequestError(400, f"bad Content-Length {length!r}") from None
        if not 0 <= size <= MAX_BODY:
            raise _BadRequestError(413, f"body of {size} bytes, more than the proxy's {MAX_BODY}")
        data = self.rfile.read(size)
        if len(data) != size:
            raise ConnectionError(f"the client sent {len(data)} of {size} body bytes")
        return data

    def _read_chunked(self) -> bytes:
        parts: list[bytes] = []
        total = 0
        for _ in range(_MAX_CHUNKS):
            line = self.rfile.readline(1024)
            if not line.endswith(b"\n"):
                raise ConnectionError("the client's chunked body ended early")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise _BadRequestError(400, f"bad chunk size line {line[:40]!r}") from None
            if size == 0:
                for _ in range(_MAX_TRAILER_LINES):
                    if self.rfile.readline(8192) in (b"\r\n", b"\n", b""):
                        return b"".join(parts)
                raise _BadRequestError(400, "too many trailer lines")
            total += size
            if size < 0 or total > MAX_BODY:
                raise _BadRequestError(413, f"chunked body over the proxy's {MAX_BODY} bytes")
            chunk = self.rfile.read(size + 2)
            if len(chunk) != size + 2:
                raise ConnectionError("the client's chunked body ended early")
            parts.append(chunk[:size])
        raise _BadRequestError(413, f"more than {_MAX_CHUNKS} chunks")

    def _forward(self, method: str, target: str, body: bytes | None) -> http.client.HTTPResponse:
        """Send the request upstream (on this connection's keep-alive upstream connection) and read the head of
        the response. A kept connection that the upstream closed meanwhile is replaced once."""
        owner = self._owner
        for attempt in range(2):
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(
                    owner.upstream_host, owner.upstream_port, timeout=owner.upstream_timeout
                )
            connection = self._upstream
            reused = connection.sock is not None
            try:
                connection.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
                if "host" not in (name.lower() for name in self.headers):
                    connection.putheader("Host", f"{owner.upstream_host}:{owner.upstream_port}")
                for name, value in self.headers.items():
                    if name.lower() not in _HOP_BY_HOP:
                        connection.putheader(name, value)
                if body is not None:
                    connection.putheader("Content-Length", str(len(body)))
                connection.endheaders(body)
                return connection.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError):
                self._close_upstream()
                if not reused or attempt == 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _relay(self, response: http.client.HTTPResponse) -> None:
        status = response.status
        no_body = self.command == "HEAD" or status in (204, 304) or status < 200
        chunked = not no_body and response.length is None  # upstream chunked or close-delimited
        self.send_response_only(status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        if no_body:
            length = response.getheader("Content-Length")
            if length is not None:  # HEAD: the size of the object, no body
                self.send_header("Content-Length", length)
        elif chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(response.length))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if no_body:
            response.read()
        elif chunked:
            self._relay_chunked(response)
        else:
            remaining = response.length or 0
            if remaining > MAX_BODY:
                raise ValueError(f"upstream body of {remaining} bytes, more than the proxy's {MAX_BODY}")
            for _ in range(remaining // _CHUNK + 2):
                if remaining == 0:
                    break
                data = response.read(min(_CHUNK, remaining))
                if not data:
                    raise ConnectionError("upstream closed mid-body")
                self.wfile.write(data)
                remaining -= len(data)
            if remaining:
                raise ConnectionError("upstream body longer than its chunks")
        if response.will_close:
            self._close_upstream()

    def _relay_chunked(self, response: http.client.HTTPResponse) -> None:
        total = 0
        for _ in range(_MAX_CHUNKS):
            data = response.read1(_CHUNK)
            if not data:
                self.wfile.write(b"0\r\n\r\n")
                return
            total += len(data)
            if total > MAX_BODY:
                raise ValueError(f"upstream body over the proxy's {MAX_BODY} bytes")
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        raise ValueError(f"upstream body in more than {_MAX_CHUNKS} pieces")

    def _drain(self, response: http.client.HTTPResponse) -> None:
        """Read a response nobody will see, keeping the upstream connection when the body is small."""
        for _ in range(_DRAIN_LIMIT // _CHUNK + 1):
            if not response.read1(_CHUNK):
                if response.will_close:
                    self._close_upstream()
                return
        self._close_upstream()

    def _send_error(self, status: int, message: str | None = None) -> None:
        code, default = _S3_ERRORS.get(status, ("InternalError", "Injected error."))
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{escape(message or default)}</Message>"
            "<RequestId>fault-proxy</RequestId></Error>"
        ).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _abort(self, rst: bool) -> None:
        """Close the client connection without (more of) a response: FIN, or RST when ``rst``."""
        self.close_connection = True
        sock = self.connection
        with contextlib.suppress(OSError):
            if rst:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            else:
                sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.rfile.close()  # the socket closes once its reader has (a makefile holds it open)
            sock.close()

    def _close_upstream(self) -> None:
        if self._upstream is not None:
            with contextlib.suppress(OSError):
                self._upstream.close()
            self._upstream = None
