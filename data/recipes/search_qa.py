"""`search_qa`: questions about a synthetic corpus that only the `search` tool can answer
(the corpus and the generator live with the tool, mmrl/tools/search.py)."""
from mmrl.registry import register
from mmrl.tools.search import build_dataset

build = register("dataset", "search_qa")(build_dataset)
