"""The Typer application and what its commands share: global options, option types, consoles and helpers.

Commands print results on stdout (tables, or JSON with ``--json``) and everything else (progress, notes, errors)
on stderr, so ``routelog ... --json | jq`` always reads clean JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.text import Text

from routelog import environment

if TYPE_CHECKING:  # the command line imports what a command needs when it runs (--help and --version: nothing)
    from rich.progress import Progress

    from routelog.format.spec import ModelSpec
    from routelog.store.store import Store

app = typer.Typer(
    name="routelog",
    help="Record, store, audit and replay MoE routing decisions (Rollout Routing Replay).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's own help: flags are shown without a value (typer's panels said "--debug <bool>")
)
_WIDE = None if sys.stdout.isatty() else 160  # redirected output: do not cut tables at 80 columns
# No markup anywhere: what is printed (sample ids, paths, messages naming "routelog[s3]") is printed as it is.
console = Console(width=_WIDE, markup=False)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160, markup=False)

DEBUG_ENV = environment.DEBUG.name
"""Set to 1 to see the traceback of any error (the same as ``--debug``)."""


def _version(value: bool) -> None:
    if value:
        from routelog import __version__
        from routelog.format.limits import FORMAT_VERSION

        typer.echo(f"routelog {__version__} (format {FORMAT_VERSION})")
        raise typer.Exit()


@app.callback()
def global_options(
    debug: Annotated[
        bool, typer.Option("--debug", help=f"Show the traceback of an error (or set {DEBUG_ENV}=1).")
    ] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Record, store, audit and replay MoE routing decisions (Rollout Routing Replay)."""
    del version
    if debug:
        os.environ[DEBUG_ENV] = "1"


StorageOptions = Annotated[
    str | None,
    typer.Option(
        "--storage-options",
        help='fsspec storage options as JSON, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\' (S3 also reads '
        "AWS_ENDPOINT_URL and the AWS_* credentials from the environment).",
    ),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
UrlArgument = Annotated[str, typer.Argument(help="Store URL (a local path, file://, memory:// or s3://).")]


def storage_options(text: str | None) -> dict[str, Any]:
    from routelog.store.storage import parse_storage_options

    return parse_storage_options(text)


def open_url(url: str, options_text: str | None) -> Store:
    """The existing store at ``url`` (a typed error when there is none)."""
    from routelog.store.store import open_store

    return open_store(url, storage_options=storage_options(options_text))


def try_open(url: str, options: dict[str, Any]) -> Store | None:
    from routelog.errors import StoreNotFoundError
    from routelog.store.store import open_store

    try:
        return open_store(url, storage_options=options)
    except StoreNotFoundError:
        return None


def load_spec(path: Path) -> ModelSpec:
    """A model spec JSON, or a HF ``config.json`` to derive one from."""
    from routelog.errors import ModelSpecError
    from routelog.format.spec import ModelSpec

    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # ValueError: bad JSON, or an integer literal of over 4300 digits
        raise ModelSpecError(f"cannot read model spec {path}: {exc}") from exc
    if isinstance(raw, dict) and "moe_layers" in raw:
        return ModelSpec.model_validate(raw)
    if not isinstance(raw, dict):
        raise ModelSpecError(f"{path} is not a model spec or a HF config.json (a JSON object)")
    return ModelSpec.from_hf_config(raw)


def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=1, default=str))


def say(message: str) -> None:
    """A human-readable note on stderr."""
    err_console.print(message, highlight=False, soft_wrap=True)


def labeled(label: str, style: str, message: str, *, stderr: bool = True) -> None:
    """``label: message``, the label styled, the message printed as it is."""
    (err_console if stderr else console).print(
        Text.assemble((f"{label}:", style), " ", message), highlight=False, soft_wrap=True
    )


def progress_bar() -> Progress:
    """A progress bar on stderr, shown only on a terminal (redirected output gets the final summary line)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,
    )


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"
