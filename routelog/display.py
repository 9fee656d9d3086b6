"""Short notebook views (``_repr_html_``) of stores, steps and records: a title and a small table."""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence


def html_card(
    title: str, facts: Sequence[tuple[str, object]], rows: Iterable[Sequence[object]] = (), columns: Sequence[str] = ()
) -> str:
    """``title`` in bold, ``facts`` as a two-column table, then an optional table of ``rows`` under ``columns``."""
    parts = [f"<div><b>{html.escape(title)}</b>", "<table>"]
    parts += [
        f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in facts
    ]
    parts.append("</table>")
    if columns:
        parts.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in columns) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in rows]
        parts.append("</table>")
    parts.append("</div>")
    return "\n".join(parts)
