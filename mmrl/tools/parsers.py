"""Tool-call parsers (plugin kind "tool_parser"): where the model's text calls a tool.

    @register("tool_parser", "hermes")
    def hermes(text: str, functions: list[dict]) -> list[ToolCall]

A parser gets the text of one model turn and the function schemas on offer, and returns the
calls in order. A call it recognises but cannot read (bad JSON, unknown function) comes back
with `error` set, so the loop answers it with a tool error the model can learn from instead of
silently ending the episode.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from mmrl.registry import register

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # set when the call could not be read


def _known(name: str, functions: list[dict[str, Any]]) -> bool:
    return any(f["function"]["name"] == name for f in functions)


def _schema(name: str, functions: list[dict[str, Any]]) -> dict[str, Any]:
    for f in functions:
        if f["function"]["name"] == name:
            return f["function"].get("parameters") or {}
    return {}


def _unknown(name: str, functions: list[dict[str, Any]]) -> str:
    return f"unknown tool {name!r}; tools: {', '.join(f['function']['name'] for f in functions)}"


@register("tool_parser", "hermes")
def hermes(text: str, functions: list[dict[str, Any]]) -> list[ToolCall]:
    """Qwen / Hermes style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number."""
    calls: list[ToolCall] = []
    for body in TOOL_CALL_RE.findall(text):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", error=f"tool call is not valid JSON ({e.msg}): {body.strip()[:200]!r}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", error='a tool call needs {"name": ..., "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models send the arguments JSON-encoded
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], error="tool call arguments must be an object"))
        elif not _known(obj["name"], functions):
            calls.append(ToolCall(obj["name"], args, error=_unknown(obj["name"], functions)))
        else:
            calls.append(ToolCall(obj["name"], args))
    return calls


@register("tool_parser", "compact")
def compact(text: str, functions: list[dict[str, Any]]) -> list[ToolCall]:
    """`<tool_call>name v1 v2 ...</tool_call>`: positional values for the function's parameters in
    schema order (a value that reads as JSON is parsed: numbers, lists). Few tokens per call,
    which is what lets a tiny model discover tool use by RL."""
    calls: list[ToolCall] = []
    for body in TOOL_CALL_RE.findall(text):
        words = body.split()
        if not words:
            calls.append(ToolCall("", error="empty tool call"))
            continue
        calls.append(_positional(words[0], words[1:], functions))
    return calls


def _positional(name: str, values: list[str], functions: list[dict[str, Any]]) -> ToolCall:
    """A call of `name` with `values` for its parameters in schema order."""
    if not _known(name, functions):
        return ToolCall(name, error=_unknown(name, functions))
    params = list((_schema(name, functions).get("properties") or {}))
    if len(values) > len(params):
        return ToolCall(name, error=f"{name} takes at most {len(params)} values ({' '.join(params)}), "
                                    f"got {len(values)}")
    return ToolCall(name, {p: _value(v) for p, v in zip(params, values)})


def _value(word: str) -> Any:
    try:
        return json.loads(word)
    except json.JSONDecodeError:
        return word


SPECIAL_MARKER_RE = re.compile(r"<\|[^|<>]*\|>")


@register("tool_parser", "bare")
def bare(text: str, functions: list[dict[str, Any]]) -> list[ToolCall]:
    """A turn that STARTS with a function name is one call: `image_zoom 3` (no tags), values
    positional as in `compact`. Anything else is an answer. The tags of `compact` cost the tiny
    tokenizer a dozen tokens per call; a bare call is the name plus its values.

    Special-token markers (`<|im_end|>`; the loop decodes with them kept) are dropped first. The
    name must not run on into a longer word ("image_zoomed" is an answer), but a value may follow
    it without a space ("zoom3" reads as "zoom 3": one token fewer for a tiny model to find); of
    two names that both fit, the longer wins. A turn with `<tool_call>` tags is read as `compact`,
    so a tagged call of an unknown function still comes back as an error rather than an answer.
    """
    if TOOL_CALL_RE.search(text):
        return compact(text, functions)
    body = SPECIAL_MARKER_RE.sub(" ", text).strip()
    names = sorted((f["function"]["name"] for f in functions), key=len, reverse=True)
    for name in names:
        rest = body[len(name):]
        if body.startswith(name) and not (rest[:1].isalpha() or rest[:1] == "_"):
            return [_positional(name, rest.split(), functions)]
    return []
