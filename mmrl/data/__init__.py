"""Data: webdataset shards -> Sample objects (stream.py); dataset recipes (recipes/)."""
from mmrl.data.sample import Sample, Video

__all__ = ["Sample", "Video"]
