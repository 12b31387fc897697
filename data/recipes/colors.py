"""The synthetic colour task: "What colour is the shape?" on a small noisy image.

A filled square or circle of one of six colours on a grey background. It is small enough for a
tiny random VLM to learn by RL alone on a laptop CPU, and it has an image-aware answer that a
reward can check (`COLOURS` is the palette; an image-aware reward imports it).

    mmrl data build colors --out DIR        # -> DIR/train-000000.tar ..., DIR/heldout-000000.tar

Each sample is `KEY.json` ({"prompt", "answer", "metadata": {"split", "shape", "frac", "index"}})
plus `KEY.png` (or `KEY.jpg`). Everything is a pure function of (seed, split, index), so a build
is byte-for-byte reproducible, and train and held-out draw from disjoint seed streams.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from mmrl.plugins.data.recipes._common import (COLOURS, build_splits, encode_image, finish, jittered,
                                       normalise_image_format, paint)
from mmrl.plugins.data.recipes._common import background as _background
from mmrl.registry import register

__all__ = ["COLOURS", "PROMPT", "SHAPES", "build", "render"]

PROMPT = "What colour is the shape? Answer with one word."
SHAPES = ("square", "circle")

# The palette (COLOURS) and the jitter live in _common: every synthetic recipe shares them.
# Per-image colour jitter is N(0, 15) per channel, truncated at +-2 sigma. Untruncated, about 0.3 %
# of yellow/orange shapes would sit nearer the other palette entry (they are only 82 apart);
# truncated at 30, no jittered colour can cross a midpoint, so every label stays unambiguous.


def _draw(colour: str, rng: np.random.Generator, size: int, min_frac: float) -> tuple[np.ndarray, dict]:
    """Pixels (size, size, 3) uint8 and what was drawn."""
    if colour not in COLOURS:
        raise ValueError(f"unknown colour {colour!r}; colours are: {', '.join(COLOURS)}")
    if not 0.0 < min_frac <= 1.0:
        raise ValueError(f"min_frac must be in (0, 1], got {min_frac}")
    if size < 4:
        raise ValueError(f"size must be at least 4 pixels, got {size}")
    # The order of the draws from `rng` is part of the output: keep it.
    img = _background(rng, size)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    side = int(round(rng.uniform(min_frac, 1.0) * size))
    side = max(1, min(size, side))
    x0 = int(rng.integers(0, size - side + 1))
    y0 = int(rng.integers(0, size - side + 1))
    paint(img, shape, x0, y0, side, jittered(colour, rng))
    return finish(img, rng), {"shape": shape, "frac": round(side / size, 4), "box": [x0, y0, side, side]}


def render(colour: str, rng: np.random.Generator, size: int = 56, min_frac: float = 0.8) -> Image.Image:
    """One RGB image: grey background, a filled square or circle of `colour`, pixel noise.

    The shape's side is between `min_frac` and 1.0 of `size`, placed fully inside the image.
    """
    return Image.fromarray(_draw(colour, rng, size, min_frac)[0], "RGB")


@register("dataset", "colors")
def build(out_dir: str, *, train_size: int = 4096, heldout_size: int = 128, image_size: int = 56,
          min_frac: float = 0.8, shard_size: int = 1024, seed: int = 0,
          image_format: str = "png") -> dict[str, Any]:
    """Synthetic colour task: a noisy square/circle of one of 6 colours; answer the colour word.

    The shape covers at least min_frac (default 0.8) of the side, so every merged vision token
    of a 56x56 image sees mostly shape: the default demo then learns from scratch within a few
    minutes on 2 CPU cores. Lower min_frac for a harder task."""
    fmt = normalise_image_format(image_format)
    ext = fmt

    def make(colour: str, rng: np.random.Generator, split: str, i: int) -> dict[str, Any]:
        pixels, info = _draw(colour, rng, image_size, min_frac)
        meta = {"split": split, "shape": info["shape"], "frac": info["frac"], "index": i}
        return {"json": {"prompt": PROMPT, "answer": colour, "metadata": meta},
                ext: encode_image(pixels, fmt)}

    return build_splits(
        out_dir, recipe="colors",
        args={"train_size": train_size, "heldout_size": heldout_size, "image_size": image_size,
              "min_frac": min_frac, "shard_size": shard_size, "seed": seed, "image_format": fmt},
        labels=list(COLOURS), salt=0xC0102, make=make, train_size=train_size,
        heldout_size=heldout_size, shard_size=shard_size, seed=seed,
        extra={"prompt": PROMPT, "answers": list(COLOURS)})
