"""Rewards read from the tools' final state: `tool_success` (a GUI episode) and `zoom_on_target`."""
from __future__ import annotations

import pytest

from mmrl import registry
from mmrl.data.sample import Sample
from mmrl.rewards import call_reward, reward_kwargs
from mmrl.plugins.rewards.tool_state import tool_success, zoom_on_target


def _transcript(*tool_errors: bool) -> list[dict]:
    out: list[dict] = []
    for error in tool_errors:
        out.append({"role": "assistant", "content": "click3", "tool_calls": [{"name": "click", "arguments": {}}]})
        out.append({"role": "tool", "name": "click", "content": "error: ..." if error else "ok", "error": error})
    return out


def test_tool_success_ladder() -> None:
    credits = dict(progress_credit=0.5, call_credit=0.1, attempt_credit=0.05)
    assert tool_success({"success": True, "progress": 1.0}, _transcript(False, False), **credits)["score"] == 1.0
    assert tool_success({"progress": 0.5}, _transcript(False, True), **credits)["score"] == pytest.approx(0.3)
    assert tool_success({"progress": 0.5}, _transcript(False, False), **credits)["score"] == pytest.approx(0.35)
    assert tool_success({"progress": 0.0}, _transcript(False), **credits)["score"] == pytest.approx(0.1)
    assert tool_success({"progress": 0.0}, _transcript(True, True), **credits)["score"] == pytest.approx(0.05)
    assert tool_success({}, [{"role": "assistant", "content": "hi"}], **credits)["score"] == 0.0
    # a turn that is no call at all is an action not taken: half the turns accepted, half the credit
    no_call = {"role": "assistant", "content": "clicko", "tool_calls": []}
    assert tool_success({"progress": 0.5}, _transcript(False) + [no_call], **credits)["score"] == pytest.approx(0.3)
    assert tool_success({"progress": 0.5}, _transcript(False))["score"] == 0.0  # no credits configured


BOX = {"box": [30, 40, 44, 54]}  # centre (37, 47)


@pytest.mark.parametrize("boxes, score, hit", [
    ([[0, 0, 112, 112]], 1.0, 1.0),            # the crop holds the target
    ([[112, 0, 224, 112]], 0.25, 0.0),         # a valid zoom elsewhere
    ([[112, 0, 224, 112], [0, 0, 112, 112]], 1.0, 1.0),  # any crop of the episode counts
    ([[37, 47, 60, 60]], 1.0, 1.0), ([[0, 0, 37, 47]], 0.25, 0.0),  # the centre, half-open boxes
    ([], 0.0, 0.0),                             # no zoom at all
])
def test_zoom_on_target(boxes: list, score: float, hit: float) -> None:
    got = zoom_on_target({"zoom_calls": len(boxes), "zoom_boxes": boxes}, BOX, elsewhere=0.25)
    assert got == {"score": score, "hit": hit, "zooms": float(len(boxes)), "no_target": 0.0}


def test_zoom_on_target_without_a_box_scores_zero_and_says_so() -> None:
    assert zoom_on_target({"zoom_boxes": [[0, 0, 9, 9]]}, {"cell": 1}) == {"score": 0.0, "hit": 0.0, "zooms": 1.0,
                                                                           "no_target": 1.0}
    assert zoom_on_target({"zoom_boxes": [[0, 0, 9, 9]]}, {"glyph": [1, 1, 3, 3]}, box_key="glyph")["hit"] == 1.0


def test_through_the_reward_calling_convention() -> None:
    assert registry.resolve("reward", "zoom_on_target") is zoom_on_target
    sample = Sample(key="k", messages=[{"role": "user", "content": "q"}], answer="red", metadata=BOX)
    episode = {"transcript": [], "tool_state": {"zoom_boxes": [[0, 0, 50, 50]]}}
    assert call_reward(zoom_on_target, **reward_kwargs(sample, "red", episode=episode))["score"] == 1.0


def test_reward_set_scores_an_episode_with_its_transcript_and_tool_state() -> None:
    """`RewardSet.score(..., episode=...)`: the weighted sum over the configured rewards sees the
    loop's transcript and tool state (what benchmarks/turn_probe.py scores episodes with); without
    an episode the response is a one-turn transcript and the tool state is empty."""
    from mmrl.rewards import RewardSet

    rewards = RewardSet([{"name": "tool_success", "weight": 2.0, "args": {"call_credit": 0.1}}])
    sample = Sample(key="s", messages=[], answer="New")
    won = rewards.score(sample, "click3", episode={"transcript": _transcript(False), "tool_state": {"success": True}})
    assert won["score"] == 2.0 and won["tool_success/success"] == 1.0
    refused = rewards.score(sample, "click9", episode={"transcript": _transcript(True), "tool_state": {}})
    assert refused["score"] == 0.0 and refused["tool_success/tool_calls"] == 1.0
    assert rewards.score(sample, "click3")["score"] == 0.0
