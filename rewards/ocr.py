"""OCR reward: 1 − normalised Levenshtein distance between the response and the reference text,
plus the character error rate (CER = edits / reference length).

Pure Python O(n·m) dynamic programming on strings cut to `max_chars` (default 1000, about 0.3 s
in the worst case); characters of the response beyond the cut count as insertions, so a
100k-character response still scores near 0, quickly. The common prefix and suffix are stripped
first, so near-identical strings cost little. If the response has an `<answer>...</answer>`
block, only its content is read.
"""
from __future__ import annotations

import re
import unicodedata
from typing import Any

from mmrl.registry import register
from mmrl.plugins.rewards._text import answer_span, as_text

__all__ = ["ocr_edit_distance", "levenshtein", "normalise_ocr"]

_WS = re.compile(r"\s+")


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute; each costs 1)."""
    if a == b:
        return 0
    # strip the common prefix and suffix: they never need an edit
    i, n = 0, min(len(a), len(b))
    while i < n and a[i] == b[i]:
        i += 1
    a, b = a[i:], b[i:]
    j, n = 0, min(len(a), len(b))
    while j < n and a[-1 - j] == b[-1 - j]:
        j += 1
    if j:
        a, b = a[:-j], b[:-j]
    if len(a) < len(b):
        a, b = b, a  # the inner loop runs over the shorter string
    if not b:
        return len(a)
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        append = cur.append
        left = i
        for k, cb in enumerate(b):
            # substitution (or match), deletion, insertion
            v = prev[k] + (ca != cb)
            up = prev[k + 1] + 1
            if up < v:
                v = up
            if left + 1 < v:
                v = left + 1
            append(v)
            left = v
        prev = cur
    return prev[-1]


def normalise_ocr(text: Any, *, ignore_case: bool = False, normalize_whitespace: bool = True,
                  ignore_punctuation: bool = False) -> str:
    """NFKC, then optionally lowercase, drop punctuation, collapse whitespace runs to one space."""
    s = unicodedata.normalize("NFKC", as_text(text))
    if ignore_case:
        s = s.lower()
    if ignore_punctuation:
        s = "".join(c for c in s if not unicodedata.category(c).startswith("P"))
    if normalize_whitespace:
        s = _WS.sub(" ", s).strip()
    return s


@register("reward", "ocr_edit_distance")
def ocr_edit_distance(response: str, answer: Any, *, ignore_case: bool = False,
                      normalize_whitespace: bool = True, ignore_punctuation: bool = False,
                      max_chars: int = 1000) -> dict[str, float]:
    """score = 1 − edits / max(len(response), len(answer)), in [0, 1]; cer = edits / len(answer).

    `answer` is the reference text (or a list of accepted texts: the best one counts). Both
    texts are normalised first (NFKC; case, whitespace and punctuation as configured).
    Components: cer (character error rate, may exceed 1), distance (edits).
    """
    if max_chars < 1:
        raise ValueError(f"ocr_edit_distance: max_chars must be >= 1, got {max_chars}")
    opts = dict(ignore_case=ignore_case, normalize_whitespace=normalize_whitespace,
                ignore_punctuation=ignore_punctuation)
    raw = as_text(answer_span(response))
    # normalising 10 MB costs time for nothing: keep a little more than the DP will read
    pred_full_len = len(normalise_ocr(raw, **opts)) if len(raw) <= 4 * max_chars else None
    pred = normalise_ocr(raw[:4 * max_chars], **opts)
    if pred_full_len is None:  # estimate the normalised length of the rest from the raw length
        pred_full_len = len(pred) + len(raw) - 4 * max_chars
    items = answer if isinstance(answer, (list, tuple, set, frozenset)) else [answer]
    best: dict[str, float] | None = None
    for a in items:
        if a is None:
            continue
        gold = normalise_ocr(a, **opts)
        if len(gold) > max_chars:  # a huge reference: compare the first max_chars of each
            g, p, extra, plen, glen = gold[:max_chars], pred[:max_chars], 0, min(pred_full_len, max_chars), max_chars
        else:
            g, p = gold, pred[:max_chars]
            extra = max(0, pred_full_len - max_chars)
            plen, glen = pred_full_len, len(gold)
        d = levenshtein(p, g) + extra
        longest = max(plen, glen)
        score = 1.0 if longest == 0 else max(0.0, 1.0 - d / longest)
        cer = d / glen if glen else (0.0 if d == 0 else 1.0)
        result = {"score": score, "cer": float(cer), "distance": float(d)}
        if best is None or score > best["score"]:
            best = result
    return best if best is not None else {"score": 0.0, "cer": 1.0, "distance": float(pred_full_len)}
