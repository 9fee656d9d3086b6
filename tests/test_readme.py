"""The README's Python snippets run as written, one after another in one namespace, as a reader would paste them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_snippets_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ray_cluster: None) -> None:
    pytest.importorskip("matplotlib")
    snippets = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(snippets) >= 4
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "readme"}
    for number, code in enumerate(snippets, start=1):
        exec(compile(code, f"README.md python snippet {number}", "exec"), namespace)
    assert (tmp_path / "stats.png").stat().st_size > 10_000
