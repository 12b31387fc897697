"""Trainer side of the weight sync: ZeRO-3 shards -> full tensors in buckets -> HF checkpoint names.

Parameters are gathered a bucket at a time (never the whole model at once). With LoRA (peft),
each adapted linear layer is one unit: its base weight and both adapter matrices are gathered
together and sent merged, W + (α/r)·B·A, under the base model's name, so the rollout engines
never know about adapters.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

import torch

_PEFT_PREFIX = "base_model.model."


def export_name(name: str) -> str:
    """The HF checkpoint name of a (possibly peft-wrapped) parameter."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX):]
    return name.replace(".base_layer.", ".")


@dataclass
class WeightUnit:
    """Parameters gathered together and the tensors they become."""

    name: str  # export name of the (base) weight
    params: list[torch.nn.Parameter]
    lora_scaling: float | None = None  # set for a merged LoRA layer: params = [W, A, B] (+ bias)

    @property
    def nbytes(self) -> int:
        # ZeRO-3 partitions parameters: numel() is 0 on a rank, ds_numel is the full size
        return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in self.params)

    def tensors(self, device: str = "cpu") -> dict[str, torch.Tensor]:
        """Full tensors on `device` (call inside GatheredParameters)."""
        if self.lora_scaling is None:
            return {self.name: self.params[0].data.detach().to(device).contiguous()}
        weight, lora_a, lora_b, *bias = self.params
        merged = weight.data.float() + self.lora_scaling * (lora_b.data.float() @ lora_a.data.float())
        out = {self.name: merged.to(weight.dtype).to(device).contiguous()}
        if bias:
            out[self.name[:-len("weight")] + "bias"] = bias[0].data.detach().to(device).contiguous()
        return out


def weight_units(model: torch.nn.Module) -> list[WeightUnit]:
    """Every weight the engines need, in a fixed order (all ranks must gather in the same order)."""
    units: list[WeightUnit] = []
    covered: set[int] = set()
    for module_name, module in model.named_modules():
        if not (hasattr(module, "base_layer") and hasattr(module, "lora_A")):
            continue
        adapter = next(iter(module.lora_A.keys()))
        base = module.base_layer
        params = [base.weight, module.lora_A[adapter].weight, module.lora_B[adapter].weight]
        if getattr(base, "bias", None) is not None:
            params.append(base.bias)
        covered.update(id(p) for p in params)
        units.append(WeightUnit(export_name(module_name + ".weight"), params, float(module.scaling[adapter])))
    for name, p in model.named_parameters():
        if id(p) in covered or ".lora_" in name:
            continue
        units.append(WeightUnit(export_name(name), [p]))
    return units


def buckets(units: list[WeightUnit], bucket_mb: float) -> Iterator[list[WeightUnit]]:
    """Consecutive units of about `bucket_mb` each (a unit larger than that is a bucket alone)."""
    limit = bucket_mb * 2**20
    bucket: list[WeightUnit] = []
    size = 0
    for unit in units:
        if bucket and size + unit.nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(unit)
        size += unit.nbytes
    if bucket:
        yield bucket


_LORA_KEY = re.compile(r"^(.*)\.lora_([AB])\.[^.]+\.weight$")


def merge_lora_state_dict(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A full peft state dict (from a checkpoint) -> plain HF names with the adapters merged."""
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        m = _LORA_KEY.match(key)
        if m:
            adapters.setdefault(m.group(1), {})[m.group(2)] = value
        else:
            out[export_name(key)] = value
    for layer, ab in adapters.items():
        name = export_name(layer + ".weight")
        base = out[name]
        out[name] = (base.float() + scaling * (ab["B"].float() @ ab["A"].float())).to(base.dtype)
    return out
