"""The object-store transport (the CPU default): each bucket as safetensors bytes through Ray's
object store, staged by every engine, then loaded in one reload when the sync finishes."""
from __future__ import annotations

from typing import Any, Sequence

import ray
import torch


class ObjectStoreSender:
    device = "cpu"

    def __init__(self, engines: Sequence[Any]):
        self.engines = list(engines)
        self._pending: list[Any] = []
        self._staged = 0  # bytes each engine holds staged when the sync finishes: all of them

    def send(self, tensors: dict[str, torch.Tensor]) -> int:
        from safetensors.torch import save as save_safetensors

        payload = save_safetensors(tensors)
        self._staged += len(payload)
        ref = ray.put(payload)
        # not waited on here: the next bucket is gathered while the engines stage this one
        self._pending += [e.stage_weights.remote(ref) for e in self.engines]
        return len(payload)

    def finish(self, version: int) -> dict[str, float]:
        ray.get(self._pending)
        applied = ray.get([e.apply_weights.remote(version) for e in self.engines])
        return {"apply_s": max(a["apply_seconds"] for a in applied), "engine_peak_staged_mb": self._staged / 2**20}

    def abort(self) -> None:
        self._pending.clear()  # what was staged is replaced by the next sync's apply
