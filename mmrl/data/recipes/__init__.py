"""Dataset recipes: `mmrl data build NAME --out DIR` writes webdataset shards.

Each recipe registers itself with @register("dataset", NAME).
"""
from mmrl.data.recipes import colors  # noqa: F401  (registers "colors")
