"""The README and the pages under docs/ hold what they promise: every ```python snippet runs as written (the README's
one after another in one namespace, as a reader pastes them; each page's after the README's, in a namespace that
starts as the README's ends), every relative link reaches a file (and a heading, for an #anchor), every page is
reachable from the README, the README stays short, and docs/benchmarks.md renders from its JSON reports.

```py blocks are the lines a user adds to a trainer's own code, not runnable on their own: they are not run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
README_MAX_LINES = 400

SNIPPET = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _snippets(path: Path) -> list[str]:
    return SNIPPET.findall(path.read_text())


def _run_snippets(path: Path, namespace: dict[str, object]) -> int:
    snippets = _snippets(path)
    for number, code in enumerate(snippets, start=1):
        exec(compile(code, f"{_name(path)} python snippet {number}", "exec"), namespace)
    return len(snippets)


def _readme_namespace() -> dict[str, object]:
    """What a reader holds after pasting every README snippet in the current directory."""
    namespace: dict[str, object] = {"__name__": "readme"}
    assert _run_snippets(README, namespace) >= 3
    return namespace


def test_readme_snippets_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace = _readme_namespace()
    assert namespace["again"].appended == 0  # type: ignore[attr-defined]


PAGES_WITH_SNIPPETS = [page for page in PAGES if _snippets(page)]


def test_the_pages_with_snippets_are_the_ones_expected() -> None:
    """A guard on the snippet pattern itself: the pages known to hold snippets are found holding them."""
    found = {_name(page) for page in PAGES_WITH_SNIPPETS}
    assert found >= {"docs/writers.md", "docs/audits.md", "docs/storage-layout.md"}, found


@pytest.mark.parametrize("page", PAGES_WITH_SNIPPETS, ids=_name)
def test_page_snippets_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    text = page.read_text()
    if "routelog.audit.figures" in text:
        pytest.importorskip("matplotlib")
    if "routelog.ray" in text or "import ray" in text:
        request.getfixturevalue("ray_cluster")
    monkeypatch.chdir(tmp_path)
    namespace = {**_readme_namespace(), "__name__": _name(page)}
    assert _run_snippets(page, namespace) >= 1
    if page.name == "audits.md":
        assert (tmp_path / "stats.png").stat().st_size > 10_000
        assert (tmp_path / "mismatch.png").stat().st_size > 10_000


def test_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail to a page under docs/"


# -- links ---------------------------------------------------------------------------------------------------------
def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _anchors(path: Path) -> set[str]:
    """The #anchors GitHub gives the headings of a markdown file (lower case, punctuation dropped, spaces to
    hyphens; a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(path.read_text()):
        heading = re.match(r"#{1,6} (.*)", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading[1].strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path: Path) -> list[str]:
    """The link targets of a markdown file, outside code."""
    prose = "\n".join(INLINE_CODE.sub("", line) for line in _prose(path.read_text()))
    return [m["target"] for m in LINK.finditer(prose)]  # a link's text may wrap onto the next line


def _resolve(source: Path, target: str) -> tuple[Path, str]:
    path, _, anchor = target.partition("#")
    return (source.parent / path).resolve() if path else source, anchor


@pytest.mark.parametrize("source", [README, *PAGES], ids=_name)
def test_relative_links_resolve(source: Path) -> None:
    broken = []
    for target in _links(source):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, anchor = _resolve(source, target)
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (path.suffix != ".md" or anchor not in _anchors(path)):
            broken.append(f"{target}: no heading #{anchor} in {_name(path)}")
    assert not broken, f"{_name(source)}: {broken}"


def test_every_page_is_reachable_from_the_readme() -> None:
    reached, todo = {README}, [README]
    while todo:
        source = todo.pop()
        for target in _links(source):
            path, _ = _resolve(source, target)
            if path.suffix == ".md" and path.is_file() and path not in reached:
                reached.add(path)
                todo.append(path)
    unreached = sorted(_name(page) for page in PAGES if page not in reached)
    assert not unreached, f"pages no link from README.md leads to: {unreached}"


# -- the benchmarks page -------------------------------------------------------------------------------------------
def test_benchmarks_page_renders_from_its_reports() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "benchmarks_page.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
