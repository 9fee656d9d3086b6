"""The entry point: every error becomes one line on stderr and an exit code (with ``--json``, also
``{"error", "exit_code"}`` on stdout); ``--debug`` shows the traceback as well.

Exit codes:

- 0: done.
- 1: a check found problems (``verify`` on an unsound store, ``gc`` facing damaged documents), or ``ingest
  --partial`` left invalid input out (the valid records are written).
- 2: the command cannot run as asked: a bad option, invalid input, a step or store that does not exist, a store
  that is damaged or refuses the write. The message names what and how to fix it.
- 3: the storage cannot be used as configured: no credentials, access denied, an unreachable endpoint.
- 4: an unexpected internal error (a bug: run again with ``--debug`` and report the traceback).
- 130: interrupted (Ctrl-C); what was committed stays, and the message says how to resume.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import typer
from rich.text import Text

from routelog import environment
from routelog.cli.app import DEBUG_ENV, app, err_console
from routelog.errors import RoutelogError, StoreAccessError, StoreUnreachableError, WriteInterruptedError
from routelog.extras import install_hint

EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_STORAGE = 3
EXIT_INTERNAL = 4
EXIT_INTERRUPTED = 130

# Typer may vendor click: take click's exception base from typer's own usage error rather than importing click.
_ClickException: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _fail(message: str, code: int, *, json_out: bool = False) -> None:
    """End with ``message`` on stderr (and, for a ``--json`` command, ``{"error", "exit_code"}`` on stdout)."""
    # The message is printed as it is: no markup, so brackets ("routelog[s3]") and paths survive.
    err_console.print(Text.assemble(("error: ", "bold red"), message), highlight=False, soft_wrap=True)
    if json_out:
        print(json.dumps({"error": message, "exit_code": code}), flush=True)
    sys.exit(code)


def _usage(exc: Exception) -> str:
    """A usage error in one line, with where to read the command's options."""
    context = getattr(exc, "ctx", None)
    command = getattr(context, "command_path", None) or "routelog"
    message = getattr(exc, "format_message", lambda: str(exc))()
    return f"{_one_line(Exception(message))} (see: {command} --help)"


def _is_validation_error(exc: Exception) -> bool:
    """A pydantic validation error (pydantic is imported only by a command that ran into one)."""
    if "pydantic" not in sys.modules:
        return False
    from pydantic import ValidationError

    return isinstance(exc, ValidationError)


def _validation(exc: Exception) -> str:
    """A pydantic validation error in one line: each field and what is wrong with it."""
    parts = []
    for error in getattr(exc, "errors", list)():
        field = ".".join(str(part) for part in error.get("loc", ())) or "value"
        parts.append(f"{field}: {error.get('msg')}")
    return "; ".join(parts) or _one_line(exc)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


_PATH_FIXES: tuple[tuple[type[OSError], str], ...] = (
    (NotADirectoryError, "a parent of this path is a file: choose a path under a directory"),
    (IsADirectoryError, "this is a directory: give a file path"),
    (PermissionError, "not allowed: choose a path this user can read or write"),
    (FileNotFoundError, "check the path"),
)


def _path_error(exc: OSError) -> str:
    """An operating-system error on a path, with what to do about it."""
    if exc.filename is None:
        return _one_line(exc)
    fix = next((fix for kind, fix in _PATH_FIXES if isinstance(exc, kind)), "check the path")
    return f"{exc.filename}: {exc.strerror or _one_line(exc)}; {fix}"


def _explain(exc: Exception, debug: bool) -> tuple[str, int]:
    """The one line and the exit code an error ends the command with."""
    if isinstance(exc, _ClickException):  # usage errors: one line, and where the command's options are
        return _usage(exc), int(getattr(exc, "exit_code", EXIT_USAGE))
    if isinstance(exc, typer.Abort):
        return "interrupted", EXIT_INTERRUPTED
    if isinstance(exc, WriteInterruptedError):
        return _one_line(exc), EXIT_INTERRUPTED
    if isinstance(exc, (StoreAccessError, StoreUnreachableError)):
        return _one_line(exc), EXIT_STORAGE
    if isinstance(exc, RoutelogError):
        return _one_line(exc), EXIT_USAGE
    if _is_validation_error(exc):  # a value the user gave (a model spec field, an option)
        return _validation(exc), EXIT_USAGE
    if isinstance(exc, ModuleNotFoundError) and exc.name and (fix := install_hint(exc.name)):
        return f"{exc.name} is not installed: {fix}", EXIT_USAGE
    if isinstance(exc, OSError):  # an input or output path of the command
        return _path_error(exc), EXIT_USAGE
    hint = "" if debug else f" (run with --debug or {DEBUG_ENV}=1 for the traceback)"
    return f"internal error {type(exc).__name__}: {_one_line(exc)}{hint}; please report it", EXIT_INTERNAL


def main() -> None:
    """Run the command line. ``--debug`` may come anywhere on it (before or after the command): it prints the
    traceback of an error, which still ends in the same one line and exit code."""
    arguments = sys.argv[1:]
    debug = "--debug" in arguments
    try:
        debug = environment.debug() or debug  # checked even with --debug: a bad value is refused, not ignored
        if debug:
            os.environ[DEBUG_ENV] = "1"
        code = app(args=[a for a in arguments if a != "--debug"], standalone_mode=False)
    except Exception as exc:  # typer.Abort (Ctrl-C outside a writer) is one too
        if debug and not isinstance(exc, (_ClickException, typer.Abort, WriteInterruptedError)):
            traceback.print_exc()
        _fail(*_explain(exc, debug), json_out="--json" in arguments)
    sys.exit(code if isinstance(code, int) else 0)
