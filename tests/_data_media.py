"""Real media bytes and tar shards for the data tests (imported by tests/test_data_*.py).

Run as a script it encodes a WebM to stdout: decord bundles its own libvpx, and once decord is
imported into a process PyAV's libvpx *encoder* fails (symbol clash), so WebM encoding happens in
a fresh interpreter. Decoding is unaffected.
"""
from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import tarfile
import zlib
from typing import Any

import numpy as np
from PIL import Image


def image_bytes(colour=(200, 30, 30), size=(24, 16), fmt="PNG", mode="RGB", **kw) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, colour).save(buf, fmt, **kw)
    return buf.getvalue()


# What the Qwen-VL processors refuse (aspect ratio above 200: a web banner, 1xN strips), and odd
# images they accept (smaller than one 14-pixel patch: upscaled; 200:1 is the limit itself). The
# quarantine corpus and the `mmrl train` test through refused images use both lists.
REFUSED_IMAGE_SIZES = [(8000, 12), (1, 300), (300, 1), (201, 1), (12, 8000)]
ACCEPTED_ODD_IMAGE_SIZES = [(1, 1), (3, 40), (40, 3), (13, 13), (200, 1), (2, 2)]


def bomb_png(width: int = 20_000, height: int = 20_000) -> bytes:
    """A valid small PNG whose header claims width x height pixels (a decompression bomb's
    signature: the guard must reject it from the header, before decoding a single row)."""
    png = image_bytes(size=(8, 8))
    ihdr = png[8:33]  # length(4) "IHDR" data(13) crc(4)
    data = struct.pack(">II", width, height) + ihdr[16:21]
    new = struct.pack(">I", 13) + b"IHDR" + data + struct.pack(">I", zlib.crc32(b"IHDR" + data))
    return png[:8] + new + png[33:]


def gray_frames(n: int, width: int = 32, height: int = 24) -> np.ndarray:
    """Frame i is flat gray level 8 * i (+16): its mean tells which source frame was decoded."""
    levels = 16 + 8 * np.arange(n)
    return np.broadcast_to(levels[:, None, None, None], (n, height, width, 3)).astype(np.uint8).copy()


def scrolling_texture(n: int, width: int, height: int, seed: int) -> np.ndarray:
    """A textured frame scrolling sideways: every frame differs, so it decodes like real video."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = ((xx[..., None] * [3, 1, 2] + yy[..., None] * [1, 2, 3]) % 256).astype(np.uint8)
    noise = rng.integers(0, 24, (height, width + n, 3), dtype=np.uint8)
    return np.stack([base + noise[:, i:i + width] for i in range(n)])


def encode_video(frames: np.ndarray, fps: int = 10, fmt: str = "mp4") -> bytes:
    """H.264 MP4 (or, via a subprocess, VP8 WebM) bytes of uint8 (T, H, W, 3) frames."""
    if fmt == "webm":
        t, h, w = frames.shape[:3]
        out = subprocess.run([sys.executable, __file__, "webm", str(fps), str(t), str(h), str(w)],
                             input=frames.tobytes(), capture_output=True, check=True)
        return out.stdout
    import av
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "10", "g": "4"}
        stream.codec_context.thread_count = 1
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _encode_webm_stdio(fps: int, t: int, h: int, w: int) -> None:
    import av
    frames = np.frombuffer(sys.stdin.buffer.read(), np.uint8).reshape(t, h, w, 3)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="webm") as container:
        stream = container.add_stream("libvpx", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"crf": "4", "b": "1M"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    sys.stdout.buffer.write(buf.getvalue())


def js(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


def write_tar(path: str | os.PathLike, samples: list[tuple[str, dict[str, bytes]]]) -> str:
    """A shard with members KEY.EXT in the given order (duplicates allowed: that is a test case)."""
    with tarfile.open(path, "w") as tf:
        for key, members in samples:
            items = members.items() if isinstance(members, dict) else members
            for ext, data in items:
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return str(path)


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "webm":
    _encode_webm_stdio(*map(int, sys.argv[2:]))


def read_members(path: str | os.PathLike) -> dict[str, dict[str, bytes]]:
    """key -> {member suffix: bytes}, in tar order."""
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tf:
        for ti in tf:
            key, _, ext = ti.name.partition(".")
            out.setdefault(key, {})[ext] = tf.extractfile(ti).read()
    return out


def read_split(out_dir: str | os.PathLike, split: str) -> dict[str, dict[str, bytes]]:
    """All members of a recipe's split (its `SPLIT-*.tar` shards), by key."""
    members: dict[str, dict[str, bytes]] = {}
    for name in sorted(os.listdir(out_dir)):
        if name.startswith(split + "-") and name.endswith(".tar"):
            members.update(read_members(os.path.join(out_dir, name)))
    return members


def video_and_multi_image_samples(colors_samples: list) -> list:
    """A video, two images and image + video prompts, built from two colours samples' images."""
    from mmrl.data.sample import Sample, Video, messages_from_prompt

    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (8, 56, 56, 3), dtype=np.uint8)
    video = Video(frames=frames, fps=2.0, frame_indices=list(range(0, 16, 2)), source_fps=4.0, total_num_frames=16)
    a, b = colors_samples[0].images[0], colors_samples[1].images[0]
    return [
        Sample(key="video", messages=messages_from_prompt("Which way?", n_videos=1), videos=[video]),
        Sample(key="two-images", messages=messages_from_prompt("Same colour?", n_images=2), images=[a, b]),
        Sample(key="mixed", messages=[{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "then"}, {"type": "video"}, {"type": "text", "text": "?"}]}],
            images=[a], videos=[video]),
    ]
