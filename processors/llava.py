"""LLaVA adapter (model_type "llava": LLaVA-1.5 and models built like it).

A CLIP-like vision tower at a fixed resolution, an MLP projector, and a decoder with plain 1-D
positions. The chat template writes one `<image>` per image; the HF processor expands it to one
token per vision patch, and so does vLLM from the raw image: the engine gets the unexpanded
ids, the trainer the expanded ones, from the same template text. Images only (no video).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoProcessor

from mmrl.data.media_limits import MediaLimits
from mmrl.data.sample import Sample
from mmrl.processors.base import ProcessedPrompt, ProcessorAdapter, PromptRejected, float_tensors, media_list
from mmrl.registry import register


def _under_vision_model(name: str, tower: str) -> str:
    """`<tower>X` -> `<tower>vision_model.X` (the layout of released LLaVA checkpoints)."""
    if name.startswith(tower) and not name.startswith(tower + "vision_model."):
        return tower + "vision_model." + name[len(tower):]
    return name


@register("processor", "llava")
class LlavaProcessor(ProcessorAdapter):
    """Adapter for LLaVA: images at the vision tower's fixed resolution, 1-D positions."""

    model_types = ("llava",)
    family = "LLaVA"  # for messages; families built like LLaVA subclass this adapter

    def __init__(self, model_path: str, *, min_pixels: int | None = None, max_pixels: int | None = None,
                 max_prompt_tokens: int = 1024, trust_remote_code: bool = False):
        if min_pixels is not None or max_pixels is not None:
            raise ValueError(f"processor.min_pixels / max_pixels: {self.family} sizes images for its vision tower's "
                             f"fixed resolution (the model's preprocessor_config.json); leave them null for this model")
        self.model_path = model_path
        self.hf = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.tokenizer = self.hf.tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        # the processor resizes (and crops or tiles) any image: nothing to refuse but a 0-pixel side
        self.media_limits = MediaLimits(owner=f"the {self.family} processor")
        tok = self.tokenizer
        self.image_token_id = int(self.config.image_token_id)
        self.image_token = tok.convert_ids_to_tokens(self.image_token_id)
        self.video_token_id = None
        self.eos_token_id = tok.eos_token_id
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.forbidden_token_ids = [self.image_token_id]

    @staticmethod
    def dummy_vision_output(model: Any) -> torch.Tensor:
        """The tower on one zero image at its input resolution."""
        vision = model.config.vision_config
        side = vision.image_size  # an int, or (height, width)
        height, width = (side, side) if isinstance(side, int) else side
        pixels = torch.zeros(1, vision.num_channels, height, width, dtype=next(model.parameters()).dtype)
        return sum(t.float().sum() for t in float_tensors(model.get_image_features(pixel_values=pixels)))

    @staticmethod
    def engine_weight_name(name: str) -> str:
        """transformers 5 names the CLIP tower's weights without `vision_model.`; vLLM's LLaVA
        loads them under it, as released checkpoints have them."""
        return _under_vision_model(name, "model.vision_tower.")

    @staticmethod
    def finish_saved_model(folder: str | Path) -> None:
        """Rename the CLIP tower's weights in a folder transformers wrote to the layout released
        LLaVA checkpoints have (`vision_tower.vision_model.*`), which vLLM loads; transformers
        loads both."""
        from safetensors.torch import load_file, save_file

        def canonical(name: str) -> str:  # checkpoint names have no "model." in front
            return _under_vision_model(name, "vision_tower.")

        folder = Path(folder)
        for path in sorted(folder.glob("model*.safetensors")):
            state = load_file(str(path))
            save_file({canonical(k): v for k, v in state.items()}, str(path), metadata={"format": "pt"})
        index = folder / "model.safetensors.index.json"
        if index.exists():
            data = json.loads(index.read_text())
            data["weight_map"] = {canonical(k): v for k, v in data["weight_map"].items()}
            index.write_text(json.dumps(data, indent=2) + "\n")

    def __call__(self, sample: Sample) -> ProcessedPrompt:
        if sample.videos:
            raise PromptRejected(f"{self.family} takes images only here; this sample has a video")
        text = self.hf.apply_chat_template(sample.messages, add_generation_prompt=True, tokenize=False)
        # add_special_tokens=False: the template text has them already (the engine's ids agree)
        enc = self.hf(text=[text], images=sample.images or None, return_tensors="pt", add_special_tokens=False)
        ids = enc["input_ids"][0]
        if ids.numel() > self.max_prompt_tokens:
            raise PromptRejected(f"prompt has {ids.numel()} tokens > processor.max_prompt_tokens="
                                 f"{self.max_prompt_tokens}; raise the limit or use fewer images")
        vllm_input: dict[str, Any] = {"prompt_token_ids": self.tokenizer(text, add_special_tokens=False)["input_ids"]}
        if sample.images:
            vllm_input["multi_modal_data"] = {"image": list(sample.images)}
        mm_inputs = {"pixel_values": torch.as_tensor(enc["pixel_values"])} if sample.images else {}
        return self._prompt(sample.key, vllm_input, ids.tolist(), mm_inputs)

    def _prompt(self, key: str, vllm_input: dict[str, Any], ids: list[int],
                mm_inputs: dict[str, torch.Tensor]) -> ProcessedPrompt:
        positions_1P = torch.arange(len(ids)).unsqueeze(0)
        return ProcessedPrompt(key=key, vllm_input=vllm_input, prompt_ids=ids, positions_AP=positions_1P,
                               next_position=len(ids), mm_inputs=mm_inputs)

    def expand(self, vllm_input: dict[str, Any]) -> ProcessedPrompt:
        return self.expand_traced(vllm_input)[0]

    def expand_traced(self, vllm_input: dict[str, Any]) -> tuple[ProcessedPrompt, list[int]]:
        """The trainer's view of an engine prompt (one placeholder per image, the raw images): each
        placeholder expanded as the processor expands it, and per trainer token the index of the
        engine token it stands for (see QwenVLProcessor.expand_traced)."""
        ids = list(vllm_input["prompt_token_ids"])
        media = vllm_input.get("multi_modal_data") or {}
        if media.get("video"):
            raise PromptRejected(f"{self.family} takes images only here")
        images = iter(media_list(media.get("image")))
        out_ids: list[int] = []
        source: list[int] = []
        pixels: list[torch.Tensor] = []
        for i, tok in enumerate(ids):
            if tok != self.image_token_id:
                out_ids.append(tok)
                source.append(i)
                continue
            image = next(images, None)
            if image is None:
                raise PromptRejected(f"the prompt has more {self.image_token} tokens than multi_modal_data has images")
            enc = self.hf(text=[self.image_token], images=[image], return_tensors="pt", add_special_tokens=False)
            expanded = enc["input_ids"][0].tolist()
            out_ids += expanded
            source += [i] * len(expanded)
            pixels.append(torch.as_tensor(enc["pixel_values"]))
        if next(images, None) is not None:
            raise PromptRejected(f"multi_modal_data has more images than the prompt has {self.image_token} tokens")
        mm_inputs = {"pixel_values": torch.cat(pixels)} if pixels else {}
        return self._prompt("", vllm_input, out_ids, mm_inputs), source

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
