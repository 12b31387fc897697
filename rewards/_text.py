"""Small text helpers shared by the built-in rewards (no plugin registered here).

Every built-in reward must stay fast on a pathological response (a model that never stops,
100k+ characters): the helpers here cut text to a bounded window before any regex or DP runs.
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["MAX_CHARS", "as_text", "head", "tail", "answer_span", "NUMBER"]

# No answer is longer than this; scanning more only costs time.
MAX_CHARS = 20_000

# A plain decimal number: optional sign, digits with an optional fraction (or ".5"), optional
# exponent. Used inside larger patterns, so it has no anchors and no groups.
NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"


def as_text(x: Any) -> str:
    """`x` as a string ("" for None)."""
    if x is None:
        return ""
    return x if isinstance(x, str) else str(x)


def head(text: Any, n: int = MAX_CHARS) -> str:
    """The first `n` characters (for "first thing mentioned" extraction)."""
    s = as_text(text)
    return s if len(s) <= n else s[:n]


def tail(text: Any, n: int = MAX_CHARS) -> str:
    """The last `n` characters (for "final answer" extraction)."""
    s = as_text(text)
    return s if len(s) <= n else s[-n:]


_TAG_CACHE: dict[str, tuple[re.Pattern[str], re.Pattern[str]]] = {}


def _tag_patterns(tag: str) -> tuple[re.Pattern[str], re.Pattern[str]]:
    pats = _TAG_CACHE.get(tag)
    if pats is None:
        t = re.escape(tag)
        pats = (re.compile(rf"<\s*{t}\s*>", re.I), re.compile(rf"<\s*/\s*{t}\s*>", re.I))
        _TAG_CACHE[tag] = pats
    return pats


def answer_span(text: Any, tag: str = "answer") -> str:
    """The content of the last `<answer>...</answer>` block if the response has one, else the
    whole response. Lets every answer-checking reward work on think/answer formatted output.

    An opening tag without a closing one (a truncated response) gives the text after it.
    """
    s = as_text(text)
    if "<" not in s:
        return s
    open_re, close_re = _tag_patterns(tag)
    window = tail(s, 4 * MAX_CHARS)
    opens = list(open_re.finditer(window))
    if not opens:
        return s
    start = opens[-1].end()
    m = close_re.search(window, start)
    return window[start:m.start()] if m else window[start:]
