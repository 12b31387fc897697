"""Format reward for reasoning output: `<think>...</think><answer>...</answer>`.

strict=True (R1-style): the whole response, give or take surrounding whitespace, is exactly one
think block followed by one answer block (only whitespace between), both non-empty, tags
lowercase as configured.
strict=False (lenient): one think block and one answer block somewhere, in that order, tag names
case-insensitive, other text allowed around them; the think block may be empty.
Either way the answer block must be non-empty. Set think_tag="" to require only the answer block.
Parsing is by string search, linear in the response length (no backtracking regex).
"""
from __future__ import annotations

import re

from mmrl.registry import register
from mmrl.plugins.rewards._text import as_text

__all__ = ["format_tags", "find_blocks"]

_MAX_SCAN = 400_000  # a longer response is scored on this prefix and its end


def find_blocks(text: str, tag: str, ignore_case: bool = False) -> list[tuple[int, int, int, int]]:
    """Every `<tag>...</tag>` block as (open_start, content_start, content_end, close_end), plus
    stray tags as blocks with content_end = -1 (an open tag never closed, or a close tag never
    opened). Nested or overlapping tags show up as several entries."""
    flags = re.I if ignore_case else 0
    t = re.escape(tag)
    tokens = sorted([(m.start(), m.end(), "open") for m in re.finditer(rf"<{t}>", text, flags)]
                    + [(m.start(), m.end(), "close") for m in re.finditer(rf"</{t}>", text, flags)])
    blocks: list[tuple[int, int, int, int]] = []
    open_at: tuple[int, int] | None = None
    for start, end, kind in tokens:
        if kind == "open":
            if open_at is not None:  # an open inside an open: the first is stray
                blocks.append((open_at[0], open_at[1], -1, -1))
            open_at = (start, end)
        elif open_at is None:
            blocks.append((start, start, -1, end))  # a close without an open
        else:
            blocks.append((open_at[0], open_at[1], start, end))
            open_at = None
    if open_at is not None:
        blocks.append((open_at[0], open_at[1], -1, -1))
    return blocks


@register("reward", "format_tags")
def format_tags(response: str, *, think_tag: str = "think", answer_tag: str = "answer",
                strict: bool = False) -> dict[str, float]:
    """1.0 if the response has the think/answer tag format (strict or lenient, see module doc).

    Components: think (one well-formed think block), answer (one well-formed non-empty answer
    block), order (think before answer, or no think tag required).
    """
    if not answer_tag:
        raise ValueError("format_tags: answer_tag must be a tag name such as 'answer'")
    s = as_text(response)
    if len(s) > _MAX_SCAN:  # keep the start and the end, where the tags are
        s = s[:_MAX_SCAN // 2] + "\n" + s[-_MAX_SCAN // 2:]
    ignore_case = not strict
    ans = find_blocks(s, answer_tag, ignore_case)
    ans_ok = len(ans) == 1 and ans[0][2] >= 0 and s[ans[0][1]:ans[0][2]].strip() != ""
    if think_tag:
        th = find_blocks(s, think_tag, ignore_case)
        think_ok = len(th) == 1 and th[0][2] >= 0 and (not strict or s[th[0][1]:th[0][2]].strip() != "")
        order_ok = think_ok and ans_ok and th[0][3] <= ans[0][0]
    else:
        th, think_ok = [], True
        order_ok = ans_ok
    ok = think_ok and ans_ok and order_ok
    if ok and strict:
        stripped_start = len(s) - len(s.lstrip())
        first = th[0] if th else ans[0]
        between = s[th[0][3]:ans[0][0]] if th else ""
        ok = (first[0] == stripped_start and between.strip() == ""
              and s[ans[0][3]:].strip() == "")
    return {"score": 1.0 if ok else 0.0, "think": 1.0 if (think_ok and bool(think_tag)) else 0.0,
            "answer": 1.0 if ans_ok else 0.0, "order": 1.0 if order_ok else 0.0}
