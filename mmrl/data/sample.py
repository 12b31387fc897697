"""The unit of data that flows from the shard stream into the processor and the rewards."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from PIL import Image


@dataclass
class Video:
    """Decoded, already-sampled video frames plus the timing both engines need.

    `frames` is uint8 (T, H, W, 3). `frame_indices` are positions in the source video and
    `fps` is the rate of the sampled frames (not the source), so the trainer's
    second_per_grid_ts and vLLM's video metadata are derived from the same sampling.
    """

    frames: Any  # numpy.ndarray uint8 (T, H, W, 3)
    fps: float  # sampled frames per second
    frame_indices: list[int]
    source_fps: float
    total_num_frames: int  # in the source video
    backend: str = ""  # decoder that produced the frames (decord, pyav, torchcodec)

    @property
    def duration(self) -> float:
        return self.total_num_frames / self.source_fps if self.source_fps else 0.0

    def vllm_metadata(self) -> dict[str, Any]:
        """Per-video metadata for vLLM (Qwen2.5-VL / Qwen3-VL require it). The sampled frames are
        presented as the whole video at the sampled rate, exactly as the HF processor sees them,
        so both sides compute the same temporal positions."""
        n = len(self.frames)
        return {"fps": self.fps, "duration": n / self.fps if self.fps else 0.0, "total_num_frames": n,
                "frames_indices": list(range(n)), "video_backend": self.backend or "opencv",
                "do_sample_frames": False}


@dataclass
class Sample:
    """One prompt with its media, as decoded from a shard.

    `messages` is a chat in the transformers format; each image/video in the user content is a
    placeholder ({"type": "image"} / {"type": "video"}) matched in order to `images` / `videos`.
    """

    key: str
    messages: list[dict[str, Any]]
    images: list[Image.Image] = field(default_factory=list)
    videos: list[Video] = field(default_factory=list)
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # shard url the sample came from

    @property
    def prompt_text(self) -> str:
        """The text of the last user turn (what a reward or a log line usually wants)."""
        for msg in reversed(self.messages):
            if msg.get("role") == "user":
                content = msg.get("content")
                if isinstance(content, str):
                    return content
                return " ".join(c.get("text", "") for c in content if c.get("type") == "text")
        return ""


def messages_from_prompt(prompt: str, n_images: int = 0, n_videos: int = 0,
                         system: str | None = None) -> list[dict[str, Any]]:
    """Chat messages for a plain prompt: media placeholders first, then the text."""
    content: list[dict[str, Any]] = [{"type": "image"} for _ in range(n_images)]
    content += [{"type": "video"} for _ in range(n_videos)]
    content.append({"type": "text", "text": prompt})
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": content})
    return messages
