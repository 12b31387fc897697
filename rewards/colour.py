"""An image-aware reward: is the first word of the response the colour of the shape in the image?

The ground truth is read from the pixels, not from the sample's answer, which is the point: it
shows a reward receiving the image (`images`) and checks the data path end to end. The images
come from the `colors` dataset recipe: a grey background (~128) with one filled coloured shape
plus noise.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from mmrl.registry import register
from mmrl.plugins.rewards.answer import first_word

__all__ = ["shape_colour", "detect_colour", "palette"]

# Pixels this saturated are shape, not (noisy) grey background: grey 128 with per-channel noise
# of σ≈20 rarely exceeds 0.4; every palette colour is above 0.75.
_SAT_THRESHOLD = 0.5
_MIN_FRACTION = 0.002  # fewer shape pixels than this: fall back to the most saturated 2%


def palette() -> Mapping[str, tuple[int, int, int]]:
    """The palette of the `colors` recipe (imported lazily: rewards must not pull in recipes)."""
    from mmrl.plugins.data.recipes.colors import COLOURS
    return COLOURS


def detect_colour(image: Any, colours: Mapping[str, tuple[int, int, int]] | None = None) -> str:
    """Name of the palette colour nearest to the mean RGB of the image's saturated pixels."""
    colours = palette() if colours is None else colours
    if hasattr(image, "convert"):
        image = image.convert("RGB")
    rgb = np.asarray(image, dtype=np.float32)
    if rgb.ndim == 2:
        rgb = np.repeat(rgb[..., None], 3, axis=-1)
    rgb = rgb[..., :3].reshape(-1, 3)
    if rgb.size == 0:
        raise ValueError("shape_colour: the image is empty")
    mx = rgb.max(axis=1)
    sat = (mx - rgb.min(axis=1)) / np.maximum(mx, 1.0)
    shape = sat > _SAT_THRESHOLD
    if shape.sum() < max(1, int(_MIN_FRACTION * len(sat))):
        k = max(1, len(sat) // 50)
        shape = np.argpartition(sat, -k)[-k:]
    mean = rgb[shape].mean(axis=0)
    names = list(colours)
    ref = np.asarray([colours[n] for n in names], dtype=np.float32)
    return names[int(np.argmin(((ref - mean) ** 2).sum(axis=1)))]


@register("reward", "shape_colour")
def shape_colour(response: str, images: Any, **_: Any) -> dict[str, float]:
    """score 1.0 if the response's first word is the shape's colour (read from the image);
    format 1.0 if the first word is any palette colour."""
    if images is None or (isinstance(images, (list, tuple)) and not images):
        raise ValueError("shape_colour needs the sample's image, but the sample has none")
    image = images[0] if isinstance(images, (list, tuple)) else images
    colours = palette()
    word = first_word(response)
    truth = detect_colour(image, colours)
    return {"score": 1.0 if word == truth else 0.0, "format": 1.0 if word in colours else 0.0}
