"""The zoom task: "What colour is the small shape?" where only a zoomed view shows the colour well.

A large grey image is divided into a grid x grid grid (2 x 2). ONE cell has a dark frame and
holds a small glyph (a filled square or circle) of one of the six `COLOURS`; each other cell
holds a grey distractor shape (3 in 4) or nothing. The frame is plain in the downscaled full
view, so a policy can learn WHERE to zoom from it; the colour is meant to be read from the
zoomed cell (`image_zoom` with `grid: 2`, see configs/zoom_read.yaml).

    mmrl data build zoom_read --out DIR     # -> DIR/train-000000.tar ..., DIR/heldout-000000.tar

Why zooming pays, with the defaults (448-px image) and the tiny model's pixel budget (56² to
224² pixels, configs/zoom_read.yaml keeps it): the processor shows the full image at 224 x 224
(half size) but a zoomed 224-px cell at its native size, and the vision tower cuts both into
14-px patches. The glyph (13-14 px) is drawn inside ONE patch-sized slot of its cell, so in the
zoomed view it fills about 70-100 % of one patch and that patch's mean colour is the glyph's;
in the full view it is 6-7 px, 17-25 % of a patch, and the patch's mean is nearer the
background than the glyph's colour.
tests/test_data_zoom_read.py measures this through the real processor.

The limit of the design: a 2 x 2 grid doubles the resolution and no more, so the full view
still holds the glyph as a 6-7 px dot whose centre pixels have its colour; a model that learns
sub-patch detail could read it without zooming. Hiding the colour at the pixel level too (the
glyph under half a full-view pixel) while the zoomed view still shows it (a few pixels) takes a
gain of 8x or more: a finer grid over a larger image, or nested zooms.

Each sample is `KEY.json` ({"prompt", "answer", "metadata": {"split", "index", "colour", "cell",
"shape", "box", "distractors"}}; box is [x1, y1, x2, y2] of the glyph in pixels, x2/y2
exclusive; distractors are the cells holding one) plus `KEY.png`. A pure function of (seed,
split, index), like every recipe (`_common.build_splits`).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from mmrl.data.recipes._common import (COLOURS, background, build_splits, encode_image, finish, jittered,
                                       normalise_image_format, paint)
from mmrl.registry import register

__all__ = ["PROMPT", "SHAPES", "build", "draw"]

PROMPT = "What colour is the small shape in the framed cell? Zoom in, then answer with one word."
SHAPES = ("square", "circle")
FRAME_GREY = 40.0  # dark against the ~128 background, so the frame stands out in the full view
DISTRACTOR_P = 0.75  # chance that a cell without the glyph holds a grey distractor


def draw(colour: str, rng: np.random.Generator, size: int = 448, grid: int = 2, slot: int = 14,
         glyph_min: int = 13, glyph_max: int = 14, frame: int = 12,
         noise_std: float = 0.0) -> tuple[np.ndarray, dict[str, Any]]:
    """uint8 (size, size, 3) and what was drawn (see the module docstring).

    Glyphs go in a `slot`-pixel square aligned to the cell's slot grid, never in the outer two
    rings of slots: with the default budget a slot is one vision patch of the zoomed cell and
    two rings are one patch of the full view, so the frame never shares a patch with a glyph
    (a dark frame mixed into the glyph's patch pulls it towards the dark palette colours)."""
    if colour not in COLOURS:
        raise ValueError(f"unknown colour {colour!r}; colours are: {', '.join(COLOURS)}")
    cell_px = size // grid if grid >= 1 else 0
    if cell_px < 1 or size % grid or cell_px % slot or cell_px // slot < 5:
        raise ValueError(f"size {size} must split into {grid} x {grid} cells of at least 5 slots of {slot} px")
    if not 1 <= glyph_min <= glyph_max <= slot:
        raise ValueError(f"need 1 <= glyph_min <= glyph_max <= slot ({slot}), got {glyph_min}..{glyph_max}")
    if not 0 < frame < slot:
        raise ValueError(f"frame must be between 1 and slot - 1 ({slot - 1}) pixels, got {frame}")
    # The order of the draws from `rng` is part of the output: keep it.
    img = background(rng, size)
    bg = img[0, 0].copy()
    cell = int(rng.integers(grid * grid))

    def place(c: int) -> tuple[str, int, int, int]:
        """A shape, side and top-left corner inside a random inner slot of cell `c`."""
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        side = int(rng.integers(glyph_min, glyph_max + 1))
        sx, sy = (int(v) for v in rng.integers(2, cell_px // slot - 2, 2))
        ox, oy = (int(v) for v in rng.integers(0, slot - side + 1, 2))
        row, col = divmod(c, grid)
        return shape, side, col * cell_px + sx * slot + ox, row * cell_px + sy * slot + oy

    row, col = divmod(cell, grid)
    y0, x0 = row * cell_px, col * cell_px
    dark = FRAME_GREY + rng.normal(0.0, 5.0)
    img[y0:y0 + cell_px, x0:x0 + cell_px] = dark
    img[y0 + frame:y0 + cell_px - frame, x0 + frame:x0 + cell_px - frame] = bg
    shape, side, gx, gy = place(cell)
    paint(img, shape, gx, gy, side, jittered(colour, rng))
    distractors = []
    for c in range(grid * grid):
        if c == cell or rng.random() >= DISTRACTOR_P:
            continue
        d_shape, d_side, dx, dy = place(c)
        level = float(bg.mean()) + rng.choice((-1.0, 1.0)) * rng.uniform(35.0, 70.0)
        paint(img, d_shape, dx, dy, d_side, np.full(3, np.clip(level, 0.0, 255.0), np.float32))
        distractors.append(c)
    info = {"cell": cell, "shape": shape, "box": [gx, gy, gx + side, gy + side], "distractors": distractors}
    return finish(img, rng, noise_std), info


@register("dataset", "zoom_read")
def build(out_dir: str, *, train_size: int = 4096, heldout_size: int = 128, image_size: int = 448,
          grid: int = 2, glyph_min: int = 13, glyph_max: int = 14, noise_std: float = 0.0,
          shard_size: int = 1024, seed: int = 0, image_format: str = "png") -> dict[str, Any]:
    """The zoom task: name the colour of a small glyph in the framed cell of a grid x grid image;
    the answer is the colour word. Meant for `image_zoom` in grid mode (configs/zoom_read.yaml).
    The defaults fit the tiny model's pixel budget (see the module docstring). No pixel noise by
    default: averaged over a vision patch it changes nothing the views show, but it makes a
    448-px PNG incompressible (about 5 kB without noise, 390 kB at noise_std 4)."""
    fmt = normalise_image_format(image_format)

    def make(colour: str, rng: np.random.Generator, split: str, i: int) -> dict[str, Any]:
        pixels, info = draw(colour, rng, image_size, grid, glyph_min=glyph_min, glyph_max=glyph_max,
                            noise_std=noise_std)
        meta = {"split": split, "index": i, "colour": colour, **info}
        return {"json": {"prompt": PROMPT, "answer": colour, "metadata": meta}, fmt: encode_image(pixels, fmt)}

    return build_splits(
        out_dir, recipe="zoom_read",
        args={"train_size": train_size, "heldout_size": heldout_size, "image_size": image_size, "grid": grid,
              "glyph_min": glyph_min, "glyph_max": glyph_max, "noise_std": noise_std,
              "shard_size": shard_size, "seed": seed, "image_format": fmt},
        labels=list(COLOURS), salt=0x200F, make=make, train_size=train_size,
        heldout_size=heldout_size, shard_size=shard_size, seed=seed,
        extra={"prompt": PROMPT, "answers": list(COLOURS)})
