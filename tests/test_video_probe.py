"""Frame order survives decode -> processor for video_motion clips (issue 21, "Diagnose video").

A real video_motion shard is decoded as training decodes it (the default `data.decode` section)
and run through the Qwen2.5-VL processor adapter. The processor's `pixel_values_videos` are
un-patchified back to frames and de-normalised: frame t must be decoded frame t (resized to the
processor's size), not another one, and the temporal patches must take increasing M-RoPE time
positions in the same order. benchmarks/video_probe.py does the same check on every held-out clip
and then trains the probe.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmrl.config.schema import DecodeConfig
from mmrl.data.decode import DecodeOptions
from mmrl.plugins.data.recipes import video_motion
from mmrl.data.stream import load_all
from mmrl.processors import build_processor


@pytest.fixture(scope="module")
def motion_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("video_motion")
    video_motion.build(str(out), train_size=0, heldout_size=4, shard_size=4, seed=3)
    return out


def centre(frame: np.ndarray) -> tuple[float, float]:
    """(x, y) centroid of the shape's pixels (palette colours are saturated, the grey is not)."""
    f = frame.astype(np.float32)
    mx = f.max(-1)
    ys, xs = np.nonzero((mx - f.min(-1)) / np.maximum(mx, 1.0) > 0.45)
    return float(xs.mean()), float(ys.mean())


@pytest.mark.parametrize("num_frames", [None, 8])  # None: the default fps sampling (4 of the 8 frames)
def test_frame_order_survives_decode_and_processor(tiny_model_dir: Path, motion_dir: Path, num_frames) -> None:
    torch.set_num_threads(1)
    proc = build_processor("auto", str(tiny_model_dir))
    decode = DecodeOptions.from_config(DecodeConfig(num_frames=num_frames), proc.media_limits)
    samples = load_all(str(motion_dir / "heldout-000000.tar"), decode=decode)
    assert len(samples) == 4
    tp = proc.hf.video_processor.temporal_patch_size
    for s in samples:
        decoded = np.asarray(s.videos[0].frames)
        n = len(decoded)
        assert n == (num_frames or 4) and n % tp == 0
        # the decoded frames are the clip in time order: the shape's centre moves monotonically
        # in the labelled direction
        axis, sign = {"left": (0, -1), "right": (0, 1), "up": (1, -1), "down": (1, 1)}[s.answer]
        along = np.array([centre(f)[axis] for f in decoded])
        assert (np.diff(along) * sign >= -0.5).all() and (along[-1] - along[0]) * sign > 5, (s.answer, along)
        prompt = proc(s)
        grid = prompt.mm_inputs["video_grid_thw"][0]
        assert int(grid[0]) == n // tp  # frames 2k and 2k+1 share temporal patch k
        seen = proc.video_frames(prompt.mm_inputs)
        ref = F.interpolate(torch.from_numpy(decoded).permute(0, 3, 1, 2).float(), size=seen.shape[-2:],
                            mode="bicubic", align_corners=False, antialias=True)
        mad = (seen[:, None] - ref[None]).abs().mean(dim=(2, 3, 4))  # [processor frame, decoded frame]
        assert mad.argmin(dim=1).tolist() == list(range(n)), mad
        assert float(mad.diagonal().max()) < 0.5  # the same frame, up to float rounding (of 255)
        off = mad + torch.eye(n) * 1e9
        assert float(off.min()) > 4 * float(mad.diagonal().max())
        # the temporal patches enter the LLM in order: M-RoPE time grows patch by patch
        ids = torch.tensor(prompt.prompt_ids)
        t = prompt.positions_AP[0][ids == proc.video_token_id].view(n // tp, -1)
        assert (t == t[:, :1]).all() and (t[1:, 0] > t[:-1, 0]).all(), t


def test_reversing_the_clip_reverses_the_pixels(tiny_model_dir: Path, motion_dir: Path) -> None:
    """The processor keeps whatever order it is given (no sorting by timestamp or index)."""
    import dataclasses

    torch.set_num_threads(1)
    proc = build_processor("auto", str(tiny_model_dir))
    s = load_all(str(motion_dir / "heldout-000000.tar"),
                 decode=DecodeOptions.from_config(DecodeConfig(), proc.media_limits))[0]
    v = s.videos[0]
    rev = dataclasses.replace(s, videos=[dataclasses.replace(v, frames=np.ascontiguousarray(v.frames[::-1]))])
    fa, fb = proc.video_frames(proc(s).mm_inputs), proc.video_frames(proc(rev).mm_inputs)
    assert torch.allclose(fa.flip(0), fb, atol=1e-5)
    assert not torch.allclose(fa, fb, atol=1e-3)  # the clip really moves
