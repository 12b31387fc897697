"""Tool plugins for tests, loaded by path like a user's plugin file. A random tiny model never
writes a tool call, so these parsers declare calls on every turn, which drives the multi-turn
loop through its tool turns deterministically; the tools fail in the ways real tools do."""
from __future__ import annotations

import time
from typing import Any

from mmrl.rollout.tool_loop import multi_turn
from mmrl.tools.base import Tool, ToolError
from mmrl.tools.parsers import ToolCall


def zoom_every_turn(text: str, functions: list[dict[str, Any]]) -> list[ToolCall]:
    """Every model turn asks for the top-left quarter of the image."""
    return [ToolCall("image_zoom", {"bbox": [0.0, 0.0, 0.5, 0.5]})]


def every_function(text: str, functions: list[dict[str, Any]]) -> list[ToolCall]:
    """Every model turn calls every function on offer once, with no arguments."""
    return [ToolCall(f["function"]["name"], {}) for f in functions]


class Echo(Tool):
    name = "echo"
    description = "Answers with a fixed text."

    def call(self, function: str, arguments: dict[str, Any]) -> str:
        return " tool says: red"


class Raises(Tool):
    name = "raises"
    description = "A tool with a bug."

    def call(self, function: str, arguments: dict[str, Any]) -> str:
        raise RuntimeError("the tool's own bug")


class Refuses(Tool):
    name = "refuses"
    description = "A tool that refuses the call."

    def call(self, function: str, arguments: dict[str, Any]) -> str:
        raise ToolError("x is required")


class Hangs(Tool):
    name = "hangs"
    description = "A tool that never answers in time."

    def call(self, function: str, arguments: dict[str, Any]) -> str:
        time.sleep(30.0)  # far past any timeout the tests set, however loaded the machine
        return "too late"


async def recording_multi_turn(ctx: Any, sample: Any, prompt: Any) -> Any:
    """The built-in multi_turn loop, with the engine's completions recorded on the side (in
    `tool_state`, which travels with the trajectory) so a test can compare them with it."""
    completions: list[list[int]] = []
    generate = ctx.client.generate

    async def recorded(p: dict[str, Any], sampling: Any) -> Any:
        c = await generate(p, sampling)
        completions.append(list(c.token_ids))
        return c

    ctx.client.generate = recorded
    trajectory = await multi_turn(ctx, sample, prompt)
    trajectory.tool_state["engine_completions"] = completions
    return trajectory


def click_top_left(text: str, functions: list[dict[str, Any]]) -> list[ToolCall]:
    """Every model turn clicks grid cell (0, 0) of the gui tool: the first menu opens, then closes."""
    return [ToolCall("click", {"x": 0, "y": 0})]
