"""Object storage through fsspec: one code path for ``file://``, ``memory://`` and ``s3://``.

Credentials and endpoints come the way fsspec users expect: the standard ``AWS_*`` environment (including
``AWS_ENDPOINT_URL``) read by botocore, fsspec's own ``FSSPEC_<PROTOCOL>_<OPTION>`` variables, or explicit
``storage_options``. The primitives routelog needs are few: whole-object reads and writes, an exclusive create
(S3 ``If-None-Match: *``; fsspec's local and memory filesystems honour ``mode="create"`` too), a non-recursive
listing of one prefix, deletes, and a zarr store for ranged reads.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import fsspec
from fsspec.spec import AbstractFileSystem
from zarr.storage import FsspecStore

from routelog.errors import StoreError


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


@dataclass
class Storage:
    """A store root on some filesystem; keys are ``/``-separated paths relative to the root."""

    url: str
    fs: AbstractFileSystem
    root: str
    storage_options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def open(cls, url: str, storage_options: Mapping[str, Any] | None = None) -> Storage:
        options = dict(storage_options or {})
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        if protocol in ("file", "local"):
            options.setdefault("auto_mkdir", True)
        try:
            fs, root = fsspec.core.url_to_fs(url, **options)
        except ImportError as exc:
            raise StoreError(
                f"cannot open {url!r}: {exc}. For S3 install the extra: pip install 'routelog[s3]'"
            ) from exc
        except ValueError as exc:
            raise StoreError(f"cannot open {url!r}: {exc}") from exc
        return cls(url=url.rstrip("/"), fs=fs, root=str(root).rstrip("/"), storage_options=options)

    @property
    def protocol(self) -> str:
        proto = self.fs.protocol
        return proto if isinstance(proto, str) else proto[0]

    def path(self, key: str) -> str:
        return posixpath.join(self.root, key) if key else self.root

    def url_of(self, key: str) -> str:
        """A URL for ``key`` that fsspec resolves to the same object."""
        return f"{self.url}/{key}" if key else self.url

    # -- primitives ------------------------------------------------------------------------------------------
    @property
    def _whole_object_kwargs(self) -> dict[str, Any]:
        # s3fs issues HEAD + GET for unranged reads when max_concurrency > 1 (s3fs #1027); documents are small.
        return {"max_concurrency": 1} if self.protocol in ("s3", "s3a") else {}

    def read(self, key: str) -> bytes:
        """The whole object; ``FileNotFoundError`` when absent."""
        data = self.fs.cat_file(self.path(key), **self._whole_object_kwargs)
        return bytes(data)

    def read_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        """Several whole objects in one call (concurrent requests on async filesystems such as S3)."""
        keys = list(keys)
        if not keys:
            return {}
        paths = [self.path(k) for k in keys]
        found = self.fs.cat(paths, on_error="return", **self._whole_object_kwargs)
        out: dict[str, bytes] = {}
        for key, path in zip(keys, paths, strict=True):
            value = found.get(path) if isinstance(found, dict) else found
            if isinstance(value, BaseException):
                raise value
            if value is None:
                raise FileNotFoundError(path)
            out[key] = bytes(value)
        return out

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        """Byte ranges ``[start, stop)`` of objects, fetched concurrently on async filesystems."""
        if not ranges:
            return []
        paths = [self.path(key) for key, _, _ in ranges]
        found = self.fs.cat_ranges(paths, [r[1] for r in ranges], [r[2] for r in ranges], on_error="return")
        out = []
        for (key, start, stop), value in zip(ranges, found, strict=True):
            if isinstance(value, BaseException):
                raise value
            if len(value) != stop - start:
                raise FileNotFoundError(f"{self.path(key)}: range [{start}, {stop}) past the end of the object")
            out.append(value if isinstance(value, bytes) else bytes(value))
        return out

    def write(self, key: str, data: bytes) -> None:
        """Write an object under a name nobody else uses (data objects have unique names)."""
        self.fs.pipe_file(self.path(key), data)

    def write_many(self, objects: Mapping[str, bytes]) -> None:
        """Write several uniquely named objects (concurrently on async filesystems)."""
        if objects:
            self.fs.pipe({self.path(k): v for k, v in objects.items()})

    def create(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist; ``False`` when it already did (someone else won)."""
        try:
            self.fs.pipe_file(self.path(key), data, mode="create")
        except FileExistsError:
            return False
        return True

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self.path(key)))

    def list(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (one level, no recursion); empty when the prefix is absent."""
        try:
            entries = self.fs.ls(self.path(prefix), detail=False, refresh=True)
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
        return sorted(n for n in names if n)

    def find(self, prefix: str) -> dict[str, int]:
        """Every object below ``prefix`` (recursive) with its size, keyed relative to the root."""
        base = self.path(prefix).rstrip("/")
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        root = self.root.rstrip("/") + "/" if self.root else ""
        return {str(path)[len(root) :]: int(info.get("size") or 0) for path, info in found.items()}

    def size(self, key: str) -> int:
        return int(self.fs.size(self.path(key)))

    def delete(self, keys: Iterable[str]) -> None:
        paths = [self.path(k) for k in keys]
        if paths:
            self.fs.rm(paths)

    def invalidate(self) -> None:
        """Drop cached listings so the next listing sees other writers' objects."""
        self.fs.invalidate_cache()

    def zarr_store(self, key: str) -> FsspecStore:
        """A read-only zarr store rooted at ``key``, for ranged reads of sharded arrays."""
        options = {k: v for k, v in self.storage_options.items() if k != "auto_mkdir"}
        return FsspecStore.from_url(self.url_of(key), storage_options=options, read_only=True)
