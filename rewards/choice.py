"""Multiple-choice reward: which option letter did the response pick?

The letter is found robustly, trying in order (the first rule that finds one wins):
  1. the last `\\boxed{C}` (also `\\boxed{\\text{C}}`, `\\boxed{(C)}`);
  2. the last "answer is C" / "Answer: (c)" / "answer = C";
  3. the last "option C" / "choice is C" / "correct option: C";
  4. a response that is only a letter with decoration: "B", "(B)", "B.", "**B**";
  5. a leading letter with punctuation: "B. Because ...", "(B) the circle";
  6. the last parenthesised letter anywhere: "... so (B)";
  7. with `choices` known: the one option text the response names ("It is a circle").
Lowercase letters count only where they cannot be a word ("answer is a circle" picks nothing).
If the response has an `<answer>...</answer>` block, only its content is read.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from mmrl.registry import register
from mmrl.plugins.rewards._text import MAX_CHARS, answer_span, as_text, tail
from mmrl.plugins.rewards.answer import normalise_text

__all__ = ["multiple_choice", "extract_choice", "normalise_choices"]

DEFAULT_LETTERS = "ABCDEFGHIJ"
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{((?:[^{}]|\{[^{}]*\})*)\}")
_CACHE: dict[str, dict[str, re.Pattern[str]]] = {}


def _patterns(letters: str) -> dict[str, re.Pattern[str]]:
    pats = _CACHE.get(letters)
    if pats is None:
        cls = "[" + "".join(re.escape(c) for c in letters.upper() + letters.lower()) + "]"
        end = r"(?![A-Za-z0-9])"
        deco = r"[\s\*\"'`]*[\(\[]?[\s\*]*"
        pats = {
            "answer": re.compile(r"\banswer\b(?:\s*(?:is|was|would\s+be|should\s+be)\b)?\s*[:=\-]?"
                                 r"(?:\s*(?:option|choice)\b)?" + deco + f"({cls}){end}", re.I),
            "option": re.compile(r"\b(?:option|choice)s?\b(?:\s*(?:is|was)\b)?\s*[:=\-]?" + deco
                                 + f"({cls}){end}", re.I),
            "only": re.compile(rf"^[\W_]*({cls})[\W_]*$"),
            "lead": re.compile(rf"^[\s\*\"'`]*[\(\[]?\s*({cls})\s*(?:[\)\]]|[\.:](?!\d))"),
            "paren": re.compile(rf"[\(\[]\s*({cls})\s*[\)\]]"),
            "inner": re.compile(rf"^[\s\(\[\*]*(?:\\text\s*\{{\s*)?\(?({cls})\)?\s*\}}?[\s\)\]\.\*]*$"),
        }
        _CACHE[letters] = pats
    return pats


_NEXT_WORD = re.compile(r"[\)\]\*]*\s+([A-Za-z]+)")
# Words that may follow a real pick: "The answer is A because ...".
_CONNECTIVES = frozenset({"because", "since", "as", "and", "or", "which", "with", "that", "so", "is"})


def _word_like(text: str, m: re.Match[str]) -> bool:
    """Is the matched letter really a word of prose? "the answer is a circle", "Answer: I think"
    pick nothing; "answer: b", "The answer is B", "The answer is A because" pick a letter."""
    letter = m.group(1)
    nxt = _NEXT_WORD.match(text, m.end(1))
    if nxt is None:
        return False
    word = nxt.group(1)
    if word.lower() in _CONNECTIVES:
        return False
    return letter.islower() or (letter in "AI" and word.islower())


def normalise_choices(choices: Any) -> dict[str, str]:
    """{letter: option text} from a mapping ({"A": "circle"}) or a list (["circle", ...] = A, B, ...)."""
    if not choices:
        return {}
    if isinstance(choices, Mapping):
        return {str(k).strip().strip("().").upper(): as_text(v) for k, v in choices.items()}
    if isinstance(choices, Sequence) and not isinstance(choices, str):
        return {chr(ord("A") + i): as_text(v) for i, v in enumerate(choices) if i < 26}
    return {}


def extract_choice(text: Any, letters: str = DEFAULT_LETTERS, choices: Mapping[str, str] | None = None) -> str | None:
    """The option letter (uppercase) the text picks, or None. See the module docstring."""
    s = tail(answer_span(text), MAX_CHARS).strip()
    if not s:
        return None
    pats = _patterns(letters)
    for m in reversed(list(_BOXED.finditer(s))):
        inner = pats["inner"].match(m.group(1))
        if inner:
            return inner.group(1).upper()
        if choices:
            picked = _match_option_text(m.group(1), choices)
            if picked:
                return picked
    for key in ("answer", "option"):
        for m in reversed(list(pats[key].finditer(s))):
            if not _word_like(s, m):
                return m.group(1).upper()
    m = pats["only"].match(s)
    if m:
        return m.group(1).upper()
    m = pats["lead"].match(s)
    if m and not _word_like(s, m):
        return m.group(1).upper()
    found = list(pats["paren"].finditer(s))
    if found:
        return found[-1].group(1).upper()
    if choices:
        return _match_option_text(s, choices)
    return None


def _match_option_text(text: str, choices: Mapping[str, str]) -> str | None:
    """The letter whose option text the response equals, or the only one it mentions."""
    said = normalise_text(text)
    if not said:
        return None
    norm = {k: normalise_text(v) for k, v in choices.items()}
    for k, v in norm.items():
        if v and said == v:
            return k
    padded = f" {said} "
    named = {k for k, v in norm.items() if v and f" {v} " in padded}
    # "circle" is inside "semicircle"'s text too; keep only options not contained in another named one
    named = {k for k in named if not any(norm[k] != norm[o] and norm[k] in norm[o] for o in named)}
    return next(iter(named)) if len(named) == 1 else None


def _gold_letters(answer: Any, letters: str, choices: Mapping[str, str]) -> tuple[set[str], set[str]]:
    """(accepted letters, accepted normalised texts when no letter could be derived)."""
    items = answer if isinstance(answer, (list, tuple, set, frozenset)) else [answer]
    got: set[str] = set()
    texts: set[str] = set()
    pats = _patterns(letters)
    for a in items:
        if a is None:
            continue
        s = as_text(a).strip()
        m = pats["only"].match(s)
        if m:
            got.add(m.group(1).upper())
            continue
        if choices:
            k = next((k for k, v in choices.items() if normalise_text(v) == normalise_text(s)), None)
            if k:
                got.add(k)
                continue
        letter = extract_choice(s, letters) if len(s) < 200 else None
        if letter:
            got.add(letter)
        elif normalise_text(s):
            texts.add(normalise_text(s))
    return got, texts


@register("reward", "multiple_choice")
def multiple_choice(response: str, answer: Any, metadata: Mapping[str, Any] | None = None, *,
                    choices: Any = None, letters: str | None = None) -> dict[str, float]:
    """1.0 if the response picks the answer's option letter (robust letter extraction).

    `answer` is a letter ("B", "(B)"), a list of accepted letters, or an option text when the
    choices are known. `choices` ({"A": "circle", ...} or a list) comes from args or from
    metadata["choices"] / metadata["options"]; `letters` (default A-J, or the choices' keys)
    limits which letters count. Components: parsed (a letter was found).
    """
    meta = metadata if isinstance(metadata, Mapping) else {}
    opts = normalise_choices(choices if choices is not None else meta.get("choices") or meta.get("options"))
    valid = letters or ("".join(sorted(k for k in opts if len(k) == 1 and k.isalpha())) or DEFAULT_LETTERS)
    gold, gold_texts = _gold_letters(answer, valid, opts)
    picked = extract_choice(response, valid, opts)
    if picked is not None:
        return {"score": 1.0 if picked in gold else 0.0, "parsed": 1.0}
    if gold_texts:  # no letters on either side: the answer is a free text, compare it plainly
        said = normalise_text(tail(answer_span(response), MAX_CHARS))
        return {"score": 1.0 if said in gold_texts else 0.0, "parsed": 0.0}
    return {"score": 0.0, "parsed": 0.0}
