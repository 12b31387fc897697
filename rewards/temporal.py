"""Video temporal grounding reward: IoU of the predicted [start, end] interval (seconds) with the
answer's.

Intervals are read from the response in these forms (the first one found counts):
  "[2.5, 4.0]", "(2.5, 4)", "from 2.5s to 4s", "between 2.5 and 4 seconds", "2.5 - 4.0 seconds",
  "2.5s-4s", and clock times "00:02.5 to 00:04" / "0:01:05 - 0:01:10" (mm:ss, hh:mm:ss).
A reversed interval is swapped. If the response has an `<answer>...</answer>` block, only its
content is read.
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping, Sequence

from mmrl.registry import register
from mmrl.plugins.rewards._text import MAX_CHARS, answer_span, as_text, head

__all__ = ["temporal_iou", "parse_interval", "interval_iou"]

_T = r"(?:\d+:)?\d+:\d+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+"  # hh:mm:ss(.f) | mm:ss(.f) | seconds
_UNIT = r"\s*(?:s|sec|secs|second|seconds)?\b\.?"
_INTERVAL = re.compile(
    rf"[\[\(]\s*({_T}){_UNIT}\s*[,;]\s*({_T}){_UNIT}\s*[\]\)]"  # [a, b] / (a, b)
    rf"|\bfrom\s+({_T}){_UNIT}\s*(?:to|until|till|-|–|—)\s*({_T}){_UNIT}"  # from a to b
    rf"|\bbetween\s+({_T}){_UNIT}\s*and\s*({_T}){_UNIT}"  # between a and b
    rf"|(?<![\w.:])({_T}){_UNIT}\s*(?:-|–|—|to)\s*({_T}){_UNIT}",  # a - b / a to b
    re.I)


def _seconds(t: str) -> float:
    parts = t.split(":")
    v = 0.0
    for p in parts:
        v = v * 60.0 + float(p)
    return v


def parse_interval(text: Any) -> tuple[float, float] | None:
    """The first interval (start <= end, seconds) in the text, or None."""
    if isinstance(text, Mapping):  # {"start": a, "end": b} / {"timestamps": [a, b]}
        for keys in (("start", "end"), ("begin", "end"), ("start_time", "end_time")):
            if all(k in text for k in keys):
                return _pair(text[keys[0]], text[keys[1]])
        for k in ("timestamps", "interval", "segment", "span"):
            if k in text:
                return parse_interval(text[k])
        return None
    if isinstance(text, Sequence) and not isinstance(text, (str, bytes)):
        if len(text) == 2 and not isinstance(text[0], (list, tuple, Mapping)):
            return _pair(text[0], text[1])
        return parse_interval(text[0]) if len(text) >= 1 else None
    s = head(answer_span(text), MAX_CHARS)
    m = _INTERVAL.search(s)
    if m is None:
        return None
    a, b = [g for g in m.groups() if g is not None][:2]
    return _pair(_seconds(a), _seconds(b))


def _pair(a: Any, b: Any) -> tuple[float, float] | None:
    try:
        x, y = (a if isinstance(a, (int, float)) else _seconds(as_text(a).strip().rstrip("s"))), \
               (b if isinstance(b, (int, float)) else _seconds(as_text(b).strip().rstrip("s")))
    except ValueError:
        return None
    x, y = float(x), float(y)
    if not (math.isfinite(x) and math.isfinite(y)):
        return None
    return (x, y) if x <= y else (y, x)


def interval_iou(p: tuple[float, float], g: tuple[float, float]) -> float:
    """|p ∩ g| / |p ∪ g| for closed intervals; two equal points give 1, other empty unions 0."""
    inter = max(0.0, min(p[1], g[1]) - max(p[0], g[0]))
    union = (p[1] - p[0]) + (g[1] - g[0]) - inter
    if union <= 0:
        return 1.0 if p == g else 0.0
    return inter / union


@register("reward", "temporal_iou")
def temporal_iou(response: str, answer: Any) -> dict[str, float]:
    """IoU of the response's [start, end] (seconds) with the answer's [start, end].

    `answer` is [start, end], "[start, end]", {"start": s, "end": e} or a list of such (the
    best match counts). Components: iou, parsed (an interval was found in the response).
    """
    pred = parse_interval(response)
    items = answer if (isinstance(answer, (list, tuple)) and answer
                       and isinstance(answer[0], (list, tuple, Mapping))) else [answer]
    golds = [g for g in (parse_interval(a) for a in items if a is not None) if g is not None]
    iou = max((interval_iou(pred, g) for g in golds), default=0.0) if pred is not None else 0.0
    return {"score": iou, "iou": iou, "parsed": 1.0 if pred is not None else 0.0}
