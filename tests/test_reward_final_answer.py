"""`final_answer`: the colour word of the LAST model turn, plus an optional credit for a tool call."""
from __future__ import annotations

import pytest

from mmrl import registry
from mmrl.data.sample import Sample
from mmrl.rewards import RewardSet, call_reward, reward_kwargs
from mmrl.plugins.rewards.final_answer import final_answer


def _episode(*turns: str | tuple[str, list]) -> list[dict]:
    """Assistant turns (text, or (text, tool calls)) with a tool turn after each call."""
    out: list[dict] = []
    for t in turns:
        text, calls = t if isinstance(t, tuple) else (t, [])
        out.append({"role": "assistant", "content": text, "tool_calls": calls})
        if calls:
            out.append({"role": "tool", "name": calls[0]["name"], "content": "zoomed into cell 3", "error": False})
    return out


ZOOM = [{"name": "zoom", "arguments": {"cell": 3}}]


def test_reads_the_last_assistant_turn_not_the_first() -> None:
    transcript = _episode(("zoom3", ZOOM), "Red.")
    assert final_answer(transcript, "red") == {"score": 1.0, "correct": 1.0, "tool_calls": 1.0, "answer_word": 0.0}
    assert final_answer(_episode("red", ("zoom3", ZOOM)), "red")["correct"] == 0.0  # ended on a call


@pytest.mark.parametrize("text, correct", [("red", 1.0), ("RED", 1.0), ("**Red**, I think", 1.0), ("red<|im_end|>", 1.0),
                                           (" red is it", 1.0), ("blue", 0.0), ("reddish", 0.0), ("", 0.0),
                                           ("<|im_end|>", 0.0), ("the answer is red", 0.0),
                                           ("<think>blue?</think><answer>Red</answer>", 1.0), ("red " * 30000, 1.0)])
def test_first_word_case_insensitive(text: str, correct: float) -> None:
    assert final_answer(_episode(text), "red")["correct"] == correct


def test_tool_credit_for_any_call_made() -> None:
    assert final_answer(_episode(("zoom3", ZOOM), "red"), "red", tool_credit=0.1)["score"] == pytest.approx(1.1)
    assert final_answer(_episode(("zoom3", ZOOM), "blue"), "red", tool_credit=0.1)["score"] == pytest.approx(0.1)
    bad_call = [{"name": "zoom", "arguments": {"cell": 9}}]  # refused by the tool: still an attempt
    assert final_answer(_episode(("zoom9", bad_call), "blue"), "red", tool_credit=0.1)["score"] == pytest.approx(0.1)
    assert final_answer(_episode("red"), "red", tool_credit=0.1)["score"] == 1.0
    assert final_answer(_episode("blue"), "red", tool_credit=0.1)["score"] == 0.0


def test_word_credit_for_ending_on_an_allowed_word() -> None:
    words = ["red", "green", "blue"]
    scored = final_answer(_episode(("zoom3", ZOOM), "Blue"), "red", words=words, word_credit=0.1)
    assert scored["score"] == pytest.approx(0.1) and scored["answer_word"] == 1.0 and scored["correct"] == 0.0
    assert final_answer(_episode(("zoom3", ZOOM), "red"), "red", words=words, word_credit=0.1)["score"] == \
        pytest.approx(1.1)
    assert final_answer(_episode("purple"), "red", words=words, word_credit=0.1)["score"] == 0.0
    # a last turn that is a call earns no word credit, even when it starts with one of the words
    assert final_answer(_episode(("red3", [{"name": "red", "arguments": {}}])), "x", words=words,
                        word_credit=0.1)["answer_word"] == 0.0
    with pytest.raises(ValueError, match="word_credit needs `words`"):
        final_answer(_episode("red"), "red", word_credit=0.1)


def test_answer_lists_and_missing_answers() -> None:
    assert final_answer(_episode("Green"), ["red", "green"])["correct"] == 1.0
    assert final_answer(_episode("red"), None)["correct"] == 0.0
    assert final_answer(_episode("none"), None)["correct"] == 0.0
    assert final_answer([], "red")["score"] == 0.0
    assert final_answer([{"role": "tool", "content": "red"}], "red")["score"] == 0.0  # only model turns count


def test_through_the_reward_calling_convention() -> None:
    sample = Sample(key="k", messages=[{"role": "user", "content": "q"}], answer="red")
    # a single-turn response is a transcript of one assistant turn
    assert call_reward(final_answer, **reward_kwargs(sample, "red"), tool_credit=0.1)["score"] == 1.0
    episode = {"transcript": _episode(("zoom3", ZOOM), "red"), "tool_state": {"zoom_calls": 1}}
    kwargs = reward_kwargs(sample, "zoom3 ... red", episode=episode)
    assert call_reward(final_answer, **kwargs, tool_credit=0.1)["score"] == pytest.approx(1.1)
    assert registry.resolve("reward", "final_answer") is final_answer
    assert RewardSet([{"name": "final_answer", "args": {"tool_credit": 0.1}}]).score(sample, "red")["score"] == 1.0
    with pytest.raises(ValueError, match="toolcredit"):  # a mistyped arg is refused when the set is built
        RewardSet([{"name": "final_answer", "args": {"toolcredit": 0.1}}])
