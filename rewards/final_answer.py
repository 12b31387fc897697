"""`final_answer`: the answer of a multi-turn episode is what the model said LAST.

In a tool episode `response` is the whole transcript (model turns and the tool turns between
them), so its first word is the first model turn's, typically a tool call. This reward reads the
last assistant turn of `transcript` instead (a single-turn response is a transcript of one turn),
compares its first word with `answer`, and optionally adds small format credits: for having
called a tool at all (a fresh tiny policy almost never writes a call, and the credit is what
first rewards it for trying), and for ending on one of the allowed answer `words` (as the
colours demo's `first_word_in` does for naming a colour).
"""
from __future__ import annotations

import re
from typing import Any

from mmrl.registry import register
from mmrl.plugins.rewards._text import MAX_CHARS, answer_span, head
from mmrl.plugins.rewards.answer import first_word, normalise_text

_MARKER = re.compile(r"<\|[^|<>]*\|>")  # special-token text such as <|im_end|>, if a turn kept it


@register("reward", "final_answer")
def final_answer(transcript: list[dict[str, Any]], answer: Any, *, tool_credit: float = 0.0,
                 words: list[str] | None = None, word_credit: float = 0.0) -> dict[str, float]:
    """score = correct + (tool_credit if any model turn made a tool call)
                       + (word_credit if the last turn is not a call and its first word is in `words`).

    correct: 1.0 when the first word of the last assistant turn (of its last <answer> block, if
    it has one) equals the answer (or one of a list), case-insensitively after `normalise_text`.
    A call counts whether or not the tool accepted it, so the credit rewards the attempt (the
    tool's error tells the model what to fix). No **kwargs: a mistyped config arg is rejected
    when the RewardSet is built."""
    turns = [t for t in transcript or [] if isinstance(t, dict) and t.get("role") == "assistant"]
    last = turns[-1].get("content") if turns else ""
    said = first_word(_MARKER.sub(" ", head(answer_span(last), MAX_CHARS)))
    accepted = answer if isinstance(answer, (list, tuple, set, frozenset)) else [answer]
    targets = {normalise_text(a) for a in accepted if a is not None} - {""}
    correct = float(bool(said) and said in targets)
    calls = sum(len(t.get("tool_calls") or []) for t in turns)
    if word_credit and not words:
        raise ValueError("final_answer: word_credit needs `words`, the answers that earn it (e.g. the colour words)")
    allowed = {normalise_text(w) for w in words or []}
    said_word = float(bool(said) and said in allowed and not (turns and turns[-1].get("tool_calls")))
    score = correct + (tool_credit if calls else 0.0) + word_credit * said_word
    return {"score": score, "correct": correct, "tool_calls": float(calls), "answer_word": said_word}
