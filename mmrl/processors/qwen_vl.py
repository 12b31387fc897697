"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL adapter.

One HF processor call per sample expands the vision pads and yields pixel_values/grid_thw;
the vLLM prompt is the same token sequence with each expanded pad run collapsed back to one pad
(vLLM expands it again from the raw image), so the two sides cannot disagree on the text.
M-RoPE positions come from the model family's own `get_rope_index`, run on the config alone.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoProcessor

from mmrl.data.sample import Sample
from mmrl.processors.base import ProcessedPrompt, PromptRejected
from mmrl.registry import register

VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_pad|>", "<|vision_start|>", "<|vision_end|>")


def _inner_model_class(model_type: str) -> type:
    """The `...Model` class whose get_rope_index defines this family's positions."""
    if model_type == "qwen2_vl":
        from transformers import Qwen2VLModel as cls
    elif model_type == "qwen2_5_vl":
        from transformers import Qwen2_5_VLModel as cls
    elif model_type == "qwen3_vl":
        from transformers import Qwen3VLModel as cls
    else:
        raise ValueError(f"qwen_vl processor does not support model_type {model_type!r}")
    return cls


class _RopeIndex:
    """Calls the family's `get_rope_index` without building the model: it needs only the config
    (merge size, tokens per second) and `get_vision_position_ids`, which reads no weights."""

    def __init__(self, config: Any):
        self.config = config
        self._cls = _inner_model_class(config.model_type)

    def get_vision_position_ids(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._cls.get_vision_position_ids(self, *args, **kwargs)

    def __call__(self, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cls.get_rope_index(self, **kwargs)


@register("processor", "qwen_vl")
class QwenVLProcessor:
    """Adapter for the Qwen-VL families (image prompts; video and multi-image come with #3)."""

    def __init__(self, model_path: str, *, min_pixels: int | None = None, max_pixels: int | None = None,
                 max_prompt_tokens: int = 1024, trust_remote_code: bool = False):
        self.model_path = model_path
        self.hf = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.tokenizer = self.hf.tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self._image_kwargs: dict[str, Any] = {}
        if min_pixels is not None or max_pixels is not None:
            size = dict(getattr(self.hf.image_processor, "size", {}) or {})
            if min_pixels is not None:
                size["shortest_edge"] = min_pixels
            if max_pixels is not None:
                size["longest_edge"] = max_pixels
            self._image_kwargs = {"size": size}
        self._rope_index = _RopeIndex(self.config)
        tok = self.tokenizer
        self.image_token_id = tok.convert_tokens_to_ids("<|image_pad|>")
        self.video_token_id = tok.convert_tokens_to_ids("<|video_pad|>")
        self.eos_token_id = tok.eos_token_id
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.forbidden_token_ids = sorted({tok.convert_tokens_to_ids(t) for t in VISION_TOKENS
                                           if tok.convert_tokens_to_ids(t) is not None})

    def __call__(self, sample: Sample) -> ProcessedPrompt:
        text = self.hf.apply_chat_template(sample.messages, add_generation_prompt=True, tokenize=False)
        images = sample.images or None
        enc = self.hf(text=[text], images=images, return_tensors="pt", **self._image_kwargs)
        ids = enc["input_ids"][0]
        if ids.numel() > self.max_prompt_tokens:
            # Cutting the prompt could cut a vision block and desynchronise image features and
            # tokens; reject the sample instead of truncating.
            raise PromptRejected(f"prompt has {ids.numel()} tokens > processor.max_prompt_tokens="
                                 f"{self.max_prompt_tokens}; raise the limit or lower the image pixel budget")
        mm_inputs = {k: enc[k] for k in ("pixel_values", "image_grid_thw") if k in enc}
        positions, _ = self._rope_index(
            input_ids=enc["input_ids"], mm_token_type_ids=enc["mm_token_type_ids"],
            image_grid_thw=enc.get("image_grid_thw"), video_grid_thw=None, attention_mask=None)
        positions_3P = positions[:, 0]
        prompt_ids = ids.tolist()
        vllm_ids = self._collapse_pads(prompt_ids)
        vllm_input: dict[str, Any] = {"prompt_token_ids": vllm_ids}
        if sample.images:
            vllm_input["multi_modal_data"] = {"image": list(sample.images)}
        return ProcessedPrompt(key=sample.key, vllm_input=vllm_input, prompt_ids=prompt_ids,
                               position_ids_3P=positions_3P, next_position=int(positions_3P.max()) + 1,
                               mm_inputs=mm_inputs)

    def _collapse_pads(self, ids: list[int]) -> list[int]:
        """Expanded ids -> one pad per image/video (what vLLM expects as prompt_token_ids)."""
        out: list[int] = []
        for t in ids:
            if t in (self.image_token_id, self.video_token_id) and out and out[-1] == t:
                continue
            out.append(t)
        return out

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
