"""Rewards read from the tools' final state (`tool_state`), not from the text.

`tool_success`: the reward of an environment episode (a GUI task, say) read from the tools'
final state, not from the text: 1 when `tool_state["success"]`, else optional partial credit
for progress (the share of the task's milestones reached) and for making a well-formed call at
all (a fresh tiny policy almost never does: the format credit the colours demo gives for a
colour word).

`zoom_on_target`: process credit for an `image_zoom` crop that holds the sample's target box
(zoom_read's glyph), whatever the answer: it rewards looking in the right place.
"""
from __future__ import annotations

from typing import Any

from mmrl.registry import register


@register("reward", "tool_success")
def tool_success(tool_state: dict[str, Any], transcript: list[dict[str, Any]], progress_credit: float = 0.0,
                 call_credit: float = 0.0, attempt_credit: float = 0.0, **_: Any) -> dict[str, float]:
    """1 on success; else progress_credit x progress, plus call_credit x the share of model turns
    whose call its tool accepted, or attempt_credit when calls were made but all refused (a tiny
    policy writes the function's name long before it writes valid arguments). Per turn, not "any
    call accepted", so each action of a multi-step episode is paid for (an environment episode
    is all actions: a turn that is no call at all counts as not accepted)."""
    success = bool(tool_state.get("success"))
    progress = float(tool_state.get("progress", 0.0) or 0.0)
    turns = [turn for turn in transcript if turn.get("role") == "assistant"]
    calls = sum(len(turn.get("tool_calls") or []) for turn in turns)
    good_calls = sum(1 for turn in transcript if turn.get("role") == "tool" and not turn.get("error"))
    share = min(1.0, good_calls / max(1, len(turns), calls))
    format_credit = call_credit * share if good_calls else attempt_credit if calls else 0.0
    score = 1.0 if success else progress_credit * progress + format_credit
    return {"score": score, "success": float(success), "progress": progress, "tool_calls": float(calls)}


@register("reward", "zoom_on_target")
def zoom_on_target(tool_state: dict[str, Any], metadata: dict[str, Any] | None = None, *,
                   box_key: str = "box", elsewhere: float = 0.0) -> dict[str, float]:
    """1 when some `image_zoom` crop of the episode (`tool_state["zoom_boxes"]`, in the sample
    image's pixels) holds the centre of the target box `metadata[box_key]` ([x1, y1, x2, y2],
    pixels); `elsewhere` when the episode zoomed, but not there (a well-formed call: the step a
    tiny policy must take before it can learn where); else 0. Process credit for looking in the
    right place, whatever the answer was. A sample without a target box scores 0 with
    `no_target` 1, so `reward/zoom_on_target/no_target` shows data built without boxes."""
    box = (metadata or {}).get(box_key)
    if not isinstance(box, (list, tuple)) or len(box) != 4:
        return {"score": 0.0, "hit": 0.0, "zooms": float(len(tool_state.get("zoom_boxes") or [])), "no_target": 1.0}
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    crops = tool_state.get("zoom_boxes") or []
    hit = any(x1 <= cx < x2 and y1 <= cy < y2 for x1, y1, x2, y2 in crops)
    return {"score": 1.0 if hit else elsewhere if crops else 0.0, "hit": float(hit), "zooms": float(len(crops)),
            "no_target": 0.0}
