"""Math / numeric answer reward.

Two checks, either of which makes the answer correct:
  * the `math-verify` library (HuggingFace; parses LaTeX and plain expressions with SymPy and
    compares them symbolically: "\\frac{1}{2}" = "0.5", "2\\sqrt{2}" = "\\sqrt{8}", sets,
    intervals, ...), when it is installed (requirements/*.txt pin it);
  * a numeric comparison with tolerance of the final answers (always available, and covering
    what the verifier misreads, such as "1.5e-3", or a percent against a fraction): the final
    answer is the last `\\boxed{...}`, else what follows the last "answer is" / "answer:", else
    the last number; numbers may be fractions ("3/4", "\\frac{3}{4}"), percents ("50%" matches
    both 0.5 and 50), have thousands separators ("1,234,567") or scientific notation ("1.5e-3",
    "1.5 \\times 10^{-3}").
If the response has an `<answer>...</answer>` block, only its content is read.
"""
from __future__ import annotations

import logging
import math
import re
import signal
import threading
from typing import Any

from mmrl.registry import register
from mmrl.plugins.rewards._text import MAX_CHARS, answer_span, as_text, tail

__all__ = ["math_answer", "extract_final_answer", "parse_number", "number_values", "verifier_available"]

# The verifier only ever sees this much of the end of a response (its extraction is regex +
# SymPy: a 100k-character response would cost seconds for nothing).
_VERIFIER_CHARS = 2_000

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"(?:final\s+answer|answer)\s*(?:is|was|would\s+be|should\s+be|=|:)?\s*:?\s*", re.I)
_NUM_TOKEN = re.compile(
    r"-?(?:\\[dt]?frac\s*\{[^{}]*\}\s*\{[^{}]*\}"  # \frac{a}{b}
    r"|\d{1,3}(?:,\d{3})+(?:\.\d+)?"  # 1,234,567.5
    r"|\d+(?:\.\d*)?|\.\d+)"  # 12, 12.5, .5
    r"(?:\s*/\s*\d+(?:\.\d+)?)?"  # 3/4
    r"(?:[eE][-+]?\d+|\s*(?:\\times|×|\*|x)\s*10\s*\^\s*\{?\s*[-+]?\d+\s*\}?)?"  # 1.5e-3, ×10^{-3}
    r"(?:\s*(?:\\?%|\\percent|\s*percent\b))?")
_OPENERS = re.compile(r"^[\s$*]*(?:\\\(|\\\[)?[\s$*]*")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}$")
_TIMES10 = re.compile(r"^(.*?)\s*(?:\\times|×|\*|x)\s*10\s*\^\s*\{?\s*([-+]?\d+)\s*\}?$")
_PERCENT = re.compile(r"\s*(?:\\?%|\\percent|percent)$")


def _boxed_contents(s: str) -> list[str]:
    """Contents of every closed \\boxed{...} (balanced braces), in order of their opening brace.
    One pass with a stack: linear even for "\\boxed{" repeated 10,000 times."""
    starts = {m.end() - 1 for m in _BOXED.finditer(s)}  # index of each boxed "{"
    out: list[tuple[int, str]] = []
    stack: list[int] = []
    for i, c in enumerate(s):
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            j = stack.pop()
            if j in starts:
                out.append((j, s[j + 1:i]))
    out.sort()
    return [content for _, content in out]


def extract_final_answer(text: Any) -> str | None:
    """The final answer as a string: last \\boxed{...}, else after the last "answer is", else the
    last number in the text; None if there is none."""
    s = tail(answer_span(text), MAX_CHARS)
    if not s.strip():
        return None
    boxed = _boxed_contents(s)
    if boxed:
        return boxed[-1].strip()
    anchors = list(_ANSWER_IS.finditer(s))
    if anchors:
        rest = _OPENERS.sub("", s[anchors[-1].end():])
        m = _NUM_TOKEN.match(rest)
        if m:
            return m.group(0).strip()
        line = rest.split("\n", 1)[0].strip().rstrip(".").strip(" $*")
        line = re.sub(r"\s*\\[)\]]$", "", line).strip(" $*")
        if line and len(line) <= 100:
            return line
    nums = list(_NUM_TOKEN.finditer(s))
    return nums[-1].group(0).strip() if nums else None


def _plain_float(s: str) -> float | None:
    s = s.strip().replace(" ", "")
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    try:
        v = float(s)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def parse_number(text: Any) -> tuple[float, bool] | None:
    """(value, is_percent) if the whole text is one number in a supported notation, else None.

    A percent gives its fraction ("50%" -> (0.5, True)).
    """
    s = as_text(text).strip()
    if not s or len(s) > 200:
        return None
    s = s.strip("$ ").replace("\\!", "").replace("\\,", "").replace("{,}", ",").replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\\(?:text|mathrm|mathbf)\s*\{([^{}]*)\}", r"\1", s).strip()
    s = s.rstrip(".").strip()
    percent = bool(_PERCENT.search(s))
    if percent:
        s = _PERCENT.sub("", s).strip()
    m = _TIMES10.match(s)
    if m:
        base = _plain_float(m.group(1)) if m.group(1).strip() else 1.0
        if base is None:
            return None
        v = base * 10.0 ** int(m.group(2))
    elif (m := _FRAC.match(s)) is not None:
        num, den = _plain_float(m.group(2)), _plain_float(m.group(3))
        if num is None or not den:
            return None
        v = (-1 if m.group(1) else 1) * num / den
    elif "/" in s:
        parts = s.split("/")
        if len(parts) != 2:
            return None
        num, den = _plain_float(parts[0]), _plain_float(parts[1])
        if num is None or not den:
            return None
        v = num / den
    else:
        v = _plain_float(s)
        if v is None:
            return None
    if not math.isfinite(v):
        return None
    return (v / 100.0 if percent else v), percent


def number_values(text: Any) -> set[float]:
    """The values a number may stand for: {0.5, 50.0} for "50%", {v} otherwise, {} if not a number."""
    p = parse_number(text)
    if p is None:
        return set()
    v, percent = p
    return {v, v * 100.0} if percent else {v}


# --------------------------------------------------------------------------------- verifier

class _DropTimeoutWarning(logging.Filter):
    """math-verify warns once that its timeout is off; here that is deliberate (see _timeouts)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


_VERIFIER: Any = None  # None: not tried yet; False: not installed


def _verifier() -> Any:
    global _VERIFIER
    if _VERIFIER is None:
        try:
            import math_verify
        except Exception:  # not installed, or broken: the numeric check still works
            _VERIFIER = False
        else:
            for name in ("math_verify.parser", "math_verify.grader"):
                logging.getLogger(name).addFilter(_DropTimeoutWarning())
            _VERIFIER = math_verify
    return _VERIFIER


def verifier_available() -> bool:
    """True if the `math-verify` package imports here."""
    return bool(_verifier())


def _timeouts(timeout_s: float | None) -> int | None:
    """math-verify's timeout uses SIGALRM: only possible in the main thread, and only when no
    other alarm is pending (it would cancel e.g. pytest-timeout's). Otherwise run without."""
    if not timeout_s or timeout_s <= 0:
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    if not hasattr(signal, "setitimer") or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        return None
    return max(1, int(math.ceil(timeout_s)))


_SCI = re.compile(r"(\d)[eE]([-+]?\d+)")


def _verify(gold: str, pred: str, timeout_s: float | None) -> bool | None:
    """True/False from math-verify, or None without a verdict (not installed, unparsable, error)."""
    mv = _verifier()
    if not mv:
        return None
    t = _timeouts(timeout_s)
    # math-verify reads "1.5e-3" as 1.5·e − 3 (Euler's e); spell plain numbers out for it.
    g = _SCI.sub(r"\1\\times 10^{\2}", gold) if parse_number(gold) else gold
    if "$" not in g and "\\boxed" not in g and "\\(" not in g and "\\[" not in g:
        g = f"${g}$"
    try:
        gold_parsed = mv.parse(g, parsing_timeout=t)
        pred_parsed = mv.parse(tail(pred, _VERIFIER_CHARS), parsing_timeout=t)
        if not gold_parsed or not pred_parsed:
            return None
        return bool(mv.verify(gold_parsed, pred_parsed, timeout_seconds=t))
    except Exception:  # a timeout or a SymPy failure on odd input: no verdict
        return None


def _numeric_match(gold: str, pred: str | None, rel_tol: float, abs_tol: float) -> bool:
    if pred is None:
        return False
    gv, pv = number_values(gold), number_values(pred)
    if gv and pv:
        return any(math.isclose(g, p, rel_tol=rel_tol, abs_tol=abs_tol) for g in gv for p in pv)
    if not gv and not pv:  # neither is a plain number: compare the expressions as written
        def canon(x: str) -> str:
            return re.sub(r"\s+|\$|\\[,!;: ]|\\left|\\right", "", x).lower().rstrip(".")
        return bool(canon(gold)) and canon(gold) == canon(pred)
    return False


@register("reward", "math_answer")
def math_answer(response: str, answer: Any, *, use_verifier: bool = True, rel_tol: float = 1e-6,
                abs_tol: float = 1e-9, timeout_s: float = 5.0) -> dict[str, float]:
    """1.0 if the response's final answer equals the answer (math-verify, or numerically within
    rel_tol/abs_tol). `answer` is a number, a string ("3/4", "\\frac{1}{2}", "50%", "x+1") or a
    list of accepted answers. Components: parsed (a final answer was found), verified (the
    verifier said equal)."""
    items = answer if isinstance(answer, (list, tuple, set, frozenset)) else [answer]
    golds = [as_text(a).strip() for a in items if a is not None and as_text(a).strip()]
    span = answer_span(response)
    pred = extract_final_answer(span)
    verified = 0.0
    correct = False
    for gold in golds:
        if _numeric_match(_gold_value(gold), pred, rel_tol, abs_tol):
            correct = True
            break
        if use_verifier and pred is not None and _verify(gold, span, timeout_s):
            correct, verified = True, 1.0
            break
    return {"score": 1.0 if correct else 0.0, "parsed": 1.0 if pred is not None else 0.0, "verified": verified}


def _gold_value(gold: str) -> str:
    """A gold answer written as "\\boxed{3}" or "The answer is 3" reduces to "3"."""
    if parse_number(gold) is not None:
        return gold
    final = extract_final_answer(gold)
    return final if final is not None and ("\\boxed" in gold or _ANSWER_IS.search(gold)) else gold
