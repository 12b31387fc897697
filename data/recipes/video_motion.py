"""The synthetic video task: which way does the shape move?

One shape (square, circle or triangle, a palette colour) moves in a straight line left, right,
up or down (balanced) across `frames` frames of a `width` x `height` grey video, by at least half
of the free room. Frames are encoded as a real H.264 MP4 (PyAV, libx264, yuv420p) at `fps`.

    mmrl data build video_motion --out DIR [frames=8 fps=4 width=64 height=64 ...]

Each sample is `KEY.json` ({"prompt", "answer", "videos": ["mp4"], "metadata": {"split",
"index", "direction", "shape", "colour", "side", "frames", "fps", "width", "height", "centres"}};
`centres` is the centre [x, y] of the shape's box per frame) plus `KEY.mp4`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from mmrl.plugins.data.recipes._common import (COLOURS, SHAPES, background, build_splits, encode_mp4,
                                       finish, jittered, paint)
from mmrl.registry import register

PROMPT = "Which direction does the shape move? Answer with one word."
DIRECTIONS = ("left", "right", "up", "down")


def draw(direction: str, rng: np.random.Generator, *, frames: int = 8, width: int = 64,
         height: int = 64, min_travel: float = 0.5) -> tuple[np.ndarray, dict[str, Any]]:
    """uint8 (frames, height, width, 3) RGB frames of one shape moving in `direction`."""
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; directions are: {', '.join(DIRECTIONS)}")
    base = background(rng, height, width)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    fill = jittered(colour, rng)
    side = max(3, int(round(rng.uniform(0.2, 0.3) * min(width, height))))
    horizontal = direction in ("left", "right")
    room = (width if horizontal else height) - side  # positions 0..room along the motion axis
    travel = int(rng.integers(int(np.ceil(min_travel * room)), room + 1))
    start = int(rng.integers(0, room - travel + 1))
    other = int(rng.integers(0, (height if horizontal else width) - side + 1))
    if direction in ("left", "up"):
        start, end = start + travel, start
    else:
        end = start + travel
    video = np.empty((frames, height, width, 3), np.uint8)
    centres = []
    for t in range(frames):
        pos = int(round(start + (end - start) * t / (frames - 1)))
        x0, y0 = (pos, other) if horizontal else (other, pos)
        img = base.copy()
        paint(img, shape, x0, y0, side, fill)
        video[t] = finish(img, rng, noise_std=0.0)
        centres.append([x0 + side / 2.0, y0 + side / 2.0])
    return video, {"direction": direction, "shape": shape, "colour": colour, "side": side,
                   "centres": centres}


@register("dataset", "video_motion")
def build(out_dir: str, *, train_size: int = 1024, heldout_size: int = 64, frames: int = 8,
          fps: float = 4.0, width: int = 64, height: int = 64, qp: int = 18,
          shard_size: int = 256, seed: int = 0) -> dict[str, Any]:
    """Synthetic video task: a shape moves left/right/up/down in an MP4; answer the direction."""
    if frames < 2:
        raise ValueError(f"frames must be >= 2 (motion needs two frames), got {frames}")
    if not fps > 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    if width % 2 or height % 2 or width < 16 or height < 16:
        raise ValueError(f"width and height must be even (yuv420p) and at least 16, got {width}x{height}")
    if not 0 <= qp <= 51:
        raise ValueError(f"qp (H.264 constant quantizer) must be in 0..51, got {qp}")

    def make(direction: str, rng: np.random.Generator, split: str, i: int) -> dict[str, Any]:
        video, info = draw(direction, rng, frames=frames, width=width, height=height)
        meta = {"split": split, "index": i, **info, "frames": frames, "fps": fps,
                "width": width, "height": height}
        return {"json": {"prompt": PROMPT, "answer": direction, "videos": ["mp4"], "metadata": meta},
                "mp4": encode_mp4(video, fps, qp)}

    return build_splits(
        out_dir, recipe="video_motion",
        args={"train_size": train_size, "heldout_size": heldout_size, "frames": frames, "fps": fps,
              "width": width, "height": height, "qp": qp, "shard_size": shard_size, "seed": seed},
        labels=list(DIRECTIONS), salt=0x71DE, make=make, train_size=train_size,
        heldout_size=heldout_size, shard_size=shard_size, seed=seed,
        extra={"modality": "video", "prompt": PROMPT, "answers": list(DIRECTIONS)})
