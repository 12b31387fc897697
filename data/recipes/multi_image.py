"""The synthetic multi-image task: are the shapes in two images the same colour?

Two images, each with one shape (square, circle or triangle, chosen independently) on a noisy
grey background. The answer is "yes" when both shapes have the same palette colour (each image
has its own jitter, so the pixels differ) and "no" otherwise; yes/no is balanced.

    mmrl data build multi_image --out DIR [image_size=56 ...]

Each sample is `KEY.json` ({"prompt", "answer", "images": ["0.png", "1.png"], "metadata":
{"split", "index", "colours", "shapes"}}) plus the members `KEY.0.png` and `KEY.1.png`; the
stream gives them as `Sample.images` in that order, after two image placeholders in the prompt.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from mmrl.plugins.data.recipes._common import (COLOURS, SHAPES, background, build_splits, encode_image,
                                       finish, jittered, normalise_image_format, paint)
from mmrl.registry import register

PROMPT = "Is the shape in the first image the same colour as in the second? Answer yes or no."
ANSWERS = ("yes", "no")


def draw_one(colour: str, rng: np.random.Generator, size: int = 56, min_frac: float = 0.4,
             max_frac: float = 0.8) -> tuple[np.ndarray, str]:
    img = background(rng, size)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    side = max(3, min(size, int(round(rng.uniform(min_frac, max_frac) * size))))
    x0 = int(rng.integers(0, size - side + 1))
    y0 = int(rng.integers(0, size - side + 1))
    paint(img, shape, x0, y0, side, jittered(colour, rng))
    return finish(img, rng), shape


def draw_pair(same: bool, rng: np.random.Generator, size: int = 56) -> tuple[list[np.ndarray], dict]:
    names = list(COLOURS)
    first = int(rng.integers(len(names)))
    second = first if same else (first + 1 + int(rng.integers(len(names) - 1))) % len(names)
    colours = [names[first], names[second]]
    images, shapes = [], []
    for colour in colours:
        pixels, shape = draw_one(colour, rng, size)
        images.append(pixels)
        shapes.append(shape)
    return images, {"colours": colours, "shapes": shapes}


@register("dataset", "multi_image")
def build(out_dir: str, *, train_size: int = 4096, heldout_size: int = 128, image_size: int = 56,
          shard_size: int = 1024, seed: int = 0, image_format: str = "png") -> dict[str, Any]:
    """Synthetic two-image task: is the shape in image 1 the same colour as in image 2? yes/no."""
    fmt = normalise_image_format(image_format)
    if image_size < 8:
        raise ValueError(f"image_size must be at least 8 pixels, got {image_size}")
    members = [f"0.{fmt}", f"1.{fmt}"]

    def make(answer: str, rng: np.random.Generator, split: str, i: int) -> dict[str, Any]:
        images, info = draw_pair(answer == "yes", rng, image_size)
        record = {"prompt": PROMPT, "answer": answer, "images": members,
                  "metadata": {"split": split, "index": i, **info}}
        return {"json": record, **{m: encode_image(px, fmt) for m, px in zip(members, images)}}

    return build_splits(
        out_dir, recipe="multi_image",
        args={"train_size": train_size, "heldout_size": heldout_size, "image_size": image_size,
              "shard_size": shard_size, "seed": seed, "image_format": fmt},
        labels=list(ANSWERS), salt=0x3172, make=make, train_size=train_size,
        heldout_size=heldout_size, shard_size=shard_size, seed=seed,
        extra={"modality": "multi_image", "images_per_sample": 2, "prompt": PROMPT,
               "answers": list(ANSWERS)})
