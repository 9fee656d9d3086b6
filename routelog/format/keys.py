"""Object keys of a store, relative to its root, and the patterns every stored name must match.

Sample ids never appear in keys. Every name that becomes part of a key, whether the caller gave it (a writer id)
or it was read back from a stored document (a commit's ``part``, an object's ``key``, a seal's commit names), is
checked against one of the patterns below: the pydantic models of :mod:`routelog.format.documents` apply them when a
document is parsed, and :func:`check_key` guards every key that reaches the filesystem, so no stored document can
make routelog read, write or delete outside its store.
"""

from __future__ import annotations

import re
import secrets

from routelog.errors import UnsafeKeyError

RUN_DOCUMENT = "routelog.json"
STEPS = "steps"
ROUTING = "routing"
INDEX = "index.parquet"
SEAL = "_SEALED.json"
SEALING = "_SEALING.json"
SEALED_DIR = "_sealed"
LOG = "log"
CLOCK_DIR = "_clock"
"""Where a process reads the storage's clock (:meth:`routelog.store.storage.Storage.clock`): an empty object created,
read back and deleted at once. Readers ignore it."""
LEGACY_MARKER = "_log.00000000.json"
"""Created in the ``commits/`` directory of a step of a format-1/2 store before its first log entry: a document of
format version 3 that every format-1/2 reader parses (the name matches their commit pattern) and refuses with its
version error, so no older routelog reads such a step without the entries it cannot see."""

_STEP_DIGITS = 10

WRITER_ID_PATTERN = r"[A-Za-z0-9_-]{1,64}"
"""Writer ids name objects: letters, digits, ``_`` and ``-``."""
PART_NAME_PATTERN = rf"{WRITER_ID_PATTERN}\.\d{{8}}\.[0-9a-f]{{1,32}}"
"""``<writer>.<seq:08d>.<random hex>``: a part (or annotation) directory."""
COMMIT_NAME_PATTERN = rf"{WRITER_ID_PATTERN}\.\d{{8}}\.json"
"""``<writer>.<seq:08d>.json``: a commit (or annotation commit) document."""
SEGMENT_PATTERN = r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}"
"""One path segment of an object inside a part; it cannot be ``.`` or ``..``."""
RELATIVE_KEY_PATTERN = rf"{SEGMENT_PATTERN}(?:/{SEGMENT_PATTERN}){{0,7}}"
"""An object key relative to a part directory: one to eight segments."""
SPAN_PART_PATTERN = rf"{STEPS}/\d{{{_STEP_DIGITS}}}/parts/{PART_NAME_PATTERN}"
"""A span's reference to a part of any step, relative to the store root."""
SEALED_OBJECT_PATTERN = rf"{SEALED_DIR}/[0-9a-f]{{1,32}}\.(?:commits\.json|index\.parquet)"
"""A seal's consolidated object, relative to the step directory."""
_POSITION_DIGITS = 10
LOG_NAME_PATTERN = rf"\d{{{_POSITION_DIGITS}}}\.json"
"""``<position:010d>.json``: an entry of a step's log (format 3)."""
_SLOT_DIGITS = 5
MAX_GROUP_COMMITS = 10**_SLOT_DIGITS
"""Commits one format-4 commit entry may hold."""
MEMBER_NAME_PATTERN = rf"\d{{{_POSITION_DIGITS}}}\.\d{{{_SLOT_DIGITS}}}\.json"
"""``<position:010d>.<slot:05d>.json``: a commit of a format-4 commit entry (its slot in the entry's list)."""
ENTRY_NAME_PATTERN = rf"(?:{COMMIT_NAME_PATTERN}|{LOG_NAME_PATTERN}|{MEMBER_NAME_PATTERN})"
"""A commit's name: its place in a format-4 commit entry, its log entry (format 3) or its per-writer document
(formats 1 and 2)."""
MAX_POSITION = 10**_POSITION_DIGITS

_WRITER_ID = re.compile(WRITER_ID_PATTERN)
_STEP_NAME = re.compile(rf"\d{{{_STEP_DIGITS}}}")
_COMMIT_NAME = re.compile(rf"(?P<writer>{WRITER_ID_PATTERN})\.(?P<seq>\d{{8}})\.json")
_SPAN_PART = re.compile(rf"{STEPS}/(?P<step>\d{{{_STEP_DIGITS}}})/parts/(?P<part>{PART_NAME_PATTERN})")
_KEY_CHARS = re.compile(r"[A-Za-z0-9._/-]*")
_LOG_NAME = re.compile(rf"(?P<position>\d{{{_POSITION_DIGITS}}})\.json")


def check_writer_id(writer_id: str) -> str:
    """Writer ids become part of object keys, so they are restricted to ``[A-Za-z0-9_-]{1,64}``."""
    if not isinstance(writer_id, str) or not _WRITER_ID.fullmatch(writer_id):
        raise UnsafeKeyError(
            f"writer id {writer_id!r} must be 1-64 characters of letters, digits, '_' or '-' "
            "(it names objects; use e.g. 'rollout-3')"
        )
    return writer_id


def check_key(key: str) -> str:
    """A key relative to the store root that stays inside it: ``/``-separated segments of ``[A-Za-z0-9._-]``,
    none empty, ``.`` or ``..``. The last line of defence: stored names are validated when parsed."""
    if not isinstance(key, str) or not _KEY_CHARS.fullmatch(key) or key.startswith("/"):
        raise UnsafeKeyError(f"object key {key!r} is not a plain relative key of this store; refusing to use it")
    if key and any(segment in ("", ".", "..") for segment in key.split("/")):
        raise UnsafeKeyError(f"object key {key!r} would leave its directory; refusing to use it")
    return key


def check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**_STEP_DIGITS:
        raise UnsafeKeyError(f"step must be an integer in [0, 10^{_STEP_DIGITS}), got {step!r}")
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


def part_prefix(writer_id: str, seq: int) -> str:
    """The start of every part name a writer uses for commit ``seq``: ``<writer>.<seq:08d>.``."""
    return f"{check_writer_id(writer_id)}.{seq:08d}."


def new_part_name(writer_id: str, seq: int) -> str:
    """Fresh, unique directory name for a part: a restarted writer never reuses an orphan's objects."""
    return f"{part_prefix(writer_id, seq)}{secrets.token_hex(6)}"


def parse_span_part(path: str) -> tuple[int, str] | None:
    """``(step, part)`` of a span's ``steps/<step>/parts/<part>`` reference; None if it is not one."""
    match = _SPAN_PART.fullmatch(path)
    return (int(match["step"]), match["part"]) if match else None


def seal_key(step: int) -> str:
    return f"{step_dir(step)}/{SEAL}"


def sealing_key(step: int) -> str:
    """The sealer's intent marker: created before it lists the step's commits (the fence writers check)."""
    return f"{step_dir(step)}/{SEALING}"


def annotations_dir(step: int) -> str:
    """Annotation commits (``<writer>.<seq>.json``) and their data directories (``<writer>.<seq>.<nonce>/``)."""
    return f"{step_dir(step)}/annotations"


def annotation_key(step: int, name: str) -> str:
    return f"{annotations_dir(step)}/{name}"


def drops_dir(step: int) -> str:
    """Drop documents (``<writer>.<seq>.json``): records removed from the step without rewriting data."""
    return f"{step_dir(step)}/drops"


def drop_key(step: int, name: str) -> str:
    return f"{drops_dir(step)}/{name}"


def fidelity_dir(step: int) -> str:
    """Replay-fidelity documents (``<writer>.<seq>.json``): what training ranks measured while replaying."""
    return f"{step_dir(step)}/fidelity"


def fidelity_key(step: int, name: str) -> str:
    return f"{fidelity_dir(step)}/{name}"


def log_dir(step: int) -> str:
    """The step's log (format 3): every commit, drop, annotation and seal, each created exclusively at the next
    free position, so the storage itself fixes their order."""
    return f"{step_dir(step)}/{LOG}"


def log_name(position: int) -> str:
    if not 0 <= position < MAX_POSITION:
        raise UnsafeKeyError(f"log position {position} outside [0, {MAX_POSITION})")
    return f"{position:0{_POSITION_DIGITS}d}.json"


def member_name(position: int, slot: int) -> str:
    """The name of the commit at ``slot`` of the commit entry at ``position`` (format 4)."""
    if not 0 <= slot < MAX_GROUP_COMMITS:
        raise UnsafeKeyError(f"slot {slot} outside [0, {MAX_GROUP_COMMITS})")
    return f"{log_name(position).removesuffix('.json')}.{slot:0{_SLOT_DIGITS}d}.json"


def log_key(step: int, position: int) -> str:
    return f"{log_dir(step)}/{log_name(position)}"


def parse_log_name(name: str) -> int | None:
    """The position of a log entry's file name; None for any other name."""
    match = _LOG_NAME.fullmatch(name)
    return int(match["position"]) if match else None
