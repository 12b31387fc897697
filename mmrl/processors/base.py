"""The processor contract shared by every model family.

An adapter is a class registered as kind "processor", built as `cls(model_path, **processor_args)`;
calling it on a `Sample` returns a `ProcessedPrompt` or raises `PromptRejected`. It also exposes
`media_limits` (`mmrl.data.media_limits.MediaLimits`): what its processor refuses, checked in
the loader workers so such media are quarantined there (an adapter without it gets no check);
`decode(ids)`, and the token ids `image_token_id`, `video_token_id`, `eos_token_id`,
`pad_token_id`, `forbidden_token_ids`.

Everything family-specific the trainer needs comes from the adapter, so the trainer, the
batcher and the weight sync name no family: the prompt's positions (any number of axes), its
vision tensors (passed to the model's forward as they are), and two class-level hooks the
trainer ranks call without building the adapter (`ProcessorAdapter`): whether a forward's
inputs run the vision tower, and a dummy vision output for a forward without media (ZeRO-3
ranks must all run the tower).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mmrl import registry


class PromptRejected(ValueError):
    """A sample cannot be turned into a prompt without corrupting it (e.g. truncation inside a
    vision block). The sample is skipped with this reason; training goes on."""


@dataclass
class ProcessedPrompt:
    """Everything both sides need for one prompt, from ONE processor call.

    vLLM gets `vllm_input` (prompt ids with one pad token per image/video, which vLLM expands
    itself, plus the raw media). The trainer gets `prompt_ids` (already expanded), the vision
    tensors in `mm_inputs` (keyword arguments of the model's forward, concatenated over a
    micro-batch along dim 0), and the positions `positions_AP` of the prompt: A axes (3 for
    M-RoPE, 1 for plain positions) by P tokens. Response token t sits at position
    `next_position + t` on every axis.
    """

    key: str
    vllm_input: dict[str, Any]
    prompt_ids: list[int]
    positions_AP: torch.Tensor
    next_position: int
    mm_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass
class PromptRef:
    """A processed prompt whose trainer side (ids, positions, vision tensors) stays in the object
    store of the rollout worker that made it: the driver plans with `num_tokens` and hands the
    reference on; each trainer rank fetches the tensors itself (`trainer.batch.resolve_prompts`).
    The pixels never pass through the driver."""

    key: str
    num_tokens: int
    ref: Any  # ray.ObjectRef of a ProcessedPrompt without its engine input


class ProcessorAdapter:
    """Base class of adapters: the class-level hooks the trainer ranks use. Override both for a
    family whose vision tower is not called as below."""

    # The model_type values (a model's config.json) this adapter serves: processor.name "auto"
    # picks the adapter by them, so a new family is one file that sets this.
    model_types: tuple[str, ...] = ()

    @staticmethod
    def runs_vision(mm_inputs: dict[str, torch.Tensor]) -> bool:
        """Whether a forward with these inputs runs the vision tower (HF's pixel_values* names)."""
        return any(k.startswith("pixel_values") for k in mm_inputs)

    @staticmethod
    def dummy_vision_output(model: Any) -> torch.Tensor:
        """The vision tower's output on the smallest valid input, as a scalar: a forward without
        media adds 0 x this, so every ZeRO-3 rank gathers the tower's parameters in the same order."""
        raise NotImplementedError("this adapter cannot run its model's vision tower on a dummy input; "
                                  "implement ProcessorAdapter.dummy_vision_output")

    @staticmethod
    def finish_saved_model(folder: Any) -> None:
        """Fix up a model folder transformers just wrote (an export, a built model) so that the
        rollout engine loads it; nothing unless the family's engine and transformers disagree."""

    @staticmethod
    def engine_weight_name(name: str) -> str:
        """The name the rollout engine loads a trainer weight under (the weight sync sends it so);
        the same name unless the family's engine and transformers disagree."""
        return name

    @staticmethod
    def engine_weight_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor the rollout engine loads for trainer weight `name` (its layout in released
        checkpoints); the same tensor unless the family's engine and transformers disagree."""
        return tensor


def media_list(x: Any) -> list[Any]:
    """An engine prompt's `multi_modal_data` entry as a list: vLLM takes one item or a list, and
    a video item is a (frames, metadata) pair."""
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) and not (len(x) == 2 and isinstance(x[1], dict)) else [x]


def float_tensors(obj: Any) -> list[torch.Tensor]:
    """Every floating tensor in a (nested) model output: vision outputs differ by family."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in float_tensors(item)]
    return []


def families() -> dict[str, str]:
    """model_type (from a model's config.json) -> the registered adapter that declares it in its
    own `model_types` (built-ins, entry points, adapters registered by an imported module). A
    subclass does not inherit its parent's model types, so it never takes over "auto" by accident;
    two adapters declaring one model type is an error that names both."""
    found: dict[str, registry.Entry] = {}
    for entry in registry.entries("processor"):
        for model_type in vars(entry.obj).get("model_types", ()) if isinstance(entry.obj, type) else ():
            first = found.setdefault(model_type, entry)
            if first.obj is not entry.obj:  # the same class under a second name is no conflict
                raise registry.PluginError(
                    f"processor adapters {first.name!r} and {entry.name!r} both declare model_type "
                    f"{model_type!r} in model_types; keep it in one of them, or set processor.name in the config")
    return {model_type: entry.name for model_type, entry in found.items()}


def build_processor(name: str, model_path: str, **kwargs: Any) -> Any:
    """Instantiate the processor adapter `name` ("auto" = by the model's model_type)."""
    return processor_class(name, model_path, bool(kwargs.get("trust_remote_code")))(model_path, **kwargs)


def processor_class(name: str, model_path: str, trust_remote_code: bool = False) -> Any:
    """The adapter class `name` ("auto" = by the model's model_type), not built."""
    if name == "auto":
        from transformers import AutoConfig

        model_type = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).model_type
        known = families()
        if model_type not in known:
            raise registry.PluginError(
                f"no processor adapter for model_type {model_type!r} (model {model_path}); supported: "
                f"{', '.join(known)}. Set processor.name to a registered adapter or 'module:Class', "
                f"or declare the model_type in an adapter's `model_types`.")
        name = known[model_type]
    return registry.resolve("processor", name)


def process_sample(processor: Any, sample: Any) -> Any:
    """The processed prompt, or the failure as a `BadSample` (`prompt_rejected` / `processor_error`):
    any per-sample failure costs that sample only (see controller/prompts.py)."""
    from mmrl.data.quarantine import BadSample

    try:
        return processor(sample)
    except Exception as e:  # noqa: BLE001 -- any per-sample failure costs that sample only
        if isinstance(e, PromptRejected):
            return BadSample("prompt_rejected", sample.key, sample.source, str(e))
        return BadSample("processor_error", sample.key, sample.source, f"{type(e).__name__}: {e}")
