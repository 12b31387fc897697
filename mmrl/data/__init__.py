"""Data: webdataset shards -> Sample objects (stream.py); dataset recipes (recipes/)."""
from mmrl.data.sample import Sample

__all__ = ["Sample"]
