"""URLs as people see them: the credentials a URL's userinfo may carry (``s3://KEY:SECRET@bucket/run``) are never
shown. Every message, log line and repr that shows a URL given to routelog passes it through :func:`redact_url`, and
opening a store refuses a URL that has userinfo (:func:`has_userinfo`), so the URL a store keeps (and every message
naming it) holds none."""

from __future__ import annotations

import re

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:/*")
"""A scheme and the slashes after it, however many a mistyped URL has (``s3:/``); one letter is a Windows drive."""
_AUTHORITY_END = re.compile(r"[/?#]")
REDACTED = "***"


def _userinfo_span(url: str) -> tuple[int, int] | None:
    """Where the userinfo of ``url`` lies, from after its scheme to the end of its ``@`` (None: it has none)."""
    scheme = _SCHEME.match(url)
    if scheme is None:  # a plain path: an '@' in it is part of a name
        return None
    start = scheme.end()
    end = _AUTHORITY_END.search(url, start)
    authority_end = end.start() if end else len(url)
    authority = url[start:authority_end]
    if "@" in authority:
        return start, start + authority.rindex("@") + 1
    _, colon, port = authority.partition(":")
    if colon and not port.isdigit() and "@" in url[authority_end:]:
        # 'KEY:SE/CRET@bucket': a password holding '/' (AWS secret keys often do) ends the authority early
        return start, url.index("@", authority_end) + 1
    return None


def has_userinfo(url: str) -> bool:
    """Whether ``url`` carries userinfo (``user:password@`` or ``user@``) before its host or bucket."""
    return _userinfo_span(url) is not None


def redact_url(url: str) -> str:
    """``url`` as messages show it: its userinfo replaced by ``***`` (``s3://***@bucket/run``), the rest as given."""
    span = _userinfo_span(url)
    if span is None:
        return url
    start, end = span
    return f"{url[:start]}{REDACTED}@{url[end:]}"
