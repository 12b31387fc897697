"""The synthetic grounding task: "Where is the triangle?" among distractor shapes.

One target shape (square, circle or triangle: balanced) and 1-3 distractors of the other kinds,
each in a random palette colour, at least two pixels apart, on a noisy grey background. The answer
is the target's box `[x1, y1, x2, y2]` in absolute pixels (x2/y2 exclusive: x2 = x1 + width), the
input of an IoU reward; `metadata.box_rel` holds the same box divided by the image size.

    mmrl data build grounding --out DIR [image_size=84 max_distractors=3 layout=free|grid grid_cells=3 ...]

`layout=grid` puts every shape inside its own cell of a `grid_cells` x `grid_cells` grid, and the
answer is the target's cell (its pixel box), which a model names in grid units with one digit a
coordinate (`[1, 0, 2, 1]`: column 1, row 0; grounding_iou's coords="grid"). With 84 pixels and 3
cells a cell is one merged 28-pixel patch of Qwen2/2.5-VL. `metadata.shape_box` keeps the shape's
own box and `metadata.cell` its [column, row]. The free layout's box needs 13-16 digit-split
tokens of exact syntax from the tiny tokenizer, which a random policy never writes.

Each sample is `KEY.json` ({"prompt", "answer", "metadata": {"split", "index", "target",
"colour", "box_rel", "image_size": [W, H], "distractors": [{"shape", "colour", "box"}]}}) plus
`KEY.png`. The default 84-pixel side is a multiple of 28, so a Qwen-VL processor does not resize
the image and the absolute coordinates stay valid for the model.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from mmrl.plugins.data.recipes._common import (COLOURS, SHAPES, background, build_splits, encode_image,
                                       finish, grid_corners, jittered, normalise_image_format,
                                       paint, place_squares)
from mmrl.registry import register

PROMPT_TEMPLATE = "Where is the {shape}? Answer with its box [x1, y1, x2, y2]."
GRID_PROMPT_TEMPLATE = "Where is the {shape}? Answer with its cell [x1, y1, x2, y2] in grid units."


def prompt_for(shape: str, layout: str = "free") -> str:
    return (GRID_PROMPT_TEMPLATE if layout == "grid" else PROMPT_TEMPLATE).format(shape=shape)


def draw(target: str, rng: np.random.Generator, size: int = 84, min_distractors: int = 1,
         max_distractors: int = 3, min_frac: float = 0.15,
         max_frac: float = 0.25, layout: str = "free", grid_cells: int = 3) -> tuple[np.ndarray, dict[str, Any]]:
    """uint8 (size, size, 3) with one `target` shape and distractors of the other kinds. With
    layout="grid", info["box"] is the target's cell (see the module docstring)."""
    if target not in SHAPES:
        raise ValueError(f"unknown shape {target!r}; shapes are: {', '.join(SHAPES)}")
    img = background(rng, size)
    others = [s for s in SHAPES if s != target]
    n_distractors = int(rng.integers(min_distractors, max_distractors + 1))
    kinds = [target] + [others[int(rng.integers(len(others)))] for _ in range(n_distractors)]
    names = list(COLOURS)
    colours = [names[int(rng.integers(len(names)))] for _ in kinds]
    lo, hi = max(3, int(round(min_frac * size))), max(3, int(round(max_frac * size)))
    corners = None
    if layout == "grid":
        corners, sides = grid_corners(rng, size, len(kinds), grid_cells)
    while corners is None:
        sides = [int(rng.integers(lo, hi + 1)) for _ in kinds]
        corners = place_squares(rng, size, sides)
        if corners is None:
            if hi <= 3:
                raise ValueError(f"cannot place {len(kinds)} separate shapes in a {size}-pixel image")
            lo, hi = max(3, int(lo * 0.8)), max(3, int(hi * 0.8))
    drawn = []
    for kind, colour, (x0, y0), side in zip(kinds, colours, corners, sides):
        paint(img, kind, x0, y0, side, jittered(colour, rng))
        drawn.append({"shape": kind, "colour": colour, "box": [x0, y0, x0 + side, y0 + side]})
    box = drawn[0]["box"]
    info = {"target": target, "colour": drawn[0]["colour"]}
    if layout == "grid":
        cell = size // grid_cells
        col, row = box[0] // cell, box[1] // cell
        info.update(shape_box=box, cell=[col, row], grid_cells=grid_cells)
        box = [col * cell, row * cell, (col + 1) * cell, (row + 1) * cell]
    info.update(box=box, box_rel=[round(v / size, 4) for v in box], image_size=[size, size],
                distractors=drawn[1:])
    return finish(img, rng), info


@register("dataset", "grounding")
def build(out_dir: str, *, train_size: int = 4096, heldout_size: int = 128, image_size: int = 84,
          min_distractors: int = 1, max_distractors: int = 3, shard_size: int = 1024, seed: int = 0,
          image_format: str = "png", layout: str = "free", grid_cells: int = 3) -> dict[str, Any]:
    """Synthetic grounding task: find the named shape among distractors; answer its pixel box."""
    fmt = normalise_image_format(image_format)
    if not 0 <= min_distractors <= max_distractors <= 6:
        raise ValueError(f"need 0 <= min_distractors <= max_distractors <= 6, "
                         f"got {min_distractors}..{max_distractors}")
    if image_size < 28:
        raise ValueError(f"image_size must be at least 28 pixels, got {image_size}")
    if layout not in ("free", "grid"):
        raise ValueError(f"layout must be 'free' or 'grid', got {layout!r}")
    if layout == "grid" and (max_distractors + 1 > grid_cells * grid_cells or image_size // grid_cells < 8
                             or not 1 <= grid_cells <= 9):
        raise ValueError(f"layout=grid needs max_distractors + 1 <= grid_cells**2, grid_cells <= 9 (one-digit "
                         f"coordinates) and cells of >= 8 pixels; got max_distractors={max_distractors}, "
                         f"grid_cells={grid_cells}, image_size={image_size}")

    def make(target: str, rng: np.random.Generator, split: str, i: int) -> dict[str, Any]:
        pixels, info = draw(target, rng, image_size, min_distractors, max_distractors, layout=layout,
                            grid_cells=grid_cells)
        box = info.pop("box")
        meta = {"split": split, "index": i, **info}
        return {"json": {"prompt": prompt_for(target, layout), "answer": box, "metadata": meta},
                fmt: encode_image(pixels, fmt)}

    return build_splits(
        out_dir, recipe="grounding",
        args={"train_size": train_size, "heldout_size": heldout_size, "image_size": image_size,
              "min_distractors": min_distractors, "max_distractors": max_distractors,
              "shard_size": shard_size, "seed": seed, "image_format": fmt, "layout": layout,
              "grid_cells": grid_cells},
        labels=list(SHAPES), salt=0x6B0C, make=make, train_size=train_size,
        heldout_size=heldout_size, shard_size=shard_size, seed=seed,
        extra={"modality": "image", "prompt": GRID_PROMPT_TEMPLATE if layout == "grid" else PROMPT_TEMPLATE,
               "targets": list(SHAPES),
               "box_format": "[x1, y1, x2, y2] absolute pixels, x2/y2 exclusive" + (
                   f"; the target's cell of a {grid_cells}x{grid_cells} grid" if layout == "grid" else "")})
