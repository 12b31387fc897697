"""Tool-call parsers for tests (loaded by path, like a user's plugin file): a random tiny model
never writes a tool call, so these declare one on every turn, which drives the multi-turn loop
through its tool turns deterministically."""
from __future__ import annotations

from typing import Any

from mmrl.tools.parsers import ToolCall


def zoom_every_turn(text: str, functions: list[dict[str, Any]]) -> list[ToolCall]:
    """Every model turn asks for the top-left quarter of the image."""
    return [ToolCall("image_zoom", {"bbox": [0.0, 0.0, 0.5, 0.5]})]
