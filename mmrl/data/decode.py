"""One raw webdataset sample (member bytes) -> `Sample`, or `BadSampleError` with a reason.

This runs in the stream's DataLoader workers, never in the driver: the worker reads tar members
as bytes, and only what survives the cheap checks (JSON, member names, placeholder counts) is
decoded -- images with PIL, videos with `mmrl.data.video`. docs/data.md describes the format.
"""
from __future__ import annotations

import io
import json
import re
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from mmrl.data.media_limits import MediaLimits
from mmrl.data.quarantine import BadSampleError
from mmrl.data.sample import Sample, Video
from mmrl.data.video import VideoDecodeError, VideoTooLarge, decode_video

IMAGE_EXTS = ("png", "jpg", "jpeg", "webp")
VIDEO_EXTS = ("mp4", "webm", "mkv", "mov", "avi", "m4v")
# Media we recognise but do not decode: quarantined rather than silently dropped, because dropping
# the picture a prompt talks about would train on a question the model cannot see.
UNSUPPORTED_MEDIA_EXTS = ("gif", "bmp", "tif", "tiff", "heic", "heif", "avif", "jxl", "svg", "ico",
                          "wav", "mp3", "flac", "ogg", "m4a", "opus", "aac", "flv", "wmv", "mpg", "mpeg")
INLINE_MARKERS = {"<image>": "image", "<video>": "video"}


@dataclass(frozen=True)
class DecodeOptions:
    """How media are decoded (the same in every worker; part of the stream's constructor).

    Args:
        pixel_limit: reject an image or video frame with more pixels than this (a decompression
            bomb guard: a 100 kB PNG can claim 50k x 50k pixels). PIL's own hard cap of
            2 x Image.MAX_IMAGE_PIXELS (~179 MP) applies on top.
        fps: sample this many frames per second of video (ignored when num_frames is set).
        num_frames: sample exactly this many frames per video instead (max_frames still caps).
        min_frames: at least this many frames with fps sampling (a short clip repeats its last).
        max_frames: at most this many frames (rounded down to even).
        max_pixels: downscale video frames to at most this many pixels while decoding (aspect
            kept; None = native size). Keeps 32 frames of 1080p from crossing the worker queue
            at 200 MB a sample; the processor resizes again to its own budget.
        decoders: video decoders in the order to try; unavailable ones are skipped.
        timeout_s: per video and decoder; a decode that runs longer is abandoned (see video.py).
        media_limits: what the model's processor refuses (`processor.media_limits`); a decoded
            image or video outside them is quarantined here as `processor_limit`. Not a config
            key: the run fills it in from the processor it builds.
    """
    pixel_limit: int = 64_000_000
    fps: float = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 32
    max_pixels: int | None = 768 * 28 * 28  # Qwen-VL's default per-frame video budget
    decoders: tuple[str, ...] = ("decord", "torchcodec", "pyav")
    timeout_s: float = 30.0
    media_limits: MediaLimits | None = None

    @classmethod
    def from_config(cls, decode_cfg: Any, media_limits: MediaLimits | None = None) -> "DecodeOptions":
        """From the `data.decode` config section (mmrl.config.schema.DecodeConfig)."""
        return cls(**{**vars(decode_cfg), "decoders": tuple(decode_cfg.decoders)}, media_limits=media_limits)

    def __post_init__(self) -> None:
        object.__setattr__(self, "decoders", tuple(self.decoders))  # a YAML list is fine too
        problems = []
        if self.pixel_limit < 1:
            problems.append(f"pixel_limit must be >= 1, got {self.pixel_limit}")
        if self.num_frames is None and not self.fps > 0:
            problems.append(f"fps must be > 0 (or set num_frames), got {self.fps}")
        if self.num_frames is not None and self.num_frames < 1:
            problems.append(f"num_frames must be >= 1 or None, got {self.num_frames}")
        if not 1 <= self.min_frames <= self.max_frames:
            problems.append(f"need 1 <= min_frames <= max_frames, got {self.min_frames}, {self.max_frames}")
        if self.max_frames < 2:
            problems.append(f"max_frames must be >= 2 (frames go in temporal pairs), got {self.max_frames}")
        if self.max_pixels is not None and self.max_pixels < 4:
            problems.append(f"max_pixels must be >= 4 or None, got {self.max_pixels}")
        if not self.timeout_s > 0:
            problems.append(f"timeout_s must be > 0, got {self.timeout_s}")
        from mmrl.data.video import VIDEO_BACKENDS
        unknown = [d for d in self.decoders if d not in VIDEO_BACKENDS]
        if unknown or not self.decoders:
            problems.append(f"decoders must name some of {sorted(VIDEO_BACKENDS)}, got {list(self.decoders)}")
        if problems:
            raise ValueError("DecodeOptions: " + "; ".join(problems))


# ------------------------------------------------------------------------------------------- images

def _to_rgb(im: Image.Image) -> Image.Image:
    """RGB the way a viewer shows it: transparency over white (not black), 16-bit scaled, not clipped."""
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    if im.mode.startswith("I;16"):
        return Image.fromarray((np.asarray(im, dtype=np.uint16) >> 8).astype(np.uint8), "L").convert("RGB")
    return im.convert("RGB")  # a fresh in-memory image, detached from the byte buffer


def decode_image(data: bytes, pixel_limit: int = DecodeOptions.pixel_limit) -> Image.Image:
    """Image bytes -> RGB PIL image, EXIF orientation applied. Raises BadSampleError
    (too_many_pixels before any pixel is decoded, corrupt_image)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit decides
            im = Image.open(io.BytesIO(data))
        width, height = im.size  # from the header; nothing is decoded yet
        if width * height > pixel_limit:
            raise BadSampleError("too_many_pixels", f"{width}x{height} = {width * height} pixels > "
                                                    f"pixel_limit {pixel_limit}")
        im.load()  # PIL is lazy: decode fully here so a truncated file fails now, not in the processor
    except BadSampleError:
        raise
    except Image.DecompressionBombError as e:
        raise BadSampleError("too_many_pixels", str(e)) from None
    except Exception as e:  # OSError, SyntaxError, ValueError, struct.error ... depending on format
        raise BadSampleError("corrupt_image", f"{type(e).__name__}: {e}") from None
    try:
        im = ImageOps.exif_transpose(im)
    except Exception:  # a broken EXIF block should not cost us a good picture
        pass
    return _to_rgb(im)


# ------------------------------------------------------------------------------------------ members

def _ext(name: str) -> str:
    return name.rpartition(".")[2].lower()


def media_kind(name: str) -> str | None:
    """"image", "video", "unsupported" (media we do not decode) or None (not media: json, txt, ...)."""
    ext = _ext(name)
    if ext in IMAGE_EXTS:
        return "image"
    if ext in VIDEO_EXTS:
        return "video"
    if ext in UNSUPPORTED_MEDIA_EXTS:
        return "unsupported"
    return None


def member_order(name: str) -> tuple[int, int, str]:
    """"jpg" first, then "0.jpg", "1.jpg", ... numerically (so 10 after 9), then other names."""
    prefix = name.rpartition(".")[0]
    if not prefix:
        return (0, 0, name)
    if prefix.isdigit():
        return (1, int(prefix), name)
    return (2, 0, name)


def _count_placeholders(messages: list[dict[str, Any]], kind: str) -> int:
    n = 0
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            n += sum(1 for c in content if isinstance(c, dict) and c.get("type") == kind)
    return n


# ------------------------------------------------------------------------------------------- sample

class _SampleDecoder:
    """The steps of `decode_sample` for one raw sample, each raising BadSampleError(reason)."""

    def __init__(self, raw: dict[str, Any], options: DecodeOptions, timings: dict[str, Any] | None = None):
        self.raw, self.options, self.timings = raw, options, timings
        self.key = str(raw.get("__key__", "?"))
        self.url = str(raw.get("__url__", ""))
        self.members = sorted(k for k in raw if not k.startswith("__"))

    def bad(self, reason: str, detail: str = "") -> BadSampleError:
        return BadSampleError(reason, detail, self.key, self.url)

    def parse_json(self) -> dict[str, Any]:
        if "json" not in self.raw:
            raise self.bad("missing_json", f"members: {', '.join(self.members) or '(none)'}")
        meta = self.raw["json"]
        if isinstance(meta, (bytes, bytearray, memoryview, str)):
            if len(meta) == 0:
                raise self.bad("empty_member", "json is zero bytes")
            try:
                meta = json.loads(meta if isinstance(meta, str) else bytes(meta).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise self.bad("bad_json", str(e)) from None
        if not isinstance(meta, dict):
            raise self.bad("bad_json", f"top level must be an object, got {type(meta).__name__}")
        return meta

    def media_names(self, meta: dict[str, Any], kind: str) -> list[str]:
        """Member names of this sample's images or videos, in placeholder order."""
        field = f"{kind}s"
        listed = meta.get(field)
        if listed is None:
            return sorted((m for m in self.members if media_kind(m) == kind), key=member_order)
        if not isinstance(listed, list) or not all(isinstance(n, str) and n for n in listed):
            raise self.bad("bad_field", f"'{field}' must be a list of member names like [\"0.jpg\", \"1.jpg\"]")
        names = [n[len(self.key) + 1:] if n.startswith(self.key + ".") else n for n in listed]
        for name in names:
            if name not in self.raw:
                raise self.bad("missing_media", f"'{field}' names {name!r}; members: {', '.join(self.members)}")
            if media_kind(name) != kind:
                raise self.bad("unsupported_media", f"'{field}' names {name!r}, not a supported {kind} "
                                                    f"type ({', '.join(IMAGE_EXTS if kind == 'image' else VIDEO_EXTS)})")
        return names

    def check_members(self, meta: dict[str, Any], image_names: list[str], video_names: list[str]) -> None:
        if "images" not in meta and "videos" not in meta:
            unsupported = [m for m in self.members if media_kind(m) == "unsupported"]
            if unsupported:
                raise self.bad("unsupported_media", f"{', '.join(unsupported)}: supported are images "
                                                    f"{IMAGE_EXTS} and videos {VIDEO_EXTS}")
        for name in image_names + video_names:
            if len(self.raw[name]) == 0:
                raise self.bad("empty_member", f"{name} is zero bytes")

    def messages(self, meta: dict[str, Any], n_images: int, n_videos: int) -> list[dict[str, Any]]:
        if meta.get("messages") is not None:
            messages = meta["messages"]
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and "role" in m for m in messages):
                raise self.bad("bad_field", "'messages' must be a non-empty list of {'role', 'content'} objects")
            counts = {kind: _count_placeholders(messages, kind) for kind in ("image", "video")}
        elif isinstance(meta.get("prompt"), str) and meta["prompt"].strip():
            system = meta.get("system")
            if system is not None and not isinstance(system, str):
                raise self.bad("bad_field", f"'system' must be a string, got {type(system).__name__}")
            messages = self.prompt_messages(meta["prompt"], n_images, n_videos, system)
            counts = {kind: _count_placeholders(messages, kind) for kind in ("image", "video")}
        else:
            raise self.bad("missing_field", "json has neither a non-empty 'prompt' nor 'messages'")
        if counts["image"] != n_images or counts["video"] != n_videos:
            raise self.bad("media_count_mismatch",
                           f"placeholders: {counts['image']} image, {counts['video']} video; "
                           f"members: {n_images} image, {n_videos} video")
        return messages

    @staticmethod
    def prompt_messages(prompt: str, n_images: int, n_videos: int, system: str | None) -> list[dict[str, Any]]:
        """With inline <image>/<video> markers, media go where the markers are; without, first."""
        if any(marker in prompt for marker in INLINE_MARKERS):
            content: list[dict[str, Any]] = []
            for part in re.split("(" + "|".join(map(re.escape, INLINE_MARKERS)) + ")", prompt):
                if part in INLINE_MARKERS:
                    content.append({"type": INLINE_MARKERS[part]})
                elif part.strip():
                    content.append({"type": "text", "text": part})
        else:
            content = [{"type": "image"} for _ in range(n_images)] + [{"type": "video"} for _ in range(n_videos)]
            content.append({"type": "text", "text": prompt})
        head = [{"role": "system", "content": system}] if system else []
        return head + [{"role": "user", "content": content}]

    def decode_images(self, names: list[str]) -> list[Image.Image]:
        images = []
        for name in names:
            start = time.perf_counter() if self.timings is not None else 0.0
            try:
                images.append(decode_image(self.raw[name], self.options.pixel_limit))
            except BadSampleError as e:
                raise self.bad(e.reason, f"{name}: {e.detail}") from None
            limits = self.options.media_limits
            if limits is not None and (problem := limits.image_problem(*images[-1].size)):
                raise self.bad("processor_limit", f"{name}: {problem}")
            if self.timings is not None:
                width, height = images[-1].size
                self.timings.setdefault("images", []).append(
                    {"start": start, "s": time.perf_counter() - start, "bytes": len(self.raw[name]),
                     "pixels": width * height})
        return images

    def decode_videos(self, names: list[str]) -> list[Video]:
        videos = []
        for name in names:
            start = time.perf_counter() if self.timings is not None else 0.0
            try:
                videos.append(decode_video(bytes(self.raw[name]), self.options))
            except VideoTooLarge as e:
                raise self.bad("too_many_pixels", f"{name}: {e}") from None
            except VideoDecodeError as e:
                raise self.bad("video_timeout" if e.timed_out else "corrupt_video", f"{name}: {e}") from None
            limits = self.options.media_limits
            frames = videos[-1].frames
            if limits is not None and (problem := limits.video_problem(len(frames), frames.shape[2], frames.shape[1])):
                raise self.bad("processor_limit", f"{name}: {problem}")
            if self.timings is not None:
                v = videos[-1]
                self.timings.setdefault("videos", []).append(
                    {"start": start, "s": time.perf_counter() - start, "bytes": len(self.raw[name]),
                     "backend": v.backend, "frames": len(v.frames), "pixels": int(v.frames[0].size // 3),
                     "total_frames": v.total_num_frames, "source_fps": v.source_fps})
        return videos


def decode_sample(raw: dict[str, Any], options: DecodeOptions | None = None,
                  timings: dict[str, Any] | None = None) -> Sample:
    """A raw sample (`__key__`, `__url__`, member name -> bytes) -> `Sample`.

    The cheap checks (JSON, member names, placeholder counts) come before any pixel is decoded.
    Raises `BadSampleError` whose `reason` is one of `mmrl.data.quarantine.REASONS`.

    `timings` (profiling; mmrl.profiling): a dict that receives "images" / "videos", one entry per
    decoded medium: {"start", "s" (perf_counter seconds), "bytes", "pixels"}, and for videos also
    "backend", "frames" (decoded), "total_frames" and "source_fps" (of the source).
    """
    d = _SampleDecoder(raw, options or DecodeOptions(), timings)
    meta = d.parse_json()
    image_names, video_names = d.media_names(meta, "image"), d.media_names(meta, "video")
    d.check_members(meta, image_names, video_names)
    messages = d.messages(meta, len(image_names), len(video_names))
    metadata = meta.get("metadata")
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict):
        raise d.bad("bad_field", f"'metadata' must be an object, got {type(metadata).__name__}")
    images = d.decode_images(image_names)
    videos = d.decode_videos(video_names)
    return Sample(key=d.key, messages=messages, images=images, videos=videos, answer=meta.get("answer"),
                  metadata=metadata, source=d.url)
