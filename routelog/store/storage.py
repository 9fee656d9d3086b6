"""Object storage through fsspec: one code path for ``file://``, ``memory://`` and ``s3://``.

Credentials and endpoints come the way fsspec users expect: the standard ``AWS_*`` environment (including
``AWS_ENDPOINT_URL``) read by botocore, fsspec's own ``FSSPEC_<PROTOCOL>_<OPTION>`` variables, or explicit
``storage_options``. The primitives routelog needs are few: whole-object reads and writes, an exclusive create
(S3 ``If-None-Match: *``; fsspec's local and memory filesystems honour ``mode="create"`` too), a non-recursive
listing of one prefix, deletes, and a zarr store for ranged reads.

Durability: a write returns once its bytes are on stable storage. S3 acknowledges a PUT only after storing it
redundantly. On a local filesystem a part's objects (new names no reader reads before a commit names them) are
written in place, then fsynced together with every directory that gained a name; any other object goes to a
temporary name, fsynced, and is moved (a create: hard-linked) into place before its directory is fsynced. So a
commit acknowledged before a power loss is still there after it, with every object it names.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import hashlib
import inspect
import io
import json
import os
import posixpath
import random
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar, overload
from urllib.parse import urlsplit

import fsspec
import fsspec.asyn
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

from routelog.errors import (
    CorruptDataError,
    CredentialsInUrlError,
    StoreAccessError,
    StoreError,
    StoreUnreachableError,
    UnsafeKeyError,
)
from routelog.format import mapped
from routelog.format.keys import CLOCK_DIR, check_key
from routelog.format.shard import WrittenFile
from routelog.urls import has_userinfo, redact_url

if TYPE_CHECKING:  # zarr loads on the first zarr store (a fifth of ``import routelog`` otherwise)
    from zarr.storage import FsspecStore

T = TypeVar("T")

_TRANSIENT_ERRNOS = {
    errno.EAGAIN,
    errno.EBUSY,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.EPIPE,
    getattr(errno, "EREMOTEIO", 121),
}
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: timeouts, dropped connections, throttling and 5xx (s3fs maps SlowDown and 503 to
    ``EBUSY``, 500 to ``EREMOTEIO``, and S3's in-flight conditional-write conflict 409 to ``EBUSY``)."""
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    name = type(exc).__name__
    return any(word in name for word in ("Timeout", "Connection", "Throttl", "ServerDisconnected", "ClientPayload"))


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff and full jitter for transient storage errors."""

    attempts: int = 6
    base_delay: float = 0.05
    max_delay: float = 2.0
    deadline: float = 60.0
    """Seconds after which no new attempt starts, whatever ``attempts`` says."""

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))


_CREDENTIALS_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass "
    '--storage-options \'{"key": "...", "secret": "..."}\' (\'{"anon": true}\' for a public bucket)'
)
_ENDPOINT_HINT = 'set AWS_ENDPOINT_URL, or pass --storage-options \'{"endpoint_url": "http://host:port"}\''
_REACHABLE: set[tuple[str, int]] = set()
"""Endpoints this process has connected to once: checked again only after a failure."""


def s3_endpoint(fs: AbstractFileSystem) -> str:
    """The endpoint an S3 filesystem talks to: its options, else botocore's environment, else AWS."""
    client_kwargs = getattr(fs, "client_kwargs", None) or {}
    return str(
        getattr(fs, "endpoint_url", None)
        or client_kwargs.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or "https://s3.amazonaws.com"
    )


def check_reachable(endpoint: str, timeout: float = 5.0) -> None:
    """Fail fast, naming the endpoint, when nothing listens there: without this check the SDK's and our retries
    spend most of a minute before reporting a refused connection. Skipped behind an HTTP proxy."""
    parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    if (host, port) in _REACHABLE or any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY")):
        return
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise StoreUnreachableError(
            f"cannot reach the S3 endpoint {redact_url(endpoint)} ({reason}): {_ENDPOINT_HINT}"
        ) from exc
    _REACHABLE.add((host, port))


def parse_storage_options(text: str | None) -> dict[str, Any]:
    """``--storage-options`` JSON from the CLI."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StoreError(f"--storage-options is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise StoreError('--storage-options must be a JSON object, e.g. \'{"endpoint_url": "http://..."}\'')
    return value


def check_digest(data: bytes, size: int, sha256: str, where: str) -> None:
    """:class:`~routelog.errors.CorruptDataError` unless ``data`` has this size and SHA-256."""
    if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
        raise CorruptDataError(f"{where}: size or SHA-256 differs from what was committed (the object is damaged)")


@dataclass(frozen=True)
class ObjectStat:
    size: int
    modified: float
    """Seconds since the epoch, from the storage service (S3 ``LastModified``) or the filesystem."""


_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV}
"""``link`` errors of filesystems that hold no (more) hard links: :func:`_create_file` falls back there."""
_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", 122)}
_FSYNC_THREADS = 16
"""Concurrent fsyncs of one batch of new files (each waits on the disk, not the CPU)."""


@functools.cache
def _fsync_threads() -> ThreadPoolExecutor:
    """The process's threads for concurrent fsyncs, started on first use and kept: a pool made per commit started
    its threads each time, and on two busy cores ``Thread.start`` waits for each new thread to be scheduled (a
    fifth of a writer's commit in a profile). A forked child has none of its parent's threads (handing them work
    would wait for ever): it starts its own."""
    return ThreadPoolExecutor(_FSYNC_THREADS, thread_name_prefix="routelog-fsync")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fsync_threads.cache_clear)

WRITE_PIECE_BYTES = 256 << 10
"""Local files are written this many bytes per ``write`` call. On the development machine's ext4, an 11 MB part
shard written with fsync took 8-10 ms in pieces of 64-512 KiB and 34-37 ms in pieces of 1 MiB or in one call
(medians of 10, alternating): calls from 1 MiB up take a slower path through the kernel."""


def _write_all(descriptor: int, data: bytes | bytearray | mapped.Bytes) -> None:
    """Write all of ``data`` to the open file ``descriptor`` at its position, :data:`WRITE_PIECE_BYTES` at a time."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(descriptor, view[:WRITE_PIECE_BYTES]) :]


def _write_durably(descriptor: int, data: bytes) -> None:
    """Write all of ``data`` to the new file ``descriptor``, fsync it and close it."""
    try:
        _write_all(descriptor, data)
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_directory(path: str) -> None:
    """Make the entries of directory ``path`` durable (a new or renamed name is lost on power loss otherwise)."""
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _make_directories(directory: str) -> None:
    """``os.makedirs`` that makes every directory it creates durable in its parent."""
    for parent in _new_directories(directory):
        _fsync_directory(parent)


def _new_directories(directory: str) -> list[str]:
    """``os.makedirs`` returning the parents of the directories it created (their entries must be fsynced)."""
    missing = []
    while directory and not os.path.isdir(directory):
        missing.append(directory)
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    changed = []
    for path in reversed(missing):
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        changed.append(os.path.dirname(path))
    return changed


def _write_new_files(files: Mapping[str, bytes | mapped.Bytes | WrittenFile]) -> None:
    """Write local files under names nobody else uses (a new part's objects, read only once a later commit names
    them), durably: each is written in place (a :class:`FileSink`'s already is), then every file and every
    directory that gained a name is fsynced, concurrently (the filesystem's journal commits them together instead of
    once each)."""
    directories: set[str] = set()
    descriptors = []
    try:
        for path, data in files.items():
            directory = os.path.dirname(path)
            directories.add(directory)
            if isinstance(data, WrittenFile):
                directories.update(data.new_directories)
                descriptors.append(os.open(path, os.O_RDONLY))
                continue
            directories.update(_new_directories(directory))
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # a retry rewrites it whole
            descriptors.append(descriptor)
            _write_all(descriptor, data)
        pool = _fsync_threads()
        list(pool.map(os.fsync, descriptors))
        list(pool.map(_fsync_directory, sorted(directories)))
    finally:
        for descriptor in descriptors:
            os.close(descriptor)


def _durable_temporary(directory: str, name: str, data: bytes) -> str:
    """A temporary file beside ``name`` (a dot name no reader parses) holding ``data``, fsynced."""
    _make_directories(directory)
    temporary = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any file
    try:
        _write_durably(descriptor, data)
    except BaseException:
        os.unlink(temporary)
        raise
    return temporary


def _write_file(path: str, data: bytes) -> None:
    """Write the local file ``path`` (a name nobody else writes) durably: temporary, fsync, rename, fsync the
    directory. A reader never sees it half-written."""
    directory, name = os.path.split(path)
    temporary = _durable_temporary(directory, name, data)
    try:
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    _fsync_directory(directory)


def _create_file(path: str, data: bytes) -> None:
    """Create the local file ``path`` holding ``data``, or raise ``FileExistsError``, so that nobody sees it
    half-written: an exclusive open would make the name visible before its bytes, and a reader listing commits
    then finds an empty document, and a writer killed mid-write leaves one behind for good. The bytes go to a
    temporary file beside it, fsynced, and are hard-linked to ``path`` once complete: ``link`` is atomic and refuses
    an existing name; the directory is fsynced before the create returns. Filesystems without hard links take the
    exclusive open."""
    directory, name = os.path.split(path)
    temporary = _durable_temporary(directory, name, data)
    try:
        try:
            os.link(temporary, path)
        except OSError as exc:
            if exc.errno not in _NO_HARD_LINKS:  # FileExistsError among them: the name is taken
                raise
            _write_durably(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), data)
    finally:
        os.unlink(temporary)
    _fsync_directory(directory)


def _modified(info: Mapping[str, Any]) -> float:
    for key in ("LastModified", "mtime", "created", "last_modified"):
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


GLOB_CHARACTERS = frozenset("*?[]")
"""Characters fsspec reads as glob patterns in a path (``fsspec.utils.has_magic`` and ``glob``'s classes)."""

S3_DELETE_BATCH = 1000
"""Keys one S3 ``DeleteObjects`` request may name."""

S3_CONNECTIONS = 64
"""Connections one process keeps to S3 (botocore's default is 10): a reader opening a step fetches every commit's
index at once, 1,000 GETs in 0.5 s at 30 ms rather than 3 s. A ``config_kwargs`` the caller gives is left as is."""


def _default_connections(options: dict[str, Any]) -> None:
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("max_pool_connections", S3_CONNECTIONS)
    options["config_kwargs"] = config


def check_url(url: str) -> None:
    """What can be refused of a store URL before anything is opened: credentials in it, and a mistyped scheme
    (:meth:`Storage.open` calls it; so should whatever keeps a URL to open later)."""
    check_no_credentials(url)
    _check_not_a_mistyped_url(url)


def check_no_credentials(url: str) -> None:
    """Refuse credentials in ``url``'s userinfo (:class:`~routelog.errors.CredentialsInUrlError`): the URL is what
    every message, log line and repr naming the store shows. :meth:`Storage.open` calls it; so should whatever keeps
    a URL before a store is opened."""
    if has_userinfo(url):
        raise CredentialsInUrlError(
            f"{redact_url(url)}: a store URL must not carry credentials (every message naming the store would show "
            "them): remove the part before '@' and pass them in storage_options (--storage-options "
            '\'{"key": "...", "secret": "..."}\' on the command line) or in the AWS_* environment (AWS_ACCESS_KEY_ID '
            "and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
        )


_OPTIONS_PASSED_TO_BASE = frozenset(
    {
        "fsspec.implementations.local.LocalFileSystem",
        "fsspec.implementations.memory.MemoryFileSystem",
        "fsspec.asyn.AsyncFileSystem",
    }
)
"""Filesystem classes whose ``**kwargs`` all go to their base class's constructor."""


def _keyword_parameters(function: Callable[..., Any]) -> tuple[set[str], bool]:
    """The names ``function`` takes by keyword, and whether it takes ``**kwargs`` as well."""
    parameters = list(inspect.signature(function).parameters.values())[1:]  # after self
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind is p.VAR_KEYWORD for p in parameters)


def _accepted_options(fs_class: type) -> set[str] | None:
    """The storage options ``fs_class`` accepts, from its constructors' signatures along its bases; None where a
    constructor hands ``**kwargs`` to something not known here (those are left to the filesystem to check)."""
    from fsspec.dircache import DirCache

    cache_options = _keyword_parameters(DirCache.__init__)[0]
    accepted = {"skip_instance_cache"}  # taken by fsspec's instance cache before any constructor runs
    for klass in fs_class.__mro__:
        if "__init__" not in vars(klass):
            continue
        named, rest = _keyword_parameters(vars(klass)["__init__"])
        accepted |= named
        name = f"{klass.__module__}.{klass.__qualname__}"
        if not rest:
            return accepted
        if klass is AbstractFileSystem:  # the rest configures its listings cache
            return accepted | cache_options
        if name == "s3fs.core.S3FileSystem":
            # s3fs passes the listings cache's options on and the rest to aiobotocore's session, which fails on
            # an unknown one only at the first request
            from aiobotocore.session import AioSession  # type: ignore[import-untyped]

            return accepted | cache_options | _keyword_parameters(AioSession.__init__)[0]
        if name not in _OPTIONS_PASSED_TO_BASE:
            return None
    return None


def _check_storage_options(url: str, protocol: str, options: Mapping[str, Any]) -> None:
    """Refuse a storage option the URL's filesystem does not take, naming it: s3fs would fail at the first request
    (a ``TypeError`` deep in botocore), the local filesystem would ignore it (a mistyped option doing nothing)."""
    try:
        fs_class = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError):  # reported by the opening itself, with what to install
        return
    accepted = _accepted_options(fs_class)
    if accepted is None:
        return
    unknown = sorted(set(options) - accepted)
    if not unknown:
        return
    meant = "".join(
        f" ({name!r}: did you mean {close[0]!r}?)"
        for name in unknown
        if (close := difflib.get_close_matches(name, accepted, n=1))
    )
    raise StoreError(
        f"unknown storage option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for "
        f"{redact_url(url)}{meant}: {fs_class.__name__} takes {', '.join(sorted(accepted))}"
    )


def _check_not_a_mistyped_url(url: str) -> None:
    """Refuse ``s3:/bucket``, ``memory:name`` or ``s3//bucket``: a known filesystem's name followed by a colon
    without ``//``, or by ``//`` without the colon, would otherwise be a relative local path (a directory named
    ``s3:`` or ``s3`` created beside the user's work, or "no store" where the user meant S3)."""
    if "://" in url:
        return
    scheme, colon, rest = url.partition(":")
    if not colon:
        scheme, slashes, rest = url.partition("//")
        if not slashes or "/" in scheme:
            return
    if len(scheme) < 2 or scheme.lower() not in fsspec.available_protocols():
        return  # a plain path (a one-letter scheme is a Windows drive)
    path = rest if scheme.lower() in ("file", "local") else rest.lstrip("/")
    raise StoreError(
        f"{url!r} is no URL: write {scheme}://{path} (a scheme is followed by '://'), or ./{url} for a local path"
    )


class FileSink:
    """A new local object written as its bytes come (a part's shard as it is compressed, see
    :class:`routelog.format.shard.ShardSink`), so they are never held in memory: pieces gather into writes of
    :data:`WRITE_PIECE_BYTES`, and the head, room for which is left at the start, is written last. Made durable by
    the part's upload (:meth:`Storage.write_many`); a failure is the storage's typed error, the file left to gc."""

    def __init__(self, storage: Storage, key: str, start: int) -> None:
        self._storage, self._key = storage, key
        self.path = storage.path(key)
        self.size = start
        self._pending = bytearray()
        self._descriptor = -1

        def open_file() -> tuple[str, ...]:
            created = tuple(_new_directories(os.path.dirname(self.path)))
            self._descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            os.lseek(self._descriptor, start, os.SEEK_SET)  # the pieces follow the room left for the head
            return created

        self._new_directories = self._guard(open_file)

    def add(self, piece: bytes) -> None:
        self._pending += piece
        self.size += len(piece)
        if len(self._pending) >= WRITE_PIECE_BYTES:
            self._guard(self._flush)

    def finish(self, head: bytes) -> WrittenFile:
        def last() -> None:
            self._flush()
            os.pwrite(self._descriptor, head, 0)
            os.close(self._descriptor)
            self._descriptor = -1

        self._guard(last)
        return WrittenFile(self.path, self.size, self._sha256, self._new_directories)

    def _sha256(self) -> str:
        def digest() -> str:
            with open(self.path, "rb") as file:  # written moments ago: read back from the page cache
                return hashlib.file_digest(file, "sha256").hexdigest()

        return self._guard(digest)

    def _flush(self) -> None:
        _write_all(self._descriptor, self._pending)
        self._pending.clear()

    def _guard(self, fn: Callable[[], T]) -> T:
        """``fn``, its failure closing the file and raised as the storage's typed error where it has one."""
        try:
            return fn()
        except OSError as exc:
            if self._descriptor >= 0:
                os.close(self._descriptor)
                self._descriptor = -1
            explained = self._storage._explain(exc, "write", self._key)
            if explained is None:
                raise
            raise explained from exc


class MappedBody(io.RawIOBase):
    """A mapped object's bytes as the seekable file an S3 client sends as a request body, read in place.

    s3fs takes its size with ``len`` and, for a multipart upload, its parts as slices (each a body of its own)."""

    def __init__(self, data: mapped.Bytes | memoryview) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._position = 0

    def __len__(self) -> int:
        return len(self._view)

    def __getitem__(self, part: slice) -> MappedBody:
        return MappedBody(self._view[part])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._view)}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        piece = self._view[self._position : self._position + len(buffer)]
        memoryview(buffer).cast("B")[: len(piece)] = piece
        self._position += len(piece)
        return len(piece)


@dataclass
class Storage:
    """A store root on some filesystem; keys are ``/``-separated paths relative to the root."""

    url: str
    fs: AbstractFileSystem
    root: str
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    sleep: Callable[[float], None] = time.sleep

    def __repr__(self) -> str:  # never the storage options: they may hold credentials
        return f"Storage({redact_url(self.url)!r})"

    def _call(self, operation: str, key: str, fn: Callable[[], T]) -> T:
        """Run one storage operation, retrying transient errors; a final failure names the operation and key."""
        start = time.monotonic()
        for attempt in range(self.retry.attempts):
            try:
                return fn()
            except Exception as exc:
                last = attempt == self.retry.attempts - 1 or time.monotonic() - start > self.retry.deadline
                if not is_transient(exc):
                    explained = self._explain(exc, operation, key)
                    if explained is None:
                        raise
                    raise explained from exc
                if last:
                    hint = f" (endpoint {redact_url(self.endpoint)}: {_ENDPOINT_HINT})" if self.endpoint else ""
                    raise StoreError(
                        f"{operation} {self.url_of(key)} failed after {attempt + 1} attempts: {exc!r}{hint}"
                    ) from exc
                self.sleep(self.retry.delay(attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    @classmethod
    def open(cls, url: str, storage_options: Mapping[str, Any] | None = None) -> Storage:
        options = dict(storage_options or {})
        check_url(url)
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        if "::" not in url:  # a chained URL's options are nested per filesystem
            _check_storage_options(url, protocol, options)
        if protocol in ("file", "local"):
            options.setdefault("auto_mkdir", True)
        if protocol in ("s3", "s3a"):
            _default_connections(options)
        try:
            fs, root = fsspec.core.url_to_fs(url, **options)
        except ImportError as exc:
            fix = (
                "install the extra: pip install 'routelog[s3]'"
                if protocol in ("s3", "s3a")
                else f"install fsspec's filesystem for {protocol}:// (its error above names the package)"
            )
            raise StoreError(f"cannot open {url!r}: {exc}. To use it, {fix}") from exc
        except ValueError as exc:
            raise StoreError(f"cannot open {url!r}: {exc}") from exc
        if protocol in ("file", "local") and os.path.isfile(root):
            raise StoreError(f"{url} is a file: a store is a directory (or an object prefix); pass a directory path")
        storage = cls(url=url.rstrip("/"), fs=fs, root=str(root).rstrip("/"), storage_options=options)
        if storage.endpoint:
            check_reachable(storage.endpoint)
        return storage

    def check_path_round_trips(self) -> None:
        """Refuse, before anything is written, a store path that the filesystem layer would not read back as written:
        ``*``, ``?``, ``[`` and ``]`` (fsspec expands them as glob patterns in some of its calls, so a store there
        could commit what no reader finds, or match other stores' objects), and on a local filesystem a path
        component longer than the filesystem allows."""
        magic = sorted({c for c in self.root if c in GLOB_CHARACTERS})
        if magic:
            raise StoreError(
                f"{self.url!r}: {' '.join(repr(c) for c in magic)} in a store's path would be read as a glob pattern: "
                "choose a path without * ? [ ]"
            )
        if not self.local:
            return
        existing = self.root
        while existing and not os.path.isdir(existing):
            existing = os.path.dirname(existing)
        limit = os.pathconf(existing or "/", "PC_NAME_MAX")
        for component in self.root.split("/"):
            if len(os.fsencode(component)) > limit:
                raise StoreError(
                    f"{self.url!r}: the path component {component[:24]!r}... is {len(os.fsencode(component))} bytes, "
                    f"longer than this filesystem's {limit}: choose a shorter directory name"
                )

    def check_not_an_object(self) -> None:
        """Raise unless the root is a prefix: an object store lets keys live under an object's own name, so a URL
        naming an object would read as an empty store or get one written under it (one request; asked only where
        that matters: creating a store, and a store not found). A local file is refused by :meth:`open`."""
        if self.protocol in ("file", "local") or not self.root:
            return
        try:
            is_object = bool(self.fs.isfile(self.root))
        except Exception:  # credentials, permissions, throttling: reported by the operation that needs them
            return
        if is_object:
            raise StoreError(
                f"{self.url} is an object: a store is an object prefix (a directory); pass a prefix no object is named"
            )

    @property
    def endpoint(self) -> str | None:
        """The S3 endpoint in use (``None`` for other filesystems)."""
        return s3_endpoint(self.fs) if self.s3 else None

    def _explain(self, exc: Exception, operation: str, key: str) -> StoreError | None:
        """A typed error with the fix for failures that mean the store cannot be used as configured (``None``
        for the rest, such as a missing object, which callers handle)."""
        where = f"{operation} {self.url_of(key)}"
        name = type(exc).__name__
        if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
            return StoreAccessError(f"{where}: no usable credentials ({exc}); {_CREDENTIALS_HINT}")
        if isinstance(exc, PermissionError):
            return StoreAccessError(f"{where}: access denied ({exc}); check the credentials: {_CREDENTIALS_HINT}")
        if isinstance(exc, FileNotFoundError) and "bucket does not exist" in str(exc).lower():
            bucket = self.root.split("/", 1)[0]
            endpoint = redact_url(self.endpoint or "")
            return StoreError(
                f"{where}: the bucket {bucket!r} does not exist at {endpoint}: create it, or fix the URL or "
                "the endpoint"
            )
        if isinstance(exc, NotADirectoryError):
            return StoreError(f"{where}: a part of the path is a file, not a directory; pass a directory path")
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            return StoreError(
                f"{where}: no space left on the device ({exc.strerror}); nothing was changed by this operation: "
                "free space (routelog gc reclaims dropped parts) and run it again"
            )
        return None

    @property
    def protocol(self) -> str:
        proto = self.fs.protocol
        return proto if isinstance(proto, str) else proto[0]

    @property
    def s3(self) -> bool:
        """Whether the store is on S3 (s3fs)."""
        return self.protocol in ("s3", "s3a")

    def path(self, key: str) -> str:
        """The filesystem path of ``key``; a key that is not a plain relative key raises
        :class:`~routelog.errors.UnsafeKeyError` (no storage call can leave the store)."""
        check_key(key)
        return posixpath.join(self.root, key) if key else self.root

    def url_of(self, key: str) -> str:
        """A URL for ``key`` that fsspec resolves to the same object."""
        return f"{self.url}/{key}" if key else self.url

    # -- primitives ------------------------------------------------------------------------------------------
    @property
    def _whole_object_kwargs(self) -> dict[str, Any]:
        # s3fs issues HEAD + GET for unranged reads when max_concurrency > 1 (s3fs #1027); documents are small.
        return {"max_concurrency": 1} if self.s3 else {}

    def read(self, key: str) -> bytes:
        """The whole object; ``FileNotFoundError`` when absent."""
        data = self._call("read", key, lambda: self.fs.cat_file(self.path(key), **self._whole_object_kwargs))
        return bytes(data)

    def read_verified(self, key: str, size: int, sha256: str, owner: str) -> bytes:
        """The whole object, checked against the size and SHA-256 ``owner`` (a commit or seal) lists for it.

        Missing, truncated or altered objects raise :class:`~routelog.errors.CorruptDataError` naming the object
        and its owner: a reader never uses bytes its commit does not vouch for.
        """
        try:
            data = self.read(key)
        except FileNotFoundError:
            raise CorruptDataError(f"{self.url_of(key)}: missing ({owner} lists it)") from None
        check_digest(data, size, sha256, f"{self.url_of(key)} (listed by {owner})")
        return data

    def read_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        """Several whole objects in one call (concurrent requests on async filesystems such as S3)."""
        keys = list(keys)
        if not keys:
            return {}
        paths = [self.path(k) for k in keys]

        def fetch() -> dict[str, bytes]:
            out: dict[str, bytes] = {}
            for key, value in zip(keys, self._cat_files(paths), strict=True):
                if isinstance(value, BaseException):
                    raise value
                out[key] = bytes(value)
            return out

        return self._call("read", keys[0], fetch)

    def _cat_files(self, paths: list[str]) -> list[bytes | BaseException]:
        """Each whole object, or the error reading it, concurrently where the filesystem is asynchronous. Never
        through ``fs.cat`` of a list, which expands ``*``, ``?`` and ``[...]`` in the paths as glob patterns."""
        options = self._whole_object_kwargs
        if not getattr(self.fs, "async_impl", False):
            return [_outcome(functools.partial(self.fs.cat_file, path, **options)) for path in paths]
        batch = getattr(self.fs, "batch_size", None) or fsspec.asyn._get_batch_size(nofiles=True)
        coroutines = [self.fs._cat_file(path, **options) for path in paths]
        return list(
            fsspec.asyn.sync(
                self.fs.loop,
                fsspec.asyn._run_coros_in_chunks,
                coroutines,
                batch_size=batch,
                nofiles=True,
                return_exceptions=True,
            )
        )

    @overload
    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes]: ...

    @overload
    def read_ranges(self, ranges: list[tuple[str, int, int]], into: memoryview) -> list[memoryview]: ...

    def read_ranges(
        self, ranges: list[tuple[str, int, int]], into: memoryview | None = None
    ) -> list[bytes] | list[memoryview]:
        """Byte ranges ``[start, stop)`` of objects, fetched concurrently on async filesystems.

        With ``into`` (at least the ranges' total size), a local store reads them end to end into it rather than
        into fresh memory, and views of it are returned, valid until it is reused: reading a step measured 1.5 M
        page faults, nearly all of them the kernel's first touch of each fresh read buffer, and 45 % of the time
        in the kernel; a caller that reuses its buffer pays them once. Other filesystems return views of their
        own bytes (an S3 response is fresh memory anyway)."""
        if not ranges:
            return []
        if into is None:
            return self._cat_ranges(ranges)
        if not self.local:
            return [memoryview(data) for data in self._cat_ranges(ranges)]
        total = sum(stop - start for _, start, stop in ranges)
        if total > len(into):
            raise ValueError(f"{total} bytes of ranges do not fit a buffer of {len(into)}")
        located = [(self.path(key), start, stop) for key, start, stop in ranges]
        return self._call("read", ranges[0][0], lambda: _pread_ranges(located, into))

    def _cat_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        paths = [self.path(key) for key, _, _ in ranges]

        def fetch() -> list[bytes]:
            found = self.fs.cat_ranges(paths, [r[1] for r in ranges], [r[2] for r in ranges], on_error="return")
            out = []
            for (key, start, stop), value in zip(ranges, found, strict=True):
                if isinstance(value, BaseException):
                    raise value
                if len(value) != stop - start:
                    raise FileNotFoundError(f"{self.path(key)}: range [{start}, {stop}) past the end of the object")
                out.append(value if isinstance(value, bytes) else bytes(value))
            return out

        return self._call("read", ranges[0][0], fetch)

    @property
    def local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def write(self, key: str, data: bytes) -> None:
        """Write an object under a name nobody else uses (data objects have unique names), durably."""
        path = self.path(key)
        if self.local:
            self._call("write", key, lambda: _write_file(path, data))
        else:
            self._call("write", key, lambda: self.fs.pipe_file(path, data))

    def write_many(self, objects: Mapping[str, bytes | mapped.Bytes | WrittenFile]) -> None:
        """Write several uniquely named objects (concurrently on async filesystems), durably (on local disk, objects
        a :meth:`file_sink` wrote are made durable where they are)."""
        if not objects:
            return
        if self.local:
            paths = {self.path(k): v for k, v in objects.items()}
            self._call("write", next(iter(objects)), lambda: _write_new_files(paths))
            return

        def body(data: bytes | mapped.Bytes | WrittenFile) -> bytes | MappedBody:
            # botocore takes bytes or a file, not a mapping: S3 reads a mapped shard as a file, in place (a copy
            # as bytes held another shard's worth for the whole upload); other filesystems keep a copy as bytes
            if isinstance(data, WrittenFile):
                raise TypeError(f"{data.path} is a local file; {self.url} takes objects in memory")
            if isinstance(data, bytes):
                return data
            return MappedBody(data) if self.s3 else bytes(data)

        # the bodies are made for each try: a retried request reads its file from the start
        self._call(
            "write", next(iter(objects)), lambda: self.fs.pipe({self.path(k): body(v) for k, v in objects.items()})
        )

    def file_sink(self, key: str, start: int) -> FileSink:
        """A sink writing the new object ``key`` to its local file as its bytes come (local stores only)."""
        if not self.local:
            raise TypeError(f"{self.url} is not on local disk: its objects are uploaded from memory")
        return FileSink(self, key, start)

    def create(self, key: str, data: bytes, *, read_back: bool = True) -> bool:
        """Create ``key`` holding ``data`` only if it does not exist; ``False`` when another's object is there.

        Finding the key may mean finding this very create: a request whose response was lost (a timeout, a reset
        connection) is retried by the S3 client or by :meth:`_call`, and the retry meets the object the first try
        wrote (S3 answers 412). So an existing object is read back: holding exactly ``data`` (every document
        routelog creates is unique: a fresh part name, a timestamp), it is this create's, which succeeded. With
        ``read_back=False`` the caller reads it back itself (a log append reads the entries it lost to anyway), and
        ``False`` means only that the key exists.
        """

        def put() -> bool:
            try:
                if self.local:
                    _create_file(self.path(key), data)
                else:  # S3's conditional PUT and the memory filesystem publish the whole object at once
                    self.fs.pipe_file(self.path(key), data, mode="create")
            except FileExistsError:
                return read_back and self.read(key) == data
            return True

        return self._call("create", key, put)

    def exists(self, key: str) -> bool:
        return bool(self._call("stat", key, lambda: self.fs.exists(self.path(key))))

    def has(self, key: str) -> bool:
        """Whether the small object ``key`` exists, in one request where :meth:`exists` may take two (S3: a GET that
        answers 404, where ``exists`` follows a 404 HEAD with a listing, for a directory of that name)."""
        try:
            self.read(key)
        except FileNotFoundError:
            return False
        return True

    def list_after(self, prefix: str, after: str | None) -> dict[str, float]:
        """Names directly under ``prefix`` that sort after ``after`` (all when None), ascending, each with the time
        the storage stored it (S3 ``LastModified``, a file's mtime: the storage's clock, never a writer's): one
        request for up to 1000 new names on S3 (``StartAfter``), however many came before. What a process that has
        read a log up to ``after`` needs to see what was appended since, and when it was."""
        if not hasattr(self.fs, "_call_s3") or after is None:  # other filesystems list a directory whole
            return {n: t for n, t in self._list_times(prefix).items() if after is None or n > after}
        bucket, key, _ = self.fs.split_path(self.path(prefix))
        base = key.rstrip("/") + "/"

        async def pages() -> dict[str, float]:
            names: dict[str, float] = {}
            options = {"Bucket": bucket, "Prefix": base, "Delimiter": "/", "StartAfter": base + after}
            while True:
                page = await self.fs._call_s3("list_objects_v2", **options, **self.fs.req_kw)
                names.update((item["Key"][len(base) :], _modified(item)) for item in page.get("Contents", []))
                names.update((item["Prefix"][len(base) :].rstrip("/"), 0.0) for item in page.get("CommonPrefixes", []))
                if not page.get("IsTruncated"):
                    return names
                options["ContinuationToken"] = page["NextContinuationToken"]

        found = self._call("list", prefix, lambda: fsspec.asyn.sync(self.fs.loop, pages))
        return {n: found[n] for n in sorted(found) if n and not n.startswith(".") and n > after}

    def _list_times(self, prefix: str) -> dict[str, float]:
        """:meth:`list` with each name's modification time (0 for a directory)."""
        try:
            entries = self._call("list", prefix, lambda: self.fs.ls(self.path(prefix), detail=True, refresh=True))
        except FileNotFoundError:
            return {}
        base = self.path(prefix).rstrip("/")
        found = {}
        for entry in entries:
            name = str(entry["name"]).rstrip("/")
            name = name[len(base) + 1 :] if name.startswith(base + "/") else name
            if name and "/" not in name and not name.startswith("."):
                found[name] = _modified(entry) if entry.get("type", "file") != "directory" else 0.0
        return dict(sorted(found.items()))

    def modified(self, key: str) -> float:
        """When the storage stored the object ``key`` (seconds since the epoch, by the storage's clock)."""
        return _modified(self._call("stat", key, lambda: self.fs.info(self.path(key))))

    def clock(self) -> float:
        """The storage's own time now: an object created and read back under :data:`~routelog.format.keys.CLOCK_DIR`
        (then deleted), so that what is compared with the times the storage gave its objects is never this
        host's clock."""
        key = f"{CLOCK_DIR}/{uuid.uuid4().hex}"
        self.write(key, b"")
        try:
            return self.modified(key)
        finally:
            self.delete([key])

    def list(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (one level, no recursion); empty when the prefix is absent."""
        try:
            entries = self._call("list", prefix, lambda: self.fs.ls(self.path(prefix), detail=False, refresh=True))
        except FileNotFoundError:
            return []
        base = self.path(prefix).rstrip("/")
        names = []
        for entry in entries:
            name = str(entry).rstrip("/")
            if name.startswith(base + "/"):
                names.append(name[len(base) + 1 :])
            elif "/" not in name:
                names.append(name)
        # A dot-name is a local create's temporary (:func:`_create_file`), never a routelog key: not listed.
        return sorted(n for n in names if n and not n.startswith("."))

    def refuse_links(self, prefix: str) -> None:
        """On a local filesystem, :class:`~routelog.errors.UnsafeKeyError` when ``prefix`` or anything below it
        (or a directory on the way to it from the store root) is a symbolic link: what deletes must never follow
        one out of the store."""
        if not self.local:
            return
        root = self.root or "/"
        path = self.path(prefix).rstrip("/")
        walked = root
        for segment in [s for s in path[len(root) :].split("/") if s]:
            walked = os.path.join(walked, segment)
            if os.path.islink(walked):
                raise UnsafeKeyError(f"{walked} is a symbolic link inside the store; refusing to follow it")
        for directory, subdirectories, files in os.walk(path, followlinks=False):
            for name in [*subdirectories, *files]:
                if os.path.islink(os.path.join(directory, name)):
                    raise UnsafeKeyError(
                        f"{os.path.join(directory, name)} is a symbolic link inside the store; refusing to follow it"
                    )

    def find(self, prefix: str) -> dict[str, ObjectStat]:
        """Every object below ``prefix`` (recursive) with its size and modification time, keyed by store key.
        Symbolic links are refused, never followed (:meth:`refuse_links`)."""
        base = self.path(prefix).rstrip("/")
        self.refuse_links(prefix)
        try:
            found = self._call("list", prefix, lambda: self.fs.find(base, detail=True))
        except FileNotFoundError:
            return {}
        root = self.root.rstrip("/") + "/" if self.root else ""
        return {
            str(path)[len(root) :]: ObjectStat(int(info.get("size") or 0), _modified(info))
            for path, info in found.items()
            if info.get("type", "file") != "directory"
        }

    def size(self, key: str) -> int:
        return int(self._call("stat", key, lambda: self.fs.size(self.path(key))))

    def delete(self, keys: Iterable[str]) -> None:
        """These objects (absent ones are no error). Never through ``fs.rm``, which expands glob patterns in the
        paths: a key is deleted by its exact name, or nothing is."""
        keys = list(keys)
        for key in keys:
            self.refuse_links(key)
        if keys:
            self._call("delete", keys[0], lambda: self._delete_exactly([self.path(k) for k in keys]))

    def _delete_exactly(self, paths: Sequence[str]) -> None:
        if self.s3:  # one request for up to 1,000 keys, as s3fs's own bulk delete makes
            for first in range(0, len(paths), S3_DELETE_BATCH):
                self._delete_s3_batch(paths[first : first + S3_DELETE_BATCH])
            return
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(path)

    def _delete_s3_batch(self, paths: Sequence[str]) -> None:
        located = [self.fs.split_path(path) for path in paths]
        bucket = located[0][0]
        if any(other != bucket for other, _, _ in located):  # pragma: no cover - a store is one bucket's prefix
            raise ValueError("objects of one delete live in one bucket")
        objects = [{"Key": key} for _, key, _ in located]

        async def delete() -> Any:
            return await self.fs._call_s3(
                "delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True}, **self.fs.req_kw
            )

        reply = fsspec.asyn.sync(self.fs.loop, delete)
        for path in paths:
            self.fs.invalidate_cache(path)
        failed = reply.get("Errors") or []
        if failed:
            first = failed[0]
            raise OSError(f"could not delete {first.get('Key')}: {first.get('Code')} {first.get('Message')}")

    def delete_tree(self, prefix: str) -> None:
        """Every object below ``prefix``, and the directory itself on filesystems that have directories (never
        through a symbolic link, and never by a glob pattern: the objects are listed, then deleted by name)."""
        self.refuse_links(prefix)
        if self.local:
            self._call("delete", prefix, lambda: _remove_tree(self.path(prefix)))
            return
        self.delete(list(self.find(prefix)))
        if not self.s3:  # filesystems with directories (memory://) keep them empty: remove them, deepest first
            base = self.path(prefix).rstrip("/")
            directories = self._call("list", prefix, lambda: self.fs.find(base, withdirs=True, detail=True))
            for directory in sorted((p for p, i in directories.items() if i.get("type") == "directory"), key=len)[::-1]:
                with contextlib.suppress(OSError):
                    self.fs.rmdir(directory)
            with contextlib.suppress(OSError):
                self.fs.rmdir(base)

    def invalidate(self) -> None:
        """Drop cached listings so the next listing sees other writers' objects."""
        self.fs.invalidate_cache()

    def zarr_store(self, key: str) -> FsspecStore:
        """A read-only zarr store rooted at ``key``, for ranged reads of sharded arrays."""
        from zarr.storage import FsspecStore

        options = {k: v for k, v in self.storage_options.items() if k != "auto_mkdir"}
        return FsspecStore.from_url(self.url_of(key), storage_options=options, read_only=True)


def _outcome(read: Callable[[], bytes]) -> bytes | BaseException:
    try:
        return read()
    except Exception as exc:  # returned to the caller, which raises it with its key
        return exc


def _remove_tree(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)


def _pread_ranges(ranges: list[tuple[str, int, int]], buffer: memoryview) -> list[memoryview]:
    """Byte ranges of local files read end to end into ``buffer`` (each file opened once)."""
    views: list[memoryview] = []
    files: dict[str, int] = {}
    offset = 0
    try:
        for path, start, stop in ranges:
            if path not in files:
                files[path] = os.open(path, os.O_RDONLY)
            view = buffer[offset : offset + stop - start]
            done = 0
            while done < len(view):  # a read may return less than asked (signals, some filesystems)
                got = os.preadv(files[path], [view[done:]], start + done)
                if got == 0:
                    raise FileNotFoundError(f"{path}: range [{start}, {stop}) past the end of the object")
                done += got
            views.append(view)
            offset += len(view)
    finally:
        for fd in files.values():
            os.close(fd)
    return views
