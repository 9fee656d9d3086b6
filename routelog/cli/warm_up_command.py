"""``routelog warm-up``: compile the format-2 codec's kernels ahead of the first chunk (an image build, a job's
setup), so no writer or reader process pays numba's compilation."""

from __future__ import annotations

from rich.table import Table

from routelog.cli.app import JsonFlag, app, console, print_json


@app.command(name="warm-up")
def warm_up(json_out: JsonFlag = False) -> None:
    """Compile the codec's kernels into numba's cache (once per machine; later runs only load them)."""
    from routelog.format.ranked import warm_up as compile_kernels

    seconds = compile_kernels()
    if json_out:
        print_json({"seconds": seconds})
        return
    table = Table("kernel path", "seconds")
    for path, took in seconds.items():
        table.add_row(path, f"{took:.1f}")
    console.print(table)
