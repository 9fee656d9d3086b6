"""What each engine version emits, as read from the engines' own code (``tests/fixtures/engines/FACTS.md``).

Only facts that change how a payload must be read live here; an unknown version (``None``) is never guessed at:
the adapters then decide from the payload's own shape, or refuse when only the version could tell.
"""

from __future__ import annotations

import re

Version = tuple[int, int, int]

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str | None) -> Version | None:
    """``"0.21.0rc1"`` -> ``(0, 21, 0)``; None when absent or not a version."""
    if not text:
        return None
    match = _VERSION.match(text)
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)


def _within(version: Version | None, low: Version, high: Version) -> bool | None:
    return None if version is None else low <= version < high


def vllm_physical_ids(engine_version: str | None) -> bool | None:
    """vLLM captures expert IDs after the EPLB logical->physical mapping in 0.14.x-0.15.x and 0.21.x; every other
    version captures logical IDs. None when the version is unknown."""
    version = parse_version(engine_version)
    if version is None:
        return None
    return bool(_within(version, (0, 14, 0), (0, 16, 0)) or _within(version, (0, 21, 0), (0, 22, 0)))


def vllm_all_zero_capture(engine_version: str | None) -> bool:
    """vLLM 0.15.0 and 0.15.1 bind their capturer before it exists: every returned row is zeros."""
    return bool(_within(parse_version(engine_version), (0, 15, 0), (0, 15, 2)))


def sglang_honours_start_len(engine_version: str | None) -> bool | None:
    """SGLang declares ``routed_experts_start_len`` from 0.5.8 but passes it to the capturer only from 0.5.12;
    0.5.8-0.5.11 always return rows ``[0, n - 1)``. None when the version is unknown."""
    version = parse_version(engine_version)
    return None if version is None else version >= (0, 5, 12)


def physical_id_note(engine: str, engine_version: str | None) -> str:
    """A sentence for errors about EPLB: which versions report physical IDs."""
    if engine == "vllm":
        return (
            "vLLM 0.14.x, 0.15.x and 0.21.x report physical expert IDs under EPLB (pass the table vLLM keeps, "
            "[num_moe_layers, num_physical_experts], with --eplb-map); 0.16-0.20 and 0.22+ report logical IDs"
        )
    return f"{engine} reports logical expert IDs"
