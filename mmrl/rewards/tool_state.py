"""`tool_success`: the reward of an environment episode (a GUI task, say) read from the tools'
final state, not from the text: 1 when `tool_state["success"]`, else optional partial credit
for progress (the share of the task's milestones reached) and for making a well-formed call at
all (a fresh tiny policy almost never does: the format credit the colours demo gives for a
colour word)."""
from __future__ import annotations

from typing import Any

from mmrl.registry import register


@register("reward", "tool_success")
def tool_success(tool_state: dict[str, Any], transcript: list[dict[str, Any]], progress_credit: float = 0.0,
                 call_credit: float = 0.0, **_: Any) -> dict[str, float]:
    success = bool(tool_state.get("success"))
    progress = float(tool_state.get("progress", 0.0) or 0.0)
    calls = sum(len(turn.get("tool_calls") or []) for turn in transcript if turn.get("role") == "assistant")
    good_calls = sum(1 for turn in transcript if turn.get("role") == "tool" and not turn.get("error"))
    score = 1.0 if success else progress_credit * progress + (call_credit if good_calls else 0.0)
    return {"score": score, "success": float(success), "progress": progress, "tool_calls": float(calls)}
