"""InternVL adapter (model_type "internvl": transformers' native format, e.g. the InternVL3 "-hf"
checkpoints; the older remote-code InternVLChatModel is another format).

Built like LLaVA -- a vision tower, a projector, a decoder with plain 1-D positions -- with two
differences this adapter inherits nothing wrong from: each image is cut into up to
`max_patches` tiles at the tower's resolution (plus a thumbnail when there are several), each
tile pixel-shuffled to `image_seq_length` tokens, all between `<img>` and `</img>`; and the
weights need no renaming between transformers and vLLM. The template writes one
`<IMG_CONTEXT>` per image; the HF processor and vLLM expand it the same way from the same
preprocessor config. Images only here (no video).
"""
from __future__ import annotations

from mmrl.plugins.processors.llava import LlavaProcessor
from mmrl.processors.base import ProcessorAdapter
from mmrl.registry import register


@register("processor", "internvl")
class InternVLProcessor(LlavaProcessor):
    """Adapter for InternVL: tiled images between <img> and </img>, 1-D positions."""

    model_types = ("internvl",)
    family = "InternVL"
    # transformers and vLLM name InternVL's weights alike: LLaVA's CLIP rename does not apply
    engine_weight_name = staticmethod(ProcessorAdapter.engine_weight_name)
    finish_saved_model = staticmethod(ProcessorAdapter.finish_saved_model)

    def __init__(self, model_path: str, **kwargs):
        super().__init__(model_path, **kwargs)
        tok = self.tokenizer
        # the image frame and the video placeholder are the processor's to write, never the policy's
        frame = [tok.convert_tokens_to_ids(t) for t in (self.hf.start_image_token, self.hf.end_image_token,
                                                         getattr(tok, "video_token", None)) if t]
        self.forbidden_token_ids = sorted({self.image_token_id, *frame})
