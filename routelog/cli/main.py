"""The entry point: every error becomes one line on stderr and an exit code; ``--debug`` shows the traceback.

Exit codes:

- 0: done.
- 1: a check found problems (``verify`` on an unsound store, ``gc`` facing damaged documents).
- 2: the command cannot run as asked: a bad option, invalid input, a step or store that does not exist, a store
  that is damaged or refuses the write. The message names what and how to fix it.
- 3: the storage cannot be used as configured: no credentials, access denied, an unreachable endpoint.
- 4: an unexpected internal error (a bug: run again with ``--debug`` and report the traceback).
- 130: interrupted (Ctrl-C); what was committed stays, and the message says how to resume.
"""

from __future__ import annotations

import os
import sys

import typer

from routelog.cli.app import DEBUG_ENV, app, err_console
from routelog.errors import RoutelogError, StoreAccessError, StoreUnreachableError, WriteInterruptedError

EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_STORAGE = 3
EXIT_INTERNAL = 4
EXIT_INTERRUPTED = 130

# Typer may vendor click: take click's exception base from typer's own usage error rather than importing click.
_ClickException: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _fail(message: str, code: int) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True, markup=True)
    sys.exit(code)


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


def main() -> None:
    """Run the command line."""
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0") or "--debug" in sys.argv[1:]
    try:
        code = app(standalone_mode=False)
    except _ClickException as exc:  # usage errors: shown with the command's usage line
        exc.show()  # type: ignore[attr-defined]
        sys.exit(exc.exit_code)  # type: ignore[attr-defined]
    except typer.Abort:  # Ctrl-C outside a writer
        _fail("interrupted", EXIT_INTERRUPTED)
    except WriteInterruptedError as exc:
        _fail(_one_line(exc), EXIT_INTERRUPTED)
    except Exception as exc:
        if debug:
            raise
        hint = f" (run with --debug or {DEBUG_ENV}=1 for the traceback)"
        if isinstance(exc, (StoreAccessError, StoreUnreachableError)):
            _fail(_one_line(exc), EXIT_STORAGE)
        elif isinstance(exc, RoutelogError):
            _fail(_one_line(exc), EXIT_USAGE)
        elif isinstance(exc, OSError):  # an input or output path of the command
            _fail(_path_error(exc), EXIT_USAGE)
        else:
            _fail(f"internal error {type(exc).__name__}: {_one_line(exc)}{hint}; please report it", EXIT_INTERNAL)
    sys.exit(code if isinstance(code, int) else 0)
