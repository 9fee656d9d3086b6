"""The ``routelog`` command line: :mod:`.app` holds the Typer application and shared options, one module per group
of commands registers them, and :func:`.main.main` turns every error into one line and an exit code."""

# Import order is the order of the commands in --help.
from routelog.cli import demo_command, write_commands, read_commands, align_command, audit_commands  # noqa: I001
from routelog.cli.app import app
from routelog.cli.main import main

__all__ = [
    "align_command",
    "app",
    "audit_commands",
    "demo_command",
    "main",
    "read_commands",
    "write_commands",
]
