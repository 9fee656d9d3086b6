"""Object keys of a store, relative to its root. Sample ids never appear in keys; writer ids are checked."""

from __future__ import annotations

import re
import secrets

RUN_DOCUMENT = "routelog.json"
STEPS = "steps"
ROUTING = "routing"
INDEX = "index.parquet"

_STEP_DIGITS = 10
_WRITER_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_STEP_NAME = re.compile(rf"\d{{{_STEP_DIGITS}}}")
_COMMIT_NAME = re.compile(r"(?P<writer>[A-Za-z0-9_-]{1,64})\.(?P<seq>\d{8})\.json")


def check_writer_id(writer_id: str) -> str:
    """Writer ids become part of object keys, so they are restricted to ``[A-Za-z0-9_-]{1,64}``."""
    if not isinstance(writer_id, str) or not _WRITER_ID.fullmatch(writer_id):
        raise ValueError(
            f"writer id {writer_id!r} must be 1-64 characters of letters, digits, '_' or '-' "
            "(it names objects; use e.g. 'rollout-3')"
        )
    return writer_id


def check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**_STEP_DIGITS:
        raise ValueError(f"step must be an integer in [0, 10^{_STEP_DIGITS}), got {step!r}")
    return step


def step_dir(step: int) -> str:
    return f"{STEPS}/{check_step(step):0{_STEP_DIGITS}d}"


def parse_step_name(name: str) -> int | None:
    return int(name) if _STEP_NAME.fullmatch(name) else None


def commits_dir(step: int) -> str:
    return f"{step_dir(step)}/commits"


def commit_name(writer_id: str, seq: int) -> str:
    return f"{check_writer_id(writer_id)}.{seq:08d}.json"


def parse_commit_name(name: str) -> tuple[str, int] | None:
    match = _COMMIT_NAME.fullmatch(name)
    return (match["writer"], int(match["seq"])) if match else None


def commit_key(step: int, name: str) -> str:
    return f"{commits_dir(step)}/{name}"


def parts_dir(step: int) -> str:
    return f"{step_dir(step)}/parts"


def part_dir(step: int, part: str) -> str:
    return f"{parts_dir(step)}/{part}"


def new_part_name(writer_id: str, seq: int) -> str:
    """Fresh, unique directory name for a part: a restarted writer never reuses an orphan's objects."""
    return f"{check_writer_id(writer_id)}.{seq:08d}.{secrets.token_hex(6)}"


def seal_key(step: int) -> str:
    return f"{step_dir(step)}/_SEALED.json"


def annotations_dir(step: int) -> str:
    """Annotation commits (``<writer>.<seq>.json``) and their data directories (``<writer>.<seq>.<nonce>/``)."""
    return f"{step_dir(step)}/annotations"


def annotation_key(step: int, name: str) -> str:
    return f"{annotations_dir(step)}/{name}"
