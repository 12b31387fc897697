"""Counting reward: the first number the response mentions (a word zero..twenty or digits)
against the answer (the `counting` recipe answers with a number word: "three").

"There are three circles" -> 3; "I count 4." -> 4; "three circles in 2 rows" -> 3 (the first).
If the response has an `<answer>...</answer>` block, only its content is read.
"""
from __future__ import annotations

import re
from typing import Any

from mmrl.registry import register
from mmrl.plugins.rewards._text import MAX_CHARS, answer_span, as_text, head

__all__ = ["counting", "NUMBER_WORDS", "first_count", "parse_count"]

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
                "eighteen", "nineteen", "twenty")
_WORD_VALUE = {w: i for i, w in enumerate(NUMBER_WORDS)}
# Digits (with an optional ".0"-style fraction) not glued to letters or other digits; or a word.
_COUNT = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?![\w]|\.\d)|\b(" + "|".join(NUMBER_WORDS) + r")\b", re.I)


def first_count(text: Any) -> float | None:
    """The first number mentioned (word or digits) as a float, or None."""
    m = _COUNT.search(head(answer_span(text), MAX_CHARS))
    if m is None:
        return None
    return float(m.group(1)) if m.group(1) is not None else float(_WORD_VALUE[m.group(2).lower()])


def parse_count(answer: Any) -> float | None:
    """The gold count: an int/float, digits ("3") or a number word ("three")."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, (int, float)):
        return float(answer)
    return first_count(as_text(answer).strip()) if as_text(answer).strip() else None


@register("reward", "counting")
def counting(response: str, answer: Any) -> dict[str, float]:
    """1.0 if the first number in the response equals the answer ("three", "3" or 3; a list
    of accepted counts also works). Components: parsed (a number was found)."""
    items = answer if isinstance(answer, (list, tuple, set, frozenset)) else [answer]
    golds = {g for g in (parse_count(a) for a in items) if g is not None}
    got = first_count(response)
    return {"score": 1.0 if got is not None and got in golds else 0.0,
            "parsed": 1.0 if got is not None else 0.0}
