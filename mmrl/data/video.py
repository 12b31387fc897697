"""Video bytes -> `Video`: frame sampling, decoders with a timeout, fallback between decoders.

    video = decode_video(mp4_bytes, DecodeOptions(fps=2.0, max_frames=32))
    video.frames.shape   # (T, H, W, 3) uint8, T even

Decoders are tried in `DecodeOptions.decoders` order (default decord, then torchcodec when it
imports, then PyAV). decord is the fastest here but can hang or fail on some files, so every
decode runs in a helper thread that the caller waits on for at most `timeout_s`: a decode that
overruns is abandoned, the next decoder is tried, and the overrunning decoder is skipped in this
process for as long as its abandoned call is still running (a hung native call may hold locks the
next call would wait on; a merely slow one comes back into use). A thread cannot kill a hung
native call, only walk away from it; the abandoned thread dies with the worker process (the
stream restarts its workers every epoch). The thread costs ~0.1 ms per video. (A subprocess per
decode could kill a hang and survive a decoder segfault, at the price of copying every frame
between processes.)

Frame sampling (`sample_frame_indices`): evenly spaced over the whole video, at `fps` frames per
second of video clamped to [min_frames, max_frames] (or exactly `num_frames`, capped by
max_frames), never more frames than the source has unless min_frames asks, and always an EVEN
count because Qwen-VL merges frames in temporal pairs (temporal_patch_size 2). An odd count is
rounded UP (one more real frame; max_frames is rounded down to even so this never exceeds it).
When the video has fewer frames than that count, the last frame is repeated -- exactly what the
Qwen-VL processors do to a too-short clip.
"""
from __future__ import annotations

import importlib.util
import io
import logging
import math
import threading
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from mmrl.data.sample import Video

if TYPE_CHECKING:
    from mmrl.data.decode import DecodeOptions

logger = logging.getLogger(__name__)


class VideoDecodeError(ValueError):
    """No decoder could produce frames. `timed_out` is True when every attempt ran out of time."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class VideoTooLarge(ValueError):
    """The source frame size exceeds the pixel limit (decompression-bomb guard)."""


class _Timeout(Exception):
    def __init__(self, thread: threading.Thread):
        super().__init__()
        self.thread = thread  # still running the abandoned call


# ----------------------------------------------------------------------------------------- sampling

def _floor_even(n: int) -> int:
    return max(2, n - n % 2)


def sample_frame_indices(total_frames: int, source_fps: float, options: "DecodeOptions") -> tuple[list[int], float]:
    """Frame positions to decode and the rate they represent (frames per second of video).

    The returned `fps` is len(indices) / duration, so `len(frames) / fps` is the source duration
    -- what the processors need for the temporal positions (second_per_grid_ts).
    """
    if total_frames < 1:
        raise VideoDecodeError("the video has no frames")
    duration = total_frames / source_fps if source_fps > 0 else 0.0
    if options.num_frames is not None:
        wanted = options.num_frames  # exactly what was asked (min_frames is for fps sampling)
    else:
        if duration <= 0:
            raise VideoDecodeError("the video has no usable frame rate, so fps-based sampling is "
                                   "impossible; set DecodeOptions.num_frames")
        wanted = min(round(duration * options.fps), total_frames)  # fps never samples a frame twice
        wanted = max(wanted, options.min_frames)
    cap = _floor_even(options.max_frames)
    n = min(max(wanted, 1), cap)
    n += n % 2  # even T, rounded up (cap is even, so n <= cap still)
    distinct = min(n, total_frames)
    indices = np.linspace(0, total_frames - 1, distinct).round().astype(int).tolist()
    indices += [indices[-1]] * (n - distinct)  # a too-short video: repeat its last frame
    fps = n / duration if duration > 0 else float(options.fps or 1.0)
    return indices, fps


def _target_size(width: int, height: int, max_pixels: int | None) -> tuple[int, int]:
    """(w, h) scaled down to at most max_pixels, aspect kept, even sides; unchanged when it fits."""
    if not max_pixels or width * height <= max_pixels:
        return width, height
    scale = math.sqrt(max_pixels / (width * height))
    return max(2, int(width * scale) // 2 * 2), max(2, int(height * scale) // 2 * 2)


# ----------------------------------------------------------------------------------------- backends

def _probe(data: bytes) -> tuple[int, int]:
    """(width, height) of the first video stream from the container headers (no decoding): for
    the pixel limit and the downscale size before any decoder allocates a frame."""
    import av
    with av.open(io.BytesIO(data)) as container:
        if not container.streams.video:
            raise VideoDecodeError("no video stream")
        context = container.streams.video[0].codec_context
        return int(context.width), int(context.height)


def _decode_decord(data: bytes, options: "DecodeOptions", resize: tuple[int, int] | None) -> Video:
    import decord
    decord.logging.set_level(decord.logging.QUIET)  # FFmpeg's own chatter; failures are reported by us
    width, height = resize or (-1, -1)  # -1: native size (no scaler in the way)
    reader = decord.VideoReader(io.BytesIO(data), ctx=decord.cpu(0), width=width, height=height,
                                num_threads=1)  # 1 thread: several workers share the cores
    source_fps = float(reader.get_avg_fps())
    total = len(reader)
    indices, fps = sample_frame_indices(total, source_fps, options)
    frames = reader.get_batch(indices).asnumpy()
    return Video(frames=frames, fps=fps, frame_indices=indices, source_fps=source_fps,
                 total_num_frames=total, backend="decord")


def _decode_torchcodec(data: bytes, options: "DecodeOptions", resize: tuple[int, int] | None) -> Video:
    from torchcodec.decoders import VideoDecoder
    decoder = VideoDecoder(data, device="cpu", dimension_order="NHWC", seek_mode="exact", num_ffmpeg_threads=1)
    total, source_fps = int(decoder.metadata.num_frames), float(decoder.metadata.average_fps or 0)
    indices, fps = sample_frame_indices(total, source_fps, options)
    frames = decoder.get_frames_at(indices=indices).data.numpy()
    if resize is not None:
        from PIL import Image
        frames = np.stack([np.asarray(Image.fromarray(f).resize(resize, Image.BILINEAR)) for f in frames])
    return Video(frames=frames, fps=fps, frame_indices=indices, source_fps=source_fps,
                 total_num_frames=total, backend="torchcodec")


def _decode_pyav(data: bytes, options: "DecodeOptions", resize: tuple[int, int] | None) -> Video:
    """Sequential decode (PyAV cannot seek in memory reliably); converts only the wanted frames."""
    import av
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        source_fps = float(stream.average_rate or stream.guessed_rate or 0)
        total = int(stream.frames or 0)
        if total <= 0:  # webm and some mkv carry no frame count: count packets (no decoding)
            total = sum(1 for p in container.demux(stream) if p.size)
            container.seek(0)
        indices, fps = sample_frame_indices(total, source_fps, options)
        wanted, last = set(indices), max(indices)
        picked: dict[int, np.ndarray] = {}
        decoded = -1
        for decoded, frame in enumerate(container.decode(stream)):
            if decoded in wanted:
                picked[decoded] = (frame.to_ndarray(format="rgb24") if resize is None else
                                   frame.to_ndarray(format="rgb24", width=resize[0], height=resize[1]))
            if decoded >= last:
                break
    if not picked:
        raise VideoDecodeError(f"decoded {decoded + 1} frame(s), none of the sampled ones")
    # the container's frame count can overstate what decodes: use the last frame that exists
    available = sorted(picked)
    frames = np.stack([picked[i] if i in picked else picked[available[-1]] for i in indices])
    return Video(frames=frames, fps=fps, frame_indices=indices, source_fps=source_fps,
                 total_num_frames=total, backend="pyav")


Backend = Callable[[bytes, "DecodeOptions", "tuple[int, int] | None"], Video]
#: name -> decode function(bytes, options, resize (width, height) or None = native) -> Video.
#: Register your own decoder here and name it in DecodeOptions.decoders.
VIDEO_BACKENDS: dict[str, Backend] = {"decord": _decode_decord, "torchcodec": _decode_torchcodec,
                                      "pyav": _decode_pyav}
_MODULE_OF = {"decord": "decord", "torchcodec": "torchcodec", "pyav": "av"}
#: decoder -> its abandoned call that overran timeout_s. While that thread still runs, the decoder
#: is skipped in this process (a hung native call may hold locks the next call would wait on);
#: once it has finished -- it was slow, not stuck -- the decoder is used again.
_hung: dict[str, threading.Thread] = {}
_importable: dict[str, bool] = {}


def available(name: str) -> bool:
    """Whether decoder `name` is registered and its module can be imported here."""
    if name not in VIDEO_BACKENDS:
        return False
    module = _MODULE_OF.get(name)
    if module is None:
        return True
    if module not in _importable:
        try:
            ok = importlib.util.find_spec(module) is not None
            if ok and name == "torchcodec":  # CPU torch + a CUDA torchcodec wheel fails at import
                import torchcodec.decoders  # noqa: F401
        except Exception:
            ok = False
        _importable[module] = ok
    return _importable[module]


def _run_with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    """fn() in a daemon thread; raise `_Timeout` if it has not returned after timeout_s."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    thread = threading.Thread(target=target, name="mmrl-video-decode", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _Timeout(thread)
    if "error" in box:
        raise box["error"]
    return box["value"]


def decode_video(data: bytes, options: "DecodeOptions") -> Video:
    """Decode and sample one video. Raises `VideoDecodeError` (every decoder failed or timed out)
    or `VideoTooLarge` (source frames above options.pixel_limit)."""
    try:
        width, height = _run_with_timeout(lambda: _probe(data), options.timeout_s)
    except _Timeout:
        raise VideoDecodeError(f"reading the container header took over {options.timeout_s}s",
                               timed_out=True) from None
    except Exception as e:
        raise VideoDecodeError(f"unreadable container: {type(e).__name__}: {e}") from None
    if width <= 0 or height <= 0:
        raise VideoDecodeError(f"bad frame size {width}x{height}")
    if width * height > options.pixel_limit:
        raise VideoTooLarge(f"{width}x{height} = {width * height} pixels per frame > pixel_limit "
                            f"{options.pixel_limit}")
    size = _target_size(width, height, options.max_pixels)
    resize = None if size == (width, height) else size
    errors: list[str] = []
    timeouts = 0
    for name in options.decoders:
        if name in _hung and not _hung[name].is_alive():
            del _hung[name]
        if name in _hung or not available(name):
            continue
        try:
            backend = VIDEO_BACKENDS[name]
            video = _run_with_timeout(lambda: backend(data, options, resize), options.timeout_s)
        except _Timeout as e:
            _hung[name] = e.thread
            timeouts += 1
            logger.warning("video decoder %s took over %.1fs; falling back to the next decoder, and "
                           "skipping %s in this process until the abandoned call returns",
                           name, options.timeout_s, name)
            errors.append(f"{name}: timeout after {options.timeout_s}s")
            continue
        except Exception as e:  # each library raises its own types (DECORDError, av.error.*, ...)
            errors.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        if video.frames.ndim != 4 or video.frames.shape[-1] != 3 or len(video.frames) == 0:
            errors.append(f"{name}: unexpected frame array {getattr(video.frames, 'shape', None)}")
            continue
        video.frames = np.ascontiguousarray(video.frames, dtype=np.uint8)
        return video
    if not errors:
        raise VideoDecodeError(f"no usable decoder among {list(options.decoders)} "
                               f"(still stuck after a timeout: {sorted(_hung) or 'none'})",
                               timed_out=bool(_hung))
    raise VideoDecodeError("; ".join(errors), timed_out=timeouts == len(errors))
