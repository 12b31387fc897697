"""`rollout.agent_loop_args` of the multi_turn loop: what each key accepts, and the message a
wrong value gets. The loop itself runs in test_plugin_contracts.py (real engine) and in the
scripted episodes of test_data_zoom_read.py and test_data_recipes.py (the shipped configs)."""
from __future__ import annotations

import pytest

from mmrl.rollout.tool_loop import ToolLoopArgs


def test_defaults_force_nothing_and_drop_last_turn_calls() -> None:
    args = ToolLoopArgs.from_dict({})
    assert args.tool_choice == "auto" and args.last_turn_calls == "drop" and args.max_tool_errors is None
    assert [args.forced_function(t) for t in range(3)] == [None, None, None]


def test_tool_choice_forces_a_function_for_the_first_turns() -> None:
    every = ToolLoopArgs.from_dict({"tool_choice": "click"})
    assert [every.forced_function(t) for t in range(3)] == ["click"] * 3
    first = ToolLoopArgs.from_dict({"tool_choice": "zoom", "tool_choice_turns": 1})
    assert [first.forced_function(t) for t in range(3)] == ["zoom", None, None]
    assert ToolLoopArgs.from_dict({"tool_choice": "zoom", "tool_choice_turns": 0}).forced_function(0) is None


def test_a_list_forces_one_function_per_turn() -> None:
    """tool_choice: [open, click]: turn 1 calls open, turn 2 click; "auto" and turns past the
    list are free."""
    args = ToolLoopArgs.from_dict({"tool_choice": ["open", "click"]})
    assert [args.forced_function(t) for t in range(3)] == ["open", "click", None]
    assert args.forced_names() == {"open", "click"}
    mixed = ToolLoopArgs.from_dict({"tool_choice": ("auto", "zoom")})
    assert [mixed.forced_function(t) for t in range(3)] == [None, "zoom", None] and mixed.forced_names() == {"zoom"}


@pytest.mark.parametrize("args, match", [
    ({"tool_choice": []}, "a function \\(or 'auto'\\) per model turn"),
    ({"tool_choice": ["open", 2]}, "per model turn"),
    ({"tool_choice": ["open", "click"], "tool_choice_turns": 1}, "tool_choice_turns goes with a single"),
    ({"tool_chioce": "zoom"}, "unknown key"),
    ({"tool_choice": ""}, "tool_choice must be"),
    ({"tool_choice": 3}, "tool_choice must be"),
    ({"tool_choice": "zoom", "tool_choice_turns": -1}, "tool_choice_turns"),
    ({"tool_choice": "zoom", "tool_choice_turns": True}, "tool_choice_turns"),
    ({"last_turn_calls": "keep"}, "last_turn_calls"),
    ({"max_tool_errors": 0}, "max_tool_errors"),
    ({"max_tool_errors": True}, "max_tool_errors"),
    ({"max_tool_errors": "1"}, "max_tool_errors"),
    ({"max_turns": 0}, "max_turns"),
    ({"tools": [{"name": "gui", "arg": {}}]}, "tools\\[0\\]"),
])
def test_bad_values_are_named(args: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ToolLoopArgs.from_dict(args)


def test_rollout_metrics_count_each_finish_reason_of_tool_episodes() -> None:
    """`agent/finished_<reason>` is the share of trajectories per finish reason, `tool_error`
    (max_tool_errors) included; a step without tool episodes has no agent metrics."""
    from types import SimpleNamespace

    from mmrl.controller.metrics import rollout_metrics

    def episode(reason: str, errors: float) -> SimpleNamespace:
        return SimpleNamespace(response_ids=[1, 2], finish_reason=reason,
                               stats={"turns": 1.0, "tool_calls": 1.0, "tool_errors": errors})

    m = rollout_metrics([[episode("tool_error", 1.0), episode("done", 0.0)], [episode("done", 0.0), episode("length", 0.0)]])
    assert m["agent/finished_tool_error"] == 0.25 and m["agent/finished_done"] == 0.5
    assert m["agent/finished_length"] == 0.25 and m["agent/finished_stop"] == 0.0
    assert m["agent/tool_errors"] == 0.25 and m["rollout/response_length"] == 2.0
    plain = rollout_metrics([[SimpleNamespace(response_ids=[1], finish_reason="stop", stats={})]])
    assert plain == {"rollout/response_length": 1.0}
