"""Small documents a writer numbers itself (drops, fidelity reports): ``<dir>/<writer>.<seq:08d>.json``, each
created exclusively under the writer's next free sequence number, so concurrent processes never overwrite one."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel

from routelog.errors import CommitConflictError
from routelog.format import keys
from routelog.format.documents import dump_document
from routelog.store.storage import Storage

_D = TypeVar("_D", bound=BaseModel)
_ATTEMPTS = 8


def create_numbered(storage: Storage, directory: str, writer_id: str, build: Callable[[int], _D]) -> _D:
    """Create ``build(seq)`` as ``<directory>/<writer_id>.<seq>.json`` for the next free ``seq`` of the writer,
    retrying when another process of the same id took it first."""
    for _ in range(_ATTEMPTS):
        existing = [keys.parse_commit_name(n) for n in storage.list(directory)]
        seq = 1 + max((p[1] for p in existing if p is not None and p[0] == writer_id), default=-1)
        document = build(seq)
        if storage.create(f"{directory}/{keys.commit_name(writer_id, seq)}", dump_document(document)):
            return document
    raise CommitConflictError(f"{storage.url_of(directory)}: could not create a document for {writer_id!r}")
