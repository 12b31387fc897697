"""Tools a multi-turn agent loop lets the model call (plugin kind "tool", contract in `base`),
and the parsers that find tool calls in the model's text (kind "tool_parser", `parsers`).
Importing this package registers the built-in tools."""
from mmrl.tools.base import Tool, ToolError, ToolResult, run_tool  # noqa: F401
from mmrl.tools import zoom  # noqa: F401  (registers "image_zoom")
from mmrl.tools import python_sandbox  # noqa: F401  (registers "python")
from mmrl.tools import search  # noqa: F401  (registers "search")
from mmrl.tools import gui  # noqa: F401  (registers "gui")
