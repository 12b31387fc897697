"""Dataset recipes: `mmrl data build NAME --out DIR` writes webdataset shards.

Each recipe registers itself with @register("dataset", NAME); shared drawing, encoding and
shard-writing helpers are in `_common`.
"""
from mmrl.plugins.data.recipes import colors  # noqa: F401  (registers "colors")
from mmrl.plugins.data.recipes import counting  # noqa: F401  (registers "counting")
from mmrl.plugins.data.recipes import grounding  # noqa: F401  (registers "grounding")
from mmrl.plugins.data.recipes import multi_image  # noqa: F401  (registers "multi_image")
from mmrl.plugins.data.recipes import video_motion  # noqa: F401  (registers "video_motion")
from mmrl.plugins.data.recipes import search_qa  # noqa: F401  (registers "search_qa")
from mmrl.plugins.data.recipes import gui_click  # noqa: F401  (registers "gui_click")
from mmrl.plugins.data.recipes import zoom_read  # noqa: F401  (registers "zoom_read")
