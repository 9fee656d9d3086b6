"""The layers of ARCHITECTURE.md hold: no module imports from a layer above its own (lazy imports included), and
every module belongs to a layer."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "routelog"
ARCHITECTURE = Path(__file__).resolve().parent.parent / "ARCHITECTURE.md"

LAYERS: dict[str, set[str]] = {
    "format": {"format", "errors", "display", "extras", "environment", "urls", "interrupts"},
    "align": {"align"},
    "store": {"store", "outputs", "ray_session"},
    "engines": {"engines"},
    "replay": {"loader", "megatron", "megatron_indexer", "integrations"},
    "audit": {"audit"},
    "applications": {
        "ingest", "synth", "demo", "demo_report", "ray", "cli", "testing", "fault_proxy", "__main__", "__init__",
    },
}  # fmt: skip
"""Each layer's folders and top-level modules: a folder's modules are all in its layer."""
MAY_IMPORT: dict[str, set[str]] = {
    "format": {"format"},
    "align": {"format", "align"},
    "store": {"format", "store"},
    "engines": {"format", "align", "engines"},
    "replay": {"format", "align", "store", "engines", "replay"},
    "audit": {"format", "align", "store", "audit"},
    "applications": set(LAYERS),
}


def _layer(module: str) -> str:
    """The layer of ``routelog.<module>`` (its first component names it)."""
    head = module.split(".", maxsplit=1)[0]
    for layer, members in LAYERS.items():
        if head in members:
            return layer
    raise AssertionError(f"routelog.{module} belongs to no layer: add it to ARCHITECTURE.md and to LAYERS here")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The routelog modules ``path`` imports, anywhere in it (``from routelog import keys`` is ``keys``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "routelog":
            base = node.module.removeprefix("routelog").removeprefix(".")
            for alias in node.names:
                candidate = f"{base}.{alias.name}" if base else alias.name
                found.add(candidate if candidate in modules else base)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("routelog.") for a in node.names if a.name.startswith("routelog.")}
    return {m for m in found if m and m != "__init__"}


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    modules = _modules()
    names = set(modules)
    upward = []
    for module, path in modules.items():
        own = _layer(module)
        for imported in sorted(_imports(path, names)):
            if _layer(imported) not in MAY_IMPORT[own]:
                upward.append(f"routelog.{module} ({own}) imports routelog.{imported} ({_layer(imported)})")
    assert not upward, "\n".join(upward)


def test_the_layers_here_are_architecture_md() -> None:
    text = ARCHITECTURE.read_text()
    for members in LAYERS.values():
        for member in members - {"__init__"}:
            shown = f"`{member}/`" if (PACKAGE / member).is_dir() else f"`{member}`"
            assert shown in text, f"{member} is not in ARCHITECTURE.md's table"


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The control: a format module importing the store is caught."""
    fake = tmp_path / "codec.py"
    fake.write_text("def f():\n    from routelog.store.store import open_store\n    from routelog.store import gc\n")
    imported = _imports(fake, set(_modules()))
    assert imported == {"store.store", "store.gc"}
    assert all(_layer(m) not in MAY_IMPORT["format"] for m in imported)


IO_MODULES = {"fsspec", "s3fs", "pathlib", "shutil", "socket", "urllib", "http", "aiohttp", "requests", "ray"}


def _io_uses(path: Path) -> list[str]:
    """The I/O modules ``path`` imports and its calls of the builtin ``open``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in IO_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in IO_MODULES:
            found.append(node.module)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
            found.append(f"open() at line {node.lineno}")
    return found


def test_the_format_layer_does_no_io() -> None:
    """Layer 1 is bytes and documents: reading and writing objects is the store's (ARCHITECTURE.md)."""
    uses = {m: _io_uses(p) for m, p in _modules().items() if _layer(m) == "format"}
    assert len(uses) > 15, sorted(uses)
    assert not {m: u for m, u in uses.items() if u}


def test_the_io_check_sees_io(tmp_path: Path) -> None:
    fake = tmp_path / "part.py"
    fake.write_text("import fsspec\nfrom pathlib import Path\n\ndef f(p):\n    return open(p).read()\n")
    assert _io_uses(fake) == ["fsspec", "pathlib", "open() at line 5"]
