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

import io
import json
import math
import os
import re
from typing import Any

import numpy as np
from PIL import Image

from mmrl.registry import register

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (230, 220, 30),
    "purple": (140, 40, 170),
    "orange": (245, 140, 20),
}
PROMPT = "What colour is the shape? Answer with one word."
SHAPES = ("square", "circle")
SPLITS = ("train", "heldout")

# Per-image colour jitter is N(0, 15) per channel, truncated at +-2 sigma. Untruncated, about 0.3 %
# of yellow/orange shapes would sit nearer the other palette entry (they are only 82 apart);
# truncated at 30, no jittered colour can cross a midpoint, so every label stays unambiguous.
_JITTER_STD, _JITTER_MAX = 15.0, 30.0
_BG_STD, _NOISE_STD = 10.0, 10.0


def _draw(colour: str, rng: np.random.Generator, size: int, min_frac: float) -> tuple[np.ndarray, dict]:
    """Pixels (size, size, 3) uint8 and what was drawn."""
    if colour not in COLOURS:
        raise ValueError(f"unknown colour {colour!r}; colours are: {', '.join(COLOURS)}")
    if not 0.0 < min_frac <= 1.0:
        raise ValueError(f"min_frac must be in (0, 1], got {min_frac}")
    if size < 4:
        raise ValueError(f"size must be at least 4 pixels, got {size}")
    bg = 128.0 + rng.normal(0.0, _BG_STD, 3)
    img = np.empty((size, size, 3), np.float32)
    img[:] = bg
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    side = int(round(rng.uniform(min_frac, 1.0) * size))
    side = max(1, min(size, side))
    x0 = int(rng.integers(0, size - side + 1))
    y0 = int(rng.integers(0, size - side + 1))
    fill = np.asarray(COLOURS[colour], np.float32) + np.clip(
        rng.normal(0.0, _JITTER_STD, 3), -_JITTER_MAX, _JITTER_MAX)
    if shape == "square":
        img[y0:y0 + side, x0:x0 + side] = fill
    else:
        r = side / 2.0
        yy, xx = np.mgrid[0:side, 0:side]
        inside = (yy + 0.5 - r) ** 2 + (xx + 0.5 - r) ** 2 <= r * r
        img[y0:y0 + side, x0:x0 + side][inside] = fill
    img += rng.normal(0.0, _NOISE_STD, img.shape).astype(np.float32)
    pixels = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    return pixels, {"shape": shape, "frac": round(side / size, 4), "box": [x0, y0, side, side]}


def render(colour: str, rng: np.random.Generator, size: int = 56, min_frac: float = 0.6) -> Image.Image:
    """One RGB image: grey background, a filled square or circle of `colour`, pixel noise.

    The shape's side is between `min_frac` and 1.0 of `size`, placed fully inside the image.
    """
    return Image.fromarray(_draw(colour, rng, size, min_frac)[0], "RGB")


def _encode(pixels: np.ndarray, image_format: str) -> bytes:
    buf = io.BytesIO()
    img = Image.fromarray(pixels, "RGB")
    if image_format == "png":
        img.save(buf, "PNG", compress_level=1)
    else:
        img.save(buf, "JPEG", quality=95)
    return buf.getvalue()


def _brace(prefix: str, n_shards: int) -> str:
    return f"{prefix}-{{{0:06d}..{n_shards - 1:06d}}}.tar"


def _labels(n: int, seed: int, split_id: int) -> list[str]:
    """Balanced colours (index % 6), shuffled with the seed."""
    names = list(COLOURS)
    labels = [names[i % len(names)] for i in range(n)]
    order = np.random.default_rng([seed, split_id, 0xC0102]).permutation(n)
    return [labels[i] for i in order]


def _write_split(out_dir: str, split: str, split_id: int, n: int, *, size: int, min_frac: float,
                 shard_size: int, seed: int, image_format: str) -> int:
    import webdataset as wds

    ext = "png" if image_format == "png" else "jpg"
    labels = _labels(n, seed, split_id)
    # mtime fixed and user/group fixed: the tar files are byte-identical for a seed.
    with wds.ShardWriter(os.path.join(out_dir, f"{split}-%06d.tar"), maxcount=shard_size, verbose=0,
                         encoder=False, mtime=0.0) as sink:
        for i, colour in enumerate(labels):
            # One seed per (seed, split, index): disjoint across splits, independent of order.
            rng = np.random.default_rng([seed, split_id, i])
            pixels, info = _draw(colour, rng, size, min_frac)
            meta = {"split": split, "shape": info["shape"], "frac": info["frac"], "index": i}
            record = {"prompt": PROMPT, "answer": colour, "metadata": meta}
            sink.write({"__key__": f"{split}-{i:06d}",
                        "json": json.dumps(record, sort_keys=True).encode("utf-8"),
                        ext: _encode(pixels, image_format)})
    return math.ceil(n / shard_size)


@register("dataset", "colors")
def build(out_dir: str, *, train_size: int = 4096, heldout_size: int = 128, image_size: int = 56,
          min_frac: float = 0.6, shard_size: int = 1024, seed: int = 0,
          image_format: str = "png") -> dict[str, Any]:
    """Synthetic colour task: a noisy square/circle of one of 6 colours; answer the colour word."""
    fmt = image_format.lower().lstrip(".")
    fmt = {"jpeg": "jpg"}.get(fmt, fmt)
    if fmt not in ("png", "jpg"):
        raise ValueError(f"image_format must be 'png' or 'jpg', got {image_format!r}")
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    if train_size < 0 or heldout_size < 0:
        raise ValueError("train_size and heldout_size must be >= 0")
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    # Shards of an earlier build with more shards would otherwise linger next to the new ones.
    stale = re.compile(r"^(%s)-\d{6}\.tar$" % "|".join(SPLITS))
    for name in os.listdir(out_dir):
        if stale.match(name):
            os.remove(os.path.join(out_dir, name))
    manifest_path = os.path.join(out_dir, "dataset.json")
    if os.path.exists(manifest_path):
        os.remove(manifest_path)

    sizes = {"train": train_size, "heldout": heldout_size}
    counts: dict[str, int] = {}
    shards: dict[str, str] = {}
    n_shards: dict[str, int] = {}
    for split_id, split in enumerate(SPLITS):
        n = sizes[split]
        if n == 0:
            continue
        n_shards[split] = _write_split(out_dir, split, split_id, n, size=image_size, min_frac=min_frac,
                                       shard_size=shard_size, seed=seed, image_format=fmt)
        counts[split] = n
        shards[split] = _brace(split, n_shards[split])
    info = {
        "recipe": "colors",
        "args": {"train_size": train_size, "heldout_size": heldout_size, "image_size": image_size,
                 "min_frac": min_frac, "shard_size": shard_size, "seed": seed, "image_format": fmt},
        "counts": counts,
        "num_shards": n_shards,
        "shards": shards,  # brace patterns relative to out_dir
        "prompt": PROMPT,
        "answers": list(COLOURS),
    }
    # written last: its presence marks a complete build
    with open(manifest_path, "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    return info
