"""Files a command writes for the user (an export, a figure, arrays): whole or not at all.

Each is written under a temporary name beside its own and renamed over it once complete, so a command that fails
half-way leaves neither a truncated file nor an empty one that a later command would read as "no records".
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def written_whole(path: Path) -> Iterator[Path]:
    """The temporary path to write ``path``'s content to; renamed to ``path`` when the block ends without an error,
    deleted otherwise."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial{path.suffix}")
    try:
        yield temporary
    except BaseException as error:
        with contextlib.suppress(OSError):
            temporary.unlink()
        if isinstance(error, OSError) and error.filename in (str(temporary), temporary):
            error.filename = str(path)  # the user chose ``path``: name it, not the temporary beside it
        raise
    os.replace(temporary, path)
