"""Helpers the dataset recipes share: the palette, shape drawing, image/video encoding, shard
writing, and the train/held-out build driver.

Every recipe is a pure function of (seed, split, index): `build_splits` gives sample `i` of a
split its own generator `default_rng([seed, split_id, i])`, so builds are byte-for-byte
reproducible and the two splits draw from disjoint seed streams. Labels are balanced (index %
number of labels) and then shuffled with the seed.
"""
from __future__ import annotations

import io
import json
import math
import os
import re
import tarfile
from fractions import Fraction
from typing import Any, Callable, Sequence

import numpy as np
from PIL import Image

SPLITS = ("train", "heldout")

# The colour palette every synthetic recipe draws from (the `colors` recipe's answers).
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (230, 220, 30),
    "purple": (140, 40, 170),
    "orange": (245, 140, 20),
}
SHAPES = ("square", "circle", "triangle")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

# Per-image colour jitter is N(0, 15) per channel, truncated at +-2 sigma (see colors.py: with the
# truncation no jittered colour crosses the midpoint between two palette entries).
JITTER_STD, JITTER_MAX = 15.0, 30.0
BG_STD, NOISE_STD = 10.0, 10.0


# ------------------------------------------------------------------------------------- drawing

def background(rng: np.random.Generator, height: int, width: int | None = None) -> np.ndarray:
    """float32 (H, W, 3): one grey near 128 (per-channel N(0, BG_STD)) everywhere."""
    bg = 128.0 + rng.normal(0.0, BG_STD, 3)
    img = np.empty((height, width if width is not None else height, 3), np.float32)
    img[:] = bg
    return img


def jittered(colour: str, rng: np.random.Generator) -> np.ndarray:
    """The palette colour plus truncated per-channel jitter (float32 (3,))."""
    if colour not in COLOURS:
        raise ValueError(f"unknown colour {colour!r}; colours are: {', '.join(COLOURS)}")
    return np.asarray(COLOURS[colour], np.float32) + np.clip(
        rng.normal(0.0, JITTER_STD, 3), -JITTER_MAX, JITTER_MAX)


def shape_mask(shape: str, side: int) -> np.ndarray:
    """bool (side, side): which pixels of the shape's bounding square it covers. Every shape
    touches all four sides of the square, so the square is also its tight bounding box."""
    if shape == "square":
        return np.ones((side, side), bool)
    yy, xx = np.mgrid[0:side, 0:side]
    if shape == "circle":
        r = side / 2.0
        return (yy + 0.5 - r) ** 2 + (xx + 0.5 - r) ** 2 <= r * r
    if shape == "triangle":  # apex up, base on the bottom row
        return np.abs(xx + 0.5 - side / 2.0) <= (yy + 1) / 2.0
    raise ValueError(f"unknown shape {shape!r}; shapes are: {', '.join(SHAPES)}")


def paint(img: np.ndarray, shape: str, x0: int, y0: int, side: int, fill: np.ndarray) -> None:
    """Fill `shape` in the square at (x0, y0) of `side` pixels (clipped to the image)."""
    mask = shape_mask(shape, side)
    h, w = img.shape[:2]
    ys, xs = slice(max(0, y0), min(h, y0 + side)), slice(max(0, x0), min(w, x0 + side))
    sub = mask[ys.start - y0:ys.stop - y0, xs.start - x0:xs.stop - x0]
    if shape == "square":
        img[ys, xs] = fill
    else:
        img[ys, xs][sub] = fill


def finish(img: np.ndarray, rng: np.random.Generator, noise_std: float = NOISE_STD) -> np.ndarray:
    """Add per-pixel Gaussian noise and round to uint8."""
    if noise_std:
        img = img + rng.normal(0.0, noise_std, img.shape).astype(np.float32)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def place_squares(rng: np.random.Generator, size: int, sides: Sequence[int], gap: int = 2,
                  tries: int = 200) -> list[tuple[int, int]] | None:
    """Top-left corners for squares of `sides` inside a `size` image, at least `gap` pixels
    apart (no touching, so shapes stay separate blobs). None when no placement was found."""
    placed: list[tuple[int, int, int]] = []
    for side in sides:
        for _ in range(tries):
            x0 = int(rng.integers(0, size - side + 1))
            y0 = int(rng.integers(0, size - side + 1))
            if all(x0 + side + gap <= x or x + s + gap <= x0 or y0 + side + gap <= y or y + s + gap <= y0
                   for x, y, s in placed):
                placed.append((x0, y0, side))
                break
        else:
            return None
    return [(x, y) for x, y, _ in placed]


def grid_corners(rng: np.random.Generator, size: int, count: int, cells: int,
                 min_frac: float = 0.45, max_frac: float = 0.7) -> tuple[list[tuple[int, int]], list[int]]:
    """Top-left corners and sides for `count` shapes in distinct cells of a `cells` x `cells` grid,
    each inside its cell with a one-pixel margin (so shapes in neighbouring cells stay apart). The
    counting and grounding recipes' layout=grid."""
    cell = size // cells
    if count > cells * cells:
        raise ValueError(f"cannot place {count} shapes in a {cells}x{cells} grid; raise grid_cells or place fewer shapes")
    lo, hi = max(3, int(round(min_frac * cell))), max(3, min(cell - 2, int(round(max_frac * cell))))
    chosen = rng.choice(cells * cells, size=count, replace=False)
    corners, sides = [], []
    for c in chosen.tolist():
        side = int(rng.integers(lo, hi + 1))
        cx, cy = (c % cells) * cell, (c // cells) * cell
        corners.append((cx + 1 + int(rng.integers(0, cell - side - 1)), cy + 1 + int(rng.integers(0, cell - side - 1))))
        sides.append(side)
    return corners, sides


# ------------------------------------------------------------------------------------ encoding

def normalise_image_format(image_format: str) -> str:
    fmt = image_format.lower().lstrip(".")
    fmt = {"jpeg": "jpg"}.get(fmt, fmt)
    if fmt not in ("png", "jpg"):
        raise ValueError(f"image_format must be 'png' or 'jpg', got {image_format!r}")
    return fmt


def encode_image(pixels: np.ndarray, image_format: str) -> bytes:
    """uint8 (H, W, 3) -> PNG (fast compression) or JPEG (quality 95) bytes."""
    buf = io.BytesIO()
    img = Image.fromarray(pixels, "RGB")
    if image_format == "png":
        img.save(buf, "PNG", compress_level=1)
    else:
        img.save(buf, "JPEG", quality=95)
    return buf.getvalue()


def rgb_to_yuv420p(frames: np.ndarray) -> np.ndarray:
    """uint8 (T, H, W, 3) RGB -> uint8 (T, H * 3 // 2, W) planar YUV 4:2:0 (BT.601, limited range;
    chroma from the mean RGB of each 2x2 block), the layout `av.VideoFrame.from_ndarray(...,
    format="yuv420p")` takes. Integer arithmetic in numpy: the encoder's input is a function of
    the pixels alone."""
    t, h, w = frames.shape[:3]
    rgb = frames.astype(np.int32)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    y = (66 * r + 129 * g + 25 * b + 128) // 256 + 16
    # 2x2 block sums (x4 the mean), so the chroma below is computed once per block with rounding
    blocks = rgb.reshape(t, h // 2, 2, w // 2, 2, 3).sum(axis=(2, 4))
    br, bg, bb = blocks[..., 0], blocks[..., 1], blocks[..., 2]
    u = (-38 * br - 74 * bg + 112 * bb + 512) // 1024 + 128
    v = (112 * br - 94 * bg - 18 * bb + 512) // 1024 + 128
    out = np.empty((t, h * 3 // 2, w), np.uint8)
    out[:, :h] = y
    out[:, h:h + h // 4] = u.reshape(t, h // 4, w)
    out[:, h + h // 4:] = v.reshape(t, h // 4, w)
    return out


def encode_mp4(frames: np.ndarray, fps: float, qp: int = 18) -> bytes:
    """uint8 (T, H, W, 3) RGB frames -> H.264 (libx264, yuv420p) MP4 bytes, byte-identical for the
    same frames whatever the machine's load: a constant quantizer `qp` with adaptive quantization,
    macroblock-tree and psychovisual tuning off, one encoder thread, our own colour conversion
    (`rgb_to_yuv420p`), no timestamps from the clock. (With CRF rate control, the same frames gave
    a different keyframe in about 1 of 60 builds inside a busy test process; x264's float-driven
    adaptive decisions are the part that varied, the constant-quantizer encodes never did.)
    H and W must be even (yuv420p)."""
    import av

    t, h, w = frames.shape[:3]
    if h % 2 or w % 2:
        raise ValueError(f"video width and height must be even for yuv420p, got {w}x{h}")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"qp": str(int(qp)), "preset": "medium", "x264-params": "aq-mode=0:mbtree=0:psy=0"}
        stream.codec_context.thread_count = 1
        for planes in rgb_to_yuv420p(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(planes, format="yuv420p")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def record_bytes(record: dict[str, Any]) -> bytes:
    """The KEY.json member: sorted keys, UTF-8."""
    return json.dumps(record, sort_keys=True).encode("utf-8")


# -------------------------------------------------------------------------------- shard writing

def member_size(sample: dict[str, Any]) -> int:
    """Bytes a sample takes in a webdataset tar: per member a 512-byte header (1536 when its name
    needs a PAX record: longer than 100 bytes or not ASCII) plus its data padded to 512 bytes. An
    estimate for deciding where a shard ends; `ShardSink` tracks the real offsets."""
    key = str(sample.get("__key__", ""))
    total = 0
    for k, v in sample.items():
        if k.startswith("_"):
            continue
        name = f"{key}.{k}"
        header = 512 if len(name) <= 100 and name.isascii() else 1536
        total += header + math.ceil(len(v) / 512) * 512
    return total


def tar_file_size(content: int) -> int:
    """The size of a tar file whose members and end-of-archive blocks take `content` bytes:
    tarfile pads the archive to whole 10 KiB records."""
    return math.ceil(content / tarfile.RECORDSIZE) * tarfile.RECORDSIZE


class ShardSink:
    """Write samples into `pattern % shard_index` tar shards, starting a new shard before one
    would exceed `maxcount` samples or a file size of `maxbytes` bytes (a single larger sample
    gets a shard of its own). Shards are only created when a sample is written. Fixed mtime/user/group: the tar
    bytes are a function of the samples only.

        with ShardSink(os.path.join(out, "train-%06d.tar"), maxcount=1024) as sink:
            sink.write({"__key__": "train-000000", "json": b"...", "png": b"..."})
        sink.shards  # paths written;  sink.counts  # samples per shard
    """

    def __init__(self, pattern: str, *, maxcount: int | None = None, maxbytes: float | None = None):
        if maxcount is not None and maxcount < 1:
            raise ValueError(f"shard size must be >= 1 sample, got {maxcount}")
        if maxbytes is not None and maxbytes <= 0:
            raise ValueError(f"shard size must be > 0 bytes, got {maxbytes}")
        self.pattern, self.maxcount, self.maxbytes = pattern, maxcount, maxbytes
        self.shards: list[str] = []
        self.counts: list[int] = []
        self.sizes: list[int] = []
        self._tar: Any = None

    def _next(self) -> None:
        import webdataset as wds

        self._close_current()
        path = self.pattern % len(self.shards)
        self._tar = wds.TarWriter(path, encoder=False, mtime=0)  # an int: a float adds a PAX record per member
        self.shards.append(path)
        self.counts.append(0)
        self.sizes.append(1024)  # the end-of-archive blocks

    def write(self, sample: dict[str, Any]) -> None:
        size = member_size(sample)
        if (self._tar is None
                or (self.maxcount is not None and self.counts[-1] >= self.maxcount)
                or (self.maxbytes is not None and self.counts[-1] > 0
                    and tar_file_size(self.sizes[-1] + size) > self.maxbytes)):
            self._next()
        self._tar.write(sample)
        self.counts[-1] += 1
        self.sizes[-1] = self._tar.tarstream.offset + 1024  # + the end-of-archive blocks

    def _close_current(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None

    def close(self) -> None:
        self._close_current()

    def __enter__(self) -> "ShardSink":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def brace(prefix: str, n_shards: int) -> str:
    """The brace pattern of `n_shards` shards `prefix-000000.tar` ..."""
    return f"{prefix}-{{{0:06d}..{n_shards - 1:06d}}}.tar"


def clean_out_dir(out_dir: str, splits: Sequence[str] = SPLITS) -> str:
    """Create `out_dir`; remove the shards of `splits` and the manifest an earlier build left
    (shards of a build with more shards would otherwise linger next to the new ones)."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    stale = re.compile(r"^(%s)-\d{6}\.tar$" % "|".join(re.escape(s) for s in splits))
    for name in os.listdir(out_dir):
        if stale.match(name):
            os.remove(os.path.join(out_dir, name))
    manifest = os.path.join(out_dir, "dataset.json")
    if os.path.exists(manifest):
        os.remove(manifest)
    return out_dir


def write_manifest(out_dir: str, info: dict[str, Any]) -> None:
    """DIR/dataset.json, written last: its presence marks a complete build."""
    with open(os.path.join(out_dir, "dataset.json"), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")


def balanced_labels(names: Sequence[Any], n: int, seed: int, split_id: int, salt: int) -> list[Any]:
    """n labels cycling through `names` (counts differ by at most one), shuffled with the seed."""
    names = list(names)
    labels = [names[i % len(names)] for i in range(n)]
    order = np.random.default_rng([seed, split_id, salt]).permutation(n)
    return [labels[i] for i in order]


def check_sizes(train_size: int, heldout_size: int, shard_size: int) -> None:
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    if train_size < 0 or heldout_size < 0:
        raise ValueError("train_size and heldout_size must be >= 0")


# A sample maker: (label, rng, split, index) -> {"json": record dict, ext: bytes, ...}
MakeSample = Callable[[Any, np.random.Generator, str, int], dict[str, Any]]


def build_splits(out_dir: str, *, recipe: str, args: dict[str, Any], labels: Sequence[Any],
                 salt: int, make: MakeSample, train_size: int, heldout_size: int, shard_size: int,
                 seed: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write train and held-out shards (`{split}-%06d.tar`, `shard_size` samples each) and
    dataset.json; return the manifest.

    Sample i of a split gets the balanced, shuffled label i and the generator
    `default_rng([seed, split_id, i])`; `make` returns its members ("json" a dict, others bytes).
    """
    check_sizes(train_size, heldout_size, shard_size)
    out_dir = clean_out_dir(out_dir)
    sizes = {"train": train_size, "heldout": heldout_size}
    counts: dict[str, int] = {}
    shards: dict[str, str] = {}
    n_shards: dict[str, int] = {}
    for split_id, split in enumerate(SPLITS):
        n = sizes[split]
        if n == 0:
            continue
        with ShardSink(os.path.join(out_dir, f"{split}-%06d.tar"), maxcount=shard_size) as sink:
            for i, label in enumerate(balanced_labels(labels, n, seed, split_id, salt)):
                # One seed per (seed, split, index): disjoint across splits, independent of order.
                members = make(label, np.random.default_rng([seed, split_id, i]), split, i)
                members["json"] = record_bytes(members["json"])
                sink.write({"__key__": f"{split}-{i:06d}", **members})
        n_shards[split] = len(sink.shards)
        counts[split] = n
        shards[split] = brace(split, n_shards[split])
    info = {"recipe": recipe, "args": args, "counts": counts, "num_shards": n_shards,
            "shards": shards}  # brace patterns relative to out_dir
    info.update(extra or {})
    write_manifest(out_dir, info)
    return info
