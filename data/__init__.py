"""Dataset plugins (installed as `mmrl.plugins.data`): the recipes `mmrl data build NAME` runs
(recipes/, each registered with @register("dataset", NAME)) and the converters behind
`mmrl data convert` (JSONL / Hugging Face / Arrow rows -> webdataset shards). Reading shards at
training time is machinery: mmrl/data/.
"""
