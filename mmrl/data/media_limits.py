"""What a model family's processor refuses, checked where the media are decoded.

A processor adapter declares its limits (`processor.media_limits`); the loader workers check every
decoded image and video against them, so a picture the processor would refuse (Qwen-VL: aspect
ratio above 200, e.g. an 8000x12 banner) is quarantined with reason `processor_limit` in the
worker, before it reaches the driver, and `mmrl data inspect --model` reports it too.
The limits are plain numbers (picklable: they travel to the workers inside `DecodeOptions`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MediaLimits:
    """Limits per image or video frame (as decoded, i.e. what the processor will receive).

    Args:
        max_aspect_ratio: refuse when max(w, h) / min(w, h) is above this (None: no limit).
        min_side: refuse when the shorter side has fewer pixels than this.
        max_pixels: refuse when w * h is above this (for processors that cannot downscale;
            None: no limit).
        min_video_frames: refuse a video with fewer decoded frames than this.
        owner: who declared the limits, for the message (e.g. "the qwen_vl processor").
    """
    max_aspect_ratio: float | None = None
    min_side: int = 1
    max_pixels: int | None = None
    min_video_frames: int = 1
    owner: str = "the processor"

    def image_problem(self, width: int, height: int) -> str | None:
        """Why an image (or a video frame) of this size is refused, or None when it is fine."""
        short, long = min(width, height), max(width, height)
        if short < self.min_side:
            return f"{width}x{height}: shorter side {short} < {self.min_side}, the minimum of {self.owner}"
        if self.max_aspect_ratio is not None and long / short > self.max_aspect_ratio:
            return (f"{width}x{height}: aspect ratio {long / short:.1f} > {self.max_aspect_ratio:g}, "
                    f"the limit of {self.owner}; crop or pad the image")
        if self.max_pixels is not None and width * height > self.max_pixels:
            return f"{width}x{height}: {width * height} pixels > {self.max_pixels}, the limit of {self.owner}"
        return None

    def video_problem(self, frames: int, width: int, height: int) -> str | None:
        """Why a decoded video of `frames` frames of width x height is refused, or None."""
        if frames < self.min_video_frames:
            return (f"{frames} decoded frame(s) < {self.min_video_frames}, the minimum of {self.owner}; "
                    f"raise data.decode.min_frames or num_frames")
        problem = self.image_problem(width, height)
        return None if problem is None else f"frames {problem}"
