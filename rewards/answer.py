"""Exact-match reward after light normalisation (case, punctuation, whitespace)."""
from __future__ import annotations

import re
import unicodedata
from typing import Any

from mmrl.registry import register

__all__ = ["normalise_text", "first_word", "answer_match"]

# Normalising a multi-megabyte response costs time for nothing: no answer is that long.
_MAX_CHARS = 200_000
_WS = re.compile(r"\s+")
# Punctuation that carries meaning in numbers: a decimal point between digits, a leading minus.
_KEEP_DOT = re.compile(r"(?<=\d)\.(?=\d)")
_KEEP_MINUS = re.compile(r"(?:(?<=\s)|^)-(?=\d)")


def normalise_text(text: Any) -> str:
    """Lowercase, drop punctuation (keeping '3.5' and '-2' intact), collapse whitespace."""
    if text is None:
        return ""
    s = text if isinstance(text, str) else str(text)
    s = unicodedata.normalize("NFKC", s[:_MAX_CHARS]).lower()
    s = _KEEP_DOT.sub("\x00", s)
    s = _KEEP_MINUS.sub("\x01", s)
    s = "".join(c for c in s if not unicodedata.category(c).startswith("P"))
    s = s.replace("\x00", ".").replace("\x01", "-")
    return _WS.sub(" ", s).strip()


def first_word(text: Any) -> str:
    """The normalised first word: the first whitespace token that has a letter or digit in it.

    Skips leading decoration such as '**' or '- ', so "**Red**, I think" gives "red".
    """
    if text is None:
        return ""
    s = text if isinstance(text, str) else str(text)
    for token in s[:_MAX_CHARS].split():
        word = normalise_text(token)
        if word:
            return word.split(" ")[0]
    return ""


@register("reward", "answer_match")
def answer_match(response: str, answer: Any, *, first_word: bool = False) -> float:
    """1.0 if the normalised response equals the normalised answer (or one of a list), else 0.0.

    `first_word=True` compares only the response's first word (for "answer in one word" prompts
    where models keep talking). A missing answer scores 0. No **kwargs on purpose: a mistyped
    config arg (`firstword`) is then rejected when the RewardSet is built.
    """
    if answer is None:
        return 0.0
    accepted = answer if isinstance(answer, (list, tuple, set, frozenset)) else [answer]
    targets = {normalise_text(a) for a in accepted if a is not None}
    targets.discard("")
    if not targets:
        return 0.0
    got = _first_word(response) if first_word else normalise_text(response)
    return 1.0 if got in targets else 0.0


_first_word = first_word  # the parameter `first_word` shadows the helper inside answer_match


@register("reward", "first_word_in")
def first_word_in(response: str, *, words: list[str]) -> float:
    """1.0 if the response's first word is one of `words` (a format reward: "answer with one of
    these words"), else 0.0. Typically given a small weight beside a correctness reward, so a
    fresh policy that almost never names a valid answer still gets a learning signal."""
    allowed = {normalise_text(w) for w in words}
    return 1.0 if first_word(response) in allowed else 0.0
