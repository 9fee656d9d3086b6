"""The fault-injecting S3 proxy (:mod:`routelog.fault_proxy`): a real s3fs (aiobotocore, aiohttp) or boto3 client,
the proxy, and the session's moto server, all over HTTP on 127.0.0.1.

What the client sees under each fault is what routelog's storage protocol must handle; the retry budgets measured
here (botocore's attempts, aiohttp's own resend of idempotent requests, s3fs's retries around botocore) size the
fault counts of the protocol tests.
"""

from __future__ import annotations

import errno
import http.client
import io
import os
import random
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from routelog.fault_proxy import FAULT_KINDS, Fault, FaultProxy

s3fs = pytest.importorskip("s3fs")
botocore_exceptions = pytest.importorskip("botocore.exceptions")
TRANSIENT = (OSError, botocore_exceptions.BotoCoreError)
"""What a faulted request may raise once the retries are spent (s3fs: OSError; botocore: connection errors)."""


@pytest.fixture
def proxy(s3_fault_proxy: FaultProxy) -> Iterator[FaultProxy]:
    """The session's proxy, without faults and with zero counts."""
    s3_fault_proxy.clear()
    yield s3_fault_proxy
    s3_fault_proxy.clear()


def s3(endpoint: str, **options: Any) -> Any:
    """A fresh s3fs filesystem on ``endpoint`` (no instance or listing cache)."""
    return s3fs.S3FileSystem(
        client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True, use_listings_cache=False, **options
    )


def faults_fired(proxy: FaultProxy) -> int:
    counts = proxy.counts
    return sum(counts[kind] for kind in FAULT_KINDS)


def test_forwards_reads_writes_listings_and_deletes(proxy: FaultProxy, s3_endpoint: str, s3_bucket: str) -> None:
    via, direct = s3(proxy.endpoint), s3(s3_endpoint)
    base = f"{s3_bucket}/plain"
    small = {f"{base}/obj-{i:02d}": f"object {i} ".encode() * (i + 1) for i in range(40)}
    via.pipe(small)
    large = random.Random(1).randbytes(5 << 20)
    via.pipe_file(f"{base}/large", large)
    direct.pipe_file(f"{base}/written-directly", b"from moto")

    assert direct.cat(list(small)) == via.cat(list(small)) == small
    assert via.cat_file(f"{base}/large") == direct.cat_file(f"{base}/large") == large
    assert via.cat_file(f"{base}/large", start=1000, end=5000) == large[1000:5000]  # 206 Partial Content
    assert via.cat_file(f"{base}/written-directly") == b"from moto"
    assert sorted(via.ls(base, detail=False)) == sorted(direct.ls(base, detail=False))
    assert via.info(f"{base}/large")["size"] == direct.info(f"{base}/large")["size"] == len(large)  # HEAD
    assert via.exists(f"{base}/obj-07") and not via.exists(f"{base}/absent")
    with pytest.raises(FileNotFoundError):
        via.cat_file(f"{base}/absent")

    via.rm([f"{base}/obj-{i:02d}" for i in range(0, 40, 2)])
    assert sorted(direct.ls(base, detail=False)) == sorted(via.ls(base, detail=False))
    assert not direct.exists(f"{base}/obj-00") and direct.exists(f"{base}/obj-01")

    counts = proxy.counts
    assert counts["requests"] == counts["forwarded"] > 45
    assert faults_fired(proxy) == 0 and counts["upstream_error"] == 0
    assert counts["expect_continue"] > 0  # aiobotocore asks PutObject to wait for 100 Continue


def test_boto3_expect_continue_and_keep_alive(proxy: FaultProxy, s3_bucket: str) -> None:
    """boto3 (urllib3) with a file body: botocore sends ``Expect: 100-continue`` and waits for the proxy's 100."""
    import boto3

    client = boto3.client("s3", endpoint_url=proxy.endpoint)
    body = os.urandom(300_000)
    for i in range(5):
        client.put_object(Bucket=s3_bucket, Key=f"boto/{i}", Body=io.BytesIO(body))
    for i in range(5):
        assert client.get_object(Bucket=s3_bucket, Key=f"boto/{i}")["Body"].read() == body
    assert client.head_object(Bucket=s3_bucket, Key="boto/0")["ContentLength"] == len(body)
    assert proxy.counts["expect_continue"] == 5
    assert proxy.counts["forwarded"] == 11


@pytest.mark.parametrize("rst", [False, True], ids=["close", "reset"])
def test_lost_response_on_a_plain_put_is_invisible(
    proxy: FaultProxy, s3_endpoint: str, s3_bucket: str, rst: bool
) -> None:
    """The PUT is applied, its response lost; the client's resend overwrites it and succeeds."""
    via = s3(proxy.endpoint)
    path = f"{s3_bucket}/lost/{uuid.uuid4().hex}"
    proxy.inject(Fault("lost_response", method="PUT", key=r"/lost/", times=1, rst=rst))
    via.pipe_file(path, b"payload")
    assert proxy.counts["lost_response"] == 1 and proxy.pending == 0
    assert proxy.counts["forwarded"] == 2  # the lost PUT and the resend, both applied
    assert [(e.method, e.kind) for e in proxy.events] == [("PUT", "lost_response")]
    assert s3(s3_endpoint).cat_file(path) == b"payload"


@pytest.mark.parametrize("rst", [False, True], ids=["close", "reset"])
def test_lost_response_on_a_conditional_create_reads_as_file_exists(
    proxy: FaultProxy, s3_endpoint: str, s3_bucket: str, rst: bool
) -> None:
    """The ambiguity ``Storage.create`` must resolve: the create took effect, its response was lost, the client's
    own resend met the object the first try wrote (412 PreconditionFailed), and s3fs raises ``FileExistsError``,
    exactly as for an object another writer created first. Only the object's bytes tell the two apart."""
    via, direct = s3(proxy.endpoint), s3(s3_endpoint)
    mine = f"{s3_bucket}/log/{uuid.uuid4().hex}.json"
    proxy.inject(Fault("lost_response", method="PUT", key=r"/log/", header="If-None-Match", times=1, rst=rst))
    with pytest.raises(FileExistsError):
        via.pipe_file(mine, b'{"commit": "mine"}', mode="create")
    assert proxy.counts["lost_response"] == 1
    assert proxy.counts["forwarded"] == 2  # the create (applied) and the resend (412)
    assert direct.cat_file(mine) == b'{"commit": "mine"}'

    theirs = f"{s3_bucket}/log/{uuid.uuid4().hex}.json"
    direct.pipe_file(theirs, b'{"commit": "theirs"}', mode="create")
    with pytest.raises(FileExistsError):  # the same exception when someone else won
        via.pipe_file(theirs, b'{"commit": "mine"}', mode="create")
    assert direct.cat_file(theirs) == b'{"commit": "theirs"}'
    assert proxy.counts["lost_response"] == 1


def test_error_before_is_retried(proxy: FaultProxy, s3_endpoint: str, s3_bucket: str) -> None:
    via = s3(proxy.endpoint)
    path = f"{s3_bucket}/slow/{uuid.uuid4().hex}"
    proxy.inject(Fault("error_before", method="PUT", key=r"/slow/", times=1, status=503))
    via.pipe_file(path, b"after a SlowDown")
    assert proxy.counts["error_before"] == 1 and proxy.counts["forwarded"] == 1
    assert s3(s3_endpoint).cat_file(path) == b"after a SlowDown"


# (fault, options, requests a PUT makes before the client gives up) with botocore allowing 2 attempts and s3fs 2
# rounds around it. s3fs retries SlowDown and ConnectionClosedError (a closed connection), not other 5xx or
# EndpointConnectionError (a reset); aiohttp resends an idempotent request (PUT, GET, HEAD, DELETE) once itself
# when the connection closes or resets, unseen by botocore.
BUDGETS = [
    ("error_before", {"status": 503}, 2 * 2, OSError),
    ("error_before", {"status": 500}, 2, OSError),
    ("reset_before", {}, 2 * 2 * 2, Exception),  # botocore ConnectionClosedError
    ("reset_before", {"rst": True}, 2 * 2, Exception),  # botocore EndpointConnectionError
]


@pytest.mark.parametrize(("kind", "options", "attempts", "error"), BUDGETS, ids=["503", "500", "close", "reset"])
def test_faults_past_the_retry_budget_fail_the_write(
    proxy: FaultProxy,
    s3_endpoint: str,
    s3_bucket: str,
    kind: Any,
    options: dict[str, Any],
    attempts: int,
    error: type[Exception],
) -> None:
    via = s3(proxy.endpoint, config_kwargs={"retries": {"total_max_attempts": 2, "mode": "standard"}})
    via.retries = 2
    path = f"{s3_bucket}/budget/{uuid.uuid4().hex}"
    proxy.inject(Fault(kind, method="PUT", key=r"/budget/", times=attempts + 1, **options))
    with pytest.raises(error) as raised:
        via.pipe_file(path, b"never stored")
    assert not isinstance(raised.value, FileExistsError | FileNotFoundError)
    assert proxy.counts[kind] == attempts and proxy.pending == 1
    assert proxy.counts["forwarded"] == 0
    assert not s3(s3_endpoint).exists(path)


@pytest.mark.slow
def test_default_retry_budget(proxy: FaultProxy, s3_endpoint: str, s3_bucket: str) -> None:
    """With s3fs's and botocore's defaults (legacy mode, 5 attempts) a PUT answered 500 every time is tried 5
    times, then fails with ``OSError(EREMOTEIO)``."""
    via = s3(proxy.endpoint)
    path = f"{s3_bucket}/default-budget/{uuid.uuid4().hex}"
    proxy.inject(Fault("error_before", method="PUT", key=r"/default-budget/", times=None, status=500))
    with pytest.raises(OSError, match="internal error") as raised:
        via.pipe_file(path, b"never stored")
    assert raised.value.errno == errno.EREMOTEIO
    assert proxy.counts["error_before"] == 5
    assert not s3(s3_endpoint).exists(path)


def test_delay_holds_the_request(proxy: FaultProxy, s3_bucket: str) -> None:
    via = s3(proxy.endpoint)
    path = f"{s3_bucket}/delay/x"
    via.pipe_file(path, b"x")
    proxy.inject(Fault("delay", method="GET", key=r"/delay/", times=1, delay=0.4))
    forwarded = proxy.counts["forwarded"]
    start = time.monotonic()
    assert via.cat_file(path) == b"x"
    assert time.monotonic() - start >= 0.4
    assert proxy.counts["delay"] == 1 and proxy.counts["forwarded"] > forwarded
    assert proxy.events[0].method == "GET" and proxy.events[0].path.endswith("/delay/x")


def test_seeded_random_faults_never_corrupt_data(proxy: FaultProxy, s3_endpoint: str, s3_bucket: str) -> None:
    """50 rounds of overwrite-then-read on 8 keys with 10 % of requests faulted: whatever succeeds is right. A
    failed write may or may not have been applied (lost response), so a read may return any write since the
    last confirmed one, and nothing else."""
    via, direct = s3(proxy.endpoint), s3(s3_endpoint)
    base = f"{s3_bucket}/soak"
    proxy.set_random(
        seed=20240611, rates={"lost_response": 0.04, "error_before": 0.03, "reset_before": 0.03}, key=r"/soak/"
    )
    values = random.Random(5)
    possible: dict[str, list[bytes]] = {}  # per key: the last confirmed write, then writes that failed since
    failed_writes = failed_reads = 0
    for round_ in range(50):
        path = f"{base}/key-{round_ % 8}"
        data = values.randbytes(values.randrange(1, 64 << 10))
        try:
            via.pipe_file(path, data)
        except TRANSIENT:
            failed_writes += 1
            possible.setdefault(path, []).append(data)
        else:
            possible[path] = [data]
        try:
            got = via.cat_file(path)
        except TRANSIENT:
            failed_reads += 1
            continue
        assert got in possible[path], f"round {round_}: read {len(got)} bytes that no write of {path} wrote"
    assert faults_fired(proxy) >= 3, proxy.counts
    proxy.clear()
    for path, candidates in possible.items():
        assert direct.cat_file(path) in candidates
        if len(candidates) == 1:
            assert via.cat_file(path) == candidates[0]
    assert failed_writes + failed_reads <= 5  # the SDK's retries absorb almost every fault


class _Upstream(BaseHTTPRequestHandler):
    """A plain HTTP server that answers chunked, close-delimited and echo responses (moto sends neither)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for piece in (b"first ", b"second ", b"x" * 100_000):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        else:  # no length: the body ends when the connection closes
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"until close")
            self.close_connection = True

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(201)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_chunked_and_close_delimited_bodies_both_ways() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        with FaultProxy(f"http://127.0.0.1:{server.server_address[1]}") as proxy:
            port = int(proxy.endpoint.rsplit(":", 1)[1])
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                for path, expected in [("/chunked", b"first second " + b"x" * 100_000), ("/close", b"until close")]:
                    connection.request("GET", path)
                    response = connection.getresponse()
                    assert response.status == 200 and response.read() == expected
                    assert response.getheader("Transfer-Encoding") == "chunked"
                connection.request("PUT", "/echo", body=iter([b"one ", b"two"]), encode_chunked=True)
                response = connection.getresponse()
                assert response.status == 201 and response.read() == b"one two"
                socket_used = connection.sock
                connection.request("PUT", "/echo", body=b"plain")
                assert connection.getresponse().read() == b"plain"
                assert connection.sock is socket_used  # one keep-alive connection for all four
            finally:
                connection.close()
            assert proxy.counts["forwarded"] == 4
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_fault_validation_and_clear(proxy: FaultProxy) -> None:
    with pytest.raises(ValueError, match="unknown fault"):
        Fault("explode")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="delay"):
        Fault("delay", delay=3600)
    with pytest.raises(ValueError, match="times"):
        Fault("lost_response", times=0)
    with pytest.raises(ValueError, match="add up"):
        proxy.set_random(1, {"lost_response": 0.7, "error_before": 0.7})
    with pytest.raises(ValueError, match="upstream"):
        FaultProxy("https://example.com/prefix")
    proxy.inject(Fault("error_before", times=3))
    assert proxy.pending == 3
    proxy.clear()
    assert proxy.pending == 0 and faults_fired(proxy) == 0
    with pytest.raises(ValueError, match="rate"):
        proxy.set_random(1, {"lost_response": -0.1})
