"""The optional parts of routelog, what each needs installed and the command that installs it.

A script (an example, a trainer's entry point) checks what it needs before it imports anything heavy, so a missing
package is one line naming the install command at once, not a ``ModuleNotFoundError`` after megatron-core loaded.
Modules are looked up, not imported (``importlib.util.find_spec``): checking costs milliseconds.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import NoReturn

from routelog.errors import MissingExtraError

VERL_INSTALL = (
    "pip install 'routelog[verl-test]' && pip install --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 "
    "transferqueue==0.1.11"
)
"""veRL pins GPU stacks: its wheel and the few packages it needs on CPU are installed without their dependencies."""

EXTRAS: dict[str, tuple[tuple[str, ...], str]] = {
    "s3": (("s3fs",), "pip install 'routelog[s3]'"),
    "torch": (("torch",), "pip install 'routelog[torch]'"),
    "ray": (("ray",), "pip install 'routelog[ray]'"),
    "megatron": (("megatron.core", "torch"), "pip install 'routelog[megatron]'"),
    "hf": (("transformers", "torch", "safetensors"), "pip install 'routelog[hf]'"),
    "plot": (("matplotlib",), "pip install 'routelog[plot]'"),
    "verl": (("verl", "tensordict", "omegaconf"), VERL_INSTALL),
}
"""Each optional part: the modules it imports and the command that installs them."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return False


def require(*extras: str, needed_by: str = "this") -> None:
    """Raise :class:`~routelog.errors.MissingExtraError` naming the missing modules and the install command
    unless every module of ``extras`` (keys of :data:`EXTRAS`) can be imported."""
    unknown = [extra for extra in extras if extra not in EXTRAS]
    if unknown:
        raise ValueError(f"unknown extras {unknown}: routelog's are {sorted(EXTRAS)}")
    missing = {extra: [m for m in EXTRAS[extra][0] if not _installed(m)] for extra in extras}
    missing = {extra: modules for extra, modules in missing.items() if modules}
    if missing:
        modules = sorted({m for ms in missing.values() for m in ms})
        commands = " && ".join(dict.fromkeys(EXTRAS[extra][1] for extra in missing))
        raise MissingExtraError(f"{needed_by} needs {', '.join(modules)}, not installed: {commands}")


def exit_unless_installed(script: str, *extras: str) -> None:
    """:func:`require` for a script's first lines: a missing extra ends it with that one line (exit status 2)."""
    try:
        require(*extras, needed_by=script)
    except MissingExtraError as exc:
        _exit(str(exc))


def _exit(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def install_hint(module: str) -> str | None:
    """The command installing the extra that provides ``module`` (a ``ModuleNotFoundError``'s name), if any."""
    top = module.split(".", maxsplit=1)[0]
    for required, command in EXTRAS.values():
        if any(m.split(".", maxsplit=1)[0] == top for m in required):
            return command
    return None
