"""CLIP-score: how well the response describes the sample's image(s), per a CLIP/SigLIP model.

A batched reward: one call embeds a whole group's responses in one text forward and the
sample's images once. Any Hugging Face image-text dual encoder that `AutoModel` loads with
`get_text_features`/`get_image_features` works (CLIP, SigLIP, their fine-tunes):

    rewards:
      - {name: clip_score, weight: 1.0, args: {model: openai/clip-vit-base-patch32,
                                               template: "a photo of {response}", normalise: clipscore, scale: 2.5}}

The model is loaded once per process (the reward workers load it at start, via the setup hook).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Sequence

from mmrl.plugins.rewards._text import answer_span, head
from mmrl.rewards.variants import reward

__all__ = ["clip_score", "load_clip", "NORMALISATIONS"]

# cosine -> score (before `scale`): Hessel et al.'s CLIPScore clips at 0; SigLIP models are
# trained with a sigmoid over logit_scale * cos + logit_bias (a match probability).
NORMALISATIONS = ("clipscore", "cosine", "unit", "sigmoid")
_MAX_CHARS = 1000  # CLIP reads 77 tokens (SigLIP 64): more text is cut by the tokenizer anyway


def _resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@functools.lru_cache(maxsize=4)
def load_clip(model: str, device: str = "cpu", dtype: str = "float32") -> tuple[Any, Any]:
    """(model, processor) for `model` (a local folder or a hub id), cached per process."""
    import torch
    from transformers import AutoModel, AutoProcessor

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"clip_score: dtype must be a torch dtype name such as float32, got {dtype!r}")
    net = AutoModel.from_pretrained(model, dtype=torch_dtype).to(_resolve_device(device)).eval()
    for fn in ("get_text_features", "get_image_features"):
        if not hasattr(net, fn):
            raise ValueError(f"clip_score: {model} loads as {type(net).__name__}, which has no {fn}; "
                             f"give a CLIP or SigLIP model")
    return net, AutoProcessor.from_pretrained(model)


def _setup(model: str, device: str = "cpu", dtype: str = "float32") -> None:
    load_clip(model, device, dtype)


def _features(output: Any) -> Any:
    """transformers 5 returns a model output with the projected `pooler_output`; 4.x a tensor."""
    return output if hasattr(output, "norm") else output.pooler_output


def _text_inputs(processor: Any, net: Any, texts: list[str]) -> dict[str, Any]:
    tokenizer = getattr(processor, "tokenizer", processor)
    max_length = getattr(getattr(net.config, "text_config", net.config), "max_position_embeddings", 77)
    # SigLIP was trained on text padded to max_length; CLIP on text padded per batch
    siglip = "siglip" in str(getattr(net.config, "model_type", ""))
    return dict(tokenizer(texts, padding="max_length" if siglip else True, truncation=True,
                          max_length=max_length, return_tensors="pt"))


def _similarities(net: Any, processor: Any, texts: list[str], images: list[Any]) -> Any:
    """cos(text_i, image_k) as a (len(texts), len(images)) tensor."""
    import torch

    device = next(net.parameters()).device
    with torch.inference_mode():
        text_in = {k: v.to(device) for k, v in _text_inputs(processor, net, texts).items()}
        text = _features(net.get_text_features(**text_in)).float()
        pixels = processor(images=[im.convert("RGB") for im in images], return_tensors="pt")["pixel_values"]
        image = _features(net.get_image_features(pixel_values=pixels.to(device, net.dtype))).float()
    text = text / text.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    image = image / image.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return text @ image.T


def _normalised(cos: float, how: str, net: Any) -> float:
    if how == "clipscore":
        return max(cos, 0.0)
    if how == "cosine":
        return cos
    if how == "unit":
        return (cos + 1.0) / 2.0
    logit_scale = float(net.logit_scale.detach().exp()) if hasattr(net, "logit_scale") else 1.0
    bias = float(net.logit_bias.detach()) if getattr(net, "logit_bias", None) is not None else 0.0
    z = logit_scale * cos + bias
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


@reward("clip_score", batched=True, setup=_setup)
def clip_score(response: Sequence[str], images: Sequence[Sequence[Any]], *, model: str,
               template: str = "{response}", normalise: str = "clipscore", scale: float = 1.0,
               device: str = "cpu", dtype: str = "float32", reduce: str = "mean") -> list[dict[str, float]]:
    """CLIP/SigLIP image-text similarity of the response (batched): scale x normalise(cosine).

    The text is `template` with the response's answer span; `cosine` is the raw similarity,
    averaged (or maxed, per `reduce`) over the sample's images."""
    if normalise not in NORMALISATIONS:
        raise ValueError(f"clip_score: normalise must be one of {', '.join(NORMALISATIONS)}, got {normalise!r}")
    if reduce not in ("mean", "max"):
        raise ValueError(f"clip_score: reduce must be 'mean' or 'max', got {reduce!r}")
    if "{response}" not in template:
        raise ValueError(f"clip_score: template must contain '{{response}}', got {template!r}")
    net, processor = load_clip(model, device, dtype)
    # The responses of a group share the sample's images: embed each distinct image once.
    distinct: dict[int, Any] = {}
    for imgs in images:
        if not imgs:
            raise ValueError("clip_score needs the sample's image(s), but a sample has none")
        for im in imgs:
            distinct.setdefault(id(im), im)
    column = {key: k for k, key in enumerate(distinct)}
    texts = [template.replace("{response}", head(answer_span(r), _MAX_CHARS).strip()) for r in response]
    sims = _similarities(net, processor, texts, list(distinct.values()))
    out = []
    for i, imgs in enumerate(images):
        row = [float(sims[i, column[id(im)]]) for im in imgs]
        cos = sum(row) / len(row) if reduce == "mean" else max(row)
        out.append({"score": scale * _normalised(cos, normalise, net), "cosine": cos})
    return out
