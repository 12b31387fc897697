"""What the trainer rank does to the HF model before DeepSpeed wraps it, for models too big to
train whole: freeze the vision encoder (and optionally its projector), and turn on gradient
checkpointing.

Freezing is requires_grad=False. It must happen before the optimizer and DeepSpeed are built: the
optimizer is given only the trainable parameters, so frozen ones get no gradient partitions and
no optimizer state (no fp32 master copy, no Adam moments), and they never change. Nothing else
treats them differently: ZeRO-3 still shards them, and the weight sync (weight_sync/gather.py)
gathers every parameter whatever its requires_grad, so the engines keep receiving them.

Where the parts live depends on the family and the transformers version, so they are found by
module name, the outermost match wins (an inner module with the same name belongs to it):
  Qwen2-VL / 2.5-VL / 3-VL   `visual` (`model.visual` in transformers 5, `visual` in 4.x);
                             its projector is `visual.merger` (+ `visual.deepstack_merger_list`
                             in Qwen3-VL)
  LLaVA, InternVL (HF)       `vision_tower` + `multi_modal_projector`
  InternVL (remote code)     `vision_model` + `mlp1`
With LoRA (peft) the names only gain a prefix, so the same lookup works after wrapping.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

TOWER_NAMES = ("visual", "vision_tower", "vision_model")
PROJECTOR_NAMES = ("merger", "deepstack_merger_list", "multi_modal_projector", "mlp1")


class VisionPartsNotFound(ValueError):
    pass


@dataclass
class VisionParts:
    """Module names (as in model.named_modules()) of the vision encoder and of the projector."""

    tower: list[str]
    projector: list[str]

    def _under(self, name: str, prefixes: list[str]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    def is_projector(self, param_name: str) -> bool:
        return self._under(param_name, self.projector)

    def is_tower(self, param_name: str) -> bool:
        """In the encoder proper: under a tower module and not in a projector (Qwen's merger sits
        inside `visual`)."""
        return self._under(param_name, self.tower) and not self.is_projector(param_name)


def _outermost(names: list[str]) -> list[str]:
    kept: list[str] = []
    for name in sorted(names, key=lambda n: n.count(".")):
        if not any(name.startswith(k + ".") for k in kept):
            kept.append(name)
    return kept


def find_vision_parts(model: torch.nn.Module) -> VisionParts:
    """The vision encoder and projector modules of `model` (any supported family, peft-wrapped
    or not). Raises VisionPartsNotFound, naming the model class, when there is no encoder."""
    names = [n for n, _ in model.named_modules() if n]
    tower = _outermost([n for n in names if n.rsplit(".", 1)[-1] in TOWER_NAMES])
    if not tower:
        raise VisionPartsNotFound(
            f"found no vision tower in {_model_class(model)}: looked for a submodule named one of "
            f"{', '.join(TOWER_NAMES)}. Set trainer.freeze_vision_tower=false, or add the tower's "
            f"name to mmrl.trainer.model_setup.TOWER_NAMES")
    projector = _outermost([n for n in names if n.rsplit(".", 1)[-1] in PROJECTOR_NAMES])
    return VisionParts(tower=tower, projector=projector)


def model_skeleton(path: str, trust_remote_code: bool = False) -> torch.nn.Module:
    """The model built from its config on the meta device: its structure and shapes, no weights
    loaded (layouts, adapter targets, parameter counts)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config, trust_remote_code=trust_remote_code)


def _model_class(model: torch.nn.Module) -> str:
    base = getattr(model, "get_base_model", None)  # peft: name the wrapped model, not PeftModel
    return type(base() if callable(base) else model).__name__


def freeze_vision(model: torch.nn.Module, *, tower: bool, projector: bool) -> list[str]:
    """Set requires_grad=False on the encoder and/or the projector; returns the frozen names."""
    if not (tower or projector):
        return []
    parts = find_vision_parts(model)
    if projector and not parts.projector:
        raise VisionPartsNotFound(
            f"trainer.freeze_projector: found no projector in {_model_class(model)}: looked for a "
            f"submodule named one of {', '.join(PROJECTOR_NAMES)}")
    frozen = []
    for name, param in model.named_parameters():
        if (tower and parts.is_tower(name)) or (projector and parts.is_projector(name)):
            param.requires_grad_(False)
            frozen.append(name)
    return frozen


def enable_gradient_checkpointing(model: torch.nn.Module, *, skip_vision_tower: bool) -> None:
    """transformers' gradient checkpointing with use_reentrant=False: the non-reentrant form
    needs no input that requires grad (frozen embeddings, LoRA) and works with ZeRO-3's parameter
    hooks. A frozen tower runs no backward, so recomputing it would only cost time: it is left
    out (`skip_vision_tower`)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"trainer.gradient_checkpointing: {type(model).__name__} does not support "
                         f"gradient checkpointing in transformers")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if skip_vision_tower:
        modules = dict(model.named_modules())
        for name in find_vision_parts(model).tower:
            for module in modules[name].modules():
                if hasattr(module, "gradient_checkpointing"):
                    module.gradient_checkpointing = False


@contextmanager
def checkpointing_paused(model: torch.nn.Module) -> Iterator[None]:
    """Gradient checkpointing off for a while. A checkpointed layer drops the KV cache in
    training mode (transformers' GradientCheckpointingLayer), which sampling with the trainer's
    own model (rollout.backend=trainer) needs."""
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    for m in flagged:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in flagged:
            m.gradient_checkpointing = True

