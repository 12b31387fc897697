"""The zoom task: "What colour is the small square in the framed cell?", answerable only after
zooming into that cell.

A grey image is divided into a grid x grid grid (2 x 2), each cell faintly tinted with a hue of
its own (the same for a cell index in every image). ONE cell has a dark frame and holds a glyph:
a square of one of the six `COLOURS`, drawn as a one-pixel checkerboard of the colour and its
complement (255 - each channel). Each other cell holds a grey checkerboard distractor (3 in 4) or
nothing. The frame is plain in the downscaled full view, so a policy can learn WHERE to zoom from
it; the colour can only be read from the zoomed cell (`image_zoom` with `grid: 2`).

Why the tints: which cell is framed must show in what the vision tokens hold, not only in where
they are. A framed cell's tokens look alike whichever cell it is (a dark corner of a frame), and
a rotary-position model carries positions in its attention weights, not in the values it reads,
so telling cell 1 from cell 2 is a hard positional problem for a tiny random model (with plain
grey cells its zooms stayed on the right cell at chance, 0.2-0.25, for 90 steps). With a tint
per cell "the framed cell" is "the frame around the green-grey cell": content, like the colours
demo's answer. The tints are zero-mean over the three channels and do not touch the glyph.

    mmrl data build zoom_read --out DIR     # -> DIR/train-000000.tar ..., DIR/heldout-000000.tar

Why the colour is gone from the full view, with the defaults (224-px image) and the pixel budget
of configs/zoom_read.yaml (`processor.max_pixels: 12544`, 112 x 112): the processor shows the
full image at half size, and downscaling averages each 2 x 2 block of the checkerboard to
(C + 255 - C) / 2 = 127.5 in every channel, whatever the colour C: the glyph becomes a grey
square like every distractor, not a faint tint a model could learn to read. A zoomed 112-px cell
is shown at its native size, pixel for pixel: the checkerboard, and with it the colour, is there.
The glyph is a 56-px square on a 28-px grid: it fills the central 2 x 2 vision tokens of the
zoomed cell (a token is 2 x 2 merged 14-px patches, 28 px), clear of the frame's ring. Smaller
glyphs are read later or not at all by the tiny model: a 14-px one (one patch of four in its
token) was not read in 270 steps although the policy zoomed to the right cell 97% of the time; a
28-px one (`glyph=28`, one token, at one of four inner positions) reached held-out 0.50 at steps
280-330 (seed 0), and its answer turn alone did not reach 0.9 in 250 GRPO steps
(benchmarks/turn_probe.py), where the 56-px one does in 125. With 56 px: 0.906 held-out at step
390 (seed 0, configs/zoom_read.yaml, benchmarks/results/tool_tasks.json).

What the 56-px glyph costs: the processor's bicubic resize does not cancel the checkerboard where
it is cut, at the glyph's edges (a few grey levels), and with the glyph always at the same place
that residue is consistent enough that a linear read-out of the random vision tower's full-view
token recovers the colour about half the time (0.5-0.6 on 40 samples, chance 0.17; the 28-px
glyph at its four positions: 0.17). It is weak: the tools-disabled control (the config with
`tools=[]`) stayed at chance over the same 390 steps of RL (0.164-0.18, seed 0), so the task still
needs the zoom. `glyph=28` is the build with no read-out above chance, for a stricter control.
tests/test_data_zoom_read.py measures all this through the real processor.

Each sample is `KEY.json` ({"prompt", "answer", "metadata": {"split", "index", "colour", "cell",
"box", "distractors"}}; box is [x1, y1, x2, y2] of the glyph in pixels, x2/y2 exclusive;
distractors are the cells holding one) plus `KEY.png`. A pure function of (seed, split, index),
like every recipe (`_common.build_splits`).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from mmrl.plugins.data.recipes._common import (COLOURS, background, build_splits, encode_image, finish, jittered,
                                       normalise_image_format)
from mmrl.registry import register

__all__ = ["PROMPT", "build", "cell_tint", "checkerboard", "draw"]

PROMPT = "What colour is the small square in the framed cell? Zoom in, then answer with one word."
FRAME_GREY = 40.0  # dark against the ~128 background, so the frame stands out in the full view
DISTRACTOR_P = 0.75  # chance that a cell without the glyph holds a grey distractor
ALIGN = 28  # glyphs sit on the zoomed view's token grid (2 x 2 merged 14-px patches)
GLYPH = 56  # 2 x 2 tokens of the zoomed cell (28, one token, is read far slower; see the docstring)


def checkerboard(img: np.ndarray, x0: int, y0: int, side: int, colour: np.ndarray) -> None:
    """Paint a `side`-px square at (x0, y0) as a one-pixel checkerboard of `colour` and its
    complement, in the image's own parity (pixel (x, y) holds the colour when x + y is even), so
    any 2 x 2 block of it averages to 127.5 per channel."""
    c = np.clip(np.asarray(colour, np.float32), 0.0, 255.0)
    ys, xs = np.mgrid[y0:y0 + side, x0:x0 + side]
    img[y0:y0 + side, x0:x0 + side] = np.where(((xs + ys) % 2 == 0)[..., None], c, 255.0 - c)


def cell_tint(cell: int, cells: int, amplitude: float) -> np.ndarray:
    """The RGB offset of a cell: hue 360° x cell / cells, zero-mean over the channels."""
    hue = 2 * np.pi * cell / cells
    return amplitude * np.cos(hue - np.array([0.0, 2 * np.pi / 3, 4 * np.pi / 3]))


def draw(colour: str, rng: np.random.Generator, size: int = 224, grid: int = 2, glyph: int = GLYPH,
         frame: int = 12, tint: float = 25.0, noise_std: float = 0.0,
         align: int = ALIGN) -> tuple[np.ndarray, dict[str, Any]]:
    """uint8 (size, size, 3) and what was drawn (see the module docstring).

    Glyphs are `glyph`-pixel squares on a grid of `align` px inside their cell, never in its
    outer ring of `align` px (where the frame is): with `align` the zoomed view's token size (28
    px: 2 x 2 merged 14-px patches) a glyph fills whole vision tokens of the zoomed cell and never
    shares one with the frame."""
    if colour not in COLOURS:
        raise ValueError(f"unknown colour {colour!r}; colours are: {', '.join(COLOURS)}")
    cell_px = size // grid if grid >= 1 else 0
    if align < 2 or align % 2 or glyph < align or glyph % align:
        raise ValueError(f"glyph ({glyph} px) must be a multiple of align ({align} px, even: a checkerboard "
                         "averages out over 2 x 2 blocks)")
    if cell_px < 1 or size % grid or cell_px % align or cell_px // align - glyph // align < 2:
        raise ValueError(f"size {size} must split into {grid} x {grid} cells of a multiple of {align} px that "
                         f"hold a {glyph}-px glyph inside a ring of {align} px")
    if not 0 < frame < align:
        raise ValueError(f"frame must be between 1 and align - 1 ({align - 1}) pixels, got {frame}")
    # The order of the draws from `rng` is part of the output: keep it.
    img = background(rng, size)
    for c in range(grid * grid):
        r, k = divmod(c, grid)
        img[r * cell_px:(r + 1) * cell_px, k * cell_px:(k + 1) * cell_px] += cell_tint(c, grid * grid, tint)
    cell = int(rng.integers(grid * grid))

    def place(c: int) -> tuple[int, int]:
        """The top-left corner of a random inner glyph position of cell `c`."""
        sx, sy = (int(v) for v in rng.integers(1, cell_px // align - glyph // align, 2))
        row, col = divmod(c, grid)
        return col * cell_px + sx * align, row * cell_px + sy * align

    row, col = divmod(cell, grid)
    y0, x0 = row * cell_px, col * cell_px
    inside = img[y0 + frame:y0 + cell_px - frame, x0 + frame:x0 + cell_px - frame].copy()
    img[y0:y0 + cell_px, x0:x0 + cell_px] = FRAME_GREY + rng.normal(0.0, 5.0)
    img[y0 + frame:y0 + cell_px - frame, x0 + frame:x0 + cell_px - frame] = inside
    gx, gy = place(cell)
    checkerboard(img, gx, gy, glyph, jittered(colour, rng))
    distractors = []
    for c in range(grid * grid):
        if c == cell or rng.random() >= DISTRACTOR_P:
            continue
        dx, dy = place(c)
        level = 127.5 + rng.choice((-1.0, 1.0)) * rng.uniform(35.0, 70.0)
        checkerboard(img, dx, dy, glyph, np.full(3, level, np.float32))
        distractors.append(c)
    info = {"cell": cell, "box": [gx, gy, gx + glyph, gy + glyph], "distractors": distractors}
    return finish(img, rng, noise_std), info


@register("dataset", "zoom_read")
def build(out_dir: str, *, train_size: int = 4096, heldout_size: int = 128, image_size: int = 224,
          grid: int = 2, glyph: int = GLYPH, tint: float = 25.0, noise_std: float = 0.0, shard_size: int = 1024,
          seed: int = 0, image_format: str = "png") -> dict[str, Any]:
    """The zoom task: name the colour of the checkerboard square in the framed cell of a grid x
    grid image; the answer is the colour word. Meant for `image_zoom` in grid mode with the pixel
    budget of configs/zoom_read.yaml (see the module docstring). PNG by default: JPEG's chroma
    subsampling and block transform smear the one-pixel checkerboard. No pixel noise by default:
    noise does not survive the averaging either, but it makes the PNG incompressible."""
    fmt = normalise_image_format(image_format)

    def make(colour: str, rng: np.random.Generator, split: str, i: int) -> dict[str, Any]:
        pixels, info = draw(colour, rng, image_size, grid, glyph=glyph, tint=tint, noise_std=noise_std)
        meta = {"split": split, "index": i, "colour": colour, **info}
        return {"json": {"prompt": PROMPT, "answer": colour, "metadata": meta}, fmt: encode_image(pixels, fmt)}

    return build_splits(
        out_dir, recipe="zoom_read",
        args={"train_size": train_size, "heldout_size": heldout_size, "image_size": image_size, "grid": grid,
              "glyph": glyph, "tint": tint, "noise_std": noise_std, "shard_size": shard_size, "seed": seed, "image_format": fmt},
        labels=list(COLOURS), salt=0x200F, make=make, train_size=train_size,
        heldout_size=heldout_size, shard_size=shard_size, seed=seed,
        extra={"prompt": PROMPT, "answers": list(COLOURS)})
