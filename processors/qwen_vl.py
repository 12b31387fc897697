"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL adapter.

One HF processor call per sample expands the vision pads and yields the vision tensors for the
trainer; the vLLM prompt is the same chat-template text tokenized before expansion (one pad per
image or video), which vLLM expands itself from the raw media.
M-RoPE positions come from the model family's own `get_rope_index`, run on the config alone.
"""
from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoProcessor

from mmrl.data.media_limits import MediaLimits
from mmrl.data.sample import Sample
from mmrl.processors.base import ProcessedPrompt, ProcessorAdapter, PromptRejected, float_tensors, media_list
from mmrl.registry import register

# Processor outputs the trainer forward needs besides the token ids.
MM_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
# Qwen3-VL and its MoE variant share the processor, the vision tower and the positions rule.
QWEN3_TYPES = ("qwen3_vl", "qwen3_vl_moe")
# Qwen3-VL-MoE's fused expert weights: released checkpoints (and vLLM) hold them as (E, in, out),
# transformers 5 as (E, out, in); it transposes them when it loads but saves its own layout.
MOE_EXPERT_WEIGHTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_pad|>", "<|vision_start|>", "<|vision_end|>")


def _inner_model_class(model_type: str) -> type:
    """The `...Model` class whose get_rope_index defines this family's positions."""
    if model_type == "qwen2_vl":
        from transformers import Qwen2VLModel as cls
    elif model_type == "qwen2_5_vl":
        from transformers import Qwen2_5_VLModel as cls
    elif model_type == "qwen3_vl":
        from transformers import Qwen3VLModel as cls
    elif model_type == "qwen3_vl_moe":  # the same vision side and positions, MoE text layers
        from transformers import Qwen3VLMoeModel as cls
    else:
        raise ValueError(f"qwen_vl processor does not support model_type {model_type!r}")
    return cls


def _hf_video_metadata(frames: Any, meta: dict[str, Any]) -> Any:
    """transformers' metadata of sampled `frames` from the per-video dict vLLM gets (`Video.vllm_metadata`)."""
    from transformers.video_utils import VideoMetadata

    height, width = frames.shape[1:3]
    return VideoMetadata(total_num_frames=meta["total_num_frames"], fps=meta["fps"], width=width, height=height,
                         duration=meta["duration"], video_backend=meta["video_backend"],
                         frames_indices=meta["frames_indices"])


class _RopeIndex:
    """M-RoPE positions of a prompt, exactly as the vLLM engine computes them.

    Qwen3-VL: the family's own `get_rope_index` from transformers, run on the config alone (it
    reads no weights); it agrees with vLLM. Qwen2-VL / Qwen2.5-VL: our own implementation of the
    original rule, because transformers 5.19 places the text after a VIDEO block at
    start + max(h, w) / merge, ignoring the temporal extent, while vLLM (and the original Qwen
    code) continue at max(block positions) + 1. For images the two rules coincide; for videos
    the transformers rule makes trainer logprobs silently differ from the sampler's.
    """

    def __init__(self, config: Any):
        self.config = config
        self.model_type = config.model_type
        self._cls = _inner_model_class(config.model_type)
        # which vision tensors this family's get_rope_index takes (Qwen2.5-VL: second_per_grid_ts)
        self.accepts = set(inspect.signature(self._cls.get_rope_index).parameters)

    def get_vision_position_ids(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._cls.get_vision_position_ids(self, *args, **kwargs)

    def __call__(self, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, **mm: Any) -> torch.Tensor:
        """(3, P) positions for one prompt (batch of 1)."""
        if self.model_type in QWEN3_TYPES:
            kwargs = {k: v for k, v in mm.items() if k in self.accepts}
            return self._cls.get_rope_index(self, input_ids=input_ids, mm_token_type_ids=mm_token_type_ids,
                                            attention_mask=None, **kwargs)[0][:, 0]
        return self._qwen2_positions(mm_token_type_ids[0].tolist(), mm)

    def _qwen2_positions(self, types: list[int], mm: dict[str, Any]) -> torch.Tensor:
        merge = self.config.vision_config.spatial_merge_size
        tokens_per_second = getattr(self.config.vision_config, "tokens_per_second", 1.0)
        grids = {1: iter(mm.get("image_grid_thw", [])), 2: iter(mm.get("video_grid_thw", []))}
        seconds = iter(mm.get("second_per_grid_ts", []))
        blocks: list[np.ndarray] = []
        next_pos, i = 0, 0
        while i < len(types):
            if types[i] == 0:  # a run of text tokens
                j = i
                while j < len(types) and types[j] == 0:
                    j += 1
                blocks.append(np.broadcast_to(np.arange(j - i), (3, j - i)) + next_pos)
                next_pos += j - i
                i = j
                continue
            t, h, w = (int(x) for x in next(grids[types[i]]))
            grid = np.indices((t, h // merge, w // merge)).reshape(3, -1)
            if types[i] == 2 and "second_per_grid_ts" in mm:
                grid[0] = (grid[0] * float(next(seconds)) * tokens_per_second).astype(np.int64)
            blocks.append(grid + next_pos)
            next_pos = int(blocks[-1].max()) + 1
            i += grid.shape[1]
        return torch.from_numpy(np.concatenate(blocks, axis=1).astype(np.int64))


def qwen_media_limits(model_type: str) -> MediaLimits:
    """What the Qwen-VL processors (transformers' `smart_resize`, which vLLM calls too) refuse:
    an image or frame whose aspect ratio is above 200 (ValueError), and for Qwen3-VL a video of
    fewer frames than its temporal patch (2). Tiny images are not refused: they are upscaled to
    the minimum pixel budget. tests/test_processor.py pins these numbers to the real processor."""
    return MediaLimits(max_aspect_ratio=200.0, min_video_frames=2 if model_type in QWEN3_TYPES else 1,
                       owner=f"the qwen_vl processor ({model_type})")


@register("processor", "qwen_vl")
class QwenVLProcessor(ProcessorAdapter):
    """Adapter for the Qwen-VL families: image, multi-image, video and mixed prompts."""

    model_types = ("qwen2_vl", "qwen2_5_vl", *QWEN3_TYPES)

    @staticmethod
    def dummy_vision_output(model: Any) -> torch.Tensor:
        """The tower on the smallest grid (one merged token) of zero pixels."""
        vision = model.config.vision_config
        merge = vision.spatial_merge_size
        grid_thw = torch.tensor([[1, merge, merge]])
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        pixels = torch.zeros(int(grid_thw.prod()), patch_dim, dtype=next(model.parameters()).dtype)
        out = model.get_image_features(pixel_values=pixels, image_grid_thw=grid_thw)
        return sum(t.float().sum() for t in float_tensors(out))

    @staticmethod
    def engine_weight_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Qwen3-VL-MoE experts in the released layout (E, in, out), which vLLM loads (of the
        families here only Qwen3-VL-MoE has fused expert weights)."""
        if name.endswith(MOE_EXPERT_WEIGHTS):
            return tensor.transpose(1, 2).contiguous()
        return tensor

    @staticmethod
    def finish_saved_model(folder: Any) -> None:
        """Qwen3-VL-MoE: rewrite the fused experts transformers saved as (E, out, in) in the
        released layout (E, in, out) that vLLM loads; transformers loads both (it transposes on
        load when the shape says so, so the tiny models keep in != out)."""
        import json
        from pathlib import Path

        from safetensors.torch import load_file, save_file

        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        if config.get("model_type") != "qwen3_vl_moe":
            return
        text = config["text_config"]
        gate_up_out = 2 * text["moe_intermediate_size"]  # transformers' dim 1 of gate_up_proj
        if gate_up_out == text["hidden_size"] or text["moe_intermediate_size"] == text["hidden_size"]:
            raise ValueError("qwen3_vl_moe with square expert weights: the layouts cannot be told apart")
        for path in sorted(folder.glob("model*.safetensors")):
            state = load_file(str(path))
            hf_layout = [k for k, v in state.items() if k.endswith(MOE_EXPERT_WEIGHTS) and v.shape[1] ==
                         (gate_up_out if k.endswith("gate_up_proj") else text["hidden_size"])]
            if hf_layout:
                state.update({k: state[k].transpose(1, 2).contiguous() for k in hf_layout})
                save_file(state, str(path), metadata={"format": "pt"})

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
        self.media_limits = qwen_media_limits(self.config.model_type)
        tok = self.tokenizer
        self.image_token_id = tok.convert_tokens_to_ids("<|image_pad|>")
        self.video_token_id = tok.convert_tokens_to_ids("<|video_pad|>")
        self.eos_token_id = tok.eos_token_id
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.forbidden_token_ids = sorted({tok.convert_tokens_to_ids(t) for t in VISION_TOKENS
                                           if tok.convert_tokens_to_ids(t) is not None})

    def __call__(self, sample: Sample) -> ProcessedPrompt:
        text = self.hf.apply_chat_template(sample.messages, add_generation_prompt=True, tokenize=False)
        kwargs: dict[str, Any] = dict(self._image_kwargs)
        if sample.videos:
            # Frames arrive already sampled; the metadata carries their rate so the processor
            # derives the same temporal positions (and Qwen3-VL timestamps) as vLLM does.
            kwargs.update(videos=[v.frames for v in sample.videos], do_sample_frames=False,
                          video_metadata=[_hf_video_metadata(v.frames, v.vllm_metadata()) for v in sample.videos])
        enc = self.hf(text=[text], images=sample.images or None, return_tensors="pt", **kwargs)
        ids = enc["input_ids"][0]
        if ids.numel() > self.max_prompt_tokens:
            # Cutting the prompt could cut a vision block and desynchronise image features and
            # tokens; reject the sample instead of truncating.
            raise PromptRejected(f"prompt has {ids.numel()} tokens > processor.max_prompt_tokens="
                                 f"{self.max_prompt_tokens}; raise the limit or lower the image pixel budget")
        mm_inputs = {k: torch.as_tensor(enc[k]) for k in MM_KEYS if k in enc}
        positions_3P = self._rope_index(enc["input_ids"], enc["mm_token_type_ids"], **mm_inputs)
        # vLLM gets the un-expanded template text: one pad per image/video, which it expands
        # itself from the raw media (for Qwen3-VL video that includes the frame timestamps).
        vllm_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        vllm_input: dict[str, Any] = {"prompt_token_ids": vllm_ids}
        media: dict[str, Any] = {}
        if sample.images:
            media["image"] = list(sample.images)
        if sample.videos:
            media["video"] = [(v.frames, v.vllm_metadata()) for v in sample.videos]
        if media:
            vllm_input["multi_modal_data"] = media
        return ProcessedPrompt(key=sample.key, vllm_input=vllm_input, prompt_ids=ids.tolist(),
                               positions_AP=positions_3P, next_position=int(positions_3P.max()) + 1,
                               mm_inputs=mm_inputs)

    def expand(self, vllm_input: dict[str, Any]) -> ProcessedPrompt:
        """See `expand_traced`; only the trainer prompt."""
        return self.expand_traced(vllm_input)[0]

    def expand_traced(self, vllm_input: dict[str, Any]) -> tuple[ProcessedPrompt, list[int]]:
        """The trainer's view of an engine prompt: `vllm_input` (token ids with one pad per
        image/video, the raw media) with every vision block expanded, the vision tensors and the
        M-RoPE positions. For a prompt made by `__call__` it is that call's trainer side exactly
        (tests/test_processor.py); it also takes what an agent loop builds from one (the prompt
        plus earlier turns), which is how `rollout.backend: trainer` sees the engines' inputs.
        Each medium is processed alone (the HF processor treats media independently), and its
        `<|vision_start|><|pad|><|vision_end|>` triple is replaced by the processor's expansion.
        Also returns, per trainer token, the index of the engine token it stands for (a vision
        block's tokens all point at its pad): how a multi-turn trajectory's loss mask and
        logprobs, kept per engine token, are laid over the trainer's tokens."""
        ids = list(vllm_input["prompt_token_ids"])
        media = vllm_input.get("multi_modal_data") or {}
        images, videos = iter(media_list(media.get("image"))), iter(media_list(media.get("video")))
        start, end = (self.tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
        out_ids: list[int] = []
        source: list[int] = []
        types: list[int] = []
        parts: dict[str, list[torch.Tensor]] = {}
        i = 0
        while i < len(ids):
            tok = ids[i]
            if tok not in (self.image_token_id, self.video_token_id):
                out_ids.append(tok)
                source.append(i)
                types.append(0)
                i += 1
                continue
            if not (out_ids and out_ids[-1] == start and i + 1 < len(ids) and ids[i + 1] == end):
                raise PromptRejected(f"vision pad at position {i} is not inside <|vision_start|>...<|vision_end|>")
            out_ids.pop()
            source.pop()
            types.pop()
            snippet = "<|vision_start|>" + ("<|image_pad|>" if tok == self.image_token_id else "<|video_pad|>") + \
                "<|vision_end|>"
            kwargs: dict[str, Any] = dict(self._image_kwargs)
            try:
                if tok == self.image_token_id:
                    kwargs["images"] = [next(images)]
                else:
                    frames, meta = next(videos)
                    kwargs.update(videos=[frames], do_sample_frames=False,
                                  video_metadata=[_hf_video_metadata(frames, meta)])
            except StopIteration:
                raise PromptRejected("the prompt has more vision pads than multi_modal_data has media") from None
            enc = self.hf(text=[snippet], return_tensors="pt", **kwargs)
            out_ids += enc["input_ids"][0].tolist()
            source += [i] * (len(out_ids) - len(source))
            types += enc["mm_token_type_ids"][0].tolist()
            for k in MM_KEYS:
                if k in enc:
                    parts.setdefault(k, []).append(torch.as_tensor(enc[k]))
            i += 2  # the pad and its <|vision_end|>
        if next(images, None) is not None or next(videos, None) is not None:
            raise PromptRejected("multi_modal_data has more media than the prompt has vision pads")
        mm_inputs = {k: torch.cat(v) for k, v in parts.items()}
        positions_3P = self._rope_index(torch.tensor([out_ids]), torch.tensor([types]), **mm_inputs)
        return ProcessedPrompt(key="", vllm_input=vllm_input, prompt_ids=out_ids, positions_AP=positions_3P,
                               next_position=int(positions_3P.max()) + 1, mm_inputs=mm_inputs), source

    def video_frames(self, mm_inputs: dict[str, Any], index: int = 0) -> torch.Tensor:
        """What the vision tower gets of video `index` of `mm_inputs`, as frames: (T, C, H, W) in
        0..255, the processor's patchify and normalisation undone (for checks that the model sees
        the frames in order, e.g. tests/test_video_probe.py)."""
        vp = self.hf.video_processor
        tp, p, m = vp.temporal_patch_size, vp.patch_size, vp.merge_size
        grids = mm_inputs["video_grid_thw"]
        start = int(sum(int(g.prod()) for g in grids[:index]))
        gt, gh, gw = (int(x) for x in grids[index])
        pixels = mm_inputs["pixel_values_videos"][start:start + gt * gh * gw]
        c = pixels.shape[1] // (tp * p * p)
        # patches are ordered (t, h/m, w/m, m, m), features (C, tp, p, p)
        x = pixels.reshape(gt, gh // m, gw // m, m, m, c, tp, p, p).permute(0, 6, 5, 1, 3, 7, 2, 4, 8)
        frames = x.reshape(gt * tp, c, gh * p, gw * p)
        mean = torch.tensor(vp.image_mean, dtype=frames.dtype).view(1, -1, 1, 1)
        std = torch.tensor(vp.image_std, dtype=frames.dtype).view(1, -1, 1, 1)
        return (frames * std + mean) * 255.0

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
