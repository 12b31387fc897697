"""The tool contract (plugin kind "tool"): what a multi-turn agent loop lets the model call.

A tool is a class registered as kind "tool", built ONCE PER TRAJECTORY as
`cls(sample, **args)` (`args` from `rollout.agent_loop_args.tools[i].args`), so it may keep
state across the calls of one trajectory (the current image, a GUI's screen, a sandbox dir):

    @register("tool", "image_zoom")
    class ImageZoom(Tool):
        name = "image_zoom"
        description = "Zoom into a region of the image."
        parameters = {"type": "object", "properties": {...}, "required": [...]}

        def call(self, function: str, arguments: dict) -> ToolResult | str: ...

  * `functions()` lists the OpenAI-style function schemas the chat template shows the model
    (one per function; a `Tool` subclass with `name`/`description`/`parameters` has one, an
    environment such as a GUI may have several: click, type).
  * `call(function, arguments)` runs one call, sync or `async def`. It returns a `ToolResult`
    (text and/or images for the tool turn) or a plain string. A bad call (unknown argument,
    out-of-range value) raises `ToolError` with a message the model can learn from; anything
    else raised, or a call slower than the loop's `tool_timeout_s`, becomes a tool error too
    (`run_tool`), counted in the trajectory, and never stops the run.
  * `state()` is what the rewards see of the environment at the end (e.g. {"success": True}).
  * `close()` frees what the tool holds (a sandbox process, a temp dir); always called.
"""
from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar


class ToolError(Exception):
    """A call the tool refuses (bad arguments, an action that is impossible): the message goes
    back to the model as the tool's answer."""


@dataclass
class ToolResult:
    """What one call gives the conversation: a tool turn with `text` and/or `images` (PIL).
    `error` marks a failed call (its text says why); `done` ends the episode (an environment
    reached a final state)."""

    text: str = ""
    images: list[Any] = field(default_factory=list)
    error: bool = False
    done: bool = False


class Tool:
    """Base class of single-function tools; see the module docstring for the contract."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    def __init__(self, sample: Any = None, **args: Any):
        self.sample = sample
        if args:
            raise TypeError(f"tool {self.name!r} takes no args, got {sorted(args)}")

    def functions(self) -> list[dict[str, Any]]:
        return [{"type": "function",
                 "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}]

    def call(self, function: str, arguments: dict[str, Any]) -> "ToolResult | str":
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def function_names(tool: Any) -> list[str]:
    return [f["function"]["name"] for f in tool.functions()]


async def run_tool(tool: Any, function: str, arguments: dict[str, Any], timeout_s: float | None) -> tuple[ToolResult, float]:
    """Run one call; every failure (ToolError, any exception, a timeout, a wrong return type)
    comes back as an error `ToolResult` naming the tool and what to do. Returns (result, seconds).
    A sync tool runs in a thread so a slow one does not block the other trajectories; a hung
    sync call cannot be killed from Python, so after the timeout its thread is left behind and
    the trajectory goes on (tools that can hang for real, such as code execution, run their
    work in a process they kill themselves)."""
    t0 = time.perf_counter()
    label = f"{type(tool).__name__}.{function}"
    try:
        if inspect.iscoroutinefunction(tool.call):
            pending = tool.call(function, arguments)
        else:
            pending = asyncio.to_thread(tool.call, function, arguments)
        out = await asyncio.wait_for(pending, timeout=timeout_s)
    except ToolError as e:
        return ToolResult(text=f"error: {e}", error=True), time.perf_counter() - t0
    except asyncio.TimeoutError:
        return (ToolResult(text=f"error: tool {function!r} timed out after {timeout_s} s", error=True),
                time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 -- a failing tool costs that call only
        return ToolResult(text=f"error: tool {function!r} failed: {type(e).__name__}: {e}", error=True), \
            time.perf_counter() - t0
    if isinstance(out, str):
        out = ToolResult(text=out)
    if not isinstance(out, ToolResult):
        return (ToolResult(text=f"error: tool {label} returned {type(out).__name__}, not a ToolResult or str",
                           error=True), time.perf_counter() - t0)
    return out, time.perf_counter() - t0
